"""Time HostAdamW.step_unit itself (the engine's real code path) on a model-shaped store.

    python benchmarks/optimizer_bench.py --shape llama-3.2-1b --layers 4 --threads 0 15 --spans 19 21 \
        --tiles 18 20 23 --where thread --repeat 3

For each of: store pinned (cudaHostRegister, as on a GPU) or pageable; clipping on or off; the
main thread or the optimizer's worker thread; the host step's threads and span sizes (2**N
elements; --tiles: the tile of the default OpenMP step): G params/s of one full step, and the GB/s
that is at the 30 bytes per parameter the step must move (read master, m, v, gradient; write
master, m, v, bf16 copy), beside the host's fp32 copy bandwidth measured first (bytes read +
written per second, as hf-megatrain probe measures it, and an in-place add). Compare with
benchmarks/adam_bench.py (the bare kernel) to see what the engine adds. The first line printed
states the versions it ran on (benchmarks/versions.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from contextlib import nullcontext

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import hf_megatrain.engine.optimizer as optimizer_module  # noqa: E402
from hf_megatrain.engine.optimizer import HostAdamW  # noqa: E402
from hf_megatrain.engine.store import HostStore, build_units  # noqa: E402
from hf_megatrain.planner.probe import ADAMW_BYTES, host_copy_gbs, host_update_gbs  # noqa: E402
from hf_megatrain.patcher.specs import spec_for  # noqa: E402
from hf_megatrain.shapes import make_config  # noqa: E402
from versions import versions, versions_line  # noqa: E402


class _Engine:
    """Just enough of StreamingEngine's public side for HostAdamW: a store and the calls it makes."""

    background_host_jobs = False  # steps run where the benchmark calls them

    def __init__(self, store, device):
        self.store, self.device = store, torch.device(device)

    def host_span(self, lane):
        return nullcontext()

    def wait_for_gradients(self):
        pass


def build(shape, layers, pin, threads):
    from transformers import AutoModelForCausalLM

    cfg = make_config(shape, layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    units = build_units(model, spec_for(cfg), [n for n, _ in model.named_parameters()])
    store = HostStore(units, torch.bfloat16, pin=pin)
    for u in units:
        store.master[u.index].normal_()
        store.grad[u.index].normal_()
        store.grad_count[u.index] = 1
    engine = _Engine(store, "cuda" if pin else "cpu")
    return engine, HostAdamW(engine, lr=1e-4, weight_decay=0.1, host_threads=threads)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, nargs="+", default=[0],
                    help="host_threads (0, the engine's default: no pool, OpenMP inside each op)")
    ap.add_argument("--spans", type=int, nargs="+", default=[None], help="log2 of the pool's span size (default: the engine's)")
    ap.add_argument("--tiles", type=int, nargs="+", default=[None],
                    help="log2 of the OpenMP step's tile (default: the engine's)")
    ap.add_argument("--where", nargs="+", default=["main", "thread"], choices=["main", "thread"],
                    help="the main thread, a worker thread (as in training), or both")
    ap.add_argument("--repeat", type=int, default=1, help="measure each row this many times (the spread)")
    a = ap.parse_args()
    print("VERSIONS " + versions_line(versions()), flush=True)
    copy, update = host_copy_gbs(), host_update_gbs()
    print(f"torch threads {torch.get_num_threads()}, default span 2^{optimizer_module.SPAN.bit_length() - 1}, "
          f"default tile 2^{optimizer_module.OPENMP_TILE.bit_length() - 1}; host fp32 copy {copy:.1f} GB/s, "
          f"in-place add {update:.1f} GB/s (bytes read + written)", flush=True)
    default_span, default_tile = optimizer_module.SPAN, optimizer_module.OPENMP_TILE
    table = []
    for pin in ([False, True] if torch.cuda.is_available() else [False]):
        for threads in a.threads:
            engine, opt = build(a.shape, a.layers, pin, threads)
            n = sum(u.n_train for u in engine.store.units)
            hyper = opt.hyperparameters()
            variants = [("pool", s_, None) for s_ in a.spans] if threads > 0 else [("openmp", None, t) for t in a.tiles]
            for kind, span, tile in variants:
                optimizer_module.SPAN = default_span if span is None else 1 << span
                optimizer_module.OPENMP_TILE = default_tile if tile is None else 1 << tile
                step_unit = opt.step_unit
                for clip in (None, torch.tensor(0.5)):
                    for where in [w for w in a.where for _ in range(a.repeat)]:
                        def one():
                            t0 = time.perf_counter()
                            for u in engine.store.units:
                                step_unit(u.index, hyper, clip, 1, 1)
                            return n / (time.perf_counter() - t0) / 1e9

                        res = {}
                        if where == "main":
                            one()
                            res["r"] = max(one() for _ in range(2))
                        else:
                            count = torch.get_num_threads()

                            def go():
                                torch.set_num_threads(count)
                                one()
                                res["r"] = max(one() for _ in range(2))

                            t = threading.Thread(target=go)
                            t.start()
                            t.join()
                        size = optimizer_module.SPAN if kind == "pool" else optimizer_module.OPENMP_TILE
                        label = f"pool of {opt.host_threads}" if kind == "pool" else "OpenMP"
                        gbs = ADAMW_BYTES * res["r"]
                        table.append((pin, label, size.bit_length() - 1, clip is not None, where, res["r"], gbs))
                        print(f"pinned={pin!s:5} {label:<11} span=2^{size.bit_length() - 1:<3}"
                              f"clip={'on ' if clip is not None else 'off'} {where:6} {res['r']:.2f} G params/s  "
                              f"{gbs:6.1f} GB/s ({gbs / copy:.0%} of copy, {gbs / update:.0%} of add)  ({n / 1e9:.2f} B params)", flush=True)
            engine = opt = None  # free this store before the next one is built
        optimizer_module.SPAN, optimizer_module.OPENMP_TILE = default_span, default_tile
    print(f"\n{'store':8} {'step':11} {'tile':>5} {'clip':4} {'thread':6} {'G params/s':>10} {'GB/s':>6} {'of copy':>7} {'of add':>6}")
    for pin, label, size, clip, where, r, gbs in table:
        print(f"{'pinned' if pin else 'pageable':8} {label:11} {'2^' + str(size):>5} {'on' if clip else 'off':4} "
              f"{where:6} {r:10.2f} {gbs:6.1f} {gbs / copy:7.0%} {gbs / update:6.0%}")

if __name__ == "__main__":
    main()
