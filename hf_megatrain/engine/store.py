"""HostStore: all model state in host RAM, one flat buffer per unit and kind.

A *unit* is what the GPU sees at once: the embedding, one decoder layer, or the head (final
norm + lm_head). Each unit has a layout mapping every HF parameter name to (offset, shape)
inside its flat buffers. Trainable parameters come first (those that get weight decay, then
the others), frozen ones (a LoRA base model) last: the optimizer steps two contiguous
segments with their own weight decay, and frozen weights exist only as the streamed copy.

Buffers per unit:
  compute  what streams to the GPU, every parameter (bf16 by default; in fp32 mode the master
           itself when everything is trainable)
  master   fp32 source of truth of the trainable prefix
  grad     fp32 accumulator of the trainable prefix, never memset: the first gradient of a
           step is copied in, the next ones are added
All three are carved from exact-size arenas; on a GPU the compute copy and the gradient (what
crosses PCIe) are page-locked (pinned.py), the master is not.
Adam moments live in the optimizer (`HostAdamW`), in the same layout.

Who writes each buffer and which event orders its readers: the table in engine/__init__.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import MegaTrainError
from .layout import TRANSIENT_GRAD_BUFFERS
from .pinned import arena_tensors
from .worker import Signal

if TYPE_CHECKING:  # a hint only: the planner reads Units back from its cache without the patcher's imports
    from ..patcher.specs import ArchSpec


@dataclass(frozen=True)
class Slot:
    name: str  # full HF parameter name, as model.named_parameters() gives it
    local: str  # the same parameter's name inside the unit's template
    offset: int
    shape: torch.Size
    decay: bool
    order: int  # position in model.named_parameters()
    trainable: bool = True

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class Unit:
    index: int
    kind: str  # "embed" | "per_layer" | "layer" | "head"
    slots: list[Slot]
    layer: int | None = None
    attn_kind: str | None = None
    numel: int = 0
    n_decay: int = 0
    n_train: int = 0  # the trainable prefix: master, grad and Adam moments cover only these
    # Resident: the unit's weights, fp32 master, gradient and Adam moments live on the compute
    # device and it is stepped there; it never crosses PCIe during training.
    resident: bool = False
    # No compute copy (store.compute[index] is None): each use casts the fp32 master into a ring
    # slot, on the GPU. EngineConfig.lean_resident asks it of resident layers, lean_streamed of
    # streamed ones (whose master then crosses PCIe instead of a compute copy).
    no_compute_copy: bool = False
    # A streamed decoder layer whose fp32 gradient accumulator lives on the GPU
    # (EngineConfig.gpu_grad_layers); it crosses PCIe only for its host step, tile by tile.
    grad_on_gpu: bool = False
    # Only for the head of a tied model: its lm_head weight is the embedding unit's weight.
    tied_local: str | None = None
    template_key: str = field(default="")

    @property
    def train_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.trainable]

    @property
    def label(self) -> str:
        """What errors call it: 'decoder layer 3', 'the embedding', 'the head'."""
        if self.kind == "layer":
            return f"decoder layer {self.layer}"
        return {"embed": "the embedding", "per_layer": "the per-layer embeddings"}.get(self.kind, "the head")


def _unit_of(name: str, spec: ArchSpec) -> tuple[str, int | None, str]:
    """Which unit a parameter belongs to, and its name inside that unit's template."""
    # what the base model runs beside the token embedding before the first layer (a position table, BLOOM's
    # embedding norm, OPT's project_in) and beside the final norm after the last (OPT's project_out) belong to
    # the embedding and head units, under the part names their templates give them (spec.embed_parts/head_parts)
    for part, prefix in (("embed", spec.embed),) + tuple(spec.embed_parts):
        if name.startswith(prefix + "."):
            return "embed", None, f"{part}." + name[len(prefix) + 1 :]
    for prefix in spec.per_layer or ():  # per-layer embeddings (Gemma 3n/4): a unit of their own
        if name.startswith(prefix + "."):
            return "per_layer", None, prefix.rpartition(".")[2] + "." + name[len(prefix) + 1 :]
    m = re.match(re.escape(spec.layers) + r"\.(\d+)\.(.+)", name)
    if m:
        return "layer", int(m.group(1)), m.group(2)
    for part, prefix in (("norm", spec.norm), ("lm_head", spec.lm_head)) + tuple(spec.head_parts):
        if name.startswith(prefix + "."):
            return "head", None, part + "." + name[len(prefix) + 1 :]
    raise ValueError(f"parameter {name!r} is not in the embedding, a decoder layer or the head")


