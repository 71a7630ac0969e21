"""HostParamOptimizer: Trainer's per-parameter optimizers (sgd, adagrad, rmsprop, adafactor) over the
engine's fp32 masters, one unit at a time.

The math is the optimizer's own code: each unit gets an instance of the very class Trainer builds
(`Trainer.get_optimizer_cls_and_kwargs(args)`: torch.optim.SGD / Adagrad / RMSprop, transformers'
Adafactor) over views of the unit's flat master buffer, one view per parameter in its own shape (what
Adafactor's factored second moment needs), with each view's `.grad` set to the same slot of the unit's
gradient buffer just for the step. These optimizers treat each parameter on its own (no state or norm
spans two parameters), so one instance per unit steps every parameter as one instance over the whole
model does: the numbers are stock's.

The outer optimizer (this class) is what Trainer, accelerate and the LR scheduler see: its two
param_groups (decay, no decay, as Trainer builds them from get_decay_parameter_names) hold segments of
the masters and the hyper-parameters, which are copied into each unit's instance at each step.

The per-parameter state lives in the unit instances' `state` (torch's or transformers' own keys), on the
device of the master: the host for streamed units, the GPU for resident ones. The checkpoint module
saves it as safetensors (`state_tensors` / `load_state_tensors`).

Not combined (refused by `unsupported_modes`, before any weight is read): data parallel (a rank's slice
cuts parameters, and Adafactor's state is not elementwise), transient gradients and gradients kept on
the GPU (both need the step to run inside the backward or tile by tile, which only HostAdamW does).
Stepping during the backward is AdamW's alone: `step_during_backward` returns False, and the caller then
steps after the backward (engine/step.py).
"""

from __future__ import annotations

from functools import partial

import torch

from .optimizer import HostOptimizer
from .worker import Worker

# Trainer's `optim` values this class runs (anything else that is not AdamW is refused in arguments.py)
PARAM_OPTIMS = ("sgd", "adagrad", "rmsprop", "adafactor")


def optimizer_name(optim: str) -> str:
    """What a checkpoint records as its optimizer: every AdamW variant the engine runs is one (same numbers)."""
    return "adamw" if optim.startswith("adamw") else optim


def unsupported_modes(optim: str, *, world_size: int = 1, transient_grads: bool = False,
                      gpu_grad_layers: int = 0) -> str | None:
    """Why a run of `optim` (one of PARAM_OPTIMS) cannot run with these settings, in one line; None: it can."""
    if world_size > 1:
        why = "data parallel (world size > 1)"
    elif transient_grads:
        why = "transient_grads"
    elif gpu_grad_layers:
        why = "gpu_grad_layers"
    else:
        return None
    return (f"optim={optim!r} is not combined with {why} yet (only the AdamW variants are); run one process with "
            f"transient_grads=False and gpu_grad_layers=0, or use optim='adamw_torch'.")


