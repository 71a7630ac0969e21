"""Memory estimator and admission check: refuse clearly before running out.

`estimate(config, batch, seq)` returns host RAM and GPU memory component by component, from
the same layout the engine builds (units, flat buffers, ring slots, activations, loss chunk).
`admit(plan)` compares it with what the machine has now and raises MegaTrainError listing what
would make it fit, instead of letting the OOM killer end a run halfway through loading.

Per parameter on the host: fp32 master 4 B, bf16 compute copy 2 B (0 in fp32 mode: the master
streams), fp32 gradient 4 B, Adam moments 8 B: 18 B, i.e. 1.26 TB for a 70B model; 16 B with
lean_streamed (the master streams and the GPU casts it). A resident parameter costs the same on the
GPU, or 16 B when lean (no compute copy; cast per use).

Data parallel over W ranks (engine/distributed.py): each rank holds the whole compute copy but
only 1/W of the master, gradient and moments, so the host entries are per rank, and a host
running L of the ranks needs L times their total; that per-host figure is what admission checks.
"""

from __future__ import annotations

import copy
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .engine.config import EngineConfig
from .engine.layout import (GRAD_LANDING_BUFFERS, LOSS_CHUNK_COPIES, TRANSIENT_GRAD_BUFFERS, config_units,
                            LANDING_TILE, fixed_buffer_numel, grad_slot_numel, loss_chunk, mark_resident,
                            ring_numel, slab_numel)
from .errors import counted

logger = logging.getLogger(__name__)

GiB = 1024**3
# Fixed costs of torch + CUDA context + libraries, host and GPU (measured on the device: BENCHMARKS.md,
# "Measurements the code's defaults rest on").
HOST_RUNTIME = 3.0 * GiB
GPU_RUNTIME = 1.0 * GiB


@dataclass
class Shapes:
    params: int
    embed: int
    head: int
    layer: int  # largest decoder layer
    layers: int
    hidden: int
    inter: int
    vocab: int
    kv_dim: int
    tied: bool
    units: list = field(default_factory=list, repr=False)  # the engine's own units (engine.layout)


_UNITS: OrderedDict = OrderedDict()  # config's contents -> its units (a meta build each: ~0.1-0.3 s)
_UNITS_KEPT = 8


def _config_key(config):
    """What a config's units depend on, as a key (None: not serialisable, so not memoized)."""
    try:
        return type(config).__qualname__, config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - an odd attribute costs the memo, never the plan
        return None


def config_units_memo(config) -> list:
    """engine.layout.config_units(config), built on the meta device once per config's contents
    (the planner's search asks for the same config's units hundreds of times). Each call returns
    fresh Unit objects (shallow copies: mark_resident sets flags on them, the slots are shared and
    never written), so a caller that marks them marks only its own."""
    return _memoized(_config_key(config), lambda: config_units(config))


def _memoized(key, build) -> list:
    """Fresh copies of the units `build()` makes, kept under `key` (the last _UNITS_KEPT keys; None:
    not kept, built each time)."""
    units = _UNITS.get(key) if key is not None else None
    if units is None:
        units = build()
        if key is not None:
            _UNITS[key] = units
            while len(_UNITS) > _UNITS_KEPT:
                _UNITS.popitem(last=False)
    else:
        _UNITS.move_to_end(key)
    return copy_units(units)


def _adapters_key(peft_config):
    """A peft config's contents, as a key (None: not serialisable, so not memoized)."""
    import json

    try:
        return type(peft_config).__qualname__, json.dumps(peft_config.to_dict(), sort_keys=True, default=repr)
    except Exception:  # noqa: BLE001 - an odd field costs the memo, never the plan
        return None


def adapter_units_memo(config, peft_config) -> list:
    """The units the engine builds for `config` with `peft_config`'s adapters (a LoRA run): PEFT
    injects them into a meta copy of the model, as checkpoint.loading.with_adapters does into the
    real one, and store.build_units lays the result out as StreamingEngine does (the base model
    under the wrapper), so each unit's `n_train` is its adapters and `numel` its whole layer.
    Memoized per (config, adapters) like config_units_memo; the Unit objects are the caller's own.
    peft_config: a peft config, a dict of LoraConfig fields, or inline JSON / a JSON file."""
    from .checkpoint.loading import lora_config

    peft_config = lora_config(peft_config)
    base, adapters = _config_key(config), _adapters_key(peft_config)
    key = ("adapters", base, adapters) if base is not None and adapters is not None else None
    return _memoized(key, lambda: _adapter_units(config, peft_config))


def _adapter_units(config, peft_config) -> list:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from .engine.store import build_units
    from .errors import MegaTrainError
    from .patcher.specs import spec_for

    with torch.device("meta"):
        # a copy: building a model settles attributes on its config (the attention choice)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
        try:
            model = get_peft_model(model, copy.deepcopy(peft_config)).get_base_model()
        except (ValueError, TypeError, KeyError) as e:
            text = " ".join(str(e).split())
            raise MegaTrainError(f"peft_config does not fit this {config.model_type} model: {text}; fix "
                                 "target_modules (or the other fields named).") from e
    return build_units(model, spec_for(config), [n for n, _ in model.named_parameters()])


def copy_units(units) -> list:
    """Units of one's own to mark (mark_resident), sharing the slot lists that nothing writes."""
    return [copy.copy(u) for u in units]


