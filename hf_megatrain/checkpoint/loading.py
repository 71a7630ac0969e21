"""Turn what the user passed (hub id, local path or loaded model) into a CPU model + tokenizer."""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ..errors import MegaTrainError
from ..patcher.specs import spec_for

logger = logging.getLogger(__name__)


def load_model_and_tokenizer(model, attn_implementation: str | None = None):
    """Returns (model on CPU with fp32 weights, tokenizer or None)."""
    if isinstance(model, PreTrainedModel):
        spec_for(model.config)
        devices = {p.device.type for p in model.parameters()}
        if devices - {"cpu"}:
            raise MegaTrainError(
                f"the model's parameters are on {sorted(devices)}; pass a model loaded on the CPU "
                "(hf_megatrain moves layers to the GPU itself), e.g. from_pretrained(..., device_map='cpu')."
            )
        return model, None
    if not isinstance(model, str):
        raise MegaTrainError(
            f"model must be a hub id, a local path or a loaded PreTrainedModel, not {type(model).__name__}."
        )
    try:
        config = AutoConfig.from_pretrained(model)
    except OSError as e:
        raise MegaTrainError(
            f"cannot find a model config for {model!r}: {e}. Pass a local folder with config.json, "
            "or a hub id that is already in the local HF cache."
        ) from e
    spec_for(config)  # refuse unsupported architectures before reading any weights
    kwargs = {"dtype": torch.float32, "device_map": "cpu"}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    loaded = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        logger.warning("no tokenizer found for %s (%s); pass processing_class= to save one", model, e)
        tokenizer = None
    return loaded, tokenizer