def _settings(layer: nn.Module) -> tuple:
    """A decoder layer's plain settings (numbers, flags, names of its modules), which its template
    copies from the first layer it is made for; `layer_idx` (the KV cache's slot) is not math."""
    out = []
    for name, module in layer.named_modules():
        plain = sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and k != "layer_idx"
                       and isinstance(v, (bool, int, float, str, type(None))))
        out.append((name, type(module).__name__, tuple(plain)))
    return tuple(out)


def _layer_kinds(spec: ArchSpec, config, layers) -> list[str]:
    """The attention kind of every module in the model's list of decoder layers: one unit each, however many the
    config's num_hidden_layers says (LongCat-Flash's layers hold two attention sublayers each, which it counts)."""
    kinds = spec.kinds(config)
    if len(kinds) != len(layers):
        raise MegaTrainError(f"the model holds {len(layers)} decoder layers where its config's {spec.depth} says "
                             f"{len(kinds)}; was the config changed after the model was built?")
    return kinds


def build_units(model: nn.Module, spec: ArchSpec, decay_names) -> list[Unit]:
    """Units in forward order: embed, the per-layer embeddings where the family has them (Gemma 3n/4: made from
    the token embeddings, read by every layer), layers 0..L-1, head. The backward's order (schedule.py) is the
    reverse, so the per-layer unit gets every layer's gradient before the embedding gets its own."""
    decay_names = set(decay_names)
    config = model.config
    groups: dict[tuple, list] = {}
    for pos, (name, p) in enumerate(model.named_parameters()):
        kind, layer, local = _unit_of(name, spec)
        groups.setdefault((kind, layer), []).append((name, local, p.shape, pos, p.requires_grad))

    layers = model.get_submodule(spec.layers)
    kinds = _layer_kinds(spec, config, layers)
    units = []
    shapes_seen: dict[tuple, int] = {}  # a layer's parameter layout -> its ordinal among distinct layouts
    per_layer = [("per_layer", None)] if ("per_layer", None) in groups else []
    order = [("embed", None)] + per_layer + [("layer", i) for i in range(len(layers))] + [("head", None)]
    for idx, key in enumerate(order):
        entries = groups.get(key, [])
        # Trainable decayed, trainable not decayed, frozen; the relative order is the model's.
        entries = sorted(entries, key=lambda e: (not e[4], e[0] not in decay_names))
        slots, offset = [], 0
        for name, local, shape, pos, trainable in entries:
            slots.append(Slot(name, local, offset, torch.Size(shape), trainable and name in decay_names, pos, trainable))
            offset += torch.Size(shape).numel()
        kind, layer = key
        unit = Unit(idx, kind, slots, layer=layer, numel=offset, n_decay=sum(s.numel for s in slots if s.decay),
                    n_train=sum(s.numel for s in slots if s.trainable))
        if kind == "layer":
            unit.attn_kind = kinds[layer]
            # One template per attention kind, parameter layout and settings: an MoE model's dense
            # layers (Qwen-MoE's mlp_only_layers) are other modules than its sparse ones, and
            # SmolLM3's attention skips RoPE on some layers by a plain attribute (use_rope).
            structure = (tuple((s.local, tuple(s.shape)) for s in slots), _settings(layers[layer]))
            layout = shapes_seen.setdefault(structure, len(shapes_seen))
            unit.template_key = f"layer:{unit.attn_kind}" + (f":{layout}" if layout else "")
        else:
            unit.template_key = kind
        units.append(unit)
    head = units[-1]
    if not any(s.local.startswith("lm_head.") for s in head.slots):
        head.tied_local = "lm_head.weight"
    return units