def model_shapes(config, peft_config=None) -> Shapes:
    """Parameter counts per unit, laid out as the engine lays them out (engine.layout.config_units:
    a meta copy of the model, no memory, built once per config: config_units_memo), plus the widths
    the activation terms need. The units are the caller's own. peft_config: a LoRA run's adapters
    (adapter_units_memo): the units' trainable part (n_train) is then the adapters alone."""
    units = config_units_memo(config) if peft_config is None else adapter_units_memo(config, peft_config)
    h = config.hidden_size
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", heads) * hd
    layers = [u for u in units if u.kind == "layer"]
    return Shapes(params=sum(u.numel for u in units), embed=units[0].numel, head=units[-1].numel,
                  layer=max((u.numel for u in layers), default=0), layers=len(layers), hidden=h,
                  inter=config.intermediate_size, vocab=config.vocab_size, kv_dim=kv,
                  tied=units[-1].tied_local is not None, units=units)


@dataclass
class MemoryPlan:
    host: dict = field(default_factory=dict)
    gpu: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    resident_layers: int = 0
    offload_activations: int = 0
    world_size: int = 1  # data-parallel ranks in all
    local_ranks: int = 1  # of them on this host: each holds the `host` entries
    lean_streamed_saving: float = 0.0  # host bytes lean_streamed would save (0: on already, or it cannot)
    transient_saving: float = 0.0  # host bytes transient_grads would save (0: on already, or it cannot)

    @property
    def host_total(self) -> float:
        """Host RAM of one rank."""
        return sum(self.host.values())

    @property
    def host_per_host(self) -> float:
        """Host RAM of every rank on this host together: what the host must have."""
        return self.host_total * self.local_ranks

    @property
    def gpu_total(self) -> float:
        """The fixed part plus the largest of the phases ("[phase] ..." entries never coexist)."""
        phases: dict[str, float] = {}
        fixed = 0.0
        for k, v in self.gpu.items():
            if k.startswith("["):
                phase = k[1 : k.index("]")]
                phases[phase] = phases.get(phase, 0.0) + v
            else:
                fixed += v
        return fixed + max(phases.values(), default=0.0)

    def table(self) -> str:
        ranks = self.world_size > 1
        w = max(map(len, [*self.host, *self.gpu, "total (fixed + largest [phase])"]))  # the labels' column
        lines = [f"{'host RAM per rank' if ranks else 'host RAM':{w + 2}} {'GiB':>9}"]
        lines += [f"  {k:{w}} {v / GiB:9.2f}" for k, v in self.host.items()]
        lines += [f"  {'total':{w}} {self.host_total / GiB:9.2f}"]
        if ranks:
            here = f"x {self.local_ranks} ranks on this host" if self.local_ranks > 1 else "1 rank on this host"
            lines += [f"  {here:{w}} {self.host_per_host / GiB:9.2f}"]
        lines += ["", f"{'GPU memory per rank' if ranks else 'GPU memory':{w + 2}} {'GiB':>9}"]
        lines += [f"  {k:{w}} {v / GiB:9.2f}" for k, v in self.gpu.items()]
        lines += [f"  {'total (fixed + largest [phase])':{w}} {self.gpu_total / GiB:9.2f}"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def as_dict(self) -> dict:
        return {"host": self.host, "gpu": self.gpu, "host_total": self.host_total, "gpu_total": self.gpu_total,
                "resident_layers": self.resident_layers, "offload_activations": self.offload_activations,
                "world_size": self.world_size, "local_ranks": self.local_ranks, "host_per_host": self.host_per_host}


def planning_config(engine: EngineConfig | None = None, **fields) -> EngineConfig:
    """The engine config a plan is made for: `engine` with `fields` replaced, or one built from
    `fields` alone, which plans a GPU run unless `device` says otherwise."""
    if engine is None:
        return EngineConfig(**{"device": "cuda", **fields})
    return replace(engine, **fields) if fields else engine


def estimate(config, batch: int, seq: int, engine: EngineConfig | None = None, *, world_size: int = 1,
             local_ranks: int | None = None, shapes: Shapes | None = None, micro_batches: int = 1,
             later_contributions: bool = True, **engine_fields) -> MemoryPlan:
    """What training `config` at `batch` x `seq` tokens per micro-batch needs, by component.

    micro_batches: how many micro-batches of a step run through each layer together
    (StreamingEngine.forward_backward_many): their layer inputs, the gradients flowing down and
    a tied head's gradients are kept for all of them at once.
    later_contributions: a unit's gradient may get a second contribution in one step (micro-batches
    one at a time), which crosses PCIe through the pinned staging slabs; False when every step runs
    as one micro-batch or its micro-batches together (the pipeline then never allocates the slabs).

    engine: the EngineConfig the run will be built with (EngineConfig fields given as keywords
    replace its values; without one, a GPU run with the engine's defaults is planned). Its
    placements must be numbers ("auto" is resolve_placement's to settle; an unsettled
    lean_resident plans without it).
    world_size: data-parallel ranks; local_ranks: how many of them run on this host (default all).
    The entries are one rank's; `host_per_host` is what this host needs for its ranks."""
    eng = planning_config(engine, **engine_fields)
    s = shapes or model_shapes(config)
    cbytes = eng.compute_dtype.itemsize
    cuda = eng.device.type == "cuda"
    tokens = batch * seq
    world = max(1, world_size)
    # data parallel streams every layer (residency is not combined with sharding yet); marked on a
    # copy: the units handed in (shapes=) stay as they were
    units = copy_units(s.units)
    resident_layers = mark_resident(units, 0 if world > 1 else eng.resident_layers or 0, eng.lean_resident,
                                    eng.lean_streamed and world == 1,
                                    0 if world > 1 or not cuda else eng.gpu_grad_layers)
    offload = max(0, min(eng.offload_activations or 0, s.layers)) if cuda else 0
    layer_input = tokens * s.hidden * cbytes  # one saved [batch, seq, hidden] layer input
    on_gpu = sum(u.numel for u in units if u.resident)
    streamed = s.params - on_gpu
    # The fp32 state (master, gradient, moments) covers each unit's trainable prefix (n_train: all of
    # it in a full fine-tune, the adapters in a LoRA run); the compute copy covers every weight.
    trained_streamed = sum(u.n_train for u in units if not u.resident)
    plan = MemoryPlan(resident_layers=resident_layers, offload_activations=offload, world_size=world,
                      local_ranks=1 if world == 1 else max(1, min(local_ranks or world, world)))
    # This rank's share of the fp32 state: the largest rank's slice of every unit, ceil(n / world)
    # (engine.distributed.Sharding); all of it in one process.
    owned = trained_streamed if world == 1 else sum(_share(u.n_train, world) for u in units)
    plan.host["fp32 master weights"] = 4 * owned
    # fp32 compute in one process streams the master itself; a rank holds only a slice of the master
    # but streams every weight, so it keeps a whole compute copy of its own
    lean_streamed = sum(u.numel for u in units if u.lean and not u.resident)  # their fp32 master streams
    # (HostStore.aliased: fp32 compute, everything trained, one process)
    aliased = cbytes == 4 and world == 1 and all(u.n_train == u.numel for u in units)
    plan.host["compute copy (streamed)"] = 0 if aliased else cbytes * (streamed - lean_streamed)
    if cuda and cbytes == 2 and world == 1:  # what lean_streamed would take off (mark_resident's rule)
        plan.lean_streamed_saving = cbytes * sum(u.numel for u in units if u.kind == "layer" and not u.resident
                                                 and not u.lean and u.n_train == u.numel)
    buffers = 4 * TRANSIENT_GRAD_BUFFERS * max((u.n_train for u in units if not u.resident), default=0)
    if eng.transient_grads and world == 1:  # a few shared buffers of the largest streamed unit
        plan.host[f"fp32 gradient buffers (transient, {TRANSIENT_GRAD_BUFFERS})"] = buffers
    else:
        on_gpu_grads = sum(u.n_train for u in units if u.grad_on_gpu)
        plan.host["fp32 gradient accumulator"] = 4 * (owned - on_gpu_grads)
        if on_gpu_grads:
            plan.host[f"pinned landing tiles ({GRAD_LANDING_BUFFERS}, gradients kept on the GPU)"] = \
                4 * GRAD_LANDING_BUFFERS * LANDING_TILE
        if cuda and world == 1 and owned:  # the accumulator and the staging slabs, for the buffers
            plan.transient_saving = 4 * (owned - on_gpu_grads) - buffers \
                + (eng.staging_slabs * 4 * slab_numel(units) if later_contributions else 0)
    plan.host["Adam moments (fp32 x2)"] = 8 * owned
    if world > 1:
        # Transient, one unit at a time: the all-gather of updated weights (own slice + the whole
        # unit, compute dtype) and, on a CPU, the gradient reduce-scatter on the host (an fp32 copy,
        # its padded copy, this rank's sum); the largest unit is usually the embedding.
        n = max(u.numel for u in units)
        gather = cbytes * (n + _share(n, world))
        reduce = 4 * (2 * n + _share(n, world)) if not cuda else 0
        plan.host["data-parallel exchange (one unit)"] = max(gather, reduce)
        plan.notes.append(f"data parallel: {world} ranks, {plan.local_ranks} on this host; each rank holds the "
                          f"whole compute copy and 1/{world} of the fp32 master, gradient and Adam moments.")
    if cuda and not eng.transient_grads and later_contributions:
        plan.host["pinned staging slabs"] = eng.staging_slabs * 4 * slab_numel(units)
    group = max(1, micro_batches)
    if offload:
        plan.host["offloaded layer inputs (pinned)"] = group * offload * layer_input
    plan.host["runtime (torch, CUDA, Python)"] = HOST_RUNTIME
    if not cuda:
        plan.notes.append("CPU run: the compute happens in host RAM; the GPU column does not apply.")
        return plan

    chunk = min(loss_chunk(s.vocab, eng.device.type, eng.loss_chunk_tokens), tokens)
    plan.gpu["weight ring (prefetch slots)"] = eng.prefetch_depth * cbytes * ring_numel(units)
    plan.gpu["embedding + head buffers"] = cbytes * fixed_buffer_numel(units)
    if lean_streamed:  # torch lands the fp32 master on the GPU, then casts it into the slot
        plan.gpu["fp32 landing of a lean streamed layer"] = 4 * max(u.numel for u in units if u.lean and not u.resident)
    plan.gpu["gradient ring (fp32)"] = eng.grad_slots * 4 * grad_slot_numel(units)
    if any(u.grad_on_gpu for u in units):
        plan.gpu["fp32 gradients of streamed layers (gpu_grad_layers)"] = \
            4 * sum(u.n_train for u in units if u.grad_on_gpu)
    lean = sum(u.numel for u in units if u.lean and u.resident)
    def state(group, per_trained):  # compute copy of every weight, fp32 state of the trained ones
        return sum(cbytes * u.numel + per_trained * u.n_train for u in group)

    if eng.transient_grads and resident_layers:  # the resident layers share one gradient buffer
        full = [u for u in units if u.resident and u.kind == "layer" and not u.lean]
        plan.gpu["resident units (weights, master, grad, Adam)"] = \
            state([u for u in units if u.resident and u.kind != "layer"], 16)
        if full:
            plan.gpu["resident layers (weights, master, Adam)"] = state(full, 12)
        if lean:
            plan.gpu["lean resident layers (master, Adam)"] = 12 * lean
        plan.gpu["fp32 gradient of a resident layer (transient, shared)"] = \
            4 * max(u.n_train for u in units if u.resident and u.kind == "layer")
    elif lean:
        plan.gpu["resident units (weights, master, grad, Adam)"] = \
            state([u for u in units if u.resident and not u.lean], 16)
        plan.gpu["lean resident layers (master, grad, Adam)"] = 16 * lean
    else:
        plan.gpu["resident units (weights, master, grad, Adam)"] = state([u for u in units if u.resident], 16)
    plan.gpu["saved layer inputs"] = group * (s.layers - offload) * layer_input
    if offload:  # brought back ahead of need (engine.activations: the lookahead, plus the one in use)
        plan.gpu["offloaded inputs in flight"] = group * min(offload, eng.activation_lookahead + 1) * layer_input
    if group > 1 and slab_numel(units):  # a later micro-batch's weight gradient, before it joins the first's
        plan.gpu["gradient scratch (fp32, micro-batches together)"] = 4 * slab_numel(units)
    # The backward passes through three phases that never overlap; the GPU peak is the fixed part
    # plus the largest phase. Calibrated against measured peaks on the device (BENCHMARKS.md,
    # "Measurements the code's defaults rest on").
    head_w = s.vocab * s.hidden
    grad_x = group * tokens * s.hidden * cbytes  # the gradients flowing down, alive in every phase
    held = group * 4 * s.embed if s.tied else 0  # a tied head's fp32 gradients wait for the embedding's
    plan.gpu["[loss] fp32 logits chunk x3"] = chunk * s.vocab * 4 * LOSS_CHUNK_COPIES
    # (the other micro-batches' last hidden states wait for the head beside the gradient)
    plan.gpu["[loss] head weight gradient (fp32, x2 while packed)"] = 2 * 4 * head_w + grad_x \
        + (group - 1) * (layer_input + held // group)
    # One layer's recompute with autograd and its backward: HF's RMSNorm computes in fp32 and
    # autograd keeps those tensors, so a layer holds about 18 [tokens, hidden] compute-dtype tensors
    # beside q/k/v, plus one MLP tile's intermediates and the layer's weight gradient.
    mlp_tokens = min(tokens, eng.mlp_tile_tokens) if eng.mlp_tile_tokens else tokens  # a tiled MLP holds one tile
    act = (tokens * (18 * s.hidden + 4 * s.kv_dim) + mlp_tokens * 4 * s.inter) * cbytes
    plan.gpu["[layer] one layer's recompute + grads"] = act + cbytes * s.layer + held + grad_x
    plan.gpu["[embedding] embedding gradient (fp32)"] = 4 * s.embed + held + grad_x
    plan.gpu["runtime (CUDA context, cuBLAS)"] = GPU_RUNTIME
    return plan


MODES = (("default", {}), ("lean_streamed", dict(lean_streamed=True)),
         ("lean_streamed + transient_grads", dict(lean_streamed=True, transient_grads=True)))


def state_bytes_per_parameter(plan: MemoryPlan, params: int) -> float:
    """Host bytes of the training state (master, compute copy, gradients, moments) per parameter."""
    keys = ("fp32 master", "compute copy", "fp32 gradient", "Adam moments")
    return sum(v for k, v in plan.host.items() if k.startswith(keys)) / params  # a resident unit's is on the GPU


def mode_plans(config, batch: int, seq: int, engine: EngineConfig, *, shapes: Shapes | None = None,
               micro_batches: int = 1, later_contributions: bool = True) -> list[tuple[str, EngineConfig, MemoryPlan]]:
    """The plan of each memory mode (MODES) at `engine`'s placement: what `estimate` shows side by side
    (gradients kept on the GPU stay where they are, except with transient_grads, which keeps none)."""
    shapes = shapes or model_shapes(config)
    out = []
    for name, fields in MODES:
        eng = mode_engine(engine, {"lean_streamed": False, "transient_grads": False, **fields})
        out.append((name, eng, estimate(config, batch, seq, eng, shapes=shapes, micro_batches=micro_batches,
                                        later_contributions=later_contributions)))
    return out


def _share(n: int, world: int) -> int:
    return -(-n // world)


def ranks_on_this_host(world_size: int) -> int:
    """How many ranks of a data-parallel run share this host: LOCAL_WORLD_SIZE, which torchrun and
    accelerate set; all of them when it is unset (the cautious guess)."""
    if world_size <= 1:
        return 1
    return max(1, min(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), world_size))


def mlp_tile(seq: int, tile: int | None = None) -> int | None:
    """The MLP sequence tile: the one asked for, or 16K tokens once rows are long (> 32K tokens).

    Tiles cut along the sequence, so they only pay off for long rows; many short rows are
    better split into micro-batches than into thin slices.
    """
    return tile or (16384 if seq > 32768 else None)


ADMIT_MARGIN = 0.05  # what admission keeps free of the host's MemAvailable and the GPU's free memory


def plan_placement(config, batch: int, seq: int, gpu_free: float, *, margin: float = 0.1,
                   host_free: float | None = None, resident_layers: int | None = None,
                   offload_activations: int | None = None, **kw) -> tuple[int, int]:
    """(resident decoder layers, offloaded layer inputs) for this run, from the plan.

    Activations come first: layer inputs stay on the GPU while they fit and only the excess
    moves to pinned host memory (each offloaded one costs PCIe traffic twice a step). Then as
    many layers as still fit become resident: they cost (compute bytes + 16) per parameter on
    the GPU and nothing in the host optimizer. A value given by the caller is kept as it is.

    With `host_free`, a plan whose host side would not fit moves more layers onto the GPU, into
    the headroom that `margin` keeps, as far as admission allows (its margin, ADMIT_MARGIN): this
    is what lets a model whose host side is just too large train (BENCHMARKS.md, "Measurements the
    code's defaults rest on": the 13B shape on the H200 box).

    kw: estimate's keywords (an `engine` config, its fields, world_size, local_ranks).
    """
    shapes = kw.pop("shapes", None) or model_shapes(config)
    layers = shapes.layers
    budget = gpu_free * (1 - margin)
    if kw.get("world_size", 1) > 1:
        resident_layers = 0  # data parallel streams every layer (estimate counts none resident)

    def plan(n, off):
        return estimate(config, batch, seq, resident_layers=n, offload_activations=off, shapes=shapes, **kw)

    def gpu(n, off):
        return plan(n, off).gpu_total

    offload = offload_activations
    if offload is None:
        offload = 0
        while offload < layers and gpu(resident_layers or 0, offload) > budget:
            offload += 1
    resident = resident_layers
    if resident is None:
        resident = 0
        while resident < layers and gpu(resident + 1, offload) <= budget:
            resident += 1
        if host_free is not None:
            def host_short(n):
                return plan(n, offload).host_per_host > host_free * (1 - ADMIT_MARGIN)

            while resident < layers and host_short(resident) and gpu(resident + 1, offload) <= gpu_free * (1 - ADMIT_MARGIN):
                resident += 1
    return resident, offload


def place_layers(config, batch: int, seq: int, gpu_free: float, *, engine: EngineConfig | None = None,
                 **kw) -> tuple[int, int, bool]:
    """(resident layers, offloaded layer inputs, lean residency): plan_placement for `engine`, with
    an 'auto' (None) lean_resident settled too. Lean is taken exactly when it keeps more layers
    resident: its cast costs a little GPU time beside the compute (0.7% of a Gemma-2-9B step,
    BENCHMARKS.md run 12), while a layer that streams instead costs its host AdamW and PCIe."""
    eng = planning_config(engine)
    if eng.lean_resident is not None:
        return (*plan_placement(config, batch, seq, gpu_free, engine=eng, **kw), eng.lean_resident)
    full = plan_placement(config, batch, seq, gpu_free, engine=replace(eng, lean_resident=False), **kw)
    slim = plan_placement(config, batch, seq, gpu_free, engine=replace(eng, lean_resident=True), **kw)
    return (*slim, True) if slim[0] > full[0] else (*full, False)


class Placement(NamedTuple):
    engine: EngineConfig  # with both placements as numbers
    planned: bool  # the planner chose the resident layers for this GPU: as many as it holds


def resolve_placement(config, batch: int, seq: int, engine: EngineConfig, *, world_size: int = 1,
                      local_ranks: int | None = None, gpu_free: float | None = None,
                      host_free: float | None = None, micro_batches: int = 1,
                      later_contributions: bool = True, shapes: Shapes | None = None) -> Placement:
    """The engine config with 'auto' (None) placements replaced by the plan's numbers: the one
    place where the automatic placement is decided, for the trainer and `hf-megatrain estimate`.

    Data parallel streams every layer, whatever was asked for. Off a GPU nothing is placed.
    gpu_free: the GPU's free bytes (default: measured now); host_free: the host's available bytes,
    for moving layers onto the GPU when the host side would not fit, and for an 'auto' lean_streamed,
    taken only when the host side fits with it and not without (None: not considered; lean_streamed
    auto is then off); micro_batches: how many run through each layer together (estimate); shapes:
    model_shapes(config[, peft_config]), the units planned (a LoRA run's: its adapters train)."""
    resident, offload, lean = engine.resident_layers, engine.offload_activations, engine.lean_resident
    streamed = engine.lean_streamed
    if world_size > 1 and resident != 0:
        if resident:
            logger.info("data parallel: GPU residency is not combined with sharding yet; streaming all layers")
        resident = 0
    planned = resident is None and engine.device.type == "cuda"
    if engine.device.type != "cuda":
        resident, offload, lean, streamed = resident or 0, offload or 0, bool(lean), bool(streamed)
    elif None in (resident, offload, lean, streamed, engine.transient_grads, engine.gpu_grad_layers):
        gpu_free = gpu_available(engine.device) if gpu_free is None else gpu_free
        ranks = dict(world_size=world_size, local_ranks=local_ranks, micro_batches=micro_batches,
                     later_contributions=later_contributions, shapes=shapes or model_shapes(config))

        def place(modes: dict):
            return place_layers(config, batch, seq, gpu_free, engine=replace(engine, **modes),
                                resident_layers=resident, offload_activations=offload, host_free=host_free, **ranks)

        def planned_with(placed, modes: dict, grads: int) -> MemoryPlan:
            return estimate(config, batch, seq, replace(engine, resident_layers=placed[0], offload_activations=placed[1],
                                                        lean_resident=placed[2], gpu_grad_layers=grads, **modes),
                            **ranks)

        def host_short(placed, modes: dict, grads: int = 0) -> bool:
            return planned_with(placed, modes, grads).host_per_host > host_free * (1 - ADMIT_MARGIN)

        def settle(modes: dict):
            """The placement for these modes, and gpu_grad_layers: on auto, while the host is short, one
            more streamed layer's gradient on the GPU as long as the GPU holds it (the room its resident
            layers leave is less than a layer's state, but may be several layers' gradients)."""
            placed = place(modes)
            grads = engine.gpu_grad_layers
            if grads is None:
                grads = 0
                if world_size == 1 and host_free is not None and not modes["transient_grads"]:
                    while grads < config.num_hidden_layers - placed[0] and host_short(placed, modes, grads) \
                            and planned_with(placed, modes, grads + 1).gpu_total <= gpu_free * (1 - ADMIT_MARGIN):
                        grads += 1
            return placed, grads

        # The host memory modes left on auto, the cheapest first: none; transient_grads (free of time:
        # without clipping each unit is stepped as it lands anyway); lean_streamed (twice the PCIe bytes
        # of the streamed weights); both. The first whose host side fits; the plain one if none does.
        choices = [dict(transient_grads=t, lean_streamed=s)
                   for s in ([False, True] if streamed is None else [bool(streamed)])
                   for t in ([False, True] if engine.transient_grads is None else [bool(engine.transient_grads)])]
        if world_size > 1 or host_free is None:  # nothing to weigh them against: as asked, auto off
            choices = choices[:1]
        modes = choices[0]
        placed, grads = settle(modes)
        for option in choices[1:] if len(choices) > 1 and host_short(placed, modes, grads) else []:
            option_placed, option_grads = settle(option)
            if not host_short(option_placed, option, option_grads):
                placed, modes, grads = option_placed, option, option_grads
                break
        resident, offload, lean = placed
        streamed, transient = modes["lean_streamed"], modes["transient_grads"]
        chosen = [name for name, on, asked in (("lean_streamed", streamed, engine.lean_streamed),
                                               ("transient_grads", transient, engine.transient_grads))
                  if on and asked is None]
        if grads and engine.gpu_grad_layers is None:
            chosen.append(f"the gradients of the last {counted(grads, 'streamed layer')} on the GPU")
        logger.info("memory plan: %d of %s resident on the GPU%s, %s offloaded (%.0f GiB free)%s",
                    resident, counted(config.num_hidden_layers, "layer"),
                    " (lean: cast from the fp32 master per use)" if lean else "",
                    counted(offload, "layer input"), gpu_free / GiB,
                    f"; {' and '.join(chosen)} (without it the host RAM is short)" if chosen else "")
        return Placement(replace(engine, resident_layers=resident, offload_activations=offload,
                                 lean_resident=bool(lean) and bool(resident), lean_streamed=streamed,
                                 transient_grads=transient, gpu_grad_layers=grads), planned)
    return Placement(replace(engine, resident_layers=resident, offload_activations=offload,
                             lean_resident=bool(lean) and bool(resident), lean_streamed=bool(streamed),
                             transient_grads=bool(engine.transient_grads),
                             gpu_grad_layers=engine.gpu_grad_layers or 0), planned)


def one_at_a_time(ga: int, split: int = 1, together: int = 0) -> bool:
    """A step's `ga` micro-batches (each cut into `split` chunks of rows) run one at a time rather
    than together, so a unit's gradient gets later contributions in a step: what `estimate`'s
    later_contributions asks (they cross PCIe through the pinned staging slabs)."""
    return ga * split > 1 and not together


def mode_engine(engine: EngineConfig, fields: dict) -> EngineConfig:
    """`engine` with a memory mode's fields (MODES). transient_grads keeps no gradient to place on the
    GPU, so gpu_grad_layers goes to 0 with it (EngineConfig refuses the two together)."""
    return replace(engine, **fields, **({"gpu_grad_layers": 0} if fields.get("transient_grads") else {}))


class StepSplit(NamedTuple):
    split: int  # each micro-batch the loader gives is cut into this many chunks of rows
    together: int  # chunks of a step that run through each layer together (0: one micro-batch at a time)
    placement: Placement  # planned for that

    def describe(self, batch: int, ga: int) -> str:
        rows, n = batch // self.split, ga * self.split
        if n == 1:
            return "one micro-batch per step"
        how = "through each layer together" if self.together else "one at a time"
        asked = f" (asked: {batch} x {ga})" if self.split > 1 else ""
        return f"micro-batches of {counted(rows, 'row')} x {n}{asked}, {how}"


def split_step(config, batch: int, seq: int, engine: EngineConfig, ga: int, *, asked: bool | None = None,
               splittable: bool | None = None, host_free: float | None = None,
               gpu_free: float | None = None, shapes: Shapes | None = None) -> StepSplit:
    """How a step of `ga` micro-batches of `batch` rows runs: the one place this is decided (the
    trainer, `hf-megatrain estimate`). The user's batch is `batch` x `ga`; the engine may cut each
    micro-batch into chunks of rows and run a step's chunks through each layer together
    (StreamingEngine.forward_backward_many), so that a streamed layer crosses PCIe once per step
    and the GPU holds one chunk's transient activations. The same loss: every chunk is divided by
    the step's (or its micro-batch's) token count, as the whole micro-batch would be.

    asked: layer_major_accumulation (None: auto). Auto on a GPU: as asked when nothing streams
    and it fits; else the fewest chunks, together, whose plan fits; else as asked (admission then
    says why not). True: together, uncut. False, or off a GPU on auto: as asked.
    splittable: rows may be cut; by default unless `config` is an MoE whose load-balancing loss
    spans the micro-batch (output_router_logits with a coefficient). The host memory modes on auto
    (lean_streamed, transient_grads, gpu_grad_layers) are tried only once no split fits without them.
    shapes: as resolve_placement's."""
    shapes = shapes or model_shapes(config)
    if splittable is None:
        splittable = not (getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0))

    def placed(rows, n=1, eng=engine):
        later = one_at_a_time(ga, together=n > 1)
        if later and eng.transient_grads is None:  # one micro-batch at a time: never exact
            eng = replace(eng, transient_grads=False)
        return resolve_placement(config, rows, seq, eng, host_free=host_free, gpu_free=gpu_free, micro_batches=n,
                                 later_contributions=later, shapes=shapes)

    cuda = engine.device.type == "cuda"
    if asked is False or (asked is None and not cuda) or (asked and ga < 2):
        return StepSplit(1, 0, placed(batch))
    if asked:
        return StepSplit(1, ga, placed(batch, ga))
    base = placed(batch)
    gpu_free = gpu_available(engine.device) if gpu_free is None else gpu_free
    host_free = host_available() if host_free is None else host_free

    def fits(placement, rows, n):
        plan = estimate(config, rows, seq, placement.engine, micro_batches=n, shapes=shapes,
                        later_contributions=one_at_a_time(ga, together=n > 1))
        return not shortfalls(plan, host_free, gpu_free)

    streams = base.engine.resident_layers < config.num_hidden_layers
    if fits(base, batch, 1) and (ga == 1 or not streams):
        return StepSplit(1, 0, base)  # nothing would cross PCIe per micro-batch: as asked
    # The host memory modes on auto are the last resort: every split without them first (cutting rows
    # costs smaller matmuls; lean_streamed twice the PCIe bytes of the streamed weights, gradients kept
    # on the GPU a copy during the host step; transient_grads nothing, but the plain plan is the one
    # the user asked for)
    plain = {k: False for k in ("lean_streamed", "transient_grads") if getattr(engine, k) is None}
    if engine.gpu_grad_layers is None:
        plain["gpu_grad_layers"] = 0
    engines = [replace(engine, **plain), engine] if plain else [engine]
    for eng in engines:
        for f in [f for f in range(1, batch + 1) if batch % f == 0 and (f == 1 or splittable)]:
            if ga * f < 2:
                continue
            placement = placed(batch // f, ga * f, eng)
            if fits(placement, batch // f, ga * f):
                return StepSplit(f, ga * f, placement)
    return StepSplit(1, 0, base)


def allocator_advice(plan: MemoryPlan, gpu_free: float, conf: str | None = None) -> str | None:
    """A line of advice when the plan fills the GPU and CUDA's allocator may fragment: micro-batches
    of several shapes left 9 GiB reserved but unused and ran out of memory near a full card, where
    expandable segments did not (BENCHMARKS.md, run 13). conf: PYTORCH_CUDA_ALLOC_CONF (default: the
    environment's). None when there is nothing to say."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if conf is None else conf
    if "expandable_segments:true" in conf.replace(" ", "").lower() or plan.gpu_total <= 0.85 * gpu_free:
        return None
    return (f"the plan fills {plan.gpu_total / gpu_free:.0%} of the GPU's free memory: launch with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before torch is imported; hf-megatrain train "
            "sets it) so that the allocator's cache does not fragment into an out-of-memory error.")


def host_available() -> float:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def gpu_available(device=None) -> float:
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return float(free)


def admit(plan: MemoryPlan, *, host_free: float | None = None, gpu_free: float | None = None,
          margin: float = ADMIT_MARGIN, hint=None, residency_planned: bool = False, step_cost=None) -> None:
    """Raise MegaTrainError, with what would make it fit, if the plan exceeds the machine.

    hint: called with host_free= and gpu_free= only on a refusal, for one more line of advice (the
    trainer's: the longest row that fits, see longest_fitting_row).
    residency_planned: plan_placement chose the resident layers for this machine, as many as the
    GPU holds, so more of them is no advice to give.
    step_cost: called with a memory mode's EngineConfig fields only on a refusal that names the mode,
    for its speed cost in words (steptime.mode_cost: the step-time model with and without it)."""
    from .errors import MegaTrainError

    host_free = host_available() if host_free is None else host_free
    if plan.gpu and gpu_free is None:
        gpu_free = gpu_available()
    problems = shortfalls(plan, host_free, gpu_free, margin)
    if not problems:
        return
    fixes = []
    if any(p.startswith("GPU") for p in problems):
        fixes += ["a smaller per_device_train_batch_size or max_seq_length (activations scale with tokens)",
                  "fewer gpu_resident_layers" if plan.resident_layers else "a smaller loss_chunk_tokens",
                  "offload_activations='auto' or a larger number (layer inputs kept in pinned host memory)"]
    hint = hint(host_free=host_free, gpu_free=gpu_free) if hint is not None else None
    if any(p.startswith("host") for p in problems):
        if plan.local_ranks > 1:
            fixes += [f"fewer ranks on this host than {plan.local_ranks} (each holds the whole compute copy)"]
        if not residency_planned and plan.world_size == 1:
            fixes += ["gpu_resident_layers > 0 to keep some layers' state on the GPU instead" if not plan.resident_layers
                      else f"more than {plan.resident_layers} gpu_resident_layers, if the GPU has room for them"]

        def fits_with(saving):
            return not shortfalls(replace(plan, host={**plan.host, "saved": -saving}), host_free, gpu_free, margin)

        def cost(**fields):
            return f"; {step_cost(fields)}" if step_cost is not None else ""

        if plan.lean_streamed_saving and fits_with(plan.lean_streamed_saving):
            fixes.insert(0, f"lean_streamed=True: the streamed layers keep no bf16 copy in host RAM "
                            f"({plan.lean_streamed_saving / GiB:.1f} GiB less; their fp32 master crosses PCIe "
                            f"instead, twice the bytes of their weights{cost(lean_streamed=True)})")
        elif plan.transient_saving and fits_with(plan.lean_streamed_saving + plan.transient_saving):
            both = plan.lean_streamed_saving + plan.transient_saving
            lean = dict(lean_streamed=True) if plan.lean_streamed_saving else {}
            fixes.insert(0, f"{'lean_streamed=True and ' if lean else ''}transient_grads=True "
                            f"({both / GiB:.1f} GiB less: the streamed layers keep no fp32 gradient accumulator, "
                            f"each gradient is stepped as it lands; with clipping each step first measures the "
                            f"global norm with a forward and backward of its own, exact, a pass that "
                            f"max_grad_norm=0 does without{cost(transient_grads=True, **lean)})")
        fixes += ["a host with more RAM (18 bytes per parameter: fp32 master, gradient and Adam states)",
                  "LoRA (peft_config; `hf-megatrain estimate --peft_config JSON` plans it) instead of full "
                  "fine-tuning: about 2 bytes per frozen parameter"]
    raise MegaTrainError(
        "this run does not fit: " + "; ".join(problems) + ".\n" + plan.table() + "\nWould fit with: "
        + "; or ".join(fixes) + "." + (f"\n{hint}" if hint else "")
    )


def shortfalls(plan: MemoryPlan, host_free: float, gpu_free: float | None, margin: float = ADMIT_MARGIN) -> list[str]:
    """What the plan lacks on this machine (host RAM, GPU memory), as admission words it; empty if it fits."""
    problems = []
    if plan.host_per_host > host_free * (1 - margin):
        ranks = f" for the {plan.local_ranks} ranks on this host ({plan.host_total / GiB:.1f} GiB each)" \
            if plan.local_ranks > 1 else ""
        problems.append(f"host RAM: needs {plan.host_per_host / GiB:.1f} GiB{ranks}, "
                        f"{host_free / GiB:.1f} GiB available")
    if plan.gpu and plan.gpu_total > gpu_free * (1 - margin):
        problems.append(f"GPU memory: needs {plan.gpu_total / GiB:.1f} GiB, {gpu_free / GiB:.1f} GiB free")
    return problems


def longest_fitting_row(config, batch: int, seq: int, gpu_free: float, host_free: float, *,
                        mlp_tile_tokens: int | None = None, **kw) -> str | None:
    """For a refusal: the longest row, halving `seq` down to 1024 tokens, whose automatic plan
    (residency, activation offload, MLP tiles as the trainer would pick them) fits this machine,
    said as the setting to use; None if none does."""
    kw.setdefault("shapes", model_shapes(config))
    length = seq // 2
    while length >= 1024:
        kw_len = dict(kw, mlp_tile_tokens=mlp_tile(length, mlp_tile_tokens))
        resident, offload, lean = place_layers(config, batch, length, gpu_free, host_free=host_free, **kw_len)
        plan = estimate(config, batch, length, resident_layers=resident, offload_activations=offload,
                        lean_resident=lean, **kw_len)
        if not shortfalls(plan, host_free, gpu_free, ADMIT_MARGIN):
            return (f"max_seq_length={length} fits this machine ({counted(resident, 'layer')} resident on the GPU"
                    f"{' (lean)' if lean and resident else ''}, "
                    f"{counted(offload, 'layer input')} offloaded; {plan.host_per_host / GiB:.1f} GiB host, "
                    f"{plan.gpu_total / GiB:.1f} GiB GPU).")
        length //= 2
    return None
