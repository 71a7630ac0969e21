"""Load an HF checkpoint folder straight into the host store.

The model is built on the meta device (no memory), its units are laid out, the store is
allocated once, and every tensor of every shard is read into its place: the compute copy that
streams and the fp32 master (with the dtype conversion and, for Mixtral, the expert fusion that
transformers applies). No full model is ever materialised besides the store itself.

Data parallel: every rank reads every tensor into its compute copy (each rank streams the whole
model) and keeps, in its master, only its own slice of each unit (`store.bounds`), exactly what
`HostStore.from_model` gives it from a loaded model.
"""

from __future__ import annotations

import json
import os
import re

import torch

from tqdm.auto import tqdm

from ..errors import MegaTrainError
from ..patcher.templates import persistent_buffers
from ..paths import looks_local, missing_path
from .hf_names import CheckpointNames
from .safetensors_io import SAFE_INDEX, SAFE_WEIGHTS, TensorReader, read_header


# What training reads of a hub repository: configs, safetensors weights, tokenizer files. Other
# formats a repository may also carry (.bin, .pth, .gguf, original/) are not downloaded.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]


def resolve_folder(model_id_or_path: str, revision: str | None = None, files: list[str] | None = None) -> str:
    """A local folder, or a hub id's snapshot, found as `from_pretrained` finds it: the local HF
    cache first, then a download through huggingface_hub (progress bars; an interrupted download
    resumes), unless HF_HUB_OFFLINE=1. `files`: the patterns needed (default: MODEL_FILES); a
    cached snapshot without them (e.g. only the config that `estimate` fetched) downloads the rest."""
    if os.path.isdir(model_id_or_path):
        return model_id_or_path
    if os.path.exists(model_id_or_path):
        raise MegaTrainError(f"model {model_id_or_path!r} is a file; pass the folder that holds config.json "
                             "and the safetensors weights.")
    if looks_local(model_id_or_path):
        raise missing_path("model", model_id_or_path, ", or pass a hub id such as org/name")
    from huggingface_hub import constants, snapshot_download

    files = MODEL_FILES if files is None else files
    weights = "*.safetensors" in files
    try:
        folder = snapshot_download(model_id_or_path, revision=revision, local_files_only=True, allow_patterns=files)
        if not weights or any(n.endswith(".safetensors") for n in os.listdir(folder)):
            return folder
        cached = "only part of it is in the local HF cache"
    except Exception as e:
        cached = f"it is not in the local HF cache ({e.__class__.__name__})"
    if constants.HF_HUB_OFFLINE:
        raise MegaTrainError(
            f"{model_id_or_path!r} is not a local folder, {cached}, and HF_HUB_OFFLINE=1 forbids downloading it. "
            f"Download it where there is a network (`hf download {model_id_or_path}`), unset HF_HUB_OFFLINE, or "
            "set HF_HUB_CACHE to the cache that holds it."
        )
    try:
        return snapshot_download(model_id_or_path, revision=revision, allow_patterns=files)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise MegaTrainError(
            f"{model_id_or_path!r} could not be downloaded from the hub ({e.__class__.__name__}: {first}). Check "
            f"the id and your access (`hf auth login` for gated models), or download it with "
            f"`hf download {model_id_or_path}`."
        ) from e


def shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise MegaTrainError(f"{index} lists {name}, which is missing from {folder}.")
        return [os.path.join(folder, n) for n in files]
    single = os.path.join(folder, SAFE_WEIGHTS)
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not found:
        raise MegaTrainError(
            f"{folder} has no safetensors weights (model.safetensors or a sharded index); "
            "convert .bin checkpoints with save_pretrained first."
        )
    return [os.path.join(folder, f) for f in found]


def engine_from_checkpoint(skeleton, folder: str, *, progress: bool = True, **engine_kw):
    """A StreamingEngine for a meta skeleton (checkpoint.loading.meta_skeleton), its store filled
    straight from the safetensors files in `folder`. engine_kw: StreamingEngine's keywords."""
    from functools import partial

    from ..engine.schedule import StreamingEngine
    from ..patcher.adapters import base_model

    base = base_model(skeleton)
    config = base.config
    # parameters read_parameters made real (then changed: embeddings resized for a cloned chat template) are taken
    # as they are; the checkpoint fills the rest (a skeleton's other real parameters, a module's own init, too)
    given = {name: p for name, p in base.named_parameters() if name in read_names(base)}
    fill = partial(load_into_store, names=CheckpointNames(base), config=config, folder=folder, progress=progress,
                   buffers=persistent_buffers(base), ignored=_ignored_on_load(base), given=given)
    return StreamingEngine(skeleton, load_weights=fill, **engine_kw)


