"""How unit weights reach the compute device and gradients come back: the `Pipeline` seam.

The schedule (schedule.py) only ever says: "give me unit i's weights", "I am done with
them", "here is unit i's gradient". A pipeline decides how. `HostPipeline` is the CPU
case: the weights are used where they lie and gradients are accumulated at once. The CUDA
pipeline (cuda_pipeline.py) streams through pinned buffers, GPU ring slots and events.
Both implement `Pipeline`, and the schedule uses nothing else of them.

Both keep the same contract with the optimizer: `weights(i)` waits for unit i's pending step
(`store.ready[i]`, which raises if that step failed), and `on_final_grad(i, landed)` (set
through `StreamingEngine.listen`) is told when a unit's last gradient of the step was emitted,
with `landed()` blocking until it is in the accumulator. Who writes which buffer and what
orders its readers: the table in the engine package's docstring (engine/__init__.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Callable, ContextManager, Protocol

import torch

from .store import HostStore
from .worker import Worker


class Pipeline(Protocol):
    """What the schedule asks of a pipeline, in the order of one forward/backward:
    start(plan), then per unit weights -> [grad_buffer -> emit_grad] -> release, then finish()."""

    timeline: object | None  # a Timeline records busy spans when attached (timeline.py)
    on_final_grad: Callable[[int, Callable[[], None]], None] | None  # StreamingEngine.listen sets it
    # StreamingEngine.gradient_norm: while measure_only, emit_grad only takes the gradient's
    # per-parameter norms into measured[unit index] (on the compute device) and drops it: nothing
    # is counted, accumulated or sent to the host.
    measure_only: bool
    measured: dict[int, torch.Tensor]

    def span(self, lane: str, stream=None) -> ContextManager:
        """A busy span of `lane` ("compute", "h2d", ...) for the timeline."""

    def start(self, plan: list[int]) -> None:
        """The order in which units will be asked for during this forward/backward."""

    def weights(self, index: int) -> torch.Tensor:
        """Unit `index`'s flat compute-dtype weights on the compute device, ready to read."""

    def release(self, index: int) -> None:
        """Compute is done with the unit's weights (its buffer may be refilled)."""

    def grad_buffer(self, index: int) -> torch.Tensor:
        """Where the backward writes unit `index`'s flat gradient (its trainable prefix)."""

    def emit_grad(self, index: int, grad: torch.Tensor) -> None:
        """`grad` (written by the backward) is one contribution to unit `index`'s accumulator."""

    def finish(self) -> None:
        """Block until every emitted gradient is in the host accumulators."""

    def grad_norms(self) -> list[torch.Tensor]:
        """Per-parameter gradient norms of every unit (in unit/slot order, on the host; zeros for a unit
        with no gradient this step), as clip_grad_norm_ would take them from the accumulators."""


def slot_norms(unit, grad: torch.Tensor) -> torch.Tensor:
    """Per-parameter L2 norms of a unit's flat fp32 gradient, in slot order (as stock's clipping takes them)."""
    return torch.stack(torch._foreach_norm([grad[s.offset : s.offset + s.numel] for s in unit.train_slots], 2))


def _landed() -> None:
    """A gradient added on the calling thread has landed already."""


class HostPipeline(Pipeline):
    """Compute on the host itself: no copies, no streams.

    asynchronous: gradient accumulation runs on a worker thread, as on a GPU (the optimizer
    then steps on its own worker too): CPU tests exercise the same ordering and failure paths.
    """

    def __init__(self, store: HostStore, device: torch.device, asynchronous: bool = False):
        self.store = store
        self.device = device
        self.timeline = None
        self.on_final_grad = None  # set through StreamingEngine.listen
        self.accumulator = Worker("megatrain-accumulate") if asynchronous else None
        # Transient gradients are gone once stepped: their per-parameter norms are taken as they land.
        self.norms: list[torch.Tensor | None] = [None] * len(store.units)
        self.measure_only, self.measured = False, {}

    def span(self, lane: str, stream=None):
        """A busy span (compute etc.) for the timeline; host work is timed on the host clock."""
        return self.timeline.host_span(lane) if self.timeline is not None else nullcontext()

    def start(self, plan: list[int]) -> None:
        """The order in which units will be asked for during this forward/backward."""

    def weights(self, index: int) -> torch.Tensor:
        self.store.ready[index].wait()  # its pending optimizer step writes this very buffer
        if self.store.units[index].no_compute_copy:  # no copy kept: the same rounding, made for this use
            return self.store.master[index].to(self.store.compute_dtype)
        # `.data`: a tensor with a version counter of its own. Every unit's copy is a view of one
        # arena, whose counter they would share, so a unit stepped during the backward (its
        # gradient final) would look to autograd like a write to the layers still waiting.
        return self.store.compute[index].data  # a resident unit's copy is already on the device

    def release(self, index: int) -> None:
        pass

    def grad_buffer(self, index: int) -> torch.Tensor:
        unit = self.store.units[index]
        if unit.resident and self.store.grad_count[index] == 0 and not self.store.transient_on_host(unit):
            return self.store.grad[index]  # the first gradient is written straight into place
        return torch.empty(self.store.units[index].n_train, dtype=self.store.compute_dtype, device=self.device)

    def emit_grad(self, index: int, grad: torch.Tensor) -> None:
        store = self.store
        if self.measure_only:  # the values the accumulator would hold: fp32 of the gradient
            self.measured[index] = slot_norms(store.units[index], grad.float())
            return
        if store.sharding is not None:  # collectives stay on the training thread, in order
            grad = store.sharding.reduce(grad.float(), store.units[index].n_train)
        first = store.count_grad(index)
        landed = _landed
        add = partial(self._add_grad, index, grad, first)
        if self.accumulator is None:
            add()
        else:  # `grad` is a fresh tensor (grad_buffer), so the job may hold it
            landed = self.accumulator.later(add, f"gradient accumulation of {store.units[index].label}")
        if self.on_final_grad is not None:
            self.on_final_grad(index, landed)

    def _add_grad(self, index: int, grad: torch.Tensor, first: bool) -> None:
        store = self.store
        store.add_grad(index, grad, first)
        if store.transient_on_host(store.units[index]):  # as stock would take them, before the step
            self.norms[index] = slot_norms(store.units[index], store.grad[index])

    def finish(self) -> None:
        """Block until every emitted gradient is in the host accumulators."""
        if self.accumulator is not None:
            self.accumulator.drain()

    def grad_norms(self) -> list[torch.Tensor]:
        """From the accumulators, as stock takes them; a transient gradient's, taken as it landed
        (the same values: it is gone once stepped)."""
        self.finish()
        out = []
        for u in self.store.units:
            if self.store.grad_count[u.index] == 0:
                out.append(torch.zeros(len(u.train_slots)))
            elif not self.store.transient_on_host(u) or self.norms[u.index] is None:  # it keeps its gradient
                out.append(slot_norms(u, self.store.grad[u.index]))
            else:
                out.append(self.norms[u.index])
        return out
