"""This machine's rates, measured in seconds and cached: what the step-time model (steptime.py) runs on.

    hf-megatrain probe            measure, print, cache
    hf-megatrain estimate ...     uses the cached rates of this GPU (or the reference rates)

Measured: the bf16 matmul rate sustained after a few seconds of load (an H200 caps its power and
drops from ~790 to ~660 TFLOP/s), pinned PCIe per direction alone and with both directions busy,
the GPU's memory bandwidth, the host's DRAM bandwidth (a large fp32 copy and an in-place add, all
cores: a copy's writes also read their lines first, an in-place update's do not) and the
engine's own host AdamW step (optimizer.adamw_tile on a 128M-parameter store, with clipping and
without, refreshing a bf16 compute copy and without one as a lean unit does), which is what the
DRAM bandwidth buys in the step, and the other host optimizers' steps (sgd, adagrad, rmsprop,
adafactor with Trainer's defaults, over one 128M-parameter matrix, as the engine steps a unit).

The cache is a JSON file (HF_MEGATRAIN_CACHE or ~/.cache/hf_megatrain, `rates.json`) holding the
latest probe of each GPU model; `load()` returns the one for this machine's GPU.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field, fields

GB = 1e9


@dataclass
class Rates:
    gpu: str  # the GPU's name ("" for none)
    matmul_tflops: float  # bf16, sustained
    h2d_gbs: float  # pinned host -> GPU, alone
    d2h_gbs: float  # GPU -> pinned host, alone
    h2d_duplex_gbs: float  # each direction while the other is busy too
    d2h_duplex_gbs: float
    gpu_mem_gbs: float  # device copy, bytes read + written per second
    host_copy_gbs: float  # fp32 copy over all cores, bytes read + written per second
    host_update_gbs: float  # fp32 in-place a += b over all cores (read 8 B, write 4 B per element)
    adamw_gparams: float  # the host AdamW step with clipping, G parameters/s
    adamw_noclip_gparams: float  # ... without clipping
    host: str = ""  # CPU model and cores
    measured: str = ""  # when (UTC), or where the reference numbers come from
    # The same step of a lean unit (no bf16 compute copy to refresh: lean_streamed), with clipping and
    # without; 0: not measured (a probe from before they were, the reference rates), see adamw().
    adamw_lean_gparams: float = 0.0
    adamw_lean_noclip_gparams: float = 0.0
    # The other host optimizers (engine/host_optim.py) with Trainer's defaults, as the engine steps a unit
    # (clipping, the optimizer's own step over a 2-D parameter, the bf16 copy refreshed):
    # {optim: [G params/s, the step's modelled bytes per parameter at those defaults]}; empty: not measured.
    optim_gparams: dict = field(default_factory=dict)

    def host_step(self, optimizer, clip: bool, lean: bool = False) -> float:
        """G params/s of the host step of one unit by `optimizer` (estimator.optimizer_state; AdamW: adamw()).
        Another optimizer's rate is modelled, not measured, where the probe did not measure it: AdamW's
        rate scaled by the bytes a unit's step moves per parameter, AdamW's tile (ADAMW_TILE_BYTES) against
        the optimizer's (OptimizerState.step_bytes, + 8 to clip the gradient, + 6 to refresh the bf16
        copy), as if both were bound by DRAM bandwidth alone. Measured (optim_gparams, at Trainer's
        defaults), it is scaled the same way to the settings and to clipping and lean asked."""
        if optimizer is None or optimizer.adamw:
            return self.adamw(clip, lean)
        moved = optimizer.step_bytes + 8 * clip + 6 * (not lean)
        measured = self.optim_gparams.get(optimizer.name)
        if measured:
            rate, at = measured
            return rate * (at + 8 + 6) / moved
        return self.adamw(clip, lean) * ADAMW_TILE_BYTES[clip][lean] / moved

    def adamw(self, clip: bool, lean: bool = False) -> float:
        """G params/s of the host AdamW of one unit: with exact clipping or not, refreshing a bf16
        compute copy or (lean) not. An unmeasured lean rate is the measured one scaled by the bytes
        a tile's ops move (ADAMW_TILE_BYTES), as if the step were bound by DRAM bandwidth alone."""
        rate = self.adamw_gparams if clip else self.adamw_noclip_gparams
        if not lean:
            return rate
        measured = self.adamw_lean_gparams if clip else self.adamw_lean_noclip_gparams
        if measured:
            return measured
        full, without_copy = ADAMW_TILE_BYTES[clip]
        return rate * full / without_copy

    def table(self) -> str:
        rows = [("bf16 matmul, sustained", f"{self.matmul_tflops:,.0f} TFLOP/s"),
                ("PCIe host -> GPU (alone / both ways)", f"{self.h2d_gbs:.1f} / {self.h2d_duplex_gbs:.1f} GB/s"),
                ("PCIe GPU -> host (alone / both ways)", f"{self.d2h_gbs:.1f} / {self.d2h_duplex_gbs:.1f} GB/s"),
                ("GPU memory copy (read + write)", f"{self.gpu_mem_gbs:,.0f} GB/s"),
                ("host DRAM copy / in-place add", f"{self.host_copy_gbs:.1f} / {self.host_update_gbs:.1f} GB/s "
                                                   "(bytes read + written)"),
                ("host AdamW, clipped / unclipped",
                 f"{self.adamw_gparams:.2f} / {self.adamw_noclip_gparams:.2f} G params/s "
                 f"({ADAMW_BYTES * self.adamw_gparams:.0f} / {ADAMW_BYTES * self.adamw_noclip_gparams:.0f} GB/s "
                 f"at {ADAMW_BYTES} B/param)"),
                ("host AdamW of a lean unit, clipped / unclipped",
                 f"{self.adamw(True, True):.2f} / {self.adamw(False, True):.2f} G params/s"
                 + ("" if self.adamw_lean_gparams and self.adamw_lean_noclip_gparams else
                    " (not measured: scaled by the bytes moved)"))]
        rows += [(f"host {name}, clipped", f"{rate:.2f} G params/s") for name, (rate, _) in self.optim_gparams.items()]
        head = f"{self.gpu or 'no GPU'}; host {self.host or '?'}; {self.measured}"
        w = max(len(k) for k, _ in rows)
        return head + "\n" + "\n".join(f"  {k:{w}} {v}" for k, v in rows)


