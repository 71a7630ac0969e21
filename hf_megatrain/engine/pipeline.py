"""How unit weights reach the compute device and gradients come back.

The schedule (schedule.py) only ever says: "give me unit i's weights", "I am done with
them", "here is unit i's gradient". A pipeline decides how. `HostPipeline` is the CPU
case: the weights are used where they lie and gradients are accumulated at once. The CUDA
pipeline (cuda_pipeline.py) streams through pinned buffers, GPU ring slots and events.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .store import HostStore


class HostPipeline:
    """Compute on the host itself: no copies, no streams."""

    def __init__(self, store: HostStore, device: torch.device):
        self.store = store
        self.device = device
        self.timeline = None

    def span(self, lane: str, stream=None):
        """A busy span (compute etc.) for the timeline; host work is timed on the host clock."""
        return self.timeline.host_span(lane) if self.timeline is not None else nullcontext()

    def start(self, plan: list[int]) -> None:
        """The order in which units will be asked for during this forward/backward."""

    def weights(self, index: int) -> torch.Tensor:
        return self.store.compute[index]  # a resident unit's copy is already on the device

    def release(self, index: int) -> None:
        pass

    def grad_buffer(self, index: int) -> torch.Tensor:
        if self.store.units[index].resident and self.store.grad_count[index] == 0:
            return self.store.grad[index]  # the first gradient is written straight into place
        return torch.empty(self.store.units[index].n_train, dtype=self.store.compute_dtype, device=self.device)

    def emit_grad(self, index: int, grad: torch.Tensor) -> None:
        self.store.accumulate(index, grad)

    def finish(self) -> None:
        """Block until every emitted gradient is in the host accumulators."""
