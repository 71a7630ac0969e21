"""PEFT models: recognised without making peft a hard import for the engine's callers."""

from __future__ import annotations

from ..errors import MegaTrainError


def is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_model(model):
    """The causal LM itself: under a PEFT wrapper, the model its adapters were added to."""
    return model.get_base_model() if is_peft_model(model) else model


def check_adapter_config(peft_config) -> None:
    """Refuse, in one line, a PEFT method the engine cannot train exactly: prompt learning (prompt
    tuning, prefix tuning, p-tuning...). Its virtual tokens enter through PeftModel.forward (prompt
    embeddings before the input's, or a prefix key/value cache), which the engine never calls: it runs
    the base model's layers itself, so the prompt encoder would get no gradient."""
    if getattr(peft_config, "is_prompt_learning", False):
        kind = getattr(getattr(peft_config, "peft_type", None), "value", None) or type(peft_config).__name__
        raise MegaTrainError(f"peft_config is {kind} (prompt learning), which hf_megatrain does not train: its "
                             "virtual tokens enter through PeftModel.forward, which the engine does not run; use "
                             "LoRA (LoraConfig, also with target_parameters) instead.")


def check_peft_model(model) -> None:
    """check_adapter_config for each adapter of a PEFT model; nothing for a plain model."""
    if is_peft_model(model):
        for config in model.peft_config.values():
            check_adapter_config(config)
