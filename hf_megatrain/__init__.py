"""hf_megatrain: train HF decoder LLMs larger than GPU memory on one GPU, through Trainer.

The names below are imported on first use (PEP 562), so that `import hf_megatrain` and the
`hf-megatrain` command's help do not pay for importing torch and transformers (seconds)."""

import importlib

_EXPORTS = {
    "HostAdamW": ".engine.optimizer",
    "HostJobError": ".errors",
    "MegaTrainArguments": ".arguments",
    "MegaTrainCPOTrainer": ".cpo",  # needs the trl extra (trl.experimental)
    "MegaTrainDPOTrainer": ".dpo",  # needs the trl extra
    "MegaTrainError": ".errors",
    "MegaTrainKTOTrainer": ".kto",  # needs the trl extra
    "MegaTrainORPOTrainer": ".orpo",  # needs the trl extra (trl.experimental)
    "MegaTrainSFTTrainer": ".sft",  # needs the trl extra
    "MegaTrainTrainer": ".trainer",
    "StreamingEngine": ".engine.schedule",
    "prepare": ".loop",
    "supported_model_types": ".patcher.specs",
    "train_step": ".engine.step",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_megatrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
