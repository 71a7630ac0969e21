"""What a run needs, component by component: `estimate(config, batch, seq)` returns host RAM and GPU
memory from the same layout the engine builds (units, flat buffers, ring slots, activations, loss
chunk), and `model_sizes` the parameter counts per unit (a meta build of the model, once per config).

Per parameter on the host: fp32 master 4 B, bf16 compute copy 2 B (0 in fp32 mode: the master
streams), fp32 gradient 4 B, Adam moments 8 B: 18 B, i.e. 1.26 TB for a 70B model; 16 B with
lean_streamed (the master streams and the GPU casts it). A resident parameter costs the same on the
GPU, or 16 B when lean (no compute copy; cast per use).

Data parallel over W ranks (engine/distributed.py): each rank holds the whole compute copy but
only 1/W of the master, gradient and moments, so the host entries are per rank, and a host
running L of the ranks needs L times their total; that per-host figure is what admission checks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging

from collections import OrderedDict
from dataclasses import dataclass, field, replace

from ..engine.config import EngineConfig
from .layout_cache import cached_units, config_key
from ..engine.layout import (GRAD_LANDING_BUFFERS, LOSS_CHUNK_COPIES, TRANSIENT_GRAD_BUFFERS, config_units,
                             LANDING_TILE, PARAM_STEP_TILE, fixed_buffer_numel, grad_slot_numel, loss_chunk, mark_resident,
                             ring_numel, slab_numel)


logger = logging.getLogger(__name__)

GiB = 1024**3


# Fixed costs of torch + CUDA context + libraries, host and GPU (measured on the device: BENCHMARKS.md,
# "Measurements the code's defaults rest on").
HOST_RUNTIME = 3.0 * GiB


GPU_RUNTIME = 1.0 * GiB


@dataclass
class ModelSizes:
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
    # Gemma 3n/4 (engine/per_layer.py): the per-layer unit's parameters, the width of the per-layer inputs it makes
    # per token (layers x hidden_size_per_layer_input), the [tokens, hidden] tensors a layer's input holds (AltUp's
    # 4), and the width per token of the keys and values KV sharing keeps for the step (keys and values, each kind)
    per_layer: int = 0
    per_layer_width: int = 0
    streams: int = 1
    shared_kv_width: int = 0
    # GLM-5 (engine/carried.py): the top-k token indices each layer with an indexer of its own hands on, kept for the
    # step (the recompute gets what its forward got): (such layers, top-k per token), int32 as the indexer casts them
    carried_layers: int = 0
    carried_topk: int = 0


_UNITS: OrderedDict = OrderedDict()  # config's contents -> its units (a meta build each: ~0.1-0.3 s)


_UNITS_KEPT = 8


_config_key = config_key  # what a config's units depend on (None: not memoized)


def config_units_memo(config) -> list:
    """engine.layout.config_units(config), built on the meta device once per config's contents
    (the planner's search asks for the same config's units hundreds of times). Each call returns
    fresh Unit objects (shallow copies: mark_resident sets flags on them, the slots are shared and
    never written), so a caller that marks them marks only its own."""
    return _memoized(_config_key(config), lambda: config_units(config))


def _memoized(key, build) -> list:
    """Fresh copies of the units `build()` makes, kept under `key` (the last _UNITS_KEPT keys; None:
    not kept, built each time), and on disk for the next process (layout_cache)."""
    units = _UNITS.get(key) if key is not None else None
    if units is None:
        units = cached_units(key, build)
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
    from ..checkpoint.loading import peft_config_from

    peft_config = peft_config_from(peft_config)
    base, adapters = _config_key(config), _adapters_key(peft_config)
    key = ("adapters", base, adapters) if base is not None and adapters is not None else None
    return _memoized(key, lambda: _adapter_units(config, peft_config))


def _adapter_units(config, peft_config) -> list:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from ..engine.prompts import attached, prompt_encoder
    from ..engine.store import build_units
    from ..errors import MegaTrainError
    from ..patcher.adapters import for_layout
    from ..patcher.specs import spec_for

    with torch.device("meta"):
        # a copy: building a model settles attributes on its config (the attention choice)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
        try:
            peft_model = get_peft_model(model, for_layout(peft_config))
        except (ValueError, TypeError, KeyError) as e:
            text = " ".join(str(e).split())
            raise MegaTrainError(f"peft_config does not fit this {config.model_type} model: {text}; fix "
                                 "target_modules (or the other fields named).") from e
    model = peft_model.get_base_model()
    # a prompt-learning adapter's encoder is part of the embedding unit, as the engine lays it out (engine/prompts.py):
    # with prefix_projection on a 70B shape it is most of a billion trainable parameters
    prompt, spec = prompt_encoder(peft_model), spec_for(config)
    if prompt:
        spec = dataclasses.replace(spec, prompt=prompt.path)
    with attached(model, prompt.module, prompt.path) if prompt else contextlib.nullcontext():
        return build_units(model, spec, [n for n, _ in model.named_parameters()])


def copy_units(units) -> list:
    """Units of one's own to mark (mark_resident), sharing the slot lists that nothing writes. (A bare
    __dict__ copy: copy.copy's generic path was most of a 70B plan's 1,400 estimates.)"""
    out = []
    for u in units:
        twin = object.__new__(type(u))
        twin.__dict__.update(u.__dict__)
        out.append(twin)
    return out


def model_sizes(config, peft_config=None) -> ModelSizes:
    """Parameter counts per unit, laid out as the engine lays them out (engine.layout.config_units:
    a meta copy of the model, no memory, built once per config: config_units_memo), plus the widths
    the activation terms need. The units are the caller's own. peft_config: a LoRA run's adapters
    (adapter_units_memo): the units' trainable part (n_train) is then the adapters alone."""
    units = config_units_memo(config) if peft_config is None else adapter_units_memo(config, peft_config)
    h = config.hidden_size
    # a stack without attention (Mamba) has no heads; GPT-J and CodeGen name theirs n_head
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 0
    kv = max(_kv_widths(config, heads), default=0)
    layers = [u for u in units if u.kind == "layer"]
    return ModelSizes(params=sum(u.numel for u in units), embed=units[0].numel, head=units[-1].numel,
                  layer=max((u.numel for u in layers), default=0), layers=len(layers), hidden=h,
                  inter=_mlp_width(config), vocab=config.vocab_size, kv_dim=kv,
                  tied=units[-1].tied_local is not None, units=units, **_side_sizes(config, units, heads))


