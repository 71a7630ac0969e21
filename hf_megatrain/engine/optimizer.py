"""HostAdamW: AdamW over the fp32 host masters, one unit at a time.

It is a `torch.optim.Optimizer`, so Trainer, accelerate and every LR scheduler treat it as
usual: `param_groups` hold the decay and no-decay segments of each unit's master buffer, and
`step()` reads lr / betas / eps / weight_decay from them at the moment it is called.

The math is torch's own fused AdamW kernel (`torch._fused_adamw_`, what Trainer's default
`adamw_torch_fused` runs). On the host a unit is stepped in 8M-element tiles, each op spread over
the cores by OpenMP; `host_threads=n` instead cuts it into spans that n single-core threads step
in parallel, each span clipped, updated and copied into the compute copy back to back.

The host step is bound by DRAM bandwidth: at the least it reads the master, both moments and the
gradient and writes the master, both moments and the bf16 copy (30 B per parameter). Three torch
ops per tile (clip, AdamW, copy) move more than that; `benchmarks/optimizer_bench.py` shows the
GB/s it reaches against the host's copy bandwidth.

The moments live here, in the store's flat layout, not in `self.state`: `state_dict()` stays
small (accelerate copies it to the GPU when it wraps an optimizer), and the checkpoint module
saves the moments as safetensors.

Clipping is exact: `clip_grad_norm_` returns the pre-clip global norm computed as
`torch.nn.utils.clip_grad_norm_` does (per-parameter norms, then the norm of those) and the
step multiplies each gradient tile by min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch

from .layout import GRAD_LANDING_BUFFERS, LANDING_TILE
from .pinned import arena_tensors
from .worker import SpanPool, Worker

# Elements per span of the host step. Each span costs a few Python calls under the GIL, which a
# dozen threads share with the thread that feeds the GPU, so spans must be large (the sizes
# measured: BENCHMARKS.md, "Measurements the code's defaults rest on").
# It must be a multiple of the widest SIMD vector (16 floats; 64 leaves room): torch's fused
# kernel runs a scalar tail past the last full vector, which rounds differently from the vector
# body, and the reference (a per-tensor step) has no tail where a span boundary is.
SPAN = 1 << 21
# host_threads=0 (the default): no pool; the calling thread steps tiles this large, each op
# spread over the cores by OpenMP. Smaller tiles keep more of a tile in cache between its three ops;
# larger ones pay fewer OpenMP forks and joins, which cost more from a worker thread. Measured from a
# worker thread with clipping, 2^21 to 2^23 are within the run-to-run spread and 2^20 below it
# (BENCHMARKS.md, "Measurements the code's defaults rest on").
# HF_MEGATRAIN_ADAMW_TILE=N sets it to 2**N (benchmarks compare tile sizes in training with it).
OPENMP_TILE = 1 << int(os.environ.get("HF_MEGATRAIN_ADAMW_TILE", "23"))


def adamw_tile(master, grad, exp_avg, exp_avg_sq, compute, hyper: dict, clip, step_t) -> None:
    """One tile of the step: clip the gradient in place (as torch's clip_grad_norm_ leaves .grad),
    AdamW, refresh the compute copy (None: there is none) from the master."""
    if clip is not None:
        grad.mul_(clip)
    torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step_t],
                        amsgrad=False, maximize=False, **hyper)
    if compute is not None:
        compute.copy_(master)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """What clipping multiplies every gradient by, min(1, max_norm / (norm + 1e-6)) as torch's
    clip_grad_norm_ computes it; None where that is 1 (nothing to do)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return coef if float(coef) < 1.0 else None


@dataclass
class _ArmedStep:
    """The step that step_during_backward() arms for the next backward: the step number, the
    hyper-parameters and clip coefficient read when it was armed, and the units stepped so far."""

    step: int
    hyper: list[dict]
    clip: torch.Tensor | None
    stepped: set[int] = field(default_factory=set)


class HostOptimizer(torch.optim.Optimizer):
    """What every host optimizer of the engine shares: the worker that steps (`_stepper`, None when steps
    run on the calling thread), where each unit's step runs (`_submit`: resident units on the device's
    stream, streamed ones on the worker), stepping during the backward (`step_during_backward`, which
    transient_grads needs), zero_grad through the engine, and its step count in the state dict (the
    optimizer's own state is saved by the checkpoint module).

    A subclass sets engine, store, step_count, _clip, _stepper and `step_name` (what a failed step's
    message calls it), calls `_init_armed()`, and defines `step_unit(index, hyper, clip, count, step)`
    and `hyperparameters()` (what its step reads from param_groups, read when the step is armed)."""

    step_name = "optimizer"

    def _init_armed(self) -> None:
        self._armed: _ArmedStep | None = None  # set by step_during_backward()
        self._torn = None  # why step() must refuse: units were stepped by a backward that then failed

    def _submit(self, indices, hyper, clip, counts, step) -> None:
        """Step these units: resident ones now, on the device's stream (before the next forward is
        queued behind them); streamed ones on the host worker, each gating its next load."""
        host = []
        for index in indices:
            if self._stepper is None or self.store.units[index].resident:
                self.step_unit(index, hyper, clip, counts[index], step)
            else:
                host.append(index)
        for index in host:  # cleared and queued together: a refused submit sets it again, failed
            self.store.ready[index].clear()
            self._stepper.submit(partial(self.step_unit, index, hyper, clip, counts[index], step),
                                 f"{self.step_name} step {step} of {self.store.units[index].label}",
                                 self.store.ready[index])

    # -- stepping during the backward (exact without clipping, or with the norm measured first) ----
    def step_during_backward(self, clip_norm: tuple[torch.Tensor, float] | None = None) -> bool:
        """Arm: during the next backward, step each unit as soon as its gradient is final.

        Call it before the LAST micro-batch of an optimizer step. Without `clip_norm`, only when no
        clipping will be applied (the global norm is unknown until the backward ends). clip_norm:
        (the global norm that backward's gradients will have, measured before it by
        StreamingEngine.gradient_norm, max_norm): each unit is clipped as it steps, as
        clip_grad_norm_(max_norm) and step() would clip it. The hyper-parameters are taken now,
        which is what `step()` would read (schedulers move lr after the step). The following
        `step()` only finishes the job. Returns False where it does not apply (no worker: the CPU
        without background_host_jobs).
        """
        if self._stepper is None:
            return False
        self._check_whole()
        clip = clip_coefficient(*clip_norm) if clip_norm is not None else None
        self._armed = _ArmedStep(step=self.step_count + 1, hyper=self.hyperparameters(), clip=clip)
        self.engine.listen(self)
        return True

    def backward_failed(self) -> None:
        """The backward that step_during_backward() armed failed (the engine has stopped telling
        us): forget the arm, so no later backward steps units early. Units it already stepped
        cannot be un-stepped; then the next step() refuses, rather than stepping them twice."""
        armed, self._armed = self._armed, None
        if armed is not None and armed.stepped:
            done = sorted(armed.stepped)
            self._torn = (f"the backward failed after step_during_backward() had already stepped "
                          f"{len(done)} unit(s) ({self.store.units[done[0]].label} first)")

    def _check_whole(self) -> None:
        if self._torn is not None:
            if self._stepper is not None:
                self._stepper.check()  # a failed step that tore it: its error first, as every later call gets
            raise RuntimeError(f"{self._torn}; the model is partly updated. Restart from the last checkpoint.")

    def final_grad(self, index: int, landed) -> None:
        """GradListener (training thread): unit `index` got its last gradient; `landed()` blocks
        until that gradient is in the host accumulator (and raises if adding it failed)."""
        armed = self._armed
        armed.stepped.add(index)
        count = self.store.grad_count[index]
        if self.store.master[index].device.type != "cpu":  # a resident unit: queued now on the device's stream
            self.step_unit(index, armed.hyper, armed.clip, count, armed.step)
            return
        self.store.ready[index].clear()

        def job():
            landed()
            self.step_unit(index, armed.hyper, armed.clip, count, armed.step)

        self._stepper.submit(job, f"{self.step_name} step {armed.step} of {self.store.units[index].label} "
                                  f"(during the backward)", self.store.ready[index])

    # -- gradients kept on the GPU (gpu_grad_layers) ------------------------------------------------
    def _init_landing(self) -> None:
        """gpu_grad_layers: a gradient kept on the GPU comes over for its host step, tile by tile, on a
        copy stream of our own (_landed_tiles); only the thread that steps touches these.
        On the CPU (where the device is the host) the same tiles are copied in place, with no
        stream: CPU tests then walk this path's tiles, offsets and in-place clipping."""
        store = self.store
        landing = any(u.grad_on_gpu for u in store.units)
        cuda = store.device.type == "cuda"
        self._landing_stream = torch.cuda.Stream(store.device) if landing and cuda else None
        self._landing = [torch.empty(LANDING_TILE, dtype=torch.float32, pin_memory=cuda)
                         for _ in range(GRAD_LANDING_BUFFERS if landing else 0)]

    def _landed_tiles(self, index: int, tiles: list[tuple[int, int]], clip):
        """Unit `index`'s gradient, kept on the GPU, on the host: yields elements [a, b) of each tile in
        turn, in a pinned landing tile. The gradient is clipped on the GPU first, in place (the product
        the host would make, so the device copy reads as a clipped .grad like the others); the next
        tile's copy runs on a copy stream of our own while the caller steps this one, which it must have
        finished with before it asks for the next (the copy after that reuses its landing tile).
        On the CPU: the same tiles, no stream."""
        grad, stream = self.store.grad[index], self._landing_stream
        done = []

        def lane():
            return torch.cuda.stream(stream) if stream is not None else nullcontext()

        def issue(k):
            a, b = tiles[k]
            with lane():
                self._landing[k % len(self._landing)][: b - a].copy_(grad[a:b], non_blocking=stream is not None)
                done.append(torch.cuda.Event() if stream is not None else None)
                if stream is not None:
                    done[-1].record(stream)

        with lane():
            if stream is not None:  # written, and its norms taken, on the compute stream
                stream.wait_event(self.store.grad_event[index])
            if clip is not None:
                grad.mul_(clip)
        if not tiles:
            return
        issue(0)
        for k, (a, b) in enumerate(tiles):
            if k + 1 < len(tiles):
                issue(k + 1)  # into the tile that step k - 1 read: it has run (the caller ran it)
            if done[k] is not None:
                done[k].synchronize()
            yield self._landing[k % len(self._landing)][: b - a]

    def _finish_armed(self, loss):
        """step() after an armed backward: the units it did not step (no gradient, or not final during it)."""
        armed, self._armed = self._armed, None
        self.engine.listen(None)
        if self._clip is not None:
            raise RuntimeError("clip_grad_norm_ was called after step_during_backward(); the steps already ran "
                               "(to clip them, measure the norm first: step_during_backward(clip_norm=...))")
        self.engine.wait_for_gradients()
        self.step_count = armed.step
        rest = [u.index for u in self.store.units if u.index not in armed.stepped]
        self._submit(rest, armed.hyper, armed.clip, list(self.store.grad_count), self.step_count)
        return loss

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        self._check_whole()
        if self._armed is not None:
            return self._finish_armed(loss)
        self.engine.wait_for_gradients()
        self.step_count += 1
        hyper = self.hyperparameters()
        clip = self._clip
        self._clip = None
        counts = list(self.store.grad_count)  # zero_grad() may run before the steps do
        self._submit([u.index for u in self.store.units], hyper, clip, counts, self.step_count)
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Pre-clip global norm; the next step scales gradients by min(1, max_norm/(norm+1e-6))."""
        total = self.engine.grad_norm()
        self._clip = clip_coefficient(total, max_norm)
        return total

    @staticmethod
    def _closure_loss(closure):
        """step(closure)'s loss, as torch's optimizers run it (with gradients on)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def set_openmp_threads(self, threads: int) -> None:
        """OpenMP threads of the host step (host_threads=0). The count is per thread in OpenMP, so it is
        set on the thread that steps: the worker, in order with the steps queued before."""
        if self._stepper is None:
            torch.set_num_threads(threads)
        else:
            self._stepper.submit(partial(torch.set_num_threads, threads), "setting OpenMP threads")

    def synchronize(self) -> None:
        """Block until every pending step has been applied (re-raises a failed one)."""
        if self._stepper is not None:
            self._stepper.drain()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_dict(self):
        sd = super().state_dict()
        sd["megatrain_step"] = self.step_count
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.step_count = int(state_dict.pop("megatrain_step", self.step_count))
        super().load_state_dict(state_dict)


class HostAdamW(HostOptimizer):
    step_name = "AdamW"

    def __init__(self, engine, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 host_threads: int | None = None):
        """host_threads: default the engine config's. 0: the calling thread steps 8M-element
        tiles, each op spread over the cores by OpenMP; n > 0: a pool of n single-core threads
        steps spans (faster alone and without clipping, slower in training with clipping, the
        Trainer default: BENCHMARKS.md, "Measurements the code's defaults rest on").

        The optimizer drives the engine through its public methods; the engine never holds the
        optimizer (step_during_backward registers it as a listener for one backward)."""
        if host_threads is None:
            host_threads = engine.engine_config.host_threads
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        self.engine = engine
        store = engine.store
        self.store = store
        decay, no_decay = [], []
        # (unit, start, end, group) for every segment, in unit order
        self.segments: list[list[tuple[int, int, int]]] = [[] for _ in store.units]
        for unit in store.units:
            m = store.master[unit.index]
            lo, hi = store.bounds[unit.index]  # this rank's slice (all of it without data parallel)
            for a, b, group, out in ((0, unit.n_decay, 0, decay), (unit.n_decay, unit.n_train, 1, no_decay)):
                a, b = max(a, lo) - lo, min(b, hi) - lo
                if a < b:
                    self.segments[unit.index].append((a, b, group))
                    out.append(m[a:b])
        # The groups are the model's, not this rank's: with data parallel a rank's slices may hold
        # only one kind, but every rank (and a resume with another number of ranks) must see the
        # same groups for schedulers and checkpoints to line up. An empty group steps nothing.
        has_decay = any(u.n_decay for u in store.units)
        has_rest = any(u.n_train > u.n_decay for u in store.units)
        groups = []
        if has_decay:
            groups.append({"params": decay, "weight_decay": weight_decay})
        if has_rest:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        if not has_decay:
            self.segments = [[(a, b, 0) for a, b, _ in segs] for segs in self.segments]
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # Moments never cross PCIe (the step runs where the master is), so they need no pinning;
        # a resident unit's moments live on the device with its master.
        numels = [0 if u.resident else hi - lo for u, (lo, hi) in zip(store.units, store.bounds)]
        self._arenas = []
        self.exp_avg, self.exp_avg_sq = [], []
        for out in (self.exp_avg, self.exp_avg_sq):
            arena, tensors = arena_tensors(numels, torch.float32, pin=False)
            for t in tensors:
                t.zero_()
            for u in store.units:
                if u.resident:
                    tensors[u.index] = torch.zeros(u.n_train, dtype=torch.float32, device=store.device)
            self._arenas.append(arena)
            out.extend(tensors)
        self.step_count = 0
        self._clip = None  # multiplier for the next step's gradients, set by clip_grad_norm_
        self._init_armed()
        # On a GPU (or on the CPU when asked: engine.background_host_jobs) the step runs on a host
        # thread, unit by unit in forward order, while the next forward already computes the
        # units that are done (store.ready gates each one).
        self._stepper = Worker("megatrain-adamw") if engine.background_host_jobs else None
        on_host = any(m.device.type == "cpu" and m.numel() for m in store.master)
        self._spans = SpanPool(host_threads, "megatrain-adamw-span") if on_host and host_threads > 0 else None
        self.host_threads = self._spans.threads if self._spans is not None else 0  # 0: OpenMP inside each op
        self._init_landing()

    # -- step -----------------------------------------------------------------------------------
    def hyperparameters(self) -> list[dict]:
        """What step() would read now, per group, in the fused kernel's words."""
        return [
            dict(lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"])
            for g in self.param_groups
        ]

    def step_unit(self, index: int, hyper: list[dict], clip, count: int, step: int) -> None:
        """AdamW on one unit (skipped, like torch does for grad=None, if it got no gradient)."""
        if count == 0:
            return
        with self.engine.host_span("optimizer"):
            self._adamw(index, hyper, clip, step)

    def _adamw(self, index: int, hyper: list[dict], clip, step: int) -> None:
        master = self.store.master[index]
        step_t = torch.tensor(float(step), dtype=torch.float32, device=master.device)
        grad = self.store.grad[index]
        if self.store.units[index].grad_on_gpu:  # kept on the GPU (gpu_grad_layers)
            self._adamw_landing(index, hyper, clip, step_t)
        elif master.device.type == "cpu":
            spans = self._pieces(index, SPAN if self._spans is not None else OPENMP_TILE)
            step_span = partial(self._adamw_span, index, hyper, clip, step_t, grad)
            if self._spans is not None:
                self._spans.run(step_span, spans)
            else:
                for span in spans:
                    step_span(span)
        else:  # a resident unit: whole segments, one kernel each, on the device's stream
            for span in self.segments[index]:
                self._adamw_span(index, hyper, clip, step_t, grad, span)
        self.store.gather_compute(index)

    def _pieces(self, index: int, size: int) -> list[tuple[int, int, int]]:
        """Unit `index`'s segments cut into (start, end, group) pieces of at most `size` elements."""
        return [(a, min(a + size, end), group) for start, end, group in self.segments[index]
                for a in range(start, end, size)]

    def _adamw_landing(self, index: int, hyper: list[dict], clip, step_t) -> None:
        """The host step of a unit whose gradient is on the GPU: each landed tile (_landed_tiles) stepped
        as it arrives, already clipped."""
        tiles = self._pieces(index, LANDING_TILE)
        for (a, b, group), tile in zip(tiles, self._landed_tiles(index, [(a, b) for a, b, _ in tiles], clip)):
            self._adamw_span(index, hyper, None, step_t, tile, (a, b, group), offset=a)

    def _adamw_span(self, index: int, hyper: list[dict], clip, step_t, grad, span, offset: int = 0) -> None:
        """Clip, update and refresh the compute copy of elements [a, b) of this rank's slice; `grad`
        holds the unit's gradient from element `offset` on (a landing tile: its own start)."""
        a, b, group = span
        store = self.store
        master = store.master[index]
        compute = store.compute[index]  # on the device for a resident unit; None for a lean one
        if compute is not None and compute is not master:
            lo = store.bounds[index][0]  # the compute copy is the whole unit; the master this rank's slice
            compute = compute[lo + a : lo + b]
        else:
            compute = None
        adamw_tile(master[a:b], grad[a - offset : b - offset], self.exp_avg[index][a:b], self.exp_avg_sq[index][a:b],
                   compute, hyper[group], clip, step_t)