class HostStore:
    """Flat host buffers for every unit (see module docstring)."""

    def __init__(self, units: list[Unit], compute_dtype: torch.dtype, pin: bool, device=None, sharding=None,
                 transient_grads: bool = False):
        self.units = units
        self.compute_dtype = compute_dtype
        self.pin = pin
        self.device = torch.device(device or "cpu")
        self.sharding = sharding
        if sharding is not None and (transient_grads or any(u.resident or u.no_compute_copy for u in units)):
            raise ValueError("GPU residency, lean streaming and transient gradients cannot be combined with data "
                             "parallel sharding yet")
        # Data parallel: this rank's fp32 state covers [lo, hi) of each trainable prefix.
        self.bounds = [sharding.bounds(u.n_train) if sharding else (0, u.n_train) for u in units]
        self._arenas = []
        # Host state exists only for streamed units: a resident unit's weights, master, gradient
        # and moments all live on the device, and the model object's parameters view its device
        # copy (no host copy to keep current: at 13B that copy alone was ~12 GiB of host RAM).
        trained = [0 if u.resident else hi - lo for u, (lo, hi) in zip(units, self.bounds)]
        # fp32 compute mode with everything trainable: the master itself streams to the device
        self.aliased = compute_dtype == torch.float32 and all(u.n_train == u.numel for u in units) \
            and sharding is None
        # Only what crosses PCIe is page-locked: the streamed copy (H2D) and the gradient
        # accumulator (the D2H lands in it). The master leaves the host only when it is what
        # streams (fp32 compute, or lean streamed layers).
        streams_master = self.aliased or any(u.no_compute_copy and not u.resident for u in units)
        self.master = self._alloc(trained, torch.float32, pin=pin and streams_master)
        if self.aliased:
            self.compute = list(self.master)
        else:
            self.compute = self._alloc([0 if u.resident or u.no_compute_copy else u.numel for u in units],
                                       compute_dtype)
            for u in units:
                if u.no_compute_copy:
                    self.compute[u.index] = None
        # transient_grads: a streamed unit's gradient lives in one of a few shared buffers from its
        # first contribution until its step has run (claim_grad), instead of a buffer of its own.
        # So does a resident decoder layer's: on a GPU in one device buffer that they all share
        # (each is stepped on the compute stream right after its backward, before the next layer's
        # backward writes the buffer: stream order is the whole protocol), on the CPU in the host
        # buffers. A resident embedding and head keep theirs (not layers: stepped after the backward).
        self.transient = transient_grads
        self.grad = self._alloc([0 if transient_grads or u.grad_on_gpu else n for u, n in zip(units, trained)],
                                torch.float32)
        self._grad_buffers, self._grad_owner, self._claims = [], [], 0
        self._device_grad = None
        if transient_grads:
            on_host = [u for u in units if self.transient_on_host(u)]
            size = max((self.bounds[u.index][1] - self.bounds[u.index][0] for u in on_host), default=0)
            self._grad_buffers = self._alloc([size] * (TRANSIENT_GRAD_BUFFERS if size else 0), torch.float32)
            self._grad_owner = [None] * len(self._grad_buffers)
            for u in on_host:
                self.grad[u.index] = None
            size = max((u.n_train for u in units if self.transient_on_device(u)), default=0)
            if size:
                self._device_grad = torch.empty(size, dtype=torch.float32, device=self.device)
        # gpu_grad_layers: those layers' accumulators on the device (their host steps bring them over:
        # optimizer.HostAdamW); `grad_event[i]` is recorded on the compute stream when unit i's
        # gradient was last written.
        self.grad_event = [None] * len(units)
        for u in units:
            if u.grad_on_gpu:
                self.grad[u.index] = torch.empty(u.n_train, dtype=torch.float32, device=self.device)
        # Resident units: master, gradient and compute copy on the device (the compute copy is the
        # master itself in fp32 compute mode; a no_compute_copy unit has none).
        for u in units:
            if u.resident:
                self.master[u.index] = torch.empty(u.n_train, dtype=torch.float32, device=self.device)
                if not (self.transient_on_host(u) or self.transient_on_device(u)):
                    self.grad[u.index] = torch.empty(u.n_train, dtype=torch.float32, device=self.device)
                if self.aliased:
                    self.compute[u.index] = self.master[u.index]
                elif u.no_compute_copy:
                    self.compute[u.index] = None
                else:
                    self.compute[u.index] = torch.empty(u.numel, dtype=compute_dtype, device=self.device)
        # How many gradient contributions each unit's accumulator holds since zero_grad().
        self.grad_count = [0] * len(units)
        # Set while a unit's master and compute copy are current; cleared while an optimizer
        # step on it is pending, so nothing streams a half-updated unit to the GPU.
        self.ready = [Signal() for _ in units]
        self.order = [s.name for s in sorted((s for u in units for s in u.train_slots), key=lambda s: s.order)]

    def grad_on_device(self, unit: Unit) -> bool:
        """The unit's gradient accumulator is on the compute device (a resident unit, or a streamed
        layer of gpu_grad_layers), where its contributions are added and its norms taken."""
        return unit.resident or unit.grad_on_gpu

    def transient_on_host(self, unit: Unit) -> bool:
        """transient_grads puts this unit's gradient in the shared host buffers (claim_grad): every
        streamed unit; on the CPU, where the host is the device, a resident decoder layer too."""
        return self.transient and (not unit.resident or (unit.kind == "layer" and self.device.type == "cpu"))

    def transient_on_device(self, unit: Unit) -> bool:
        """transient_grads puts this resident decoder layer's gradient in the one shared device buffer."""
        return self.transient and unit.resident and unit.kind == "layer" and self.device.type != "cpu"

    def device_grad(self, index: int) -> torch.Tensor:
        """The shared device buffer, as resident layer `index`'s gradient (transient_on_device)."""
        return self._device_grad[: self.units[index].n_train]

    def _alloc(self, numels: list[int], dtype: torch.dtype, pin: bool | None = None) -> list[torch.Tensor]:
        arena, tensors = arena_tensors(numels, dtype, self.pin if pin is None else pin)
        self._arenas.append(arena)
        return tensors

    @classmethod
    def from_model(cls, model: nn.Module, units: list[Unit], compute_dtype: torch.dtype, pin: bool = False,
                   device=None, sharding=None, transient_grads: bool = False):
        """Copy a loaded model into flat buffers, unit by unit, and re-point its parameters.

        After this the model's parameters (the same objects) are views of the store (`bind`: the
        fp32 masters of what trains), so the model object shows the training state and stays
        usable and savable; its original storage is freed as we go: peak memory is the store
        plus one unit of the original.
        """
        store = cls(units, compute_dtype, pin, device, sharding, transient_grads)
        params = dict(model.named_parameters())
        for unit in units:
            for s in unit.slots:
                store.put(unit.index, s, params[s.name])
            store.bind(model, unit.index)
        return store

    def put(self, index: int, slot: Slot, tensor: torch.Tensor) -> None:
        """A real tensor of the slot's shape into unit `index`: all of it into the compute copy (where the unit
        has one and it is not the master; every rank streams all of it), this rank's part of it into the fp32
        master where the slot trains. The compute copy is then the master's rounding, as refresh_compute makes it."""
        flat = tensor.detach().reshape(-1)
        a, b = slot.offset, slot.offset + slot.numel
        lo, hi = self.bounds[index]
        master, compute = self.master[index], self.compute[index]
        with torch.no_grad():
            if compute is not None and compute is not master:
                compute[a:b].copy_(flat)
            p, q = max(a, lo), min(b, hi)
            if slot.trainable and p < q:
                master[p - lo : q - lo].copy_(flat[p - a : q - a])

    def bind(self, model: nn.Module, index: int | None = None) -> None:
        """Point the model's parameters at the store (all units, or one), so that the model shows
        what trains, in the precision stock's model shows it:

          trainable  its fp32 master, where the master is whole (on the host, or on the device for a
                     resident unit): the optimizer's own result, at no cost (a view)
          frozen     the compute copy (a LoRA base exists only as the streamed copy)
          data parallel: each rank holds a slice of the master, so every parameter views the compute
                     copy, which the all-gather keeps whole (`views_compute`; the engine says so once)

        The model's own Parameter objects are kept (`p.data = view`), so whatever holds them (an
        optimizer or EMA built beforehand, a dict of parameters, hooks, PEFT's bookkeeping) sees
        training. A meta skeleton's cannot take host or device storage: those are replaced, in
        every module that holds them, so tied weights stay one object.
        """
        units = self.units if index is None else [self.units[index]]
        views = {}
        for unit in units:
            views.update(self.param_views(unit.index))
        named = dict(model.named_parameters())
        replace = {}
        for name, v in views.items():
            p = named[name]
            if p.device.type == "meta":
                replace[id(p)] = nn.Parameter(v, requires_grad=p.requires_grad)
            else:
                p.data = v  # the same object, now a view of the store (any dtype, any device)
        if replace:
            for module in model.modules():
                for key, p in list(module._parameters.items()):
                    if p is not None and id(p) in replace:
                        module._parameters[key] = replace[id(p)]

    @property
    def views_compute(self) -> bool:
        """Data parallel: the model's trainable parameters view the compute copy, not the master
        (each rank holds only a slice of that)."""
        return self.sharding is not None

    def param_views(self, index: int) -> dict[str, torch.Tensor]:
        """{name: view} of what the model's parameters show for unit `index` (see `bind`)."""
        unit = self.units[index]
        compute = self.compute[index]
        master = None if self.views_compute else self.master[index]  # a no_compute_copy unit's one copy
        out = {}
        for s in unit.slots:
            flat = master if s.trainable and master is not None else compute
            out[s.name] = flat[s.offset : s.offset + s.numel].view(s.shape)
        return out

    # -- views ------------------------------------------------------------------------------
    def views(self, index: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a unit's flat buffer: every slot for a compute copy, the trainable ones for
        a master / gradient / moment buffer (which cover only the trainable prefix)."""
        unit = self.units[index]
        slots = unit.slots if flat.numel() == unit.numel else unit.train_slots
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in slots]

    def named(self, buffers: list) -> "list[tuple[str, torch.Tensor]]":
        """(name, view) for every trainable parameter, in the model's named_parameters() order."""
        where = {}
        for unit in self.units:
            for s, v in zip(unit.train_slots, self.views(unit.index, buffers[unit.index])):
                where[s.name] = v
        return [(name, where[name]) for name in self.order]

    def wait_ready(self, index: int | None = None) -> None:
        """Block until the unit's (every unit's) pending optimizer step has run; raise its failure."""
        for e in self.ready if index is None else [self.ready[index]]:
            e.wait()

    def refresh_compute(self, index: int) -> None:
        """Bring the copy the GPU reads up to date with the master (after a step)."""
        unit = self.units[index]
        if unit.resident:
            if not unit.no_compute_copy and self.compute[index] is not self.master[index]:
                self.compute[index][: unit.n_train].copy_(self.master[index])
        elif not self.aliased and not unit.no_compute_copy:
            lo, hi = self.bounds[index]
            self.compute[index][lo:hi].copy_(self.master[index])
            self.gather_compute(index)

    def gather_compute(self, index: int) -> None:
        """Data parallel: every rank's compute copy gets the slices the other ranks just stepped."""
        if self.sharding is not None:
            self.sharding.gather(self.compute[index], self.units[index].n_train, weights=True)

    def full(self, buffers: list, index: int) -> torch.Tensor:
        """A unit's whole trainable prefix of a sliced buffer (master, grad): gathered when
        data parallel (a collective: every rank must ask), the buffer itself otherwise."""
        if self.sharding is None:
            return buffers[index]
        return self.sharding.gather_slice(buffers[index].cpu(), self.units[index].n_train)

    # -- gradients --------------------------------------------------------------------------
    def count_grad(self, index: int) -> bool:
        """Count one more contribution to unit `index` (training thread); True for the step's first.
        With transient gradients the first claims a buffer for it (claim_grad) and a second is refused."""
        self.grad_count[index] += 1
        first = self.grad_count[index] == 1
        unit = self.units[index]
        on_host, on_device = self.transient_on_host(unit), self.transient_on_device(unit)
        if (on_host or on_device) and not first:
            raise MegaTrainError(
                f"transient_grads: {unit.label} got a second gradient in one optimizer step; its first has no "
                f"buffer of its own to be added to. Run the step's micro-batches together "
                f"(layer_major_accumulation) or leave transient_grads off.")
        if on_host:
            self.claim_grad(index)
        elif on_device:
            self.grad[index] = self.device_grad(index)
        return first

    def claim_grad(self, index: int) -> None:
        """Give unit `index` a transient gradient buffer (training thread). Buffers are taken in turn;
        one still held by an earlier unit is free once that unit's step has run, which is when its
        `ready` signal is set (with the step's failure, which this then raises: nothing waits
        forever for a step that a failed worker skipped)."""
        k = self._claims % len(self._grad_buffers)
        self._claims += 1
        owner = self._grad_owner[k]
        if owner is not None:
            self.ready[owner].wait()
            self.grad[owner] = None  # its gradient is gone with its step
        self._grad_owner[k] = index
        self.grad[index] = self._grad_buffers[k][: self.bounds[index][1] - self.bounds[index][0]]

    def add_grad(self, index: int, grad: torch.Tensor, first: bool) -> None:
        """Write a counted contribution into the accumulator: the first is copied in (nothing is
        ever memset), later ones are added. Any thread; see the ownership rules above."""
        acc = self.grad[index]
        if not first:
            acc.add_(grad)
        elif grad.data_ptr() != acc.data_ptr():
            acc.copy_(grad)

    def grad_or_zeros(self, index: int) -> torch.Tensor:
        """Unit `index`'s accumulator itself, wherever it lives (zeros if it got no gradient this step)."""
        if self.transient:
            raise MegaTrainError("transient_grads keeps no gradient once its step has run: there is none to read "
                                 "(named_grads, grad_norm); leave transient_grads off to inspect gradients.")
        lo, hi = self.bounds[index]
        if self.grad_count[index] == 0:
            return torch.zeros(hi - lo, dtype=torch.float32)
        return self.grad[index]

    def zero_grad(self) -> None:
        self.grad_count = [0] * len(self.units)

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_parameters(self) -> int:
        return sum(u.numel for u in self.units)
