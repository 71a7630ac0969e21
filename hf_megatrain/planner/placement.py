"""Where each layer lives and how a step is cut: the search that turns the "auto" placements and
memory modes into numbers (`resolve_placement`), and the step split (`split_step`: micro-batches
through each layer together, cut into chunks of rows where that fits). Each candidate is priced by
`estimate.estimate` and checked by `admission.shortfalls`, so what is placed is what is admitted.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import NamedTuple

from ..engine.config import EngineConfig
from ..errors import counted
from .admission import ADMIT_MARGIN, shortfalls
from .estimator import GiB, MemoryPlan, ModelSizes, estimate, mlp_tile, model_sizes, planning_config
from .machine import gpu_available, host_available

logger = logging.getLogger(__name__)

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
    sizes = kw.pop("sizes", None) or model_sizes(config)
    layers = sizes.layers
    budget = gpu_free * (1 - margin)

    def plan(n, off):
        return estimate(config, batch, seq, resident_layers=n, offload_activations=off, sizes=sizes, **kw)

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
                      later_contributions: bool = True, sizes: ModelSizes | None = None,
                      optimizer=None) -> Placement:
    """The engine config with 'auto' (None) placements replaced by the plan's numbers: the one
    place where the automatic placement is decided, for the trainer and `hf-megatrain estimate`.

    plan_run settles data parallel's modes first (every layer streams). Off a GPU nothing is placed.
    gpu_free: the GPU's free bytes (default: measured now); host_free: the host's available bytes,
    for moving layers onto the GPU when the host side would not fit, and for an 'auto' lean_streamed,
    taken only when the host side fits with it and not without (None: not considered; lean_streamed
    auto is then off); micro_batches: how many run through each layer together (estimate); sizes:
    model_sizes(config[, peft_config]), the units planned (a LoRA run's: its adapters train); optimizer:
    what steps the run (estimator.optimizer_state; default AdamW), whose state is what a layer costs."""
    resident, offload, lean = engine.resident_layers, engine.offload_activations, engine.lean_resident
    streamed = engine.lean_streamed
    planned = resident is None and engine.device.type == "cuda"
    if engine.device.type != "cuda":
        resident, offload, lean, streamed = resident or 0, offload or 0, bool(lean), bool(streamed)
    elif None in (resident, offload, lean, streamed, engine.transient_grads, engine.gpu_grad_layers):
        gpu_free = gpu_available(engine.device) if gpu_free is None else gpu_free
        ranks = dict(world_size=world_size, local_ranks=local_ranks, micro_batches=micro_batches,
                     later_contributions=later_contributions, sizes=sizes or model_sizes(config), optimizer=optimizer)

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
                if host_free is not None and not modes["transient_grads"]:
                    while grads < ranks["sizes"].layers - placed[0] and host_short(placed, modes, grads) \
                            and planned_with(placed, modes, grads + 1).gpu_total <= gpu_free * (1 - ADMIT_MARGIN):
                        grads += 1
            return placed, grads

        # The host memory modes left on auto, the cheapest first: none; transient_grads (free of time:
        # without clipping each unit is stepped as it lands anyway); lean_streamed (twice the PCIe bytes
        # of the streamed weights); both. The first whose host side fits; the plain one if none does.
        choices = [dict(transient_grads=t, lean_streamed=s)
                   for s in ([False, True] if streamed is None else [bool(streamed)])
                   for t in ([False, True] if engine.transient_grads is None else [bool(engine.transient_grads)])]
        if host_free is None:  # nothing to weigh them against: as asked, auto off
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
                    resident, counted(ranks["sizes"].layers, "layer"),
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


def one_at_a_time(ga: int, split: int = 1, per_pass: int = 1) -> bool:
    """A step's `ga` micro-batches (each cut into `split` chunks of rows) run one at a time rather
    than together, so a unit's gradient gets later contributions in a step: what `estimate`'s
    later_contributions asks (they cross PCIe through the pinned staging slabs)."""
    return ga * split > 1 and per_pass <= 1


class StepSplit(NamedTuple):
    split: int  # each micro-batch the loader gives is cut into this many chunks of rows
    per_pass: int  # chunks of a step through each layer in one pass (1: one micro-batch at a time)
    placement: Placement  # planned for that

    def describe(self, batch: int, ga: int) -> str:
        rows, n = batch // self.split, ga * self.split
        if n == 1:
            return "one micro-batch per step"
        how = "through each layer together" if self.per_pass > 1 else "one at a time"
        asked = f" (asked: {batch} x {ga})" if self.split > 1 else ""
        return f"micro-batches of {counted(rows, 'row')} x {n}{asked}, {how}"


def split_step(config, batch: int, seq: int, engine: EngineConfig, ga: int, *, asked: bool | None = None,
               splittable: bool | None = None, host_free: float | None = None,
               gpu_free: float | None = None, sizes: ModelSizes | None = None, optimizer=None) -> StepSplit:
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
    sizes, optimizer: as resolve_placement's."""
    sizes = sizes or model_sizes(config)
    if splittable is None:
        coef = getattr(config, "router_aux_loss_coef", 0) or getattr(config, "aux_loss_coef", 0)  # JetMoE's name
        splittable = not (getattr(config, "output_router_logits", False) and coef)

    def placed(rows, n=1, eng=engine):
        later = one_at_a_time(ga, per_pass=n)
        if later and eng.transient_grads is None:  # one micro-batch at a time: never exact
            eng = replace(eng, transient_grads=False)
        return resolve_placement(config, rows, seq, eng, host_free=host_free, gpu_free=gpu_free, micro_batches=n,
                                 later_contributions=later, sizes=sizes, optimizer=optimizer)

    cuda = engine.device.type == "cuda"
    if asked is False or (asked is None and not cuda) or (asked and ga < 2):
        return StepSplit(1, 1, placed(batch))
    if asked:
        return StepSplit(1, ga, placed(batch, ga))
    base = placed(batch)
    gpu_free = gpu_available(engine.device) if gpu_free is None else gpu_free
    host_free = host_available() if host_free is None else host_free

    def fits(placement, rows, n):
        plan = estimate(config, rows, seq, placement.engine, micro_batches=n, sizes=sizes,
                        later_contributions=one_at_a_time(ga, per_pass=n), optimizer=optimizer)
        return not shortfalls(plan, host_free, gpu_free)

    streams = base.engine.resident_layers < sizes.layers  # the units, not num_hidden_layers (LongCat-Flash)
    if fits(base, batch, 1) and (ga == 1 or not streams):
        return StepSplit(1, 1, base)  # nothing would cross PCIe per micro-batch: as asked
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
    return StepSplit(1, 1, base)


def longest_fitting_row(config, batch: int, seq: int, gpu_free: float, host_free: float, *,
                        mlp_tile_tokens: int | None = None, **kw) -> str | None:
    """For a refusal: the longest row, halving `seq` down to 1024 tokens, whose automatic plan
    (residency, activation offload, MLP tiles as the trainer would pick them) fits this machine,
    said as the setting to use; None if none does."""
    kw.setdefault("sizes", model_sizes(config))
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
