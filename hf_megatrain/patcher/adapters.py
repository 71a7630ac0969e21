"""PEFT models: recognised without making peft a hard import for the engine's callers."""

from __future__ import annotations


def is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_model(model):
    """The causal LM itself: under a PEFT wrapper, the model its adapters were added to."""
    return model.get_base_model() if is_peft_model(model) else model


# PEFT methods whose trainable parameters sit in the decoder layers (or the embedding and head), one layer's in
# that layer, and whose model adds nothing to the forward: the engine runs each layer's adapters as stock runs them.
# Each is checked against stock peft's loss and gradients (tests/integration/test_peft_methods.py), so a peft
# release that changes one fails a test here rather than a user's run. Prompt learning is engine/prompts.py's.
EXACT_METHODS = {  # PeftType value: the method's name, as errors say it
    "LORA": "LoRA (DoRA, rsLoRA and LoRA on expert tensors included)", "IA3": "IA3", "LOHA": "LoHa", "LOKR": "LoKr",
    "OFT": "OFT", "BOFT": "BOFT", "VERA": "VeRA", "FOURIERFT": "FourierFT", "LN_TUNING": "LN tuning", "HRA": "HRA",
    "RANDLORA": "RandLoRA", "SHIRA": "SHiRA", "C3A": "C3A", "MISS": "MiSS", "BEFT": "BEFT", "DEFT": "DEFT",
    "DELORA": "DeLoRA", "GLORA": "GLoRA", "GRALORA": "GraLoRA", "HIRA": "HiRA", "PEANUT": "PEANuT", "ROAD": "RoAd",
    "SUPERTUNING": "SuperTuning", "WAVEFT": "WaveFT", "TRAINABLE_TOKENS": "trainable tokens", "PSOFT": "PSOFT",
}
_SHARED = "one trainable parameter shared by every layer, which does not stream with one layer"
# why a method is not among them, where it is known; the rest were not checked (their type is new to this list)
_NOT_EXACT = {
    "ADALORA": "AdaLoraModel.forward adds its orthogonal regularization to the loss and its rank allocation "
               "(update_and_allocate) reads the gradients after each backward; the engine runs neither",
    "OSF": "its hooks change the adapter's gradients, and the engine's fp32 masters take theirs without them",
    "PVERA": "it draws fresh noise in every training forward, which the engine's recompute would draw again",
    "FROD": "its adapters start from a joint decomposition of every layer's weights, which the engine's plan (made "
            "on a meta copy of the model, without the weights) cannot compute",
    "VBLORA": _SHARED + " (its vector bank)",
    "TINYLORA": _SHARED,
    "UNILORA": _SHARED,
    "LILY": _SHARED + " (lily_B)",
    "XLORA": "its classifier mixes every layer's adapters after a pass of the whole model",
    "POLY": "its routing needs task ids",
    "SHADOW": "its shadow network runs beside the model and adds a loss of its own",
    "ADAPTION_PROMPT": "its adapted attention takes learned prompts that the engine's layers are not given",
}


def peft_type(config) -> str:
    """A peft config's method, as PeftType's value ("LORA", "PREFIX_TUNING", ...)."""
    kind = getattr(config, "peft_type", None)
    return getattr(kind, "value", None) or str(kind)


def for_layout(peft_config):
    """A copy of `peft_config` for laying adapters out on a meta copy of the model (the planner, the disk check):
    adapters started from the weights themselves (LoRA's PiSSA, OLoRA, CorDA, LoftQ inits, and the like) get the
    default start, which gives the same shapes and needs no data."""
    import copy

    config = copy.deepcopy(peft_config)
    for field in ("init_lora_weights", "init_weights"):
        if isinstance(getattr(config, field, None), str):
            setattr(config, field, True)
    return config


def check_adapter_config(peft_config) -> None:
    """Refuse, in one line, a PEFT method the engine cannot train exactly: prompt methods other than prompt tuning,
    p-tuning and prefix tuning (engine/prompts.py; prefix tuning's families are checked when the engine is built),
    and any other method outside EXACT_METHODS, or LoRA with an option that reaches outside a layer (activated
    LoRA's offsets are computed in PeftModel.forward; layer_replication makes layers share weights)."""
    from ..engine.prompts import check_prompt_learning
    from ..errors import MegaTrainError

    if peft_config is None:
        return
    if isinstance(peft_config, (str, dict)):  # MegaTrainArguments' forms: made into a config, which is checked
        from ..checkpoint.loading import peft_config_from

        peft_config_from(peft_config)
        return
    check_prompt_learning(peft_config)
    if getattr(peft_config, "is_prompt_learning", False):
        return
    kind = peft_type(peft_config)
    works = ", ".join(EXACT_METHODS.values()) + ", prompt tuning, p-tuning and prefix tuning train"
    if kind not in EXACT_METHODS:
        why = _NOT_EXACT.get(kind, "it is not among the methods checked against stock peft on the engine")
        raise MegaTrainError(f"peft_config is {kind}, which hf_megatrain does not train: {why}. {works}.")
    if kind == "LORA" and getattr(peft_config, "alora_invocation_tokens", None):
        raise MegaTrainError("peft_config sets alora_invocation_tokens (activated LoRA), which hf_megatrain does not "
                             "train: PeftModel.forward finds the invocation tokens in each row and the engine does not "
                             "run it. Plain LoRA (without alora_invocation_tokens) trains.")
    if kind == "LORA" and getattr(peft_config, "layer_replication", None):
        raise MegaTrainError("peft_config sets layer_replication, which hf_megatrain does not train: the replicated "
                             "layers share their base weights, and the engine streams each layer's own. LoRA "
                             "without layer_replication trains.")


def check_peft_model(model) -> None:
    """check_adapter_config for each adapter of a PEFT model; nothing for a plain model."""
    if is_peft_model(model):
        for config in model.peft_config.values():
            check_adapter_config(config)


def decay_names(get_names, model) -> list[str]:
    """The parameters Trainer decays (`get_names`: its get_decay_parameter_names, or an override), named as the
    engine names them: in the base model, and a PeftModel's prompt encoder (prompt tuning, p-tuning) under its own
    name there (prompt_encoder.<adapter>.*), which the engine maps to its embedding unit."""
    names = list(get_names(base_model(model)))
    if is_peft_model(model):
        names += [n for n in get_names(model) if n.startswith("prompt_encoder.")]
    return names
