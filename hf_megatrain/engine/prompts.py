"""PEFT's prompt learning on the engine: prompt tuning and p-tuning.

`PeftModelForCausalLM.forward` puts `num_virtual_tokens` learned vectors (its prompt encoder's output)
before each row's token embeddings, a row of ones before the attention mask and -100 before the labels,
and drops the batch's position ids (the model then counts 0 .. L+T-1). The engine does the same in two
places: `with_virtual_tokens` lengthens each batch by placeholder ids before anything reads it (so masks,
positions, documents and the loss see the row the model sees), and the embedding unit's template runs the
prompt encoder and puts its output where those ids stand (`schedule._Embed`). The prompt encoder's
parameters are trainable slots of the embedding unit: the host store keeps their fp32 masters and the
optimizer steps them with the rest, and the PeftModel's own parameter objects view them, so its
`save_pretrained` writes what trained.

Prefix tuning (a key/value cache per layer), multitask prompt tuning (task ids) and the other prompt
methods enter elsewhere and are refused (`check_prompt_learning`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import NamedTuple

import torch

from ..constants import IGNORE_INDEX
from ..errors import MegaTrainError

_TRAINED = ("PROMPT_TUNING", "P_TUNING")


def _peft_type(config) -> str:
    kind = getattr(config, "peft_type", None)
    return getattr(kind, "value", None) or str(kind)


def check_prompt_learning(config) -> None:
    """Refuse, in one line, a prompt-learning method the engine does not train (prefix tuning and the rest)."""
    if getattr(config, "is_prompt_learning", False) and _peft_type(config) not in _TRAINED:
        raise MegaTrainError(f"peft_config is {_peft_type(config)}, which hf_megatrain does not train: its virtual "
                             "tokens enter each layer's attention (a prefix key/value cache) or need task ids, "
                             "which the engine does not run. Prompt tuning (PromptTuningConfig), p-tuning "
                             "(PromptEncoderConfig) and LoRA work.")


class Prompt(NamedTuple):
    """A prompt-learning PeftModel's active prompt encoder."""

    module: torch.nn.Module
    path: str  # in the PeftModel: prompt_encoder.<adapter>
    tokens: int  # num_virtual_tokens


def prompt_encoder(peft_model) -> Prompt | None:
    """The active adapter's prompt encoder of a prompt-learning PeftModel; None for any other model."""
    if peft_model is None:
        return None
    config = peft_model.active_peft_config
    if not getattr(config, "is_prompt_learning", False):
        return None
    check_prompt_learning(config)
    if getattr(config, "num_transformer_submodules", 1) not in (None, 1):
        raise MegaTrainError("the prompt-learning config has num_transformer_submodules > 1 (an encoder-decoder's); "
                             "a causal LM has one.")
    adapter = peft_model.active_adapter
    return Prompt(peft_model.prompt_encoder[adapter], f"prompt_encoder.{adapter}", int(config.num_virtual_tokens))


@contextmanager
def attached(base, module, path: str):
    """`module` registered in the base model at `path` (prompt_encoder.<adapter>, its path in the PeftModel) while
    the engine is built (its units, store and templates read the base model, and so name its parameters as the
    PeftModel does), and taken off again."""
    holder, _, name = path.rpartition(".")
    if holder in base._modules:
        raise MegaTrainError(f"the base model already has a submodule {holder!r}, where the engine puts the prompt "
                             "encoder while it is built.")
    base.add_module(holder, torch.nn.ModuleDict({name: module}))
    try:
        yield
    finally:
        del base._modules[holder]


def with_virtual_tokens(batch: dict, n: int) -> dict:
    """The batch as the base model sees it under prompt learning: n placeholder ids (0: the embedding unit puts
    the prompt there) before each row, ones before the mask, IGNORE_INDEX before the labels, no position ids
    (PeftModel drops them, with its warning) and no token type ids (likewise)."""
    if not n:
        return batch
    ids = batch.get("input_ids")
    if ids is None:
        return batch
    rows = ids.shape[0]
    out = dict(batch)
    out["input_ids"] = torch.cat([ids.new_zeros(rows, n), ids], dim=1)
    mask = batch.get("attention_mask")
    if mask is not None:
        out["attention_mask"] = torch.cat([mask.new_ones(rows, n), mask], dim=1)
    labels = batch.get("labels")
    if labels is not None:
        out["labels"] = torch.cat([labels.new_full((rows, n), IGNORE_INDEX), labels], dim=1)
    if batch.get("position_ids") is not None:
        warnings.warn("Position ids are not supported for parameter efficient tuning. Ignoring position ids.")
        out["position_ids"] = None
    if batch.get("token_type_ids") is not None:
        warnings.warn("Token type ids are not supported for parameter efficient tuning. Ignoring token type ids")
        out["token_type_ids"] = None
    return out
