"""Admission: compare a plan with what the machine has and refuse clearly, before running out,
listing what would make it fit (instead of letting the OOM killer end a run halfway through loading).
"""

from __future__ import annotations

import os
from dataclasses import replace


from .estimator import GiB, MemoryPlan
from .machine import gpu_available, host_available

ADMIT_MARGIN = 0.05  # what admission keeps free of the host's MemAvailable and the GPU's free memory


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


def admit(plan: MemoryPlan, *, host_free: float | None = None, gpu_free: float | None = None,
          margin: float = ADMIT_MARGIN, hint=None, residency_planned: bool = False, step_cost=None,
          optimizer=None, optimizers=None) -> None:
    """Raise MegaTrainError, with what would make it fit, if the plan exceeds the machine.

    hint: called with host_free= and gpu_free= only on a refusal, for one more line of advice (the
    trainer's: the longest row that fits, see longest_fitting_row).
    residency_planned: plan_placement chose the resident layers for this machine, as many as the
    GPU holds, so more of them is no advice to give.
    step_cost: called with a memory mode's EngineConfig fields only on a refusal that names the mode,
    for its speed cost in words (steptime.mode_cost: the step-time model with and without it).
    optimizer: what steps the run (estimator.optimizer_state; default AdamW), for the bytes per parameter
    a larger host needs. optimizers: called only on a host-RAM refusal, [(optim, its memory plan, its
    step time in words)] for optimizers that keep less state (run.leaner_optimizers): the first that
    fits is named with what it needs, else the leanest with what it would still need."""
    from ..errors import MegaTrainError

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
        named = optimizers() if optimizers is not None else []
        fitting = [o for o in named if not shortfalls(o[1], host_free, gpu_free, margin)]
        for name, other, timing in fitting[:1]:
            fixes.append(f"optim='{name}' (with optim={name} it needs {other.host_per_host / GiB:.1f} GiB of host "
                         f"RAM and {other.gpu_total / GiB:.1f} GiB of GPU memory{'; ' + timing if timing else ''}; "
                         f"its updates, not {'AdamW' if optimizer is None or optimizer.adamw else optimizer.name}'s)")
        if named and not fitting:  # the first of them, short too: how far
            name, other, _ = named[0]
            hint = (f"{hint}\n" if hint else "") + (f"With optim={name} it would need {other.host_per_host / GiB:.1f} "
                                                    f"GiB of host RAM, still short.")
        state = ("18 bytes per parameter: fp32 master, gradient and Adam states" if optimizer is None or optimizer.adamw
                 else f"{10 + optimizer.per_parameter():.2g} bytes per parameter: fp32 master, bf16 compute copy, "
                      f"fp32 gradient and {optimizer.name}'s {optimizer.per_parameter():.2g}")
        fixes += [f"a host with more RAM ({state})",
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