# Bytes the host AdamW must move per parameter: read master, m, v, gradient (16), write master, m,
# v (12) and the bf16 compute copy (2).
ADAMW_BYTES = 30
# Bytes per parameter that a tile's ops (optimizer.adamw_tile) move, {clip: (with the compute copy,
# without)}: clipping reads and writes the gradient (8), the fused AdamW reads master, gradient, m, v
# and writes master, m, v (28), refreshing the compute copy reads the master and writes bf16 (6).
ADAMW_TILE_BYTES = {True: (42, 36), False: (34, 28)}

# An H200 box's rates, for planning on a machine that has not been probed (or has no GPU): the
# device machine's probe of 2026-12-04 17:29 UTC (BENCHMARKS.md, run 14, call d). It measured no
# optimizer but AdamW: the others' host rates are modelled from it (Rates.host_step).
REFERENCE = Rates(gpu="NVIDIA H200", matmul_tflops=669.0, h2d_gbs=55.5, d2h_gbs=55.4, h2d_duplex_gbs=52.0,
                  d2h_duplex_gbs=50.8, gpu_mem_gbs=4240.0, host_copy_gbs=77.7, host_update_gbs=129.4,
                  adamw_gparams=2.55, adamw_noclip_gparams=2.74, host="16 cores",
                  measured="reference rates of an H200 box with 16 host cores (run `hf-megatrain probe` on yours)")


def cache_file() -> str:
    from .layout_cache import cache_root

    return os.path.join(cache_root(), "rates.json")


