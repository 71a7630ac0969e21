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

Where HostAdamW steps a unit during the backward (engine/step.py's policy: the step's last backward without
clipping, or with transient_grads after a norm pass), this does too, with the same machinery (HostOptimizer:
step_during_backward, final_grad on the worker as each unit's last gradient lands, resident units on the
device's stream): each unit's instance steps over the gradient in whatever buffer holds it then, the unit's
own accumulator or one of transient_grads' shared buffers (store.claim_grad), which is free again once the
step has run. The numbers are those of the step after the backward: the same gradients, clipped by the same
coefficient, stepped by the same instance.

Not combined (refused by `unsupported_modes`, before any weight is read): data parallel (a rank's slice
cuts parameters, and Adafactor's state is not elementwise: its factored second moment and RMS span the
whole parameter), and gradients kept on the GPU (gpu_grad_layers: HostAdamW brings them over in tiles that
cut parameters, which the stock classes cannot step).
"""

from __future__ import annotations

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
    """Why a run of `optim` (one of PARAM_OPTIMS) cannot run with these settings, in one line; None: it can.
    transient_grads combines (each unit's instance steps during the backward); it is taken as an argument
    so that callers ask one question of every mode."""
    del transient_grads
    if world_size > 1:
        return (f"optim={optim!r} is not combined with data parallel (world size > 1): each rank would hold a "
                f"slice of the fp32 state that cuts parameters, and {optim}'s step needs whole ones "
                f"(Adafactor's factored moments, RMS); run one process, or use optim='adamw_torch', whose "
                f"state is elementwise.")
    if gpu_grad_layers:
        return (f"optim={optim!r} is not combined with gpu_grad_layers yet: those gradients come to the host in "
                f"tiles that cut parameters, which {optim}'s step needs whole; set gpu_grad_layers=0 "
                f"(transient_grads=True saves more host RAM), or use optim='adamw_torch'.")
    return None


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
        self._init_armed()
        self._stepper = Worker("megatrain-optim") if engine.background_host_jobs else None
        self.host_threads = 0
        self.step_name = name

    # -- step -----------------------------------------------------------------------------------
    def hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def step_unit(self, index: int, hyper: list[dict], clip, count: int, step: int = 0) -> None:
        """The unit's optimizer over its views (skipped, like torch for grad=None, if it got no gradient);
        `step` (the engine's count) is not read: each stock instance keeps its own, per parameter."""
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
