"""HF-format model files streamed from the host store, unit by unit.

What `save_pretrained` writes: sharded safetensors (+ `model.safetensors.index.json`), with the
checkpoint names HF writes (`revert_weight_conversion`, so Mixtral's fused experts go back to
per-expert w1/w2/w3), `config.json` and `generation_config.json`. Only one unit is ever
converted at a time, so saving a 70B model needs no second copy of it in RAM.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig
from transformers.core_model_loading import revert_weight_conversion

from ..patcher.adapters import base_model
from ..patcher.templates import persistent_buffers
from .safetensors_io import SAFE_INDEX, SAFE_WEIGHTS

DEFAULT_SHARD_BYTES = 5 * 1024**3


def model_dtype(config) -> torch.dtype:
    """The dtype the model declares for its weights (what `save_pretrained` would keep)."""
    dtype = getattr(config, "dtype", None)  # (config.torch_dtype is a deprecated alias of it)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _plan_shards(units, dtype: torch.dtype, max_bytes: int) -> list[list[int]]:
    """Greedy plan: whole units per shard, in forward order."""
    shards, current, size = [], [], 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for unit in units:
        nbytes = unit.numel * itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(unit.index)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def unit_state_dict(store, skeleton, index: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One unit's master weights in `dtype`, under the names HF writes to disk."""
    unit = store.units[index]
    tensors = {}
    master = store.full(store.master, index)  # data parallel: gathered from every rank's slice
    for slot in unit.slots:
        # trainable weights from the fp32 master; frozen ones (a LoRA base) from the streamed copy
        src = master if slot.trainable else store.compute[index]
        view = src[slot.offset : slot.offset + slot.numel].view(slot.shape)
        tensors[slot.name] = view.to(device="cpu", dtype=dtype)  # no copy when it already is
    return revert_weight_conversion(skeleton, tensors)


def save_hf_model(store, skeleton, out_dir: str, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None, unit_tensors=None,
                  write: bool = True, buffers: dict | None = None) -> list[str]:
    """Write `out_dir` so that `AutoModelForCausalLM.from_pretrained(out_dir)` loads the masters.

    dtype: None reads `skeleton.config` now, which the model's own save_pretrained() rewrites to the
    dtype of whatever its parameters view: callers that save repeatedly pass the dtype they remembered
    (ModelWriter.dtype). unit_tensors(index, dtype) -> {name: tensor} replaces the default per-unit
    source (the PEFT export merges adapters there), and `buffers` the persistent buffers written beside the
    weights (default: the skeleton's). Data parallel: every rank calls this (the masters are gathered unit by
    unit) and only the one with write=True writes.
    """
    unit_tensors = unit_tensors or (lambda index, dt: unit_state_dict(store, skeleton, index, dt))
    if write:
        os.makedirs(out_dir, exist_ok=True)
    dtype = dtype or model_dtype(skeleton.config)
    shards = _plan_shards(store.units, dtype, max_bytes=max_shard_bytes)
    names = [SAFE_WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map, total_bytes, total_params = {}, 0, 0
    # Buffers saved with the weights (GLM-4-MoE's router bias): constants the store does not hold, read from
    # the model object, which keeps them; a few numbers per layer, written with the first shard.
    buffers = persistent_buffers(base_model(skeleton)) if buffers is None else buffers
    buffers = {k: b.cpu() for k, b in buffers.items()}  # in their own dtype
    for fname, unit_ids in zip(names, shards):
        tensors, buffers = buffers, {}
        for index in unit_ids:
            tensors.update(unit_tensors(index, dtype))
            if progress is not None:
                progress.update(1)
        for k, t in tensors.items():
            weight_map[k] = fname
            total_bytes += t.numel() * t.element_size()
            total_params += t.numel()
        if write:
            save_file({k: t.contiguous() for k, t in tensors.items()}, os.path.join(out_dir, fname),
                      metadata={"format": "pt"})
        del tensors
    if not write:
        return names
    if len(shards) > 1:
        index = {"metadata": {"total_parameters": total_params, "total_size": total_bytes}, "weight_map": weight_map}
        with open(os.path.join(out_dir, SAFE_INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    config = skeleton.config
    old = getattr(config, "dtype", None)
    config.dtype = dtype
    try:
        config.architectures = [type(skeleton).__name__]
        config.save_pretrained(out_dir)
    finally:
        config.dtype = old
    gen = getattr(skeleton, "generation_config", None) or GenerationConfig.from_model_config(config)
    gen.save_pretrained(out_dir)
    return names