def _read_cache() -> dict:
    try:
        with open(cache_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save(rates: Rates) -> str:
    """Keep `rates` as the latest probe of its GPU (written whole, then renamed: never half a file)."""
    path = cache_file()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cache = _read_cache()
    cache[rates.gpu or "cpu"] = asdict(rates)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(cache, f, indent=1)
    os.replace(tmp, path)
    return path


def load(gpu: str | None = None) -> Rates | None:
    """The cached probe of `gpu` (default: this machine's GPU, or the newest of any without one)."""
    cache = _read_cache()
    if gpu is None:
        gpu = gpu_name()
    if gpu is None:  # no GPU here: planning for another machine; take the newest probe of a GPU
        entries = sorted((e for k, e in cache.items() if k != "cpu"), key=lambda e: e.get("measured", ""))
        entry = entries[-1] if entries else None
    else:
        entry = cache.get(gpu)
    if not entry:
        return None
    names = {f.name for f in fields(Rates)}
    return Rates(**{k: v for k, v in entry.items() if k in names})


def rates_for_planning() -> Rates:
    """The cached probe of this GPU, else the reference rates."""
    return load() or REFERENCE


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def host_name() -> str:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores".lstrip(", ")


# -- measurements --------------------------------------------------------------------------------
def _best(fn, repeats: int) -> float:
    """Shortest wall time of `repeats` calls of fn (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def host_copy_gbs(numel: int = 1 << 28) -> float:
    """fp32 copy between two host buffers of `numel` elements, (read + written bytes) per second."""
    import torch

    a, b = torch.ones(numel), torch.empty(numel)
    b.copy_(a)  # first touch
    return 2 * 4 * numel / _best(lambda: b.copy_(a), 3) / GB


def host_update_gbs(numel: int = 1 << 28) -> float:
    """fp32 a += b over two host buffers of `numel` elements, (read + written bytes) per second: the
    access pattern of the AdamW step and of gradient accumulation (in place, no write-allocate)."""
    import torch

    a, b = torch.ones(numel), torch.ones(numel)
    return 3 * 4 * numel / _best(lambda: a.add_(b), 3) / GB


def host_adamw_gparams(numel: int = 1 << 27, clip: bool = True, lean: bool = False) -> float:
    """The engine's host step (optimizer.adamw_tile over OPENMP_TILE tiles, as HostAdamW runs it with
    OpenMP inside each op) on a store of `numel` parameters, refreshing a bf16 compute copy unless
    `lean`, G parameters per second, stepped from a worker thread with the caller's OpenMP thread
    count, as in training (from a worker thread it ran about 20% slower than from the main thread on
    the H200 box: BENCHMARKS.md, run 14)."""
    return _on_worker(lambda: _adamw_rate(numel, clip, lean), "megatrain-probe-adamw")


def _on_worker(fn, name: str):
    """fn() on a thread of its own with the caller's OpenMP thread count (the count is per thread),
    as the engine's host steps run; its result, or its exception raised here."""
    import threading

    import torch

    result: list = []
    threads = torch.get_num_threads()

    def work():
        try:
            torch.set_num_threads(threads)
            result.append(fn())
        except BaseException as e:  # re-raised on the caller's thread
            result.append(e)

    worker = threading.Thread(target=work, name=name)
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _adamw_rate(numel: int, clip: bool, lean: bool = False) -> float:
    import torch

    from ..engine import optimizer

    master, grad = torch.randn(numel), torch.randn(numel)
    m, v = torch.zeros(numel), torch.zeros(numel)
    compute = None if lean else torch.empty(numel, dtype=torch.bfloat16)
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    coef = torch.tensor(0.5) if clip else None
    step = torch.tensor(1.0)
    tile = optimizer.OPENMP_TILE

    def run():
        for a in range(0, numel, tile):
            b = min(a + tile, numel)
            optimizer.adamw_tile(master[a:b], grad[a:b], m[a:b], v[a:b], None if lean else compute[a:b], hyper,
                                 coef, step)

    return numel / _best(run, 3) / GB


def host_optim_gparams(optim: str, shape: tuple = (16384, 8192)) -> float:
    """The engine's host step of `optim` (one of engine.host_optim.PARAM_OPTIMS, Trainer's defaults) on
    one fp32 parameter of `shape`, as HostParamOptimizer.step_unit runs it (the gradient clipped in place,
    the class's own step, the bf16 compute copy refreshed), from a worker thread with the caller's
    OpenMP thread count; G parameters per second, the first step (its state allocated) left out."""
    import torch

    from .estimator import optimizer_class

    cls, kwargs = optimizer_class(optim)
    master = torch.randn(shape)
    master.grad = torch.randn(shape)
    compute = torch.empty(shape, dtype=torch.bfloat16)
    inner = cls([master], **kwargs)
    coef = torch.tensor(0.5)

    def run():
        master.grad.mul_(coef)
        inner.step()
        compute.copy_(master)

    return _on_worker(lambda: master.numel() / _best(run, 3) / GB, "megatrain-probe-optim")


