"""Optimizer state as safetensors: fp32 master, exp_avg, exp_avg_sq per unit, plus step.

No model-sized pickle. Each rank writes the slices it owns (the whole of every unit without data
parallel) as tensors named `<unit>.master`, `<unit>.exp_avg`, `<unit>.exp_avg_sq`, in files
`megatrain_optimizer-r<rank>-<i>.safetensors`; `megatrain_optimizer.json` (written by rank 0)
records the step, the hyper-parameters, the unit layout, and which file holds which range of
which unit. A resume with any number of ranks reads, for each unit, the ranges it now owns from
whichever files hold them.

The per-parameter optimizers (engine/host_optim.py: sgd, adagrad, rmsprop, adafactor; one process) save
only `<unit>.master` in those files, and each parameter's state, under the optimizer's own keys, as
`<unit>.<slot>.<key>` in `megatrain_optimizer_state-<i>.safetensors` (plain values, such as Adafactor's
step, in the JSON). The JSON names the optimizer ("adamw" where absent: written before there were
others), and a resume with another one is refused.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import MegaTrainError

STATE_JSON = "megatrain_optimizer.json"
SHARD_BYTES = 4 * 1024**3


def _kind(optimizer) -> str:
    return getattr(optimizer, "name", "adamw")


def _buffers(optimizer, index: int) -> dict[str, torch.Tensor]:
    if _kind(optimizer) != "adamw":
        return {"master": optimizer.store.master[index]}
    return {
        "master": optimizer.store.master[index],
        "exp_avg": optimizer.exp_avg[index],
        "exp_avg_sq": optimizer.exp_avg_sq[index],
    }


def _bounds_of(store, rank: int) -> list[tuple[int, int]]:
    if store.sharding is None:
        return [(0, u.n_train) for u in store.units]
    return [store.sharding.bounds(u.n_train, rank) for u in store.units]


def _file_plan(bounds: list[tuple[int, int]], rank: int) -> dict[int, str]:
    """unit index -> file, for one rank's slices: files of about SHARD_BYTES, in unit order."""
    plan, part, size = {}, 1, 0
    for index, (lo, hi) in enumerate(bounds):
        nbytes = 12 * (hi - lo)
        if size and size + nbytes > SHARD_BYTES:
            part, size = part + 1, 0
        plan[index] = f"megatrain_optimizer-r{rank:05d}-{part:05d}.safetensors"
        size += nbytes
    return plan


def save_optimizer_state(optimizer, out_dir: str) -> None:
    """Every rank calls this: it writes its own slices; rank 0 also writes the index."""
    os.makedirs(out_dir, exist_ok=True)
    store = optimizer.store
    sharding = store.sharding
    rank, world = (sharding.rank, sharding.world) if sharding else (0, 1)
    plan = _file_plan(_bounds_of(store, rank), rank)
    for fname in sorted(set(plan.values())):
        ids = [i for i, f in plan.items() if f == fname]
        tensors = {f"{i}.{k}": t.cpu() for i in ids for k, t in _buffers(optimizer, i).items()}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
    state_files = _save_param_state(optimizer, out_dir) if _kind(optimizer) != "adamw" else None
    if rank != 0:
        return
    pieces = {str(u.index): [] for u in store.units}
    for r in range(world):
        bounds = _bounds_of(store, r)
        for index, fname in _file_plan(bounds, r).items():
            lo, hi = bounds[index]
            if hi > lo:
                pieces[str(index)].append([fname, lo, hi])
    small = optimizer.state_dict()
    meta = {
        "step": optimizer.step_count,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in small["param_groups"]],
        "units": [[u.kind, u.numel] for u in store.units],
        "world": world,
        "pieces": pieces,
        "optimizer": _kind(optimizer),
    }
    if state_files is not None:
        meta["state_files"], meta["state_values"] = state_files
    with open(os.path.join(out_dir, STATE_JSON), "w") as f:
        json.dump(meta, f, indent=1)


