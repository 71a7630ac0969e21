"""PEFT models: recognised without making peft a hard import for the engine's callers."""

from __future__ import annotations


def is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_model(model):
    """The causal LM itself: under a PEFT wrapper, the model its adapters were added to."""
    return model.get_base_model() if is_peft_model(model) else model
