"""When was each resource busy? H2D, compute and D2H (CUDA events), host optimizer (host clock).

The pipeline and the optimizer report spans here when a Timeline is attached (benchmarks, and
Trainer logging). `collect()` turns them into busy fractions of the wall time since the last
collect, so a user can tell at a glance whether PCIe, the CPU optimizer or the GPU is the
bottleneck, and into a trace of intervals that the notebooks plot.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

LANES = ("h2d", "cast", "compute", "d2h", "optimizer", "accumulate")  # cast: lean resident layers (cuda_pipeline)


def _union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


class Timeline:
    def __init__(self, device=None):
        self.device = device
        self._gpu: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._host: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()
        self._since = time.perf_counter()
        self._open: dict[str, torch.cuda.Event] = {}

    # -- recording ----------------------------------------------------------------------------
    def gpu_begin(self, lane: str, stream) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        self._open[lane] = ev

    def gpu_end(self, lane: str, stream) -> None:
        start = self._open.pop(lane, None)
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._gpu.append((lane, start, end))

    @contextmanager
    def gpu_span(self, lane: str, stream):
        self.gpu_begin(lane, stream)
        try:
            yield
        finally:
            self.gpu_end(lane, stream)

    @contextmanager
    def host_span(self, lane: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self._host.append((lane, t0, t1))

    # -- reading ------------------------------------------------------------------------------
    def collect(self) -> dict:
        """Busy fraction of each lane since the last collect, plus the raw intervals (seconds)."""
        now_h = time.perf_counter()
        spans: list[tuple[str, float, float]] = []
        if self._gpu:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            ref.synchronize()
            now_h = time.perf_counter()  # the reference event completed just before this
            for lane, a, b in self._gpu:
                spans.append((lane, now_h - a.elapsed_time(ref) / 1e3, now_h - b.elapsed_time(ref) / 1e3))
        with self._lock:
            spans += self._host
            self._host = []
        self._gpu = []
        lo, hi = self._since, now_h
        self._since = now_h
        wall = max(hi - lo, 1e-9)
        busy = {lane: _union_length([(a, b) for l, a, b in spans if l == lane], lo, hi) / wall for lane in LANES}
        out = {f"{lane}_busy": round(v, 4) for lane, v in busy.items()}
        out["gpu_idle"] = round(1.0 - busy["compute"], 4)
        out["wall_s"] = wall
        out["spans"] = [(lane, a - lo, b - lo) for lane, a, b in spans if b > lo]
        return out