def read_parameters(skeleton, folder: str, names: list[str], device="cpu") -> None:
    """Make the meta skeleton's parameters `names` real, on `device` in fp32 (as stock's from_pretrained loads
    them by default), read from the checkpoint in `folder` as load_into_store would read them; every module
    holding one of them (a tied head) gets the real one. engine_from_checkpoint then takes them from the
    skeleton as they are by then, not from the checkpoint: what changes them in between (resize_token_embeddings
    for a cloned chat template) is what the engine trains, and the rest of the model is never loaded whole."""
    import torch.nn as nn

    from ..patcher.adapters import base_model

    base = base_model(skeleton)
    params = dict(base.named_parameters())
    wanted = {name: params[name] for name in names}
    shapes = {name: p.shape for name, p in params.items()}
    real = {name: torch.zeros(p.shape, dtype=torch.float32, device=device) for name, p in wanted.items()}
    filled = dict.fromkeys(wanted, 0)
    mapper = CheckpointNames(base)
    reader = TensorReader()
    try:
        for e in (e for path in shard_files(folder) for e in read_header(path)):
            for e, target, index in mapper(e, shapes):
                if target in real:
                    dest = _landing(real[target].view(-1), _Whole(real[target].shape), index, e, target)
                    reader.read_into(e, dest.reshape(-1))
                    filled[target] += dest.numel()
    finally:
        reader.close()
    missing = [n for n, count in filled.items() if count != real[n].numel()]
    if missing:
        raise MegaTrainError(f"the checkpoint in {folder} lacks {missing[0]!r}, which the model needs.")
    swap = {id(p): nn.Parameter(real[name], requires_grad=p.requires_grad) for name, p in wanted.items()}
    for module in base.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and id(p) in swap:
                module._parameters[key] = swap[id(p)]
    base._hf_megatrain_read = tuple(read_names(base)) + tuple(names)


def read_names(model) -> tuple[str, ...]:
    """The parameters read_parameters made real on this (base) model: what the engine takes from it as it is."""
    return getattr(model, "_hf_megatrain_read", ())


class _Whole:
    """A parameter's own shape as _landing reads a slot's: the whole of it, from offset 0."""

    def __init__(self, shape):
        self.shape = shape


def _ignored_on_load(model) -> tuple[str, ...]:
    """The patterns of checkpoint tensors the model's class says from_pretrained skips
    (`_keys_to_ignore_on_load_unexpected`: LongCat-Flash's multi-token-prediction layers, model.mtp.*,
    which its causal LM does not hold), as from_pretrained reads them: the class's, and those the models inside it
    set when built (Gemma 3n's and Gemma 4's base model: the keys, values and their norms of the layers that share
    another layer's, which their checkpoints carry)."""
    out = list(getattr(type(model), "_keys_to_ignore_on_load_unexpected", None) or ())
    for module in model.modules():
        out += list(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ())
    return tuple(dict.fromkeys(out))


def load_into_store(store, names: CheckpointNames, config, folder: str, progress: bool = True,
                    buffers: dict | None = None, ignored: tuple[str, ...] = (), given: dict | None = None) -> None:
    """Fill every unit's compute copy and this rank's part of its fp32 master from the checkpoint;
    and `buffers` (persistent_buffers of the skeleton: host tensors, e.g. a router's score correction
    bias, which the engine hands to each layer's template call) in place, every one of them.
    `names`: where each checkpoint tensor goes, by transformers' own mapping of checkpoint names (hf_names.py).
    `ignored`: patterns (re.search) of checkpoint tensors the model does not hold and skips (_ignored_on_load).
    `given`: parameter name -> a real tensor that fills that slot instead of the checkpoint's (whose tensor for it,
    of another shape once the embeddings were resized, is not read)."""
    files = shard_files(folder)
    entries = [e for path in files for e in read_header(path)]  # every header first: fail before reading
    slots = {s.name: (u.index, s) for u in store.units for s in u.slots}
    given = given or {}
    # a tied lm_head (CTRL's beside a bias of its own, which the layout does not mark) saved anyway: skipped
    tied = {u.tied_local for u in store.units if u.tied_local} or getattr(config, "tie_word_embeddings", False)
    buffers = buffers or {}
    plan, filled, buffer_plan = [], {name: 0 for name in slots}, []
    shapes = {name: s.shape for name, (_, s) in slots.items()}
    for e, target, index in (piece for e in entries for piece in names(e, shapes)):
        if target in given:
            continue
        if target in buffers and not index:
            buffer_plan.append((e, target))
            continue
        if target not in slots:
            if any(re.search(pattern, e.name) for pattern in ignored):
                continue  # what from_pretrained skips too: only tensors the model does not hold (GPT-2's pattern
                # for its old attn.bias buffers also matches its c_attn.bias weights)
            if target.endswith("lm_head.weight") and tied:
                continue  # a tied lm_head saved anyway: the embedding already holds it
            if "rotary_emb" in target:
                continue  # non-persistent buffers some older checkpoints still carry
            raise MegaTrainError(
                f"{e.path}: tensor {e.name!r} does not belong to {type(config).__name__}'s model "
                f"(mapped to {target!r}). Is this checkpoint for another architecture?"
            )
        plan.append((e, target, index))
    unread = sorted(set(buffers) - {t for _, t in buffer_plan})
    if unread:
        raise MegaTrainError(
            f"the checkpoint in {folder} lacks {len(unread)} buffer(s) the model saves with its weights, e.g. "
            f"{unread[:3]}; hf_megatrain reads them from the checkpoint and does not make them up."
        )
    reader = TensorReader()
    total = sum(e.nbytes for e, _, _ in plan)
    quiet = not progress or (store.sharding is not None and store.sharding.rank != 0)  # one bar, not one a rank
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=quiet)
    try:
        for target, tensor in given.items():
            u, slot = slots[target]
            filled[target] += _take_tensor(store, tensor, u, slot)
        for e, target in buffer_plan:  # a few small tensors, read whole (every data-parallel rank reads them)
            buf = buffers[target]
            if tuple(buf.shape) != tuple(e.shape):
                raise MegaTrainError(f"{e.path}: tensor {e.name!r} has shape {list(e.shape)}, but the model "
                                     f"expects {list(buf.shape)} for {target}. Does config.json match these weights?")
            reader.read_into(e, buf.view(-1))
        for e, target, index in plan:
            u, slot = slots[target]
            filled[target] += _read_tensor(store, reader, e, u, slot, index, target)
            bar.update(e.nbytes)
    finally:
        reader.close()
        bar.close()
    missing = [n for n, (_, s) in slots.items() if filled[n] != s.numel]
    if missing:
        raise MegaTrainError(
            f"the checkpoint in {folder} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}."
        )