class HostParamOptimizer(HostOptimizer):
    def __init__(self, engine, optimizer_cls, kwargs: dict, weight_decay: float = 0.0, name: str = "sgd"):
        """optimizer_cls, kwargs: what Trainer.get_optimizer_cls_and_kwargs returns for `name`; weight_decay:
        the decay group's (args.weight_decay), the other group's being 0, as Trainer's create_optimizer sets them."""
        store = engine.store
        why = unsupported_modes(name, world_size=2 if store.sharding is not None else 1,
                                transient_grads=store.transient,
                                gpu_grad_layers=sum(u.grad_on_gpu for u in store.units))
        if why is not None:
            raise ValueError(why)
        self.engine, self.store, self.name = engine, store, name
        self.stock_cls, self.kwargs = optimizer_cls, dict(kwargs)
        decay, no_decay = [], []
        for unit in store.units:
            m = store.master[unit.index]
            if unit.n_decay:
                decay.append(m[: unit.n_decay])
            if unit.n_train > unit.n_decay:
                no_decay.append(m[unit.n_decay : unit.n_train])
        groups = []  # the model's groups (an empty one is left out, as HostAdamW leaves it)
        if decay:
            groups.append({"params": decay, "weight_decay": weight_decay})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        probe = optimizer_cls([torch.zeros(1)], **kwargs)  # the class's defaults, as it fills them in
        super().__init__(groups, dict(probe.defaults))
        outer = {True: 0, False: 1 if decay else 0}
        # per unit: (the optimizer over its parameter views, which outer group each of its groups follows, views)
        self.units: list[tuple | None] = []
        for unit in store.units:
            slots = unit.train_slots
            if not slots:
                self.units.append(None)
                continue
            views = store.views(unit.index, store.master[unit.index])
            inner_groups, follows = [], []
            for decayed in (True, False):
                params = [v for s, v in zip(slots, views) if s.decay == decayed]
                if params:
                    inner_groups.append({"params": params, "weight_decay": weight_decay if decayed else 0.0})
                    follows.append(outer[decayed])
            self.units.append((optimizer_cls(inner_groups, **kwargs), follows, views))
        self.step_count = 0
        self._clip = None
        self._stepper = Worker("megatrain-optim") if engine.background_host_jobs else None
        self.host_threads = 0

    # -- step -----------------------------------------------------------------------------------
    def hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        self.engine.wait_for_gradients()
        self.step_count += 1
        hyper, clip, self._clip = self.hyperparameters(), self._clip, None
        counts = list(self.store.grad_count)  # zero_grad() may run before the steps do
        host = []
        for unit in self.store.units:
            if self._stepper is None or unit.resident:  # a resident unit: now, on the device's stream
                self.step_unit(unit.index, hyper, clip, counts[unit.index])
            else:
                host.append(unit.index)
        for index in host:
            self.store.ready[index].clear()
        for index in host:
            self._stepper.submit(partial(self.step_unit, index, hyper, clip, counts[index]),
                                 f"{self.name} step {self.step_count} of {self.store.units[index].label}",
                                 self.store.ready[index])
        return loss

    def step_unit(self, index: int, hyper: list[dict], clip, count: int) -> None:
        """The unit's optimizer over its views (skipped, like torch for grad=None, if it got no gradient)."""
        entry = self.units[index]
        if count == 0 or entry is None:
            return
        inner, follows, views = entry
        with self.engine.host_span("optimizer"):
            grad = self.store.grad[index]
            if clip is not None:
                grad.mul_(clip.to(grad.device))  # in place, as torch's clip_grad_norm_ leaves .grad
            for v, g in zip(views, self.store.views(index, grad)):
                v.grad = g
            for group, k in zip(inner.param_groups, follows):
                group.update(hyper[k])
            try:
                inner.step()
            finally:
                for v in views:
                    v.grad = None
            self.store.refresh_compute(index)

    # -- what the step policy asks of an optimizer --------------------------------------------------
    def step_during_backward(self, clip_norm=None) -> bool:
        return False  # AdamW's alone; the step runs after the backward

    def backward_failed(self) -> None:
        pass

    # -- state ------------------------------------------------------------------------------------
    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """(tensors, plain values) of every parameter's state, named `<unit>.<slot>.<key>` (slot: its
        index among the unit's trainable slots); None values are left out."""
        tensors, plain = {}, {}
        for index, entry in enumerate(self.units):
            if entry is None:
                continue
            inner, _, views = entry
            for j, v in enumerate(views):
                for key, val in inner.state.get(v, {}).items():
                    name = f"{index}.{j}.{key}"
                    if isinstance(val, torch.Tensor):
                        tensors[name] = val.detach().cpu().contiguous()
                    elif val is not None:
                        plain[name] = val
        return tensors, plain

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], plain: dict[str, object]) -> None:
        """Replace every parameter's state by the saved one (state_tensors' names)."""
        per_param: dict[tuple[int, int], dict] = {}
        for name, val in list(tensors.items()) + list(plain.items()):
            index, j, key = name.split(".", 2)
            per_param.setdefault((int(index), int(j)), {})[key] = val
        for index, entry in enumerate(self.units):
            if entry is None:
                continue
            inner, _, views = entry
            inner.state.clear()
            for j, v in enumerate(views):
                saved = per_param.get((index, j))
                if saved:
                    inner.state[v] = {k: (x.to(v.device) if isinstance(x, torch.Tensor) and x.dim() else x)
                                      for k, x in saved.items()}
