"""plan_run: the planning sequence, written once (split -> placement -> estimate -> admission ->
step time), for the trainer, `hf-megatrain estimate` and `prepare()`.

What is decided here and nowhere else:
- the auto rules of the host memory modes: transient_grads and gpu_grad_layers on auto are weighed
  only where there is a machine to weigh them against (a GPU, its free memory and the host's), and
  transient_grads only where it is free of time (one process, no clipping), for every optimizer the
  engine runs (each steps a unit as its gradient lands); gpu_grad_layers for the optimizers that step
  tile by tile (AdamW and the elementwise sgd / adagrad / rmsprop), not Adafactor;
- data parallel x memory modes: residency is not combined with sharding (streamed, said in a note), the
  host memory modes are off; layer_major_accumulation, transient_grads, lean_streamed and
  gpu_grad_layers asked for with it are refused;
- transient_grads with micro-batches one at a time is refused;
- admission (the refusal's words, with the longest row that fits and each mode's cost), the
  allocator's advice, the step-time prediction and what lean_streamed taken on auto costs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import partial

from .admission import admit, allocator_advice
from .estimator import MemoryPlan, estimate, model_sizes, optimizer_state
from .machine import Machine, ranks_on_this_host
from .placement import StepSplit, longest_fitting_row, one_at_a_time, resolve_placement, split_step
from ..engine.config import EngineConfig
from ..errors import MegaTrainError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What the user asked for.

    engine: the EngineConfig as asked, "auto" fields None (arguments.engine_config, or the flags).
    batch x seq: rows per micro-batch as the loader gives them, and tokens per row.
    grad_accum: micro-batches per optimizer step; layer_major: layer_major_accumulation (None: auto).
    max_grad_norm: clipping (0: none). world_size / local_ranks: data-parallel ranks in all / on this
    host (None: all). peft_config: a LoRA run's adapters (a peft config, a dict of LoraConfig fields,
    inline JSON or a JSON file, as MegaTrainArguments.peft_config takes them; None: full fine-tuning):
    the plan's units then train only the adapters (model_sizes), the base is frozen (no
    step-time prediction yet).
    optimizer: every host optimizer steps during the backward (transient_grads), and all but Adafactor
    (whose state spans whole parameters) step tile by tile or a slice of each parameter, so the modes
    that need that (gpu_grad_layers, data parallel) are off or refused for Adafactor alone; optimizer and
    optim_args (TrainingArguments' spellings) say what state it keeps per parameter (optimizer_state).
    admit: check the plan against the machine (memory_check). suggest_row: a refusal also names the
    longest row that fits (mlp_tile_tokens: the tile as asked, for that search)."""
    engine: EngineConfig
    batch: int
    seq: int
    grad_accum: int = 1
    layer_major: bool | None = None
    max_grad_norm: float = 1.0
    world_size: int = 1
    local_ranks: int | None = None
    peft_config: object | None = None
    admit: bool = True
    suggest_row: bool = True
    mlp_tile_tokens: int | None = None
    optimizer: str = "adamw"  # what steps the run: "adamw" or one of engine.host_optim.PARAM_OPTIMS
    optim_args: str | None = None  # TrainingArguments.optim_args for it ("momentum=0.9,nesterov=True")

    def __post_init__(self):  # a PeftModel's own peft_config (adapter name -> config): its adapter's
        object.__setattr__(self, "peft_config", planned_adapters(self.peft_config))

    @property
    def optimizer_state(self):
        """What the optimizer keeps per parameter (estimator.optimizer_state: AdamW's moments, or the
        state of the class Trainer builds for `optimizer` and `optim_args`)."""
        return optimizer_state(self.optimizer, None if self.optimizer == "adamw" else self.optim_args)

    @property
    def lora(self) -> bool:
        return self.peft_config is not None

    @property
    def clip(self) -> bool:
        return bool(self.max_grad_norm) and self.max_grad_norm > 0


