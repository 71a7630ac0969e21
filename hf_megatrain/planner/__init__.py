"""The planner: what a run needs, where each layer lives, whether it fits, how long a step takes.

One entry, `plan_run(model_config, request, machine) -> RunPlan`, that the trainer, `hf-megatrain
estimate` and `prepare()` call: the request is what the user asked (the autos, world size,
accumulation, clipping, LoRA), the machine what it has (free host and GPU memory and rates,
measured or given). Every auto rule and every data-parallel x mode refusal is settled there.

The parts it runs on still live at their first homes (`memory.py`: estimate, placement search,
admission, the machine's free memory; `steptime.py`; `probe.py`), re-exported here.
"""

from ..memory import (GiB, MemoryPlan, Placement, Shapes, StepSplit, admit, estimate, gpu_available,  # noqa: F401
                      host_available, model_shapes, resolve_placement, shortfalls, split_step)
from ..steptime import StepTime, predict  # noqa: F401
from .run import (LONG_CONTEXT_TOKENS, Machine, Request, RunPlan, plan_run, planned_adapters,  # noqa: F401
                  request_from_arguments)