def _save_param_state(optimizer, out_dir: str) -> tuple[dict[str, str], dict]:
    """A per-parameter optimizer's state: files of about SHARD_BYTES; (tensor name -> file, plain values)."""
    tensors, plain = optimizer.state_tensors()
    where, part, size, batch = {}, 1, 0, {}

    def flush():
        if batch:
            save_file(dict(batch), os.path.join(out_dir, f"megatrain_optimizer_state-{part:05d}.safetensors"),
                      metadata={"format": "pt"})
            batch.clear()

    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > SHARD_BYTES:
            flush()
            part, size = part + 1, 0
        batch[name] = t
        where[name] = f"megatrain_optimizer_state-{part:05d}.safetensors"
        size += nbytes
    flush()
    return where, plain


def saved_optimizer(path: str) -> str:
    """The optimizer a checkpoint's state was written by ('adamw' for one written before there were others)."""
    with open(os.path.join(path, STATE_JSON)) as f:
        return json.load(f).get("optimizer", "adamw")


def check_optimizer_kind(path: str, kind: str) -> None:
    """Refuse, in one line, to resume `kind` from a checkpoint another optimizer wrote."""
    if not has_optimizer_state(path):
        return
    saved = saved_optimizer(path)
    if saved != kind:
        want = "an AdamW variant" if saved == "adamw" else f"optim={saved!r}"
        raise MegaTrainError(f"{path} holds the state of {saved}, but this run steps {kind}: resume with {want}, "
                             "or start without resume_from_checkpoint.")


def has_optimizer_state(path: str) -> bool:
    return os.path.isfile(os.path.join(path, STATE_JSON))


def _check_layout(meta: dict, units, path: str) -> None:
    expected = [[u.kind, u.numel] for u in units]
    if meta["units"] != expected:
        raise MegaTrainError(
            f"the optimizer state in {path} was written for a different model layout "
            f"({len(meta['units'])} units) than this one ({len(expected)} units); resume with the same model."
        )


def _read(path: str, meta: dict, store, targets) -> None:
    """targets: (unit index, kind, destination) triples; the destination covers this rank's range."""
    handles = {}
    try:
        for index, kind, buf in targets:
            lo, hi = store.bounds[index]
            got = 0
            for fname, plo, phi in meta["pieces"][str(index)]:
                a, b = max(lo, plo), min(hi, phi)
                if a >= b:
                    continue
                full_path = os.path.join(path, fname)
                if fname not in handles:
                    try:
                        handles[fname] = safe_open(full_path, framework="pt", device="cpu")
                    except Exception as e:
                        raise MegaTrainError(f"cannot open {full_path}: {e}") from e
                key = f"{index}.{kind}"
                try:
                    part = handles[fname].get_slice(key)[a - plo : b - plo]
                except Exception as e:  # missing key or truncated file
                    raise MegaTrainError(f"cannot read tensor {key!r} from {full_path}: {e}") from e
                buf[a - lo : b - lo].copy_(part)
                got += b - a
            if got != hi - lo:
                raise MegaTrainError(f"{path} holds {got} of the {hi - lo} values of unit {index}'s {kind} this rank needs.")
    finally:
        handles.clear()


def load_masters(store, path: str) -> None:
    """Only the fp32 master weights (e.g. the best checkpoint at the end of training)."""
    with open(os.path.join(path, STATE_JSON)) as f:
        meta = json.load(f)
    _check_layout(meta, store.units, path)
    _read(path, meta, store, [(u.index, "master", store.master[u.index]) for u in store.units])
    for u in store.units:
        store.refresh_compute(u.index)


def load_optimizer_state(optimizer, path: str) -> None:
    """Restore masters, moments and step (written by any number of ranks); compute copies follow."""
    with open(os.path.join(path, STATE_JSON)) as f:
        meta = json.load(f)
    store = optimizer.store
    check_optimizer_kind(path, _kind(optimizer))
    _check_layout(meta, store.units, path)
    _read(path, meta, store, [(u.index, k, b) for u in store.units for k, b in _buffers(optimizer, u.index).items()])
    for u in store.units:
        store.refresh_compute(u.index)
    if _kind(optimizer) != "adamw":
        tensors, handles = {}, {}
        for name, fname in meta["state_files"].items():
            if fname not in handles:
                handles[fname] = safe_open(os.path.join(path, fname), framework="pt", device="cpu")
            tensors[name] = handles[fname].get_tensor(name)
        optimizer.load_state_tensors(tensors, meta["state_values"])
    optimizer.step_count = int(meta["step"])
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            group[k] = tuple(v) if k == "betas" or isinstance(group.get(k), tuple) else v
