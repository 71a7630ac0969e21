"""Optimizer state as safetensors: fp32 master, exp_avg, exp_avg_sq per unit, plus step.

No model-sized pickle. Each rank writes the slices it owns (the whole of every unit without data
parallel) as tensors named `<unit>.master`, `<unit>.exp_avg`, `<unit>.exp_avg_sq`, in files
`megatrain_optimizer-r<rank>-<i>.safetensors`; `megatrain_optimizer.json` (written by rank 0)
records the step, the hyper-parameters, the unit layout, and which file holds which range of
which unit. A resume with any number of ranks reads, for each unit, the ranges it now owns from
whichever files hold them.

The other host optimizers (engine/host_optim.py) save `<unit>.master` in those files, and their own state
under the stock class's keys:
- sgd, adagrad, rmsprop (elementwise; any number of ranks): each piece's state tensors, as
  `<unit>.<key>.<start>` beside the master in the rank's files (start: the piece's first element in the
  unit's trainable prefix); the JSON's "piece_state" says which file holds which range of each, and
  carries each unit's 0-d counters (torch's per-parameter `step`, the same for every piece of a unit)
  and plain values. A resume with any number of ranks, or other pieces (gpu_grad_layers), reads the
  ranges each of its pieces covers.
- adafactor (one process): each parameter's state as `<unit>.<slot>.<key>` in
  `megatrain_optimizer_state-<i>.safetensors` (plain values, such as Adafactor's step, in the JSON).
  The elementwise optimizers wrote theirs so too before they were sharded; a resume still reads it.
The JSON names the optimizer ("adamw" where absent: written before there were others), and a resume
with another one is refused.
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
    elementwise = getattr(optimizer, "elementwise", False)
    for fname in sorted(set(plan.values())):
        ids = [i for i, f in plan.items() if f == fname]
        tensors = {f"{i}.{k}": t.cpu() for i in ids for k, t in _buffers(optimizer, i).items()}
        if elementwise:  # each piece's state beside its unit's master
            tensors.update({f"{i}.{key}.{start}": t.detach().cpu().contiguous() for i in ids
                            for start, _, state in optimizer.piece_state(i) for key, t in state.items()
                            if isinstance(t, torch.Tensor) and t.dim()})
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
    state_files = _save_param_state(optimizer, out_dir) if _kind(optimizer) != "adamw" and not elementwise else None
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
    if elementwise:
        meta["piece_state"] = _piece_index(optimizer, world)
    with open(os.path.join(out_dir, STATE_JSON), "w") as f:
        json.dump(meta, f, indent=1)


def _piece_index(optimizer, world: int) -> dict:
    """Rank 0's record of the elementwise optimizers' piece state: per unit, which file holds which range
    of each state tensor (every rank's pieces, as each rank cuts them), and the 0-d counters and plain
    values, which every piece of a unit shares (torch steps a unit's pieces together), from rank 0's."""
    store = optimizer.store
    bounds = [_bounds_of(store, r) for r in range(world)]
    plans = [_file_plan(bounds[r], r) for r in range(world)]
    out = {}
    for unit in store.units:
        mine = optimizer.piece_state(unit.index)
        first = next((state for _, _, state in mine if state), None)
        if first is None:
            continue  # never stepped and nothing built eagerly
        for start, _, state in mine:
            same = {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim())}
            if state and any(not _equal(same.get(k), v) for k, v in first.items()
                             if not (isinstance(v, torch.Tensor) and v.dim())):
                raise RuntimeError(f"{unit.label}: its pieces' counters differ (piece at {start}): not one state")
        keys = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim()]
        ranges = []
        for r in range(world):
            ranges += [[plans[r][unit.index], a, b] for a, b in optimizer.piece_bounds(unit.index, *bounds[r][unit.index])]
        out[str(unit.index)] = {
            "tensors": {k: ranges for k in keys},
            "scalars": {k: [v.item(), str(v.dtype).removeprefix("torch.")] for k, v in first.items()
                        if isinstance(v, torch.Tensor) and not v.dim()},
            "values": {k: v for k, v in first.items() if not isinstance(v, torch.Tensor) and v is not None},
        }
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


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


class _Files:
    """The checkpoint's safetensors files, each opened once, read by element range."""

    def __init__(self, path: str):
        self.path, self.handles = path, {}

    def open(self, fname: str):
        if fname not in self.handles:
            full_path = os.path.join(self.path, fname)
            try:
                self.handles[fname] = safe_open(full_path, framework="pt", device="cpu")
            except Exception as e:
                raise MegaTrainError(f"cannot open {full_path}: {e}") from e
        return self.handles[fname]

    def tensor(self, fname: str, name: str) -> torch.Tensor:
        try:
            return self.open(fname).get_tensor(name)
        except MegaTrainError:
            raise
        except Exception as e:  # missing key or truncated file
            raise MegaTrainError(f"cannot read tensor {name!r} from {os.path.join(self.path, fname)}: {e}") from e

    def parts(self, ranges, lo: int, hi: int, what: str) -> list[torch.Tensor]:
        """Elements [lo, hi) of a flat tensor saved in pieces: `ranges` are (file, start, end, tensor name),
        each tensor holding elements [start, end) (flattened where it has a parameter's shape); the parts
        that cover [lo, hi), in order."""
        out, got = [], 0
        for fname, plo, phi, name in sorted(ranges, key=lambda r: r[1]):
            a, b = max(lo, plo), min(hi, phi)
            if a >= b:
                continue
            try:
                piece = self.open(fname).get_slice(name)
                if len(piece.get_shape()) == 1:
                    part = piece[a - plo : b - plo]
                else:  # a parameter's state in its shape (written per parameter)
                    part = self.tensor(fname, name).reshape(-1)[a - plo : b - plo]
            except MegaTrainError:
                raise
            except Exception as e:  # missing key or truncated file
                raise MegaTrainError(f"cannot read tensor {name!r} from {os.path.join(self.path, fname)}: {e}") from e
            out.append(part)
            got += b - a
        if got != hi - lo:
            raise MegaTrainError(f"{self.path} holds {got} of the {hi - lo} values of {what} this rank needs.")
        return out


def _read(path: str, meta: dict, store, targets) -> None:
    """targets: (unit index, kind, destination) triples; the destination covers this rank's range."""
    files = _Files(path)
    for index, kind, buf in targets:
        lo, hi = store.bounds[index]
        ranges = [(fname, plo, phi, f"{index}.{kind}") for fname, plo, phi in meta["pieces"][str(index)]]
        at = 0
        for part in files.parts(ranges, lo, hi, f"unit {index}'s {kind}"):
            buf[at : at + part.numel()].copy_(part)
            at += part.numel()


def _piece_record(meta: dict, store, files: _Files) -> dict[int, tuple[dict, dict, dict]]:
    """The elementwise optimizers' saved state, per unit: ({key: [(file, start, end, tensor name)]},
    {key: 0-d tensor}, {key: plain value}); from _piece_index's record, or from the per-parameter files
    they were written in before they were sharded (each parameter's tensors cover its own range)."""
    out = {}
    if "piece_state" in meta:
        for index, saved in meta["piece_state"].items():
            ranges = {k: [(f, a, b, f"{index}.{k}.{a}") for f, a, b in r] for k, r in saved["tensors"].items()}
            scalars = {k: torch.tensor(v, dtype=getattr(torch, dtype)) for k, (v, dtype) in saved["scalars"].items()}
            out[int(index)] = (ranges, scalars, dict(saved["values"]))
        return out
    for name, fname in meta.get("state_files", {}).items():
        index, j, key = name.split(".", 2)
        ranges, scalars, values = out.setdefault(int(index), ({}, {}, {}))
        if not files.open(fname).get_slice(name).get_shape():  # a 0-d counter: each parameter's, all equal
            scalars.setdefault(key, files.tensor(fname, name))
            continue
        slot = store.units[int(index)].train_slots[int(j)]
        ranges.setdefault(key, []).append((fname, slot.offset, slot.offset + slot.numel, name))
    for name, value in meta.get("state_values", {}).items():
        index, _, key = name.split(".", 2)
        out.setdefault(int(index), ({}, {}, {}))[2].setdefault(key, value)
    return out


def _load_piece_state(optimizer, path: str, meta: dict) -> None:
    """Each of this rank's pieces gets the saved state of the elements it covers."""
    store, files = optimizer.store, _Files(path)
    record = _piece_record(meta, store, files)
    for unit in store.units:
        if unit.index not in record:  # nothing saved: never stepped, as this optimizer was just built
            continue
        ranges, scalars, values = record[unit.index]
        states = []
        for start, end, _ in optimizer.piece_state(unit.index):
            state = {k: torch.cat(files.parts(r, start, end, f"unit {unit.index}'s {k}")) for k, r in ranges.items()}
            state.update({k: v.clone() for k, v in scalars.items()})
            state.update(values)
            states.append(state)
        optimizer.load_piece_state(unit.index, states)


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
    if getattr(optimizer, "elementwise", False):
        _load_piece_state(optimizer, path, meta)
    elif _kind(optimizer) != "adamw":
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
