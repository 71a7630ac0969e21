"""Data parallel through torch.distributed: each rank owns a slice of every unit's state.

Every rank runs the whole streaming engine on its share of the batch and keeps the full
streamed compute copy (it needs every weight), but only 1/world of each unit's trainable fp32
state: master, gradient accumulator and Adam moments. So host RAM for optimizer state falls as
ranks are added. Per unit:

    gradient   reduce-scatter (sum) of the unit's flat gradient: each rank gets its slice
    step       each rank runs AdamW on its slice (clipping uses the all-reduced global norm)
    weights    all-gather of the updated slices into every rank's compute copy

Slices are contiguous ranges of the flat trainable prefix, `ceil(n / world)` long, so a
checkpoint written by W ranks is read back by any other number (checkpoint/optimizer_state.py).
Gradients travel on the default group (NCCL on GPUs, gloo on CPUs); weights are all-gathered
between host buffers on a gloo group of their own, from the optimizer's host thread, so the two
kinds of collectives never interleave.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import MegaTrainError

# torch 2.13 renamed the flat-tensor collectives (`*_into_tensor` / `*_tensor` -> `*_single`, same
# arguments) and warns on the old names; older releases (the GPU machine's 2.11) may lack the new ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_launch(args) -> None:
    """Refuse several launched processes that TrainingArguments did not join into one run.

    On a machine without a GPU, torchrun (or accelerate launch --multi_gpu) starts WORLD_SIZE
    processes, but without use_cpu=True TrainingArguments treats each as a run of its own
    (args.world_size == 1): they would train the same model independently into one output_dir.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and args.world_size == 1:
        raise MegaTrainError(
            f"{launched} processes were launched (WORLD_SIZE={launched}), but they do not form one data-parallel "
            f"run (TrainingArguments sees a world of 1; on a machine without a GPU it joins them only with "
            f"use_cpu=True). Add --use_cpu (use_cpu=True) to train on the CPU with {launched} processes, "
            "or launch one process."
        )


class Sharding:
    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        # Host-side collectives (weights, norms, checkpoint gathers) always go through gloo.
        self.host_group = dist.new_group(backend="gloo")
        self.weights_group = dist.new_group(backend="gloo")

    def bounds(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of a flat trainable prefix of length n that `rank` (default: this rank) owns."""
        per = self.per(n)
        r = self.rank if rank is None else rank
        lo = min(r * per, n)
        return lo, min(lo + per, n)

    def per(self, n: int) -> int:
        return -(-n // self.world)

    def _padded(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        size = self.per(n) * self.world
        if flat.numel() == size:
            return flat
        padded = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        padded[:n].copy_(flat[:n])
        return padded

    def reduce(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        """Sum of `flat[:n]` over ranks, this rank's slice only."""
        out = torch.empty(self.per(n), dtype=flat.dtype, device=flat.device)
        group = self.host_group if flat.device.type == "cpu" else self.group
        _reduce_scatter(out, self._padded(flat, n), group=group)
        lo, hi = self.bounds(n)
        return out[: hi - lo]

    def gather(self, full: torch.Tensor, n: int, *, weights: bool = False) -> None:
        """Fill `full[:n]` on every rank from each rank's own slice of it (in place)."""
        lo, hi = self.bounds(n)
        per = self.per(n)
        mine = torch.zeros(per, dtype=full.dtype)
        mine[: hi - lo].copy_(full[lo:hi])
        out = torch.empty(per * self.world, dtype=full.dtype)
        _all_gather(out, mine, group=self.weights_group if weights else self.host_group)
        full[:n].copy_(out[:n])

    def gather_slice(self, part: torch.Tensor, n: int) -> torch.Tensor:
        """The full length-n tensor whose slices the ranks hold (`part` is this rank's)."""
        full = torch.empty(n, dtype=part.dtype)
        lo, hi = self.bounds(n)
        full[lo:hi].copy_(part)
        self.gather(full, n)
        return full

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.host_group)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self.host_group)
