"""Optimizer state as sharded safetensors: fp32 master, exp_avg, exp_avg_sq per unit, plus step.

No model-sized pickle: each unit's three flat fp32 buffers are written as tensors named
`<unit>.master`, `<unit>.exp_avg`, `<unit>.exp_avg_sq`; the small rest (step, hyper-parameters,
the unit layout used to check a resume) goes to `megatrain_optimizer.json`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import MegaTrainError

STATE_JSON = "megatrain_optimizer.json"
KINDS = ("master", "exp_avg", "exp_avg_sq")
SHARD_BYTES = 4 * 1024**3


def _buffers(optimizer, index: int) -> dict[str, torch.Tensor]:
    return {
        "master": optimizer.store.master[index],
        "exp_avg": optimizer.exp_avg[index],
        "exp_avg_sq": optimizer.exp_avg_sq[index],
    }


def save_optimizer_state(optimizer, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    units = optimizer.store.units
    shards, current, size = [], [], 0
    for u in units:
        nbytes = 12 * u.numel
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(u.index)
        size += nbytes
    shards.append(current)
    files = {}
    for i, unit_ids in enumerate(shards):
        fname = f"megatrain_optimizer-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {f"{idx}.{k}": t.cpu() for idx in unit_ids for k, t in _buffers(optimizer, idx).items()}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        files.update({str(idx): fname for idx in unit_ids})
    small = optimizer.state_dict()
    meta = {
        "step": optimizer.step_count,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in small["param_groups"]],
        "units": [[u.kind, u.numel] for u in units],
        "files": files,
    }
    with open(os.path.join(out_dir, STATE_JSON), "w") as f:
        json.dump(meta, f, indent=1)


def has_optimizer_state(path: str) -> bool:
    return os.path.isfile(os.path.join(path, STATE_JSON))


def _check_layout(meta: dict, units, path: str) -> None:
    expected = [[u.kind, u.numel] for u in units]
    if meta["units"] != expected:
        raise MegaTrainError(
            f"the optimizer state in {path} was written for a different model layout "
            f"({len(meta['units'])} units) than this one ({len(expected)} units); resume with the same model."
        )


def _read(path: str, meta: dict, targets) -> None:
    """targets: (unit index, kind, destination tensor) triples."""
    handles = {}
    try:
        for index, kind, buf in targets:
            fname = meta["files"][str(index)]
            if fname not in handles:
                try:
                    handles[fname] = safe_open(os.path.join(path, fname), framework="pt", device="cpu")
                except Exception as e:
                    raise MegaTrainError(f"cannot open {os.path.join(path, fname)}: {e}") from e
            key = f"{index}.{kind}"
            try:
                t = handles[fname].get_tensor(key)
            except Exception as e:  # missing key or truncated file
                raise MegaTrainError(f"cannot read tensor {key!r} from {os.path.join(path, fname)}: {e}") from e
            if t.shape != buf.shape:
                raise MegaTrainError(f"{key!r} in {fname} has shape {tuple(t.shape)}, expected {tuple(buf.shape)}")
            buf.copy_(t)
    finally:
        handles.clear()


def load_masters(store, path: str) -> None:
    """Only the fp32 master weights (e.g. the best checkpoint at the end of training)."""
    with open(os.path.join(path, STATE_JSON)) as f:
        meta = json.load(f)
    _check_layout(meta, store.units, path)
    _read(path, meta, [(u.index, "master", store.master[u.index]) for u in store.units])
    for u in store.units:
        store.refresh_compute(u.index)


def load_optimizer_state(optimizer, path: str) -> None:
    """Restore masters, moments and step; the streamed compute copies are refreshed."""
    with open(os.path.join(path, STATE_JSON)) as f:
        meta = json.load(f)
    units = optimizer.store.units
    _check_layout(meta, units, path)
    _read(path, meta, [(u.index, k, b) for u in units for k, b in _buffers(optimizer, u.index).items()])
    for u in units:
        optimizer.store.refresh_compute(u.index)
    optimizer.step_count = int(meta["step"])
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            group[k] = tuple(v) if k == "betas" else v
