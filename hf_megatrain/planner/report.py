"""A RunPlan in words: what `hf-megatrain estimate` prints (a table, or JSON), rendered from the plan
that plan_run made, with the memory modes at its placement priced beside it."""

from __future__ import annotations

from .admission import shortfalls
from .estimator import GiB, mode_plans, model_sizes, optimizer_state, state_bytes_per_parameter
from .placement import one_at_a_time
from .run import Machine, Request, RunPlan


def verdict(request: Request, run: RunPlan) -> str | None:
    """None where nothing was admitted; "fits"; else the refusal's first line, what would fit, and
    the longest row that fits if one does."""
    if not request.admit:
        return None
    if run.refusal is None:
        return "fits"
    lines = run.refusal.splitlines()
    return lines[0] + "".join(f"\n{ln}" for ln in lines[1:] if ln.startswith(("max_seq_length=", "Would fit with:", "With optim=")))


# Optimizers priced beside the one asked for, in the modes table: Adafactor (the leanest that keeps a
# second moment), and AdamW where another was asked; every memory mode of each (all of them step a
# transient gradient as it lands), labelled "optim=NAME[ + mode]".
ALTERNATIVE_OPTIMIZERS = ("adafactor", "adamw")


def mode_rows(model_config, request: Request, run: RunPlan, machine: Machine) -> list[dict]:
    """Each memory mode at the plan's placement, for the optimizer asked for and for the alternatives
    (ALTERNATIVE_OPTIMIZERS, Trainer's defaults): bytes per parameter, host and GPU GiB, the step-time
    model's seconds, and whether it fits the machine's host (None: no host given). Only where a step
    time is predicted (a GPU run of one process)."""
    if run.step_time is None:
        return []
    rows = _optimizer_rows(model_config, request, run, machine, request.optimizer_state, "")
    for name in ALTERNATIVE_OPTIMIZERS:
        if name != request.optimizer:
            rows += _optimizer_rows(model_config, request, run, machine, optimizer_state(name), f"optim={name}")
    return rows


def _optimizer_rows(model_config, request: Request, run: RunPlan, machine: Machine, opt, label: str) -> list[dict]:
    """mode_rows' rows of one optimizer: each memory mode (label: "" for the one asked for, whose rows are
    named by their mode alone; "optim=NAME" for an alternative)."""
    from .steptime import norm_pass, predict, routed_per_layer

    sizes, ga, clip = model_sizes(model_config, request.peft_config), request.grad_accum, request.clip
    n = ga * run.split
    routed = routed_per_layer(model_config)
    later = one_at_a_time(ga, run.split, run.per_pass)
    rows = []
    for name, eng, plan in mode_plans(model_config, run.rows, request.seq, run.engine, sizes=sizes,
                                      micro_batches=run.per_pass, later_contributions=later, optimizer=opt):
        if label:
            name = label if name == "default" else f"{label} + {name}"
        step = predict(model_config, run.rows, request.seq, eng, machine.planning_rates(), micro_batches=n,
                       together=run.per_pass > 1 or n == 1, clip=clip, sizes=sizes, routed=routed, optimizer=opt)
        fits = None if machine.host_free is None else \
            not shortfalls(plan, machine.host_free, machine.gpu_free or float("inf"))
        rows.append(dict(mode=name, optimizer=opt.name, state_bytes_per_parameter=round(state_bytes_per_parameter(plan,
                                                                                                   sizes.params), 2),
                         host_gib=round(plan.host_per_host / GiB, 1), gpu_gib=round(plan.gpu_total / GiB, 1),
                         step_s=round(step.step_s, 2), clipping=clip, norm_pass=norm_pass(eng, clip), fits=fits))
    return rows


def as_dict(request: Request, run: RunPlan, modes: list[dict]) -> dict:
    """The numbers `estimate --json` prints."""
    return {**run.memory.as_dict(), "verdict": verdict(request, run), "rows_per_micro_batch": run.rows,
            "micro_batches": request.grad_accum * run.split, "together": run.per_pass > 1,
            "step_time": run.step_time.as_dict() if run.step_time else None, "modes": modes}


def as_text(name: str, model_config, request: Request, run: RunPlan, machine: Machine, modes: list[dict]) -> str:
    """What `estimate` prints: the run in one line, the memory table, the step time, the modes, the verdict."""
    import torch

    from ..errors import counted, parameter_count
    from .steptime import norm_pass

    plan, engine = run.memory, run.engine
    dtype = str(torch.empty(0, dtype=engine.compute_dtype).dtype).replace("torch.", "")
    sizes = model_sizes(model_config, request.peft_config)
    lora = f" (LoRA: {parameter_count(sum(u.n_train for u in sizes.units))} trained)" if request.lora else ""
    out = [f"{name}: {parameter_count(sizes.params)} parameters{lora}, "
           f"{run.rows} x {request.seq} tokens per micro-batch, "
           f"{run.step.describe(request.batch, request.grad_accum)}, "
           f"{dtype} compute, {counted(plan.resident_layers, 'layer')} resident on the GPU"
           f"{' (lean)' if engine.lean_resident and plan.resident_layers else ''}, "
           f"{counted(plan.offload_activations, 'layer input')} offloaded"
           + ("" if request.optimizer_state.adamw else f", optim={request.optimizer}"
              + (f" ({request.optimizer_state.settings})" if request.optimizer_state.settings else "")) + "\n",
           plan.table()]
    if run.step_time is not None:
        clipping = f"clipping at {request.max_grad_norm:g}" if request.clip else "no clipping"
        if norm_pass(engine, request.clip):
            clipping += " through a norm pass, transient_grads"
        out.append(f"\nstep time (model, {clipping}): {run.step_time.describe()}")
    if modes:
        here = " on this host" if machine.host_free is not None else ""
        w = max(32, *(len(m["mode"]) for m in modes))  # an alternative optimizer's label with its mode is longer
        out.append(f"\n{'memory modes at this placement':{w + 2}} {'host B/param':>13} {'host GiB':>9} {'GPU GiB':>8} "
                   f"{'step s (model)':>14} {'clipping':16}{here}")
        for m in modes:
            clip = "norm pass first" if m["norm_pass"] else "after backward" if m["clipping"] else "none"
            here = "" if m["fits"] is None else f" {'fits' if m['fits'] else 'short'}"
            out.append(f"  {m['mode']:{w}} {m['state_bytes_per_parameter']:13.1f} {m['host_gib']:9.1f} "
                       f"{m['gpu_gib']:8.1f} {m['step_s']:14.2f} {clip:16}{here}")
    said = verdict(request, run)
    if said is not None:
        where = " + ".join(f"{v / GiB:g} GiB {k}" for k, v in (("GPU", machine.gpu_free), ("host", machine.host_free))
                           if v)
        out.append(f"\non {where}: {said}")
    return "\n".join(out)