def _landing(flat, slot, index: tuple, e, target: str):
    """Where checkpoint tensor `e` lands in a slot's flat range: the whole slot, or the part
    `index` picks (one expert of a fused tensor); checked to match and to be one flat range."""
    dest = flat.view(slot.shape)[index] if index else flat.view(slot.shape)
    if tuple(dest.shape) != tuple(e.shape):
        raise MegaTrainError(
            f"{e.path}: tensor {e.name!r} has shape {list(e.shape)}, but the model expects "
            f"{list(dest.shape)} for {target}. Does config.json match these weights?"
        )
    if not dest.is_contiguous():  # hf_names places whole experts and row ranges: a new conversion's bug
        raise MegaTrainError(f"{target}{list(index)}: a checkpoint tensor must land in one flat range")
    return dest


def _read_tensor(store, reader, e, u: int, slot, index: tuple, target: str) -> int:
    """One checkpoint tensor into unit u: all of it into the compute copy, and the part inside this
    rank's master slice into the master, both as HostStore.from_model would fill them. Returns the
    number of elements of the slot it filled. A unit without a compute copy (Unit.no_compute_copy):
    its master, the one copy, gets the checkpoint's exact values (what the other path gives the
    master too)."""
    if store.compute[u] is None:
        return _read_master_only(store, reader, e, u, slot, index, target)
    flat = store.compute[u][slot.offset : slot.offset + slot.numel]
    dest = _landing(flat, slot, index, e, target)
    a = slot.offset + dest.storage_offset() - flat.storage_offset()  # [a, b) in the unit's flat layout
    b = a + dest.numel()
    lo, hi = store.bounds[u]
    master = store.master[u]
    # The part of [a, b) this rank's master holds; none for a frozen slot, and nothing to do twice
    # when the master itself is what streams (fp32 compute, one process).
    p, q = (max(a, lo), min(b, hi)) if slot.trainable and master is not store.compute[u] else (a, a)
    dest = dest.reshape(-1)
    if p >= q or e.dtype == store.compute_dtype or store.compute_dtype == torch.float32:
        # The compute copy can hold what the master needs (the checkpoint's own bytes, e.g. bf16 on
        # disk and bf16 compute, or in fp32 compute the fp32 value itself): read it there once,
        # and the master is its exact upcast.
        reader.read_into(e, dest)
        if p < q:
            master[p - lo : q - lo].copy_(dest[p - a : q - a])
        return b - a
    # A checkpoint more precise than the compute copy (fp32 on disk, bf16 compute): the master
    # gets the exact values, the compute copy their rounding; the rest of the tensor only streams.
    mine = master[p - lo : q - lo]
    reader.read_into(e, mine, first=p - a)
    dest[p - a : q - a].copy_(mine)
    for x, y in ((a, p), (q, b)):
        if x < y:
            reader.read_into(e, dest[x - a : y - a], first=x - a)
    return b - a


def _take_tensor(store, tensor: torch.Tensor, u: int, slot) -> int:
    """A real tensor into its slot of unit u, as HostStore.from_model copies a loaded model's (HostStore.put)."""
    if tuple(tensor.shape) != tuple(slot.shape):
        raise MegaTrainError(f"{slot.name} has shape {list(tensor.shape)}, but the model's layout expects "
                             f"{list(slot.shape)}")
    store.put(u, slot, tensor)
    return slot.numel


def _read_master_only(store, reader, e, u: int, slot, index: tuple, target: str) -> int:
    """_read_tensor for a unit without a compute copy, resident or streamed (every slot trained, no
    data parallel): the master is the only copy."""
    dest = _landing(store.master[u][slot.offset : slot.offset + slot.numel], slot, index, e, target)
    reader.read_into(e, dest.reshape(-1))  # an exact upcast of what is on disk, to the master's device
    return dest.numel()