@dataclass
class RunPlan:
    """What plan_run settled: the EngineConfig to build (every placement a number), how a step runs
    (each loader micro-batch cut into `split` chunks of `rows` rows; `per_pass` of them through each
    layer in one pass, 1: one at a time), the memory plan, the step-time prediction (a GPU run of one
    process, full fine-tuning), the refusal (admission's words) or None, and the lines to log."""
    engine: EngineConfig
    split: int
    per_pass: int
    rows: int
    memory: MemoryPlan
    placement_planned: bool
    step: StepSplit
    step_time: object | None = None
    refusal: str | None = None
    notes: list = field(default_factory=list)  # INFO
    warnings: list = field(default_factory=list)  # WARNING

    def summary(self) -> dict:
        """What must agree between the trainer, estimate and prepare() for one request."""
        return {"engine": self.engine, "split": self.split, "per_pass": self.per_pass, "rows": self.rows,
                "host": dict(self.memory.host), "gpu": dict(self.memory.gpu), "refusal": self.refusal}


LONG_CONTEXT_TOKENS = 65536  # the trainer's: from here on a refusal names the longest row that fits


def planned_adapters(peft_config=None, model=None):
    """The adapters a run trains, for Request.peft_config: `peft_config` as given (args.peft_config),
    else the config of a PEFT `model`'s adapter; None for a full fine-tune."""
    if peft_config is None:
        peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config and all(hasattr(v, "peft_type") for v in peft_config.values()):
        # a PeftModel's own: adapter name -> config; the active one
        active = getattr(model, "active_adapter", None)
        return peft_config.get(active if isinstance(active, str) else "default") or next(iter(peft_config.values()))
    return peft_config or None


def request_from_arguments(args, device, lora: bool = False, model=None, optimizer: str = "adamw") -> Request:
    """The Request that MegaTrainArguments make on `device` (arguments.engine_config: autos None).
    lora: the run trains adapters, args.peft_config's or those of the PEFT `model` (planned_adapters)."""
    from ..arguments import engine_config
    from ..engine.config import parse_switch

    tokens = args.per_device_train_batch_size * args.max_seq_length
    return Request(engine_config(args, device), args.per_device_train_batch_size, args.max_seq_length,
                   grad_accum=args.gradient_accumulation_steps,
                   layer_major=parse_switch(args.layer_major_accumulation, "layer_major_accumulation"),
                   max_grad_norm=args.max_grad_norm or 0.0, world_size=args.world_size,
                   local_ranks=ranks_on_this_host(args.world_size),
                   peft_config=planned_adapters(args.peft_config, model) if lora else None, admit=bool(args.memory_check),
                   suggest_row=args.world_size == 1 and tokens >= LONG_CONTEXT_TOKENS,
                   mlp_tile_tokens=args.mlp_tile_tokens, optimizer=optimizer,
                   optim_args=None if optimizer == "adamw" else args.optim_args)


def settle_autos(engine: EngineConfig, request: Request, machine: Machine) -> EngineConfig:
    """The auto rules of the host memory modes, once: with nothing to weigh them against (no GPU, no
    free memory given, data parallel), they are off; transient_grads on auto is offered only where
    it costs no pass (no clipping); with transient_grads no gradient persists to keep on the GPU, and
    Adafactor cannot step a gradient kept there (it comes over in tiles that cut parameters).
    Data parallel streams every layer (residency is not combined with sharding yet)."""
    cuda = engine.device.type == "cuda"
    weighed = cuda and request.world_size <= 1 and machine.gpu_free is not None and machine.host_free is not None
    fields = {}
    if request.world_size > 1:  # each rank holds a slice of the fp32 state: every layer streams, modes off
        fields.update(resident_layers=0, lean_resident=False, lean_streamed=False, transient_grads=False,
                      gpu_grad_layers=0)
    if engine.transient_grads and engine.gpu_grad_layers is None:
        fields["gpu_grad_layers"] = 0  # no gradient persists to be placed
    if not request.optimizer_state.sliceable and engine.gpu_grad_layers is None:  # Adafactor: whole parameters
        fields["gpu_grad_layers"] = 0
    if engine.transient_grads is None and not (weighed and not request.clip):
        fields["transient_grads"] = False
    if engine.gpu_grad_layers is None and not weighed:
        fields["gpu_grad_layers"] = 0
    if engine.lean_streamed is None and not weighed:
        fields["lean_streamed"] = False
    if not cuda or machine.gpu_free is None:  # no GPU to place for: what is not given stays off
        fields.update(resident_layers=fields.get("resident_layers", engine.resident_layers) or 0,
                      offload_activations=engine.offload_activations or 0,
                      lean_resident=bool(fields.get("lean_resident", engine.lean_resident)))
    return replace(engine, **fields) if fields else engine


