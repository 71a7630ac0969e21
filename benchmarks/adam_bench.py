"""Host AdamW throughput on this machine: which way of calling torch's fused kernel is fastest.

    python benchmarks/adam_bench.py [--numel 200_000_000]

Prints G params/s for: one call over the whole tensor, 1M-element tiles, tiles spread over a
pool of Python threads, in the main thread and in a worker thread (where HostAdamW runs).
The first line printed states the versions it ran on (benchmarks/versions.py).
"""

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's hf_megatrain (--registered; its commit is recorded)

from versions import versions, versions_line  # noqa: E402


def step(p, g, m, v, s, a, b):
    torch._fused_adamw_([p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], [], [s], lr=1e-4, beta1=0.9, beta2=0.999,
                        weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)


def run(kind, n, p, g, m, v, c, s, pool):
    t0 = time.perf_counter()
    if kind == "whole":
        step(p, g, m, v, s, 0, n)
        c.copy_(p)
    elif kind.startswith("tiled"):
        tile = int(kind.split(":")[1])
        for a in range(0, n, tile):
            step(p, g, m, v, s, a, min(a + tile, n))
            c[a:min(a + tile, n)].copy_(p[a:min(a + tile, n)])
    elif kind.startswith("pool"):
        tile = int(kind.split(":")[1])

        def job(a):
            b = min(a + tile, n)
            step(p, g, m, v, s, a, b)
            c[a:b].copy_(p[a:b])

        list(pool.map(job, range(0, n, tile)))
    return n / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=200_000_000)
    ap.add_argument("--registered", action="store_true",
                    help="master, grad and compute copy in cudaHostRegister'ed arenas, as the engine keeps them")
    a = ap.parse_args()
    print("VERSIONS " + versions_line(versions()), flush=True)
    n = a.numel
    if a.registered:
        from hf_megatrain.engine.pinned import arena_tensors

        keep = []
        tensors = []
        for dtype in (torch.float32, torch.float32, torch.bfloat16):
            arena, (t,) = arena_tensors([n], dtype, pin=True)
            keep.append(arena)
            tensors.append(t)
        p, g, c = tensors
        p.normal_(), g.normal_()
        m, v = torch.randn(n), torch.randn(n)
    else:
        p, g, m, v = (torch.randn(n) for _ in range(4))
        c = torch.empty(n, dtype=torch.bfloat16)
    v.abs_()
    s = torch.tensor(10.0)
    print("torch threads", torch.get_num_threads(), "interop", torch.get_num_interop_threads())
    pool = ThreadPoolExecutor(torch.get_num_threads())
    kinds = ["whole", "tiled:1048576", "tiled:8388608", "pool:4194304"]
    for where in ("main", "thread", "thread+set"):
        for kind in kinds:
            out = {}

            def go():
                run(kind, n, p, g, m, v, c, s, pool)  # warm
                out["r"] = max(run(kind, n, p, g, m, v, c, s, pool) for _ in range(2))

            if where == "main":
                go()
            else:
                nthreads = torch.get_num_threads() if where == "thread+set" else None

                def in_thread():
                    if nthreads:
                        torch.set_num_threads(nthreads)
                    go()

                t = threading.Thread(target=in_thread)
                t.start()
                t.join()
            print(f"{where:6} {kind:16} {out['r']:.2f} G params/s", flush=True)


if __name__ == "__main__":
    main()
