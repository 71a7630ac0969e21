"""PEFT models: recognised without making peft a hard import for the engine's callers."""

from __future__ import annotations


def is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_model(model):
    """The causal LM itself: under a PEFT wrapper, the model its adapters were added to."""
    return model.get_base_model() if is_peft_model(model) else model


def check_adapter_config(peft_config) -> None:
    """Refuse, in one line, a PEFT method the engine cannot train exactly: the prompt methods that need task ids
    (engine/prompts.py). LoRA, prompt tuning, p-tuning and prefix tuning train (prefix tuning on the families
    whose layers take its keys and values: checked when the engine is built)."""
    from ..engine.prompts import check_prompt_learning

    check_prompt_learning(peft_config)


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
