"""What this machine has now: available host RAM, free GPU memory, the ranks on this host; and
`Machine`, the planner's input (measured, capped by the user, or given by `estimate`'s flags).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import MegaTrainError
from .estimator import GiB

def ranks_on_this_host(world_size: int) -> int:
    """How many ranks of a data-parallel run share this host: LOCAL_WORLD_SIZE, which torchrun and
    accelerate set; all of them when it is unset (the cautious guess)."""
    if world_size <= 1:
        return 1
    return max(1, min(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), world_size))


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


@dataclass(frozen=True)
class Machine:
    """What the machine has: free GPU and available host bytes (None: not known, so nothing auto is
    weighed against it and admission does not check it), and the rates the step-time model runs on
    (None: the cached probe of this GPU, else the reference rates)."""
    gpu_free: float | None = None
    host_free: float | None = None
    rates: object | None = None

    @classmethod
    def measured(cls, device, *, max_gpu_memory: float | None = None, max_host_memory: float | None = None,
                 rates=None) -> "Machine":
        """This machine now (the GPU's free memory on a GPU run only), each capped where a cap is given,
        in GiB (MegaTrainArguments.max_gpu_memory / max_host_memory: a shared card, or planning for a
        smaller one)."""
        import torch

        for name, cap in (("max_gpu_memory", max_gpu_memory), ("max_host_memory", max_host_memory)):
            if cap is not None and not cap > 0:
                raise MegaTrainError(f"{name} is a number of GiB greater than 0, not {cap!r}.")
        device = torch.device(device)
        gpu = gpu_available(device) if device.type == "cuda" else None
        host = host_available()
        if max_gpu_memory is not None and gpu is not None:
            gpu = min(gpu, max_gpu_memory * GiB)
        if max_host_memory is not None:
            host = min(host, max_host_memory * GiB)
        return cls(gpu, host, rates)

    def planning_rates(self):
        if self.rates is not None:
            return self.rates
        from .probe import rates_for_planning

        return rates_for_planning()