def _kv_widths(config, heads: int) -> list[int]:
    """Each layer's key (or value) width, key/value heads x head_dim: one for the whole stack, or per layer where the
    config varies them (Gemma 4's per_layer_config: its full-attention layers' own head_dim and key/value heads,
    which the config refuses to read as one global)."""
    per_layer = getattr(config, "per_layer_config", None)
    if per_layer is not None and getattr(config, "per_layer_attributes", None):
        out = []
        for i in range(config.num_hidden_layers):
            c = per_layer[i]
            out.append((getattr(c, "num_key_value_heads", None) or heads) * getattr(c, "head_dim", 0))
        return out
    h = config.hidden_size
    hd = getattr(config, "head_dim", None) or (h // heads if heads else 0)
    return [(getattr(config, "num_key_value_heads", None) or heads) * hd]


def _side_sizes(config, units, heads: int) -> dict:
    """ModelSizes' per-layer fields (Gemma 3n/4: engine/per_layer.py); {} for every other family."""
    out = {}
    per_layer = [u for u in units if u.kind == "per_layer"]
    if per_layer:
        out.update(per_layer=per_layer[0].numel,
                   per_layer_width=config.num_hidden_layers * config.hidden_size_per_layer_input)
    altup = getattr(config, "altup_num_inputs", None)
    if isinstance(altup, int) and altup > 1:
        out["streams"] = altup
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if shared:  # keys and values of one layer per kind (the last before the sharing ones), and their gradients
        widths = _kv_widths(config, heads)
        kinds = {getattr(config, "layer_types", [None] * len(widths))[i]: w for i, w in enumerate(widths)}
        out["shared_kv_width"] = 2 * sum(kinds.values())
    indexers = getattr(config, "indexer_types", None)
    topk = getattr(config, "index_topk", None)
    if isinstance(indexers, (list, tuple)) and isinstance(topk, int):  # GLM-5's carried top-k ("shared" reuse it)
        out.update(carried_layers=sum(t != "shared" for t in indexers[: config.num_hidden_layers]), carried_topk=topk)
    return out


# -- the optimizer's state ---------------------------------------------------------------------
# What each optimizer `optim` builds keeps per parameter, read from the installed classes' step code
# (torch 2.13 SGD / Adagrad / RMSprop, transformers 5.17 Adafactor; tests/unit/test_optimizer_plan.py
# checks the count against the state tensors the engine's optimizers really allocate):
# - AdamW (HostAdamW): exp_avg and exp_avg_sq, fp32, 8 B per parameter, in flat arenas per unit.
# - SGD: a momentum_buffer (4 B) only with momentum != 0; nothing otherwise.
# - Adagrad: `sum` (4 B), built at construction, and a 0-d fp32 `step` on the host per parameter.
# - RMSprop: `square_avg` (4 B), + `momentum_buffer` with momentum > 0, + `grad_avg` when centered,
#   and a 0-d fp32 `step` on the host per parameter.
# - Adafactor: a parameter of 2 or more dimensions keeps its second moment factored, the means over
#   its last dimension (shape[:-1]) and over its second-to-last (shape[:-2] + shape[-1:]); a 1-D one
#   keeps it whole (4 B); `exp_avg` (4 B) only with beta1 set (Trainer's `adafactor` leaves it None);
#   `RMS`, a 0-d fp32 tensor beside the parameter, and `step`, a Python int.
# SGD, Adagrad and RMSprop are elementwise: the engine steps them over flat pieces of each unit's slice
# (engine/host_optim.py), so their state shards under data parallel like AdamW's moments, and their step
# counters are one per piece, not per parameter.
# Their step allocates temporaries as large as what it steps (one tensor at a time on the host: torch
# takes its single-tensor path for CPU tensors; a piece of at most PARAM_STEP_TILE elements for the
# elementwise ones, a parameter for Adafactor): the weight-decay term `grad + wd * p` (counted whether or
# not weight decay is set: the decay group may have it), SGD's nesterov `grad + m * buf`, Adagrad's and
# RMSprop's `sqrt`, Adafactor's `grad**2 + eps` and then its `r x c` product or `-update` beside the
# update. On the GPU (resident units) torch's optimizers take the foreach path, whose temporaries span a
# whole parameter group (at most a unit); Adafactor's stay per parameter.


@dataclass(frozen=True)
class OptimizerState:
    """The state an optimizer keeps, by parameter shape (optimizer_state builds it from `optim`)."""
    name: str = "adamw"
    full: int = 2  # fp32 tensors as large as the parameter
    factored: bool = False  # Adafactor's second moment: row + column means of a >= 2-D parameter, else whole
    host_scalars: int = 0  # 0-d fp32 tensors per parameter kept on the host (torch's step counters)
    scalars: int = 0  # 0-d fp32 tensors per parameter kept beside it (Adafactor's RMS)
    scratch: int = 0  # temporaries as large as the parameter stepped (see above)
    foreach: bool = False  # on the GPU the temporaries span a parameter group (torch's foreach path)
    step_bytes: int = 28  # DRAM bytes per parameter its host step reads and writes (steptime: modelled)
    settings: str = ""  # what of optim / optim_args changes the state, in words ("momentum 0.9")
    keeps: str = "exp_avg, exp_avg_sq"  # its state tensors, in words

    @property
    def adamw(self) -> bool:
        return self.name == "adamw"

    @property
    def elementwise(self) -> bool:
        """A stock optimizer whose state and update are elementwise (sgd, adagrad, rmsprop): stepped in
        flat pieces, so its state shards and it steps tiles."""
        return not self.adamw and not self.factored and not self.scalars

    @property
    def sliceable(self) -> bool:
        """It steps a slice of a parameter: data parallel and gpu_grad_layers combine with it (all but
        Adafactor, whose factored moment and RMS span whole parameters)."""
        return self.adamw or self.elementwise

    def param_bytes(self, shape) -> int:
        """Bytes of one parameter's state beside it (its device), host step counters left out."""
        numel = 1
        for d in shape:
            numel *= d
        n = self.full * numel + self.scalars
        if self.factored:
            if len(shape) >= 2:
                rows, cols = numel // shape[-1], numel // shape[-2]
                n += rows + cols
            else:
                n += numel
        return 4 * n

    def unit_bytes(self, unit) -> int:
        """Bytes of a unit's state beside its master (its trainable parameters' state)."""
        if not self.factored and not self.scalars:
            return 4 * self.full * unit.n_train
        return sum(self.param_bytes(s.shape) for s in unit.train_slots)

    def host_scalar_bytes(self, units, world: int = 1) -> int:
        """Bytes of the 0-d step counters that stay on the host, resident or not: one per parameter, or
        per piece for the elementwise optimizers (the most a rank of `world` holds)."""
        if not self.host_scalars:
            return 0
        if self.elementwise:
            return 4 * self.host_scalars * sum(step_pieces(u, world)[0] for u in units)
        return 4 * self.host_scalars * sum(len(u.train_slots) for u in units)

    def scratch_bytes(self, units, gpu: bool = False, world: int = 1) -> int:
        """Temporaries of the largest step among `units`: the largest parameter's (the largest piece's for
        the elementwise optimizers), or on the GPU with foreach the largest unit's (0 for AdamW: torch's
        fused kernel keeps none)."""
        if not self.scratch or not units:
            return 0
        if gpu and self.foreach:
            return 4 * self.scratch * max(u.n_train for u in units)
        if self.elementwise:
            return 4 * self.scratch * max((step_pieces(u, world)[1] for u in units), default=0)
        return 4 * self.scratch * max((s.shape.numel() for u in units for s in u.train_slots), default=0)

    def per_parameter(self, shape=(4096, 4096)) -> float:
        """Bytes per parameter of the state of a parameter of `shape` (default a square matrix)."""
        numel = 1
        for d in shape:
            numel *= d
        return (self.param_bytes(shape) + 4 * self.host_scalars) / numel

    def describe(self) -> str:
        """The state in words, for the memory table's label."""
        return "Adam moments (fp32 x2)" if self.adamw else f"{self.name} state ({self.keeps})"


def step_pieces(unit, world: int = 1) -> tuple[int, int]:
    """(how many, the largest) of the pieces an elementwise optimizer steps of `unit` on the rank of `world`
    that holds the most (the first: ceil(n / world) elements): its decay and no-decay segments within that
    slice, cut into PARAM_STEP_TILE elements, or into landing tiles for a gradient kept on the GPU
    (HostParamOptimizer.piece_bounds). The planner's units do not carry Trainer's decay split (every
    parameter counts as decayed there): a unit of more than one trainable parameter is counted as two
    segments, as Trainer's grouping gives a decoder layer (its norms do not decay) and the head."""
    hi = min(_share(unit.n_train, world), unit.n_train)
    if not hi:
        return 0, 0
    size = LANDING_TILE if unit.grad_on_gpu else PARAM_STEP_TILE
    split = unit.n_decay if 0 < unit.n_decay < unit.n_train else None
    if split is None:
        count = -(-hi // size) + (len(unit.train_slots) > 1)
    else:
        count = -(-min(split, hi) // size) + (-(-(hi - split) // size) if hi > split else 0)
    return count, min(size, hi)


ADAMW = OptimizerState()
# The AdamW names of arguments.SUPPORTED_OPTIM (without importing TrainingArguments, seconds of an estimate)
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def optimizer_class(optim: str, optim_args: str | None = None):
    """(class, kwargs) that Trainer builds for `optim` and `optim_args` (what the trainer hands
    HostParamOptimizer), without a TrainingArguments: transformers' own handler for the name."""
    from types import SimpleNamespace

    from transformers import Trainer
    from transformers.training_args import OptimizerNames

    from ..errors import MegaTrainError

    args = SimpleNamespace(optim=OptimizerNames(optim), optim_args=optim_args, learning_rate=1e-3, adam_beta1=0.9,
                           adam_beta2=0.999, adam_epsilon=1e-8)
    try:
        return Trainer.get_optimizer_cls_and_kwargs(args)
    except ValueError as e:
        raise MegaTrainError(f"optim_args={optim_args!r} for optim={optim!r}: {e}; it takes key=value pairs "
                             "separated by commas, as TrainingArguments.optim_args") from None


@functools.lru_cache(maxsize=32)
def optimizer_state(optim: str = "adamw", optim_args: str | None = None) -> OptimizerState:
    """What `optim` (a TrainingArguments name; every AdamW variant the engine runs is HostAdamW) keeps
    per parameter with `optim_args`: the class Trainer builds, its defaults filled in as it fills them."""
    optim = str(getattr(optim, "value", optim))
    if optim == "adamw" or optim in ADAMW_OPTIMS:  # ("adamw": what checkpoints and Request call them all)
        return ADAMW
    from ..engine.host_optim import PARAM_OPTIMS
    from ..errors import MegaTrainError

    if optim not in PARAM_OPTIMS:
        raise MegaTrainError(f"optim={optim!r} is not one the engine runs: {', '.join(ADAMW_OPTIMS + PARAM_OPTIMS)}.")
    if not optim_args and optim in TRAINER_DEFAULTS:  # importing transformers' optimizers costs an estimate ~4 s
        return state_from_defaults(optim, TRAINER_DEFAULTS[optim])
    return state_of(optim, *optimizer_class(optim, optim_args))


# What the classes Trainer builds for each `optim` without optim_args fill in, as far as the state depends on
# it (torch's SGD and RMSprop: no momentum, not nesterov or centered; Adafactor: beta1 None); a test checks
# these against the installed classes (tests/unit/test_optimizer_plan.py).
TRAINER_DEFAULTS = {"sgd": dict(momentum=0.0, nesterov=False), "adagrad": {},
                    "rmsprop": dict(momentum=0.0, centered=False), "adafactor": dict(beta1=None)}


def state_of(optim: str, cls, kwargs: dict) -> OptimizerState:
    """What `cls(params, **kwargs)` keeps per parameter, for `optim` (one of engine.host_optim.PARAM_OPTIMS:
    the class Trainer builds for it), from the defaults the class fills in."""
    import torch

    return state_from_defaults(optim, cls([torch.zeros(1)], **kwargs).defaults)


def state_from_defaults(optim: str, d: dict) -> OptimizerState:
    """state_of's rules, from the class's filled-in defaults `d`."""
    if optim == "sgd":
        momentum, nesterov = bool(d["momentum"]), bool(d["nesterov"])
        return OptimizerState("sgd", full=int(momentum), scratch=1 + nesterov, foreach=True,
                              keeps="momentum_buffer" if momentum else "none",
                              step_bytes=12 + 20 * momentum + 12 * nesterov,
                              settings=f"momentum {d['momentum']:g}" * momentum + ", nesterov" * nesterov)
    if optim == "adagrad":
        return OptimizerState("adagrad", full=1, host_scalars=1, scratch=2, foreach=True, step_bytes=44, keeps="sum")
    if optim == "rmsprop":
        momentum, centered = d["momentum"] > 0, bool(d["centered"])
        return OptimizerState("rmsprop", full=1 + momentum + centered, host_scalars=1, scratch=2, foreach=True,
                              keeps=" + ".join(["square_avg"] + ["momentum_buffer"] * momentum + ["grad_avg"] * centered),
                              step_bytes=52 + 20 * momentum + 24 * centered,
                              settings=", ".join([f"momentum {d['momentum']:g}"] * momentum + ["centered"] * centered))
    beta1 = d["beta1"] is not None
    return OptimizerState("adafactor", full=int(beta1), factored=True, scalars=1, scratch=2,
                          keeps="factored second moment" + " + exp_avg" * beta1,
                          step_bytes=84 + 20 * beta1, settings=f"beta1 {d['beta1']:g}" if beta1 else "")


def _mlp_width(config) -> int:
    """The widest MLP intermediate of a layer (what one MLP tile's activations are sized by): the
    config's intermediate_size, else its MoE experts' or shared expert's, else GPT-J's n_inner (4 x
    hidden when unset)."""
    widths = [getattr(config, name, None) for name in
              ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "n_inner")]
    widths = [w for w in widths if isinstance(w, int) and w > 0]
    return max(widths) if widths else 4 * config.hidden_size


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
             local_ranks: int | None = None, sizes: ModelSizes | None = None, micro_batches: int = 1,
             later_contributions: bool = True, optimizer: OptimizerState | None = None,
             **engine_fields) -> MemoryPlan:
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
    The entries are one rank's; `host_per_host` is what this host needs for its ranks.
    optimizer: what steps the run (optimizer_state; default AdamW): its state by parameter shape, on
    the host for streamed units and on the GPU for resident ones, and its step's temporaries."""
    eng = planning_config(engine, **engine_fields)
    opt = optimizer or ADAMW
    s = sizes or model_sizes(config)
    cbytes = eng.compute_dtype.itemsize
    cuda = eng.device.type == "cuda"
    tokens = batch * seq
    world = max(1, world_size)
    # marked on a copy: the units handed in (sizes=) stay as they were. The placement is the engine's
    # as given (plan_run streams every layer under data parallel)
    units = copy_units(s.units)
    resident_layers = mark_resident(units, eng.resident_layers or 0, eng.lean_resident, eng.lean_streamed,
                                    eng.gpu_grad_layers if cuda else 0)
    offload = max(0, min(eng.offload_activations or 0, s.layers)) if cuda else 0
    layer_input = tokens * s.hidden * cbytes * s.streams  # one saved [batch, seq, hidden] layer input (AltUp: 4)
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
    lean_streamed = sum(u.numel for u in units if u.no_compute_copy and not u.resident)  # their fp32 master streams
    # (HostStore.aliased: fp32 compute, everything trained, one process)
    aliased = cbytes == 4 and world == 1 and all(u.n_train == u.numel for u in units)
    plan.host["compute copy (streamed)"] = 0 if aliased else cbytes * (streamed - lean_streamed)
    if cuda and cbytes == 2 and world == 1:  # what lean_streamed would take off (mark_resident's rule)
        plan.lean_streamed_saving = cbytes * sum(u.numel for u in units if u.kind == "layer" and not u.resident
                                                 and not u.no_compute_copy and u.n_train == u.numel)
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
            # (every host optimizer steps a transient gradient as it lands)
            plan.transient_saving = 4 * (owned - on_gpu_grads) - buffers \
                + (eng.staging_slabs * 4 * slab_numel(units) if later_contributions else 0)
    if opt.adamw:
        plan.host["Adam moments (fp32 x2)"] = 8 * owned
    else:  # step counters stay on the host; data parallel (elementwise only: plan_run refuses Adafactor)
        streamed_units = [u for u in units if not u.resident]  # shards it as it shards the master
        held = sum(opt.unit_bytes(u) for u in streamed_units) if world == 1 else 4 * opt.full * owned
        plan.host[f"optimizer state ({opt.name}: {opt.keeps})"] = held + opt.host_scalar_bytes(units, world)
        scratch = opt.scratch_bytes(streamed_units, world=world)
        if scratch:
            what = "largest piece" if opt.elementwise else "largest parameter"
            plan.host[f"optimizer step temporaries ({what})"] = scratch
    if world > 1:
        # Transient, one unit at a time: the all-gather of updated weights (own slice + the whole
        # unit, compute dtype) and, on a CPU, the gradient reduce-scatter on the host (an fp32 copy,
        # its padded copy, this rank's sum); the largest unit is usually the embedding.
        n = max(u.numel for u in units)
        gather = cbytes * (n + _share(n, world))
        reduce = 4 * (2 * n + _share(n, world)) if not cuda else 0
        plan.host["data-parallel exchange (one unit)"] = max(gather, reduce)
        state = "Adam moments" if opt.adamw else f"{opt.name} state" if opt.full else ""
        plan.notes.append(f"data parallel: {world} ranks, {plan.local_ranks} on this host; each rank holds the "
                          f"whole compute copy and 1/{world} of the fp32 master, gradient"
                          + (f" and {state}." if state else "."))
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
        plan.gpu["fp32 landing of a lean streamed layer"] = 4 * max(u.numel for u in units if u.no_compute_copy and not u.resident)
    plan.gpu["gradient ring (fp32)"] = eng.grad_slots * 4 * grad_slot_numel(units)
    if any(u.grad_on_gpu for u in units):
        plan.gpu["fp32 gradients of streamed layers (gpu_grad_layers)"] = \
            4 * sum(u.n_train for u in units if u.grad_on_gpu)
    lean_units = [u for u in units if u.no_compute_copy and u.resident]
    lean = sum(u.numel for u in lean_units)

    def state(group, per_trained):  # compute copy of every weight, fp32 state of the trained ones
        # (per_trained counts AdamW's 8 B of moments; another optimizer's state replaces them)
        return sum(cbytes * u.numel + (per_trained - 8) * u.n_train + opt.unit_bytes(u) for u in group)

    def lean_state(per_trained):  # a lean resident layer: no compute copy
        return sum((per_trained - 8) * u.n_train + opt.unit_bytes(u) for u in lean_units) \
            if not opt.adamw else per_trained * lean

    adam = "Adam" if opt.adamw else f"{opt.name} state"

    if eng.transient_grads and resident_layers:  # the resident layers share one gradient buffer
        full = [u for u in units if u.resident and u.kind == "layer" and not u.no_compute_copy]
        plan.gpu[f"resident units (weights, master, grad, {adam})"] = \
            state([u for u in units if u.resident and u.kind != "layer"], 16)
        if full:
            plan.gpu[f"resident layers (weights, master, {adam})"] = state(full, 12)
        if lean:
            plan.gpu[f"lean resident layers (master, {adam})"] = lean_state(12)
        plan.gpu["fp32 gradient of a resident layer (transient, shared)"] = \
            4 * max(u.n_train for u in units if u.resident and u.kind == "layer")
    elif lean:
        plan.gpu[f"resident units (weights, master, grad, {adam})"] = \
            state([u for u in units if u.resident and not u.no_compute_copy], 16)
        plan.gpu[f"lean resident layers (master, grad, {adam})"] = lean_state(16)
    else:
        plan.gpu[f"resident units (weights, master, grad, {adam})"] = state([u for u in units if u.resident], 16)
    plan.gpu["saved layer inputs"] = group * (s.layers - offload) * layer_input
    if s.per_layer_width:  # made once, read by every layer; their gradients fill in during the layers' backward
        plan.gpu["per-layer inputs and their gradients"] = 2 * group * tokens * s.per_layer_width * cbytes
    if s.shared_kv_width:  # the keys and values KV sharing hands the last layers, and the gradients they send back
        plan.gpu["shared keys/values and their gradients"] = 2 * group * tokens * s.shared_kv_width * cbytes
    if s.carried_layers:  # [batch, seq, min(top-k, seq)] int32 per layer that makes its own, kept for the recompute
        plan.gpu["carried top-k indices"] = group * tokens * min(s.carried_topk, seq) * 4 * s.carried_layers
    if offload:  # brought back ahead of need (engine.activations: the lookahead, plus the one in use)
        plan.gpu["offloaded inputs in flight"] = group * min(offload, eng.activation_lookahead + 1) * layer_input
    if group > 1 and slab_numel(units):  # a later micro-batch's weight gradient, before it joins the first's
        plan.gpu["gradient scratch (fp32, micro-batches together)"] = 4 * slab_numel(units)
    # The backward passes through three phases that never overlap; the GPU peak is the fixed part
    # plus the largest phase. Calibrated against measured peaks on the device (BENCHMARKS.md,
    # "Measurements the code's defaults rest on").
    head_w = s.vocab * s.hidden
    grad_x = group * tokens * s.hidden * cbytes * s.streams  # the gradients flowing down, alive in every phase
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
    if s.per_layer:  # its recompute: its flat fp32 gradient, autograd's dense one of the table (compute dtype) beside
        # it until it is copied in, the projection of the token embeddings with autograd
        plan.gpu["[per-layer embeddings] their gradient (fp32) + recompute"] = \
            (4 + cbytes) * s.per_layer + 3 * group * tokens * s.per_layer_width * cbytes + held + grad_x
    scratch = opt.scratch_bytes([u for u in units if u.resident and u.n_train], gpu=True)
    if scratch:  # a resident unit steps after the backward, or during it (beside the gradients flowing down)
        plan.gpu["[optimizer step] temporaries of a resident unit's step"] = scratch + grad_x + held
    plan.gpu["runtime (CUDA context, cuBLAS)"] = GPU_RUNTIME
    return plan


MODES = (("default", {}), ("lean_streamed", dict(lean_streamed=True)),
         ("lean_streamed + transient_grads", dict(lean_streamed=True, transient_grads=True)))


def state_bytes_per_parameter(plan: MemoryPlan, params: int) -> float:
    """Host bytes of the training state (master, compute copy, gradients, moments) per parameter."""
    keys = ("fp32 master", "compute copy", "fp32 gradient", "Adam moments", "optimizer state")
    return sum(v for k, v in plan.host.items() if k.startswith(keys)) / params  # a resident unit's is on the GPU


def mode_plans(config, batch: int, seq: int, engine: EngineConfig, *, sizes: ModelSizes | None = None,
               micro_batches: int = 1, later_contributions: bool = True,
               optimizer: OptimizerState | None = None) -> list[tuple[str, EngineConfig, MemoryPlan]]:
    """The plan of each memory mode (MODES) at `engine`'s placement: what `estimate` shows side by side
    (gradients kept on the GPU stay where they are, except with transient_grads, which keeps none).
    optimizer: what steps the run (default AdamW); Adafactor keeps no gradient on the GPU (its step needs
    whole parameters, and those come over in tiles)."""
    sizes = sizes or model_sizes(config)
    opt = optimizer or ADAMW
    out = []
    for name, fields in MODES:
        eng = mode_engine(engine, {"lean_streamed": False, "transient_grads": False, **fields,
                                   **({} if opt.sliceable else {"gpu_grad_layers": 0})})
        out.append((name, eng, estimate(config, batch, seq, eng, sizes=sizes, micro_batches=micro_batches,
                                        later_contributions=later_contributions, optimizer=opt)))
    return out


def _share(n: int, world: int) -> int:
    return -(-n // world)


def mlp_tile(seq: int, tile: int | None = None) -> int | None:
    """The MLP sequence tile: the one asked for, or 16K tokens once rows are long (> 32K tokens).

    Tiles cut along the sequence, so they only pay off for long rows; many short rows are
    better split into micro-batches than into thin slices.
    """
    return tile or (16384 if seq > 32768 else None)


def mode_engine(engine: EngineConfig, fields: dict) -> EngineConfig:
    """`engine` with a memory mode's fields (MODES). transient_grads keeps no gradient to place on the
    GPU, so gpu_grad_layers goes to 0 with it (EngineConfig refuses the two together)."""
    return replace(engine, **{**fields, **({"gpu_grad_layers": 0} if fields.get("transient_grads") else {})})