def refuse_data_parallel(request: Request) -> None:
    """The memory modes data parallel does not combine with yet, asked for explicitly: refused."""
    if request.world_size <= 1:
        return
    if request.layer_major:
        raise MegaTrainError("layer_major_accumulation is not combined with data parallel yet; leave it on auto.")
    if request.engine.transient_grads:
        raise MegaTrainError("transient_grads is not combined with data parallel yet: the ranks' gradients "
                             "are summed before each step; leave it off.")
    if request.engine.lean_streamed:
        raise MegaTrainError("lean_streamed is not combined with data parallel yet: each rank holds only a "
                             "slice of the fp32 master, which therefore cannot be what streams; leave it off.")
    if request.engine.gpu_grad_layers:
        raise MegaTrainError("gpu_grad_layers is not combined with data parallel yet: each rank keeps a slice of "
                             "the gradients on the host; leave it on auto.")


def plan_run(model_config, request: Request, machine: Machine | None = None) -> RunPlan:
    """The plan for `request` on `machine` (default: nothing known, so nothing auto is weighed and
    nothing is admitted). Raises MegaTrainError for a request that cannot run whatever the machine
    (a mode refused with data parallel or with accumulation one at a time); a plan that does not fit
    comes back with `refusal` set."""
    machine = machine or Machine()
    refuse_data_parallel(request)
    if request.optimizer != "adamw":
        from ..engine.host_optim import unsupported_modes

        why = unsupported_modes(request.optimizer, world_size=request.world_size,
                                gpu_grad_layers=request.engine.gpu_grad_layers or 0)
        if why is not None:
            raise MegaTrainError(why)
    notes: list = []
    if request.engine.transient_grads and request.clip:
        notes.append(f"transient_grads with clipping (max_grad_norm={request.max_grad_norm:g}): each step first "
                     "measures the global gradient norm with a forward and backward of its own, then steps each "
                     "layer, clipped, as its gradient lands: exact, for one more forward and backward per step")
    if request.world_size > 1 and request.engine.resident_layers:
        notes.append("data parallel: GPU residency is not combined with sharding yet; streaming all layers")
    engine = settle_autos(request.engine, request, machine)
    world, ga = max(1, request.world_size), request.grad_accum
    local = request.local_ranks
    ranks = dict(world_size=world, local_ranks=local)
    cuda = engine.device.type == "cuda"
    sizes = model_sizes(model_config, request.peft_config)
    opt = request.optimizer_state
    if world > 1:  # data parallel runs its micro-batches one at a time, as asked
        step = StepSplit(1, 1, resolve_placement(
            model_config, request.batch, request.seq, engine, gpu_free=machine.gpu_free, host_free=machine.host_free,
            later_contributions=one_at_a_time(ga), sizes=sizes, optimizer=opt, **ranks))
    else:
        asked = request.layer_major
        if asked is None and cuda and (machine.gpu_free is None or machine.host_free is None):
            asked = False  # auto weighs the machine: with none given, as asked
        step = split_step(model_config, request.batch, request.seq, engine, ga, asked=asked,
                                 gpu_free=machine.gpu_free, host_free=machine.host_free, sizes=sizes, optimizer=opt)
        if step.per_pass > 1 or step.split > 1:
            notes.append(f"step: {step.describe(request.batch, ga)}")
        if step.placement.engine.transient_grads and one_at_a_time(ga, step.split, step.per_pass):
            raise MegaTrainError("transient_grads with gradient accumulation needs a step's micro-batches "
                                 "through each layer together (a unit's gradient has no buffer to be added "
                                 "to): set layer_major_accumulation=true, or leave transient_grads off.")
    placement, rows = step.placement, request.batch // step.split
    later = one_at_a_time(ga, step.split, step.per_pass)
    plan = estimate(model_config, rows, request.seq, placement.engine, sizes=sizes,
                           micro_batches=step.per_pass, later_contributions=later, optimizer=opt, **ranks)
    n = ga * step.split
    timed = dict(micro_batches=n, together=step.per_pass > 1 or n == 1, clip=request.clip, sizes=sizes,
                 optimizer=opt)
    run = RunPlan(placement.engine, step.split, step.per_pass, rows, plan, placement.planned, step, notes=notes)
    if cuda and world == 1 and not request.lora:
        try:  # a diagnostic: a config it cannot read costs the prediction, never the run
            from .steptime import lean_verdict, predict, routed_per_layer

            model_step = partial(predict, model_config, rows, request.seq, rates=machine.planning_rates(),
                                 routed=routed_per_layer(model_config), **timed)
            run.step_time = model_step(engine=placement.engine)
            notes.append(f"step-time model: {run.step_time.describe()}")
            if placement.engine.lean_streamed and request.engine.lean_streamed is None:  # taken on auto: its cost
                without = model_step(engine=replace(placement.engine, lean_streamed=False))
                notes.append(f"lean_streamed: {lean_verdict(run.step_time, without)}")
        except Exception as e:  # noqa: BLE001
            run.warnings.append(f"step-time model unavailable for this model ({type(e).__name__}: {e})")
    if request.admit:  # (after the step time: a refusal naming another optimizer compares the two)
        run.refusal = _admission(model_config, request, machine, run, timed, ranks)
    if cuda and machine.gpu_free is not None:
        advice = allocator_advice(plan, machine.gpu_free)
        if advice:
            run.warnings.append(advice)
    return run


