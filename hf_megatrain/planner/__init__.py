"""The planner: what a run needs, where each layer lives, whether it fits, how long a step takes.

One entry, `plan_run(model_config, request, machine) -> RunPlan`, that the trainer, `hf-megatrain
estimate` and `prepare()` call: the request is what the user asked (the autos, world size,
accumulation, clipping, LoRA), the machine what it has (free host and GPU memory and rates,
measured or given). Every auto rule and every data-parallel x mode refusal is settled there.

The parts, lowest first:
- `estimator`: what a run allocates on the host and the GPU, component by component, from the
  engine's own layout (a meta build of the model, once per config);
- `machine`: what this machine has (available host RAM, free GPU memory, ranks on this host) and
  `Machine`, the planner's input;
- `admission`: a plan against a machine, refused in words that say what would make it fit;
- `placement`: the search that turns the auto placements and memory modes into numbers, and the
  step split;
- `steptime` and `probe`: the step-time model and the rates it runs on (measured on the GPU box);
- `run`: `plan_run` itself, and `report`: `hf-megatrain estimate`'s rendering of a RunPlan.
"""

from .admission import admit, shortfalls  # noqa: F401
from .estimator import GiB, MemoryPlan, ModelSizes, estimate, model_sizes  # noqa: F401
from .machine import Machine, gpu_available, host_available  # noqa: F401
from .placement import Placement, StepSplit, resolve_placement, split_step  # noqa: F401
from .run import LONG_CONTEXT_TOKENS, Request, RunPlan, plan_run, planned_adapters, request_from_arguments  # noqa: F401
from .steptime import StepTime, predict  # noqa: F401
