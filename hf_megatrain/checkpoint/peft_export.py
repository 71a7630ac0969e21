"""PEFT runs: the adapter as PEFT saves it, and a merged full HF checkpoint.

The adapter is written by PEFT itself (`save_pretrained` with a state dict of the fp32 masters),
so `PeftModel.from_pretrained` loads it. The merged export streams unit by unit: each tuner layer or
wrapper (LoRA, DoRA, IA3, LoHa, modules_to_save, trainable tokens, ...) is copied with its trained state
(the frozen base weights from the streamed copy, upcast) and merged by PEFT's own merge, and what it
unloads to is written under the base model's own names, like `merge_and_unload()` followed by
`save_pretrained`, one layer in memory at a time.
"""

from __future__ import annotations

import copy

import torch
from transformers.core_model_loading import revert_weight_conversion

from ..errors import MegaTrainError
from ..patcher.adapters import base_model
from ..patcher.templates import persistent_buffers
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
    # buffers the adapters keep (VeRA's shared projections), which PEFT saves beside them; the engine holds none of
    # them in its store, and they do not train, so the model's own are the ones to save (under every name: PEFT
    # reads VeRA's under the model's and each layer's); PEFT keeps only its adapters' among them
    for prefix, module in engine.peft_model.named_modules(remove_duplicate=False):
        for k, b in module._buffers.items():
            if b is not None and not b.is_meta and k not in module._non_persistent_buffers_set:
                state.setdefault(f"{prefix}.{k}", b.cpu())
    engine.peft_model.save_pretrained(out_dir, state_dict=state)


def save_merged(engine, out_dir: str, dtype: torch.dtype | None = None) -> list[str]:
    """A full HF checkpoint of base + merged adapters; from_pretrained loads it as the base class.
    dtype: by default the model's own, as its writer remembered it (ModelWriter.dtype)."""
    peft_model = engine.peft_model
    if peft_model.active_peft_config.is_prompt_learning:
        raise MegaTrainError("save_merged merges adapters into the base weights; a prompt-learning adapter (prompt "
                             "tuning, p-tuning, prefix tuning) has no weight to merge into (its virtual tokens stay "
                             "before every input): save_model writes it as PEFT does, for PeftModel.from_pretrained.")
    engine.synchronize()
    dtype = dtype or getattr(engine.writer, "dtype", None)
    store, base = engine.store, peft_model.get_base_model()
    owners = _owners(base)
    adapter = peft_model.active_adapter
    embed = engine.spec.embed
    if engine._tied and hasattr(owners.get(embed), "original_module"):
        raise MegaTrainError(f"save_merged: {embed} is in modules_to_save and the head is tied to it: merging puts "
                             "the trained copy in its place and leaves the head on the original weight, so the two "
                             "come untied (merge_and_unload sets tie_word_embeddings=False), which this export does "
                             "not write. save_model writes the adapter; PeftModel.from_pretrained(...)"
                             ".merge_and_unload() merges it.")

    def merged_unit(index: int, dt: torch.dtype) -> dict[str, torch.Tensor]:
        unit = store.units[index]
        master = store.full(store.master, index)
        full = {}
        for slot in unit.slots:
            src = master if slot.trainable else store.compute[index]
            full[slot.name] = src[slot.offset : slot.offset + slot.numel].view(slot.shape).float().cpu()
        out, mine = {}, {}
        for name, t in full.items():
            owner = _owner_of(name, owners)
            if owner is None:
                out[name] = t
            else:
                mine.setdefault(owner, {})[name[len(owner) + 1 :]] = t
        for owner, tensors in mine.items():
            for k, t in _merged(owners[owner], tensors, adapter, owner).items():
                out[f"{owner}.{k}"] = t
        out = {k: v.to(dt) for k, v in out.items()}
        return revert_weight_conversion(base, out)

    # persistent buffers outside the adapters (a router's bias); the adapters' own (VeRA's projections) are merged
    # away, as merge_and_unload drops them
    buffers = {k: b for k, b in persistent_buffers(base).items() if _owner_of(k, owners) is None}
    return save_hf_model(store, base, out_dir, dtype=dtype, unit_tensors=merged_unit, buffers=buffers)


def _owners(base) -> dict[str, torch.nn.Module]:
    """The modules PEFT's merge_and_unload replaces, by name in the base model: its tuner layers (LoRA, IA3, LoHa,
    ...) and its wrappers (modules_to_save, trainable tokens), each outermost one (not those inside another)."""
    owners = {}
    for name, module in base.named_modules():
        if hasattr(module, "unload_and_optionally_merge_module") or hasattr(module, "base_layer"):
            if _owner_of(name, owners) is None:
                owners[name] = module
    return owners


def _owner_of(name: str, owners) -> str | None:
    """The outermost of `owners` that `name` lies under: its shortest prefix among them (a lookup per prefix, not a
    scan of every owner, which a 70B model has hundreds of)."""
    parts = name.split(".")
    return next((p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in owners), None)


def _merged(owner: torch.nn.Module, tensors: dict[str, torch.Tensor], adapter: str, where: str) -> dict:
    """One tuner layer or wrapper merged by PEFT's own code (merge, or unload_and_optionally_merge_module), as
    merge_and_unload merges it: a copy of the module given `tensors` (its trained state in fp32, by local name),
    and the state dict of what it unloads to, by local name."""
    twin = copy.deepcopy(owner)
    twin.load_state_dict(tensors, strict=False, assign=True)
    left = [n for n, t in (*twin.named_parameters(), *twin.named_buffers()) if t.is_meta]
    if left:
        raise MegaTrainError(f"save_merged: {where}.{left[0]} is not held by the engine, so it cannot be merged here; "
                             "save_model writes the adapter for PeftModel.from_pretrained, whose merge_and_unload() "
                             "merges it.")
    twin = twin.float()
    with torch.no_grad():
        if hasattr(twin, "unload_and_optionally_merge_module"):
            plain = twin.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=[adapter])
        else:
            twin.merge(safe_merge=False, adapter_names=[adapter])
            plain = twin.get_base_layer()
    return plain.state_dict()


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
