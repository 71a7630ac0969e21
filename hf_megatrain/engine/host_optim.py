"""HostParamOptimizer: Trainer's stock optimizers other than AdamW (sgd, adagrad, rmsprop, adafactor) over
the engine's fp32 masters, one unit at a time.

The math is the optimizer's own code: each unit gets an instance of the very class Trainer builds
(`Trainer.get_optimizer_cls_and_kwargs(args)`: torch.optim.SGD / Adagrad / RMSprop, transformers'
Adafactor) over views of the unit's flat master buffer, with each view's `.grad` set to the same slot of
the unit's gradient buffer just for the step. What those views are depends on the optimizer:

- Adafactor: one view per parameter, in its own shape. Its second moment is factored over the
  parameter's rows and columns and its update is scaled by an RMS over the whole parameter, so it
  needs each parameter whole; no state or norm spans two parameters, so one instance per unit steps
  every parameter as one instance over the whole model does.
- SGD (momentum, nesterov, dampening, weight decay), Adagrad and RMSprop (centered, momentum): every
  number of their state and update is a function of the same element of the parameter, its gradient
  and its state (per-parameter step counters advance together). So the unit's master is stepped as
  flat pieces: this rank's slice of each weight-decay segment (decay / no decay: the groups' own
  weight decay), cut into pieces of PARAM_STEP_TILE elements (the step's temporaries are as large as
  what it steps), or into the landing tiles for a gradient kept on the GPU. Each piece is a parameter
  of the stock class, stepped by its own single-tensor code; the numbers are those of stepping each
  parameter (tests/unit/test_host_optim.py holds them to stock bit for bit). That is what lets them
  run where a piece is all a step sees: data parallel (each rank holds a slice of every unit's state,
  as HostAdamW's moments) and gpu_grad_layers (the gradient comes to the host tile by tile).

The outer optimizer (this class) is what Trainer, accelerate and the LR scheduler see: its two
param_groups (decay, no decay, as Trainer builds them from get_decay_parameter_names) hold segments of
the masters and the hyper-parameters, which are copied into each unit's instance at each step.

The state lives in the unit instances' `state` (torch's or transformers' own keys), on the device of the
master: the host for streamed units, the GPU for resident ones. The checkpoint module saves it as
safetensors: Adafactor's per parameter (`state_tensors` / `load_state_tensors`); the elementwise
optimizers' per piece, by element range, so a resume with any number of ranks or another tiling reads
the ranges it now holds (`piece_state` / `load_piece_state`).

Where HostAdamW steps a unit during the backward (engine/step.py's policy: the step's last backward without
clipping, or with transient_grads after a norm pass), this does too, with the same machinery (HostOptimizer:
step_during_backward, final_grad on the worker as each unit's last gradient lands, resident units on the
device's stream): each unit's instance steps over the gradient in whatever buffer holds it then, the unit's
own accumulator or one of transient_grads' shared buffers (store.claim_grad), which is free again once the
step has run. The numbers are those of the step after the backward: the same gradients, clipped by the same
coefficient, stepped by the same instance.

Not combined (refused by `unsupported_modes`, before any weight is read): Adafactor with data parallel or
with gpu_grad_layers (both cut parameters, and Adafactor needs them whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import optimizer as _adamw_module  # LANDING_TILE read at construction (tests shrink it)
from .layout import PARAM_STEP_TILE
from .optimizer import HostOptimizer
from .worker import Worker

# Trainer's `optim` values this class runs (anything else that is not AdamW is refused in arguments.py)
PARAM_OPTIMS = ("sgd", "adagrad", "rmsprop", "adafactor")
# Those whose state and update are elementwise: stepped in flat pieces, so they shard and take tiles
ELEMENTWISE_OPTIMS = ("sgd", "adagrad", "rmsprop")
ELEMENTWISE_NAMES = ", ".join(f"{o!r}" for o in ELEMENTWISE_OPTIMS)


def optimizer_name(optim: str) -> str:
    """What a checkpoint records as its optimizer: every AdamW variant the engine runs is one (same numbers)."""
    return "adamw" if optim.startswith("adamw") else optim


def unsupported_modes(optim: str, *, world_size: int = 1, gpu_grad_layers: int = 0) -> str | None:
    """Why a run of `optim` (one of PARAM_OPTIMS) cannot run with these settings, in one line; None: it can.
    The elementwise ones combine with every mode the engine has; Adafactor needs whole parameters."""
    if optim in ELEMENTWISE_OPTIMS:
        return None
    if world_size > 1:
        return (f"optim={optim!r} is not combined with data parallel (world size > 1): each rank holds a slice of "
                f"the fp32 state that cuts parameters, and {optim}'s factored second moment and update RMS span "
                f"each whole parameter; run one process, or use {ELEMENTWISE_NAMES} or 'adamw_torch', whose state "
                f"is elementwise and shards.")
    if gpu_grad_layers:
        return (f"optim={optim!r} is not combined with gpu_grad_layers: those gradients come to the host in tiles "
                f"that cut parameters, and {optim}'s factored second moment and update RMS need each whole "
                f"parameter; set gpu_grad_layers=0 (transient_grads=True saves more host RAM), or use "
                f"{ELEMENTWISE_NAMES} or 'adamw_torch', which step tile by tile.")
    return None


@dataclass
class _UnitStep:
    """One unit's stock instance (None: this rank holds no element of the unit's state), which outer group
    each of its groups follows, the views of the master it steps, and each view's [a, b) in this rank's
    slice of the unit (the master's and the gradient's coordinates)."""

    inner: torch.optim.Optimizer | None
    follows: list[int]
    views: list[torch.Tensor]
    spans: list[tuple[int, int]]


def cut(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """[start, end) in consecutive pieces of at most `size` elements."""
    return [(a, min(a + size, end)) for a in range(start, end, size)]


class HostParamOptimizer(HostOptimizer):
    def __init__(self, engine, optimizer_cls, kwargs: dict, weight_decay: float = 0.0, name: str = "sgd"):
        """optimizer_cls, kwargs: what Trainer.get_optimizer_cls_and_kwargs returns for `name`; weight_decay:
        the decay group's (args.weight_decay), the other group's being 0, as Trainer's create_optimizer sets them."""
        store = engine.store
        why = unsupported_modes(name, world_size=store.sharding.world if store.sharding is not None else 1,
                                gpu_grad_layers=sum(u.grad_on_gpu for u in store.units))
        if why is not None:
            raise ValueError(why)
        self.engine, self.store, self.name = engine, store, name
        self.elementwise = name in ELEMENTWISE_OPTIMS
        self.stock_cls, self.kwargs = optimizer_cls, dict(kwargs)
        # The groups are the model's, not this rank's: with data parallel a rank's slices may hold only
        # one kind, but every rank (and a resume with another number of ranks) must see the same groups
        # for schedulers and checkpoints to line up (as HostAdamW's). An empty one is left out.
        has_decay = any(u.n_decay for u in store.units)
        has_rest = any(u.n_train > u.n_decay for u in store.units)
        decay, no_decay = [], []
        for unit in store.units:
            m = store.master[unit.index]
            for a, b, decayed in self._segments(unit.index):
                (decay if decayed else no_decay).append(m[a:b])
        groups = []
        if has_decay:
            groups.append({"params": decay, "weight_decay": weight_decay})
        if has_rest:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        probe = optimizer_cls([torch.zeros(1)], **kwargs)  # the class's defaults, as it fills them in
        super().__init__(groups, dict(probe.defaults))
        outer = {True: 0, False: 1 if has_decay else 0}
        # per unit: the optimizer over its views (None: nothing of it trains), which outer group each of its
        # groups follows, the views and where each lies
        self.units: list[_UnitStep | None] = []
        for unit in store.units:
            if not unit.n_train:
                self.units.append(None)
                continue
            pieces = self._pieces(unit.index)
            m = store.master[unit.index]
            views = [m[a:b].view(shape) for a, b, _, shape in pieces]
            inner_groups, follows = [], []
            for decayed in (True, False):
                params = [v for v, p in zip(views, pieces) if p[2] == decayed]
                if params:
                    inner_groups.append({"params": params, "weight_decay": weight_decay if decayed else 0.0})
                    follows.append(outer[decayed])
            inner = optimizer_cls(inner_groups, **kwargs) if inner_groups else None
            self.units.append(_UnitStep(inner, follows, views, [(a, b) for a, b, _, _ in pieces]))
        self.step_count = 0
        self._clip = None
        self._init_armed()
        self._init_landing()
        self._stepper = Worker("megatrain-optim") if engine.background_host_jobs else None
        self.host_threads = 0
        self.step_name = name

    # -- what each unit's instance steps ---------------------------------------------------------
    def _segments(self, index: int) -> list[tuple[int, int, bool]]:
        """(a, b, decayed): this rank's slice of unit `index`'s decay and no-decay segments, in the
        coordinates of that slice (all of the unit without data parallel)."""
        unit = self.store.units[index]
        lo, hi = self.store.bounds[index]
        out = []
        for a, b, decayed in ((0, unit.n_decay, True), (unit.n_decay, unit.n_train, False)):
            a, b = max(a, lo) - lo, min(b, hi) - lo
            if a < b:
                out.append((a, b, decayed))
        return out

    def piece_size(self, index: int) -> int:
        """Elements per piece of unit `index` (elementwise optimizers): a landing tile where its gradient
        is kept on the GPU (a piece is what one tile brings over), else PARAM_STEP_TILE."""
        return _adamw_module.LANDING_TILE if self.store.units[index].grad_on_gpu else PARAM_STEP_TILE

    def _pieces(self, index: int) -> list[tuple[int, int, bool, tuple]]:
        """(a, b, decayed, shape) of what unit `index`'s instance steps: each trainable parameter in its
        shape (Adafactor), or flat pieces of this rank's segments (the elementwise optimizers)."""
        if self.elementwise:
            size = self.piece_size(index)
            return [(a, b, decayed, (b - a,)) for start, end, decayed in self._segments(index)
                    for a, b in cut(start, end, size)]
        return [(s.offset, s.offset + s.numel, s.decay, tuple(s.shape)) for s in self.store.units[index].train_slots]

    def piece_bounds(self, index: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """[start, end) in the unit's trainable prefix of each piece that the rank holding [lo, hi) of unit
        `index` steps (the elementwise optimizers; any rank's, for the checkpoint's index)."""
        unit = self.store.units[index]
        size = self.piece_size(index)
        return [p for a, b in ((0, unit.n_decay), (unit.n_decay, unit.n_train))
                for p in cut(max(a, lo), min(b, hi), size)]

    # -- step -----------------------------------------------------------------------------------
    def hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def step_unit(self, index: int, hyper: list[dict], clip, count: int, step: int = 0) -> None:
        """The unit's optimizer over its views (skipped, like torch for grad=None, if it got no gradient);
        `step` (the engine's count) is not read: each stock instance keeps its own, per parameter."""
        entry = self.units[index]
        if count == 0 or entry is None:
            return
        with self.engine.host_span("optimizer"):
            if entry.inner is not None:
                for group, k in zip(entry.inner.param_groups, entry.follows):
                    group.update(hyper[k])
                if self.store.units[index].grad_on_gpu:  # one piece per landed tile, each stepped as it lands
                    tiles = self._landed_tiles(index, entry.spans, clip)
                    for view, tile in zip(entry.views, tiles):
                        self._step_views(entry.inner, [view], [tile])
                else:
                    grad = self.store.grad[index]
                    if clip is not None:
                        grad.mul_(clip.to(grad.device))  # in place, as torch's clip_grad_norm_ leaves .grad
                    self._step_views(entry.inner, entry.views, [grad[a:b].view(v.shape)
                                                                for v, (a, b) in zip(entry.views, entry.spans)])
            # (with data parallel every rank takes part in the all-gather, whatever it holds of the unit)
            self.store.refresh_compute(index)

    @staticmethod
    def _step_views(inner, views, grads) -> None:
        """The stock step over `views` with these gradients (the instance's other views, without one, are
        skipped by its own code, as torch skips a parameter without .grad)."""
        for v, g in zip(views, grads):
            v.grad = g
        try:
            inner.step()
        finally:
            for v in views:
                v.grad = None

    # -- state ------------------------------------------------------------------------------------
    def piece_state(self, index: int) -> list[tuple[int, int, dict]]:
        """The elementwise optimizers' state of unit `index` on this rank: (start, end, {key: value}) for each
        piece, [start, end) in the unit's trainable prefix; a piece never stepped has an empty dict."""
        entry = self.units[index]
        if entry is None or entry.inner is None:
            return []
        lo = self.store.bounds[index][0]
        return [(lo + a, lo + b, dict(entry.inner.state.get(v, {}))) for v, (a, b) in zip(entry.views, entry.spans)]

    def load_piece_state(self, index: int, states: list[dict]) -> None:
        """Replace the state of unit `index`'s pieces (in piece_state's order) by `states` ({} for a piece
        without any); tensors of the piece's size go to its device, 0-d ones (step counters) stay on the
        host, as torch keeps them."""
        entry = self.units[index]
        if entry is None or entry.inner is None:
            return
        entry.inner.state.clear()
        for v, saved in zip(entry.views, states):
            if saved:
                entry.inner.state[v] = {k: (x.to(v.device) if isinstance(x, torch.Tensor) and x.dim() else x)
                                        for k, x in saved.items()}

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """(tensors, plain values) of every parameter's state (Adafactor), named `<unit>.<slot>.<key>` (slot:
        its index among the unit's trainable slots), or of every piece (the elementwise optimizers), named
        `<unit>.<start>.<key>` (start: its first element in the unit's trainable prefix); None values are
        left out."""
        tensors, plain = {}, {}
        for index, entry in enumerate(self.units):
            if entry is None or entry.inner is None:
                continue
            names = [s for s, _, _ in self.piece_state(index)] if self.elementwise else range(len(entry.views))
            for j, v in zip(names, entry.views):
                for key, val in entry.inner.state.get(v, {}).items():
                    name = f"{index}.{j}.{key}"
                    if isinstance(val, torch.Tensor):
                        tensors[name] = val.detach().cpu().contiguous()
                    elif val is not None:
                        plain[name] = val
        return tensors, plain

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], plain: dict[str, object]) -> None:
        """Replace every parameter's state by the saved one (Adafactor: state_tensors' names)."""
        per_param: dict[tuple[int, int], dict] = {}
        for name, val in list(tensors.items()) + list(plain.items()):
            index, j, key = name.split(".", 2)
            per_param.setdefault((int(index), int(j)), {})[key] = val
        for index, entry in enumerate(self.units):
            if entry is not None:
                self.load_piece_state(index, [per_param.get((index, j), {}) for j in range(len(entry.views))])
