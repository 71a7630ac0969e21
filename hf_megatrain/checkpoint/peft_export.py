"""LoRA runs: the adapter as PEFT saves it, and a merged full HF checkpoint.

The adapter is written by PEFT itself (`save_pretrained` with a state dict of the fp32 masters),
so `PeftModel.from_pretrained` loads it. The merged export streams unit by unit: the frozen base
weights (the streamed copy, upcast) plus scaling * B @ A for every LoRA layer, written under the
base model's own names, like `merge_and_unload()` followed by `save_pretrained`.
"""

from __future__ import annotations

import torch
from transformers.core_model_loading import revert_weight_conversion

from ..errors import MegaTrainError
from ..patcher.adapters import base_model
from .hf_format import model_dtype, save_hf_model

PEFT_PREFIX = "base_model.model."


def save_adapter(engine, out_dir: str) -> None:
    engine.synchronize()
    store = engine.store
    masters = [store.full(store.master, u.index).cpu() for u in store.units]
    state = {PEFT_PREFIX + name: t for name, t in store.named(masters)}
    # the frozen embedding and head as the model shows them (their compute copy): PEFT saves them beside the
    # adapter where the embeddings were resized (a cloned chat template), as from the model's own state dict
    for unit in (store.units[0], store.units[-1]):
        for slot in unit.slots:
            if not slot.trainable:
                flat = store.compute[unit.index]
                state[PEFT_PREFIX + slot.name] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).cpu()
    engine.peft_model.save_pretrained(out_dir, state_dict=state)


def _lora_layers(base) -> dict[str, object]:
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            if any(module.use_dora.values()):
                raise MegaTrainError(f"{name} uses DoRA; the merged export supports plain LoRA only.")
            layers[name] = module
    return layers


def save_merged(engine, out_dir: str, dtype: torch.dtype | None = None) -> list[str]:
    """A full HF checkpoint of base + merged adapters; from_pretrained loads it as the base class.
    dtype: by default the model's own, as its writer remembered it (ModelWriter.dtype)."""
    if engine.virtual_tokens:
        raise MegaTrainError("save_merged merges LoRA adapters into the base weights; a prompt-tuning or p-tuning "
                             "prompt has no weight to merge into (it stays before every input): save_model writes "
                             "it as PEFT does, for PeftModel.from_pretrained.")
    engine.synchronize()
    dtype = dtype or getattr(engine.writer, "dtype", None)
    store, base = engine.store, engine.peft_model.get_base_model()
    lora = _lora_layers(base)
    adapters = {name: m.active_adapters[0] if m.active_adapters else "default" for name, m in lora.items()}

    def merged_unit(index: int, dt: torch.dtype) -> dict[str, torch.Tensor]:
        unit = store.units[index]
        full = {}
        master = store.full(store.master, index)
        for slot in unit.slots:
            src = master if slot.trainable else store.compute[index]
            full[slot.name] = src[slot.offset : slot.offset + slot.numel].view(slot.shape).float().cpu()
        out = {}
        for name, t in full.items():
            owner = next((m for m in lora if name.startswith(m + ".")), None)
            if owner is None:
                out[name] = t
                continue
            rest = name[len(owner) + 1 :]
            if not rest.startswith("base_layer."):
                continue  # lora_A / lora_B / dropout: folded into the base weight below
            key = f"{owner}.{rest[len('base_layer.'):]}"
            if rest == "base_layer.weight":
                a = adapters[owner]
                m = lora[owner]
                delta = full[f"{owner}.lora_B.{a}.weight"] @ full[f"{owner}.lora_A.{a}.weight"]
                delta = delta.T if m.fan_in_fan_out else delta
                t = t + delta * m.scaling[a]
            out[key] = t
        out = {k: v.to(dt) for k, v in out.items()}
        return revert_weight_conversion(base, out)

    return save_hf_model(store, base, out_dir, dtype=dtype, unit_tensors=merged_unit)


class ModelWriter:
    """What StreamingEngine.save_pretrained (and the trainer's saves) call: the adapters of a LoRA
    engine, else the whole model as `skeleton`'s class (the engine's meta or CPU skeleton) loads it.

    `dtype`: the dtype the files hold when no other is asked, the model's own as it declared it when
    the writer was made (fp32 for a model loaded in fp32). It is not read from the config at save time:
    the model's own `save_pretrained()` rewrites `config.dtype` to the dtype of whatever its parameters
    view, and a save must not depend on what was called before it."""

    def __init__(self, skeleton):
        self.skeleton = skeleton
        self.dtype = model_dtype(base_model(skeleton).config)

    def __call__(self, engine, output_dir: str, dtype=None, write: bool = True) -> None:
        if engine.peft_model is not None:
            save_adapter(engine, output_dir)
        else:  # write=False: a data-parallel rank that only takes part in the gathers
            save_hf_model(engine.store, self.skeleton, output_dir, dtype=dtype or self.dtype, write=write)


def model_writer(skeleton) -> ModelWriter:
    return ModelWriter(skeleton)