def matmul_rates(seconds: float) -> tuple[float, float]:
    """bf16 8192^3 matmuls, TFLOP/s: (burst, the first ~0.1 s; sustained, after `seconds` of load).
    An H200 caps its power under load and drops from ~790 to ~660."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def rate(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        torch.cuda.synchronize()
        return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12

    for _ in range(3):
        a @ b
    burst = rate(60)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        rate(100)
    return burst, rate(400)


def pcie_gbs(nbytes: int = 1 << 30) -> tuple[float, float, float, float]:
    """(h2d alone, d2h alone, h2d while d2h runs, d2h while h2d runs) in GB/s, pinned host memory."""
    import torch

    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_out = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(pairs, repeats=3):
        """Seconds per copy on each stream, the copies of all pairs running at once."""
        events = []
        torch.cuda.synchronize()
        for stream, dst, src in pairs:
            with torch.cuda.stream(stream):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeats):
                    dst.copy_(src, non_blocking=True)
                end.record()
                events.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 / repeats for s, e in events]

    h2d, d2h = (up, dev_in, host_in), (down, host_out, dev_out)
    timed([h2d, d2h], 1)  # warm both directions
    alone_up, = timed([h2d])
    alone_down, = timed([d2h])
    both_up, both_down = timed([h2d, d2h])
    return tuple(nbytes / t / GB for t in (alone_up, alone_down, both_up, both_down))


def gpu_mem_gbs(nbytes: int = 4 << 30) -> float:
    import torch

    a = torch.ones(nbytes // 4, device="cuda")
    b = torch.empty_like(a)

    def copy():
        b.copy_(a)
        torch.cuda.synchronize()

    return 2 * nbytes / _best(copy, 5) / GB


def measure(seconds: float = 5.0, progress=print) -> Rates:
    """Probe this machine: about `seconds` of matmul load plus a few seconds of copies and steps."""
    import torch

    progress("host DRAM copy and in-place add ...")
    copy, update = host_copy_gbs(), host_update_gbs()
    progress("host AdamW (the engine's step) ...")
    adamw, adamw_noclip = host_adamw_gparams(clip=True), host_adamw_gparams(clip=False)
    lean, lean_noclip = host_adamw_gparams(clip=True, lean=True), host_adamw_gparams(clip=False, lean=True)
    progress("host sgd, adagrad, rmsprop, adafactor (the engine's steps) ...")
    from ..engine.host_optim import PARAM_OPTIMS
    from .estimator import optimizer_state

    others = {name: [round(host_optim_gparams(name), 3), optimizer_state(name).step_bytes] for name in PARAM_OPTIMS}
    gpu, matmul, pcie, device_mem = "", 0.0, (0.0, 0.0, 0.0, 0.0), 0.0
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
        progress("PCIe, pinned, each way and both ways at once ...")
        pcie = pcie_gbs()
        progress("GPU memory copy ...")
        device_mem = gpu_mem_gbs()
        progress(f"bf16 matmul, {seconds:g} s of load ...")
        matmul = matmul_rates(seconds)[1]
        torch.cuda.empty_cache()
    return Rates(gpu=gpu, matmul_tflops=round(matmul, 1), h2d_gbs=round(pcie[0], 2), d2h_gbs=round(pcie[1], 2),
                 h2d_duplex_gbs=round(pcie[2], 2), d2h_duplex_gbs=round(pcie[3], 2), gpu_mem_gbs=round(device_mem, 1),
                 host_copy_gbs=round(copy, 2), host_update_gbs=round(update, 2), adamw_gparams=round(adamw, 3), adamw_noclip_gparams=round(adamw_noclip, 3),
                 host=host_name(), measured=time.strftime("probed %Y-%m-%d %H:%M UTC", time.gmtime()),
                 adamw_lean_gparams=round(lean, 3), adamw_lean_noclip_gparams=round(lean_noclip, 3),
                 optim_gparams=others)