# What a host-RAM refusal offers in place of the optimizer asked for, where it keeps less: Adafactor
# (Trainer's: factored second moment, no first moment). Plain SGD keeps nothing at all, but hardly less
# than Adafactor, and planning each costs a refusal a whole plan: SGD is not offered.
LEANER_OPTIMIZERS = ("adafactor",)


def leaner_optimizers(model_config, request: Request, machine: Machine, run: RunPlan) -> list:
    """For a host-RAM refusal: [(optim, its RunPlan)] for each of LEANER_OPTIMIZERS that keeps less state
    per parameter than the optimizer asked for, the run planned again with it (Trainer's defaults for it,
    everything else as asked; a mode it does not combine with, asked for, leaves it out)."""
    mine = request.optimizer_state.per_parameter()
    out = []
    for name in LEANER_OPTIMIZERS:
        if name == request.optimizer or optimizer_state(name).per_parameter() >= mine:
            continue
        try:
            out.append((name, plan_run(model_config, replace(request, optimizer=name, optim_args=None, admit=False,
                                                             suggest_row=False), machine)))
        except MegaTrainError:
            continue
    return out


def _admission(model_config, request: Request, machine: Machine, run: RunPlan, timed: dict, ranks: dict):
    """Admission's refusal of `run` on `machine`, in its words, or None when it fits."""
    cuda = run.engine.device.type == "cuda"
    hint = cost = None
    if cuda and request.suggest_row:  # the longest row that would fit
        hint = partial(longest_fitting_row, model_config, run.rows, request.seq, engine=request.engine,
                       mlp_tile_tokens=request.mlp_tile_tokens, micro_batches=run.per_pass,
                       sizes=timed["sizes"], **ranks)
    if cuda and ranks["world_size"] == 1:  # a refusal naming a memory mode says what it costs
        from .steptime import mode_cost

        cost = mode_cost(model_config, run.rows, request.seq, run.engine, machine.planning_rates(), **timed)

    def optimizers():  # [(optim, memory plan, the step time's words or "")], asked only on a host refusal
        from .steptime import compared

        return [(name, other.memory, compared(other.step_time, run.step_time, f"with optim={request.optimizer}")
                 if other.step_time is not None and run.step_time is not None else "")
                for name, other in leaner_optimizers(model_config, request, machine, run)]

    unknown = float("inf")  # what is not known of the machine is not checked
    try:
        admit(run.memory, host_free=unknown if machine.host_free is None else machine.host_free,
                     gpu_free=unknown if machine.gpu_free is None else machine.gpu_free, hint=hint,
                     residency_planned=run.placement_planned or not cuda,  # no GPU: no layers to keep there
                     step_cost=cost, optimizer=timed["optimizer"], optimizers=optimizers)
    except MegaTrainError as e:
        return str(e)
    return None
