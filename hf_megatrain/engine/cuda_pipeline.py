"""The CUDA pipeline: pinned host buffers, a ring of GPU weight slots, copy streams, events.

    h2d stream   pinned compute copy of unit i  ->  GPU slot      (prefetched `depth - 1` ahead)
    compute      the current stream: waits for the slot's `ready` event, runs, records `released`
    d2h stream   fp32 gradient of unit i  ->  pinned host accumulator (or a staging slab)

The schedule hands over its *plan* (the order in which units will be asked for) at the start
of each forward/backward, so loads are issued ahead in both directions: the backward never
waits for a load that could have started earlier. A layer used twice in a row (the last layer:
end of forward, start of backward) stays in its slot. Embedding and head have buffers of their
own and stay resident for the whole step (a tied head reads the embedding's buffer).

A lean resident layer (EngineConfig.lean_resident) passes through the ring like a streamed one,
but its "load" is a cast of its fp32 master, already on the GPU, into the slot, on the H2D
stream: no PCIe traffic, one elementwise kernel beside the compute. The cast waits for an event
recorded at `start()`, after every optimizer step queued on the compute stream. A lean streamed
layer (EngineConfig.lean_streamed) loads its pinned fp32 master instead of a compute copy: torch
copies it to a transient fp32 buffer on the H2D stream and casts it into the slot there (a
non-blocking copy converts on the GPU), the same rounding as the host's copy.

Ordering is by CUDA events only. The host waits in two places, both data dependencies: before
loading a unit whose optimizer step is still running (its `ready` flag), and in `finish()`,
when every gradient must be on the host (the global norm for clipping needs all of them).

Gradients: the first contribution to a unit in a step goes straight into the pinned fp32
accumulator (cast to fp32 on the GPU; no host work at all), with its per-parameter norms taken
on the GPU on the way. Later contributions (gradient accumulation) land in a pinned staging
slab and a host worker adds them in.

Who writes each buffer and which event orders its readers: the table in the engine package's
docstring (engine/__init__.py).
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch

from .layout import grad_slot_numel, ring_numel, slab_numel
from .pipeline import Pipeline, slot_norms
from .store import HostStore
from .worker import Worker


@dataclass
class _Buffer:
    data: torch.Tensor
    ready: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # load finished (h2d)
    released: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # compute done with it
    unit: int | None = None


@dataclass
class _Entry:
    unit: int
    buffer: _Buffer
    load: bool  # False: the unit is already in this buffer (repeat use)
    depends_on: int | None  # plan entry that must be released before this load may start
    issued: bool = False
    released: bool = False


def _landed() -> None:
    """A gradient on the device, in the stream order of its step, has landed already."""


class CudaPipeline(Pipeline):
    """The `Pipeline` of a GPU run: streams units through a ring of `depth` GPU weight slots,
    sends gradients back through `grad_slots` GPU slots and `staging_slabs` pinned slabs.

    Threads: the training thread calls every method; the H2D and D2H streams do the copies it
    queues; one `megatrain-accumulate` worker adds later gradient contributions on the host.
    Buffer sizes are engine.layout's (the planner counts with the same functions)."""

    def __init__(self, store: HostStore, device: torch.device, depth: int = 2, grad_slots: int = 2,
                 staging_slabs: int = 2):
        if depth < 2:
            raise ValueError("depth must be >= 2")
        self.store = store
        self.device = device
        self.depth = depth
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        n = ring_numel(store.units)
        dt = store.compute_dtype
        self.ring = [_Buffer(torch.empty(n, dtype=dt, device=device)) for _ in range(depth if n else 0)]
        self.fixed: dict[int, _Buffer] = {}
        for u in store.units:
            if u.no_compute_copy:
                continue  # through the ring, cast from its master
            if u.resident:  # already on the device: its "buffer" is the resident copy, never loaded
                self.fixed[u.index] = _Buffer(store.compute[u.index])
            elif u.kind != "layer":
                self.fixed[u.index] = _Buffer(torch.empty(u.numel, dtype=dt, device=device))
        # gradients cover the trainable prefix only
        g, n = grad_slot_numel(store.units), slab_numel(store.units)
        self.grad_ring = [_Buffer(torch.empty(g, dtype=torch.float32, device=device)) for _ in range(grad_slots if g else 0)]
        self._grad_next = 0
        # (transient gradients take no later contributions: no slabs). Each is allocated at its first
        # use: a run whose steps are one micro-batch, or their micro-batches together, never has a later
        # contribution, and the planner does not count slabs for it (memory.estimate).
        slabs = 0 if store.transient or not n else staging_slabs
        self._slab_numel = n
        self.slabs: list[torch.Tensor | None] = [None] * slabs
        self._slab_free = [True] * len(self.slabs)
        self.accumulator = Worker("megatrain-accumulate")
        self._pending: list[torch.cuda.Event] = []
        # Per-parameter gradient norms of each unit (valid once its gradient has landed).
        self.norms: list[torch.Tensor | None] = [None] * len(store.units)
        self.measure_only, self.measured = False, {}  # StreamingEngine.gradient_norm (the Pipeline seam)
        self._gpu_norms: dict[int, torch.Tensor] = {}
        self.plan: list[_Entry] = []
        self.pos = 0
        self._masters = torch.cuda.Event()  # lean casts wait for it: the masters are stepped
        self.timeline = None  # a Timeline records busy spans when attached (timeline.py)
        self.on_final_grad = None  # set through StreamingEngine.listen
        # Test hook: random GPU sleeps on the copy streams and host sleeps in the accumulator,
        # to shake out missing event dependencies (tests/gpu/test_gpu.py).
        self.chaos: random.Random | None = None

    # -- the plan -------------------------------------------------------------------------------
    def start(self, plan: list[int]) -> None:
        # Ring slots are given least-recently-used first; a unit still in a slot is not reloaded
        # (at the forward/backward turn the last `depth` layers are all still there).
        self._masters.record(torch.cuda.current_stream(self.device))
        entries, seen_fixed = [], set()
        content = [None] * self.depth
        last_use = [-1] * self.depth
        for k, u in enumerate(plan):
            unit = self.store.units[u]
            if unit.kind != "layer" or (unit.resident and not unit.no_compute_copy):
                entries.append(_Entry(u, self.fixed[u], u not in seen_fixed and not unit.resident, None))
                seen_fixed.add(u)
                continue
            if u in content:
                s = content.index(u)
                entries.append(_Entry(u, self.ring[s], False, None))
            else:
                s = min(range(self.depth), key=last_use.__getitem__)
                dep = last_use[s] if last_use[s] >= 0 else None
                entries.append(_Entry(u, self.ring[s], True, dep))
                content[s] = u
            last_use[s] = k
        self.plan, self.pos = entries, 0
        self._issue()

    def _issue(self) -> None:
        """Start every load inside the look-ahead window whose buffer is free."""
        for k in range(self.pos, min(self.pos + self.depth, len(self.plan))):
            e = self.plan[k]
            if e.issued:
                continue
            if e.depends_on is not None and not self.plan[e.depends_on].released:
                break  # in order: a later load never overtakes an earlier one
            if e.load:
                self.store.ready[e.unit].wait()  # its optimizer step must be finished (raises if it failed)
                unit = self.store.units[e.unit]
                cast = unit.no_compute_copy and unit.resident  # a master already on the GPU: no PCIe
                src = self.store.master[e.unit] if unit.no_compute_copy else self.store.compute[e.unit]
                with torch.cuda.stream(self.h2d):
                    self.h2d.wait_event(e.buffer.released)
                    if cast:
                        self.h2d.wait_event(self._masters)
                    with self.span("cast" if cast else "h2d", self.h2d):  # busy from here: waits excluded
                        self._shake()
                        e.buffer.data[: src.numel()].copy_(src, non_blocking=True)
                        e.buffer.ready.record(self.h2d)
                e.buffer.unit = e.unit
            e.issued = True

    def _entry_for(self, index: int) -> int:
        for k in range(self.pos, len(self.plan)):
            if self.plan[k].unit == index:
                return k
        raise RuntimeError(f"unit {index} was asked for but is not in the plan ahead ({self.pos}/{len(self.plan)})")

    def weights(self, index: int) -> torch.Tensor:
        k = self._entry_for(index)
        self.pos = k
        self._issue()
        e = self.plan[k]
        if not e.issued:  # its buffer is still held by an entry nobody released: a schedule bug
            raise RuntimeError(f"unit {index} cannot be loaded: entry {e.depends_on} of the plan was never released")
        torch.cuda.current_stream(self.device).wait_event(e.buffer.ready)
        self.pos = k + 1
        self._issue()
        return e.buffer.data[: self.store.units[index].numel]

    def release(self, index: int) -> None:
        """Compute is done with the unit's most recent entry: its buffer may be refilled."""
        for k in range(self.pos - 1, -1, -1):
            e = self.plan[k]
            if e.unit == index and not e.released:
                e.buffer.released.record(torch.cuda.current_stream(self.device))
                e.released = True
                break
        self._issue()

    # -- gradients ------------------------------------------------------------------------------
    def grad_buffer(self, index: int) -> torch.Tensor:
        unit = self.store.units[index]
        numel = unit.n_train
        if self.store.transient_on_device(unit):
            return self.store.device_grad(index)  # shared by the resident layers (count_grad refuses a second)
        if self.store.grad_on_device(unit) and self.store.grad_count[index] == 0:
            return self.store.grad[index]  # the first gradient is written straight into place
        if unit.kind != "layer" or self.store.grad_on_device(unit):
            return torch.empty(numel, dtype=torch.float32, device=self.device)
        slot = self.grad_ring[self._grad_next]
        self._grad_next = (self._grad_next + 1) % len(self.grad_ring)
        torch.cuda.current_stream(self.device).wait_event(slot.released)  # its last D2H is done
        slot.unit = index
        return slot.data[:numel]

    def _slot_of(self, grad: torch.Tensor) -> _Buffer | None:
        for slot in self.grad_ring:
            if grad.data_ptr() == slot.data.data_ptr():
                return slot
        return None

    def emit_grad(self, index: int, grad: torch.Tensor) -> None:
        """Dispatch one contribution to the path its unit takes (each method below is one path)."""
        store = self.store
        unit = store.units[index]
        compute = torch.cuda.current_stream(self.device)
        grad = grad.reshape(-1)
        if grad.dtype != torch.float32:
            grad = grad.float()
        if self.measure_only:  # StreamingEngine.gradient_norm: its norms, then the buffer is free again
            self._measure(unit, grad, compute)
            return
        if store.sharding is not None:  # data parallel: sum over ranks, keep this rank's slice
            grad = store.sharding.reduce(grad, unit.n_train)
        first = store.count_grad(index)
        if store.grad_on_device(unit):  # accumulate and take norms where it lives; nothing crosses PCIe now
            self._add_on_device(unit, grad, first, compute)
        else:
            self._send_to_host(unit, grad, first, compute)

    def _measure(self, unit, grad: torch.Tensor, compute) -> None:
        """measure_only: keep the gradient's per-parameter norms and drop it; a grad ring slot is
        free again once the compute stream has taken them."""
        self.measured[unit.index] = slot_norms(unit, grad)
        slot = self._slot_of(grad)
        if slot is not None:
            slot.released = torch.cuda.Event()
            slot.released.record(compute)

    def _add_on_device(self, unit, grad: torch.Tensor, first: bool, compute) -> None:
        """A gradient whose accumulator is on the GPU: a resident unit's, a gpu_grad_layers layer's,
        or a resident layer's in the shared transient buffer. Added, and its norms taken, on the
        compute stream."""
        store, index = self.store, unit.index
        store.add_grad(index, grad, first)
        self.norms[index] = slot_norms(unit, store.grad[index])
        if unit.grad_on_gpu:  # its host step brings it over once this is done (HostAdamW._adamw_landing)
            store.grad_event[index] = torch.cuda.Event()
            store.grad_event[index].record(compute)
        if self.on_final_grad is not None and (unit.grad_on_gpu or store.transient_on_device(unit)):
            # a resident layer's step must read the shared buffer before the next layer's backward
            # writes it: queued now, on this stream, it does
            self.on_final_grad(index, _landed)

    def _send_to_host(self, unit, grad: torch.Tensor, first: bool, compute) -> None:
        """A streamed unit's gradient over the D2H stream, once the compute stream has produced it:
        the step's first contribution straight into the pinned accumulator (_copy_to_accumulator),
        a later one into a staging slab that the accumulate worker adds in (_copy_to_slab)."""
        store, index = self.store, unit.index
        if first and store.sharding is None:  # sliced gradients: the engine sums squares over ranks
            self._gpu_norms[index] = slot_norms(unit, grad)
        produced = torch.cuda.Event()
        produced.record(compute)
        with torch.cuda.stream(self.d2h), self.span("d2h", self.d2h):
            self.d2h.wait_event(produced)
            self._shake()
            if first:
                self._copy_to_accumulator(unit, grad)
                slab = None
            else:
                slab = self._copy_to_slab(grad)
            done = torch.cuda.Event()
            done.record(self.d2h)
        self._free_after(grad, done)
        if first:
            self._pending.append(done)
            landed = done.synchronize
        else:
            landed = self.accumulator.later(partial(self._accumulate, index, slab, done),
                                            f"gradient accumulation of {unit.label}")
        if self.on_final_grad is not None:
            self.on_final_grad(index, landed)

    def _copy_to_accumulator(self, unit, grad: torch.Tensor) -> None:
        """On the D2H stream: the first contribution into the pinned fp32 accumulator, and the norms
        taken on the GPU (_send_to_host) into pinned memory beside it."""
        index = unit.index
        self.store.grad[index].copy_(grad, non_blocking=True)
        gpu_norms = self._gpu_norms.pop(index, None)
        if gpu_norms is not None:
            norms_host = torch.empty(len(unit.train_slots), dtype=torch.float32, pin_memory=True)
            norms_host.copy_(gpu_norms, non_blocking=True)
            gpu_norms.record_stream(self.d2h)
            self.norms[index] = norms_host

    def _copy_to_slab(self, grad: torch.Tensor) -> int:
        """On the D2H stream: a later contribution into a free staging slab; returns the slab."""
        slab = self._take_slab()
        self.slabs[slab][: grad.numel()].copy_(grad, non_blocking=True)
        return slab

    def _free_after(self, grad: torch.Tensor, done: torch.cuda.Event) -> None:
        """The gradient's GPU memory is reused only after its D2H: a grad ring slot is handed out again
        after `done`; any other tensor's memory is held for the D2H stream (record_stream)."""
        slot = self._slot_of(grad)
        if slot is not None:
            slot.released = done
        else:
            grad.record_stream(self.d2h)

    def span(self, lane: str, stream=None):
        """A busy span on `stream` (default: compute) when a timeline is attached."""
        if self.timeline is None:
            return nullcontext()
        return self.timeline.gpu_span(lane, stream or torch.cuda.current_stream(self.device))

    def _take_slab(self) -> int:
        while True:
            for i, free in enumerate(self._slab_free):
                if free:
                    self._slab_free[i] = False
                    if self.slabs[i] is None:
                        self.slabs[i] = torch.empty(self._slab_numel, dtype=torch.float32, pin_memory=True)
                    return i
            self.accumulator.drain()  # all slabs in use: let the host catch up

    def _shake(self) -> None:
        if self.chaos is not None and self.chaos.random() < 0.5:
            torch.cuda._sleep(self.chaos.randint(1_000, 2_000_000))  # up to ~1 ms of GPU cycles

    def _accumulate(self, index: int, slab: int, done: torch.cuda.Event) -> None:
        if self.chaos is not None and self.chaos.random() < 0.5:
            time.sleep(self.chaos.random() * 2e-3)
        done.synchronize()
        with self.timeline.host_span("accumulate") if self.timeline else nullcontext():
            self._accumulate_now(index, slab)

    def _accumulate_now(self, index: int, slab: int) -> None:
        unit = self.store.units[index]
        acc = self.store.grad[index]
        self.store.add_grad(index, self.slabs[slab][: acc.numel()], first=False)
        self._slab_free[slab] = True
        if self.store.sharding is None:
            self.norms[index] = slot_norms(unit, acc)

    def finish(self) -> None:
        for ev in self._pending:
            ev.synchronize()
        self._pending.clear()
        self.accumulator.drain()

    def grad_norms(self) -> list[torch.Tensor]:
        """The norms taken on the GPU as each gradient passed (one not taken: from its accumulator,
        on the host)."""
        self.finish()
        out = []
        for u in self.store.units:
            if self.store.grad_count[u.index] == 0:
                out.append(torch.zeros(len(u.train_slots)))
            elif self.norms[u.index] is None:
                out.append(slot_norms(u, self.store.grad[u.index].cpu()))
            else:
                out.append(self.norms[u.index].cpu())
        return out
