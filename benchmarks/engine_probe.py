"""Where does a streamed step's time go? The engine's parts timed alone and together.

    python benchmarks/engine_probe.py --shape llama-3.2-1b --tokens 16384

On one engine (StreamingEngine + HostAdamW, all layers streamed), times:
  fwd_bwd      forward + backward only (gradients land on the host; no optimizer step)
  opt alone    HostAdamW.step() + synchronize() with the GPU idle, for several thread counts
  full step    forward/backward, clipping and the step, overlapped as in training
and, from a Timeline, the host optimizer's seconds per layer in each case. Prints a table last.
The record ($OUT/probe<tag>.json) states the versions it ran on (benchmarks/versions.py),
printed first and in the table's header.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench import build_model  # noqa: E402
from versions import versions, versions_line  # noqa: E402

from hf_megatrain import prepare  # noqa: E402
from hf_megatrain.engine.timeline import Timeline  # noqa: E402


def lane_seconds(spans, lane="optimizer"):
    d = [b - a for name, a, b in spans if name == lane]
    return sum(d), len(d)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--threads", type=int, nargs="+", default=[16, 8, 4])
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    stack = versions()
    print("VERSIONS " + versions_line(stack), flush=True)
    print("torch threads", torch.get_num_threads(), "affinity", len(os.sched_getaffinity(0)),
          "OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY"), flush=True)
    model = build_model(a.shape, a.layers, "cpu", a.seq)
    engine, opt = prepare(model, lr=1e-5, weight_decay=0.1)
    n_layers = sum(u.kind == "layer" for u in engine.units)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (a.tokens // a.seq, a.seq))
    batch = {"input_ids": ids, "labels": ids}
    rows = []

    def sync():
        engine.synchronize()
        torch.cuda.synchronize()

    def full_step():
        engine.forward_backward(batch)
        if a.clip > 0:
            opt.clip_grad_norm_(a.clip)
        opt.step()
        engine.zero_grad()

    for _ in range(2):
        full_step()
    sync()

    def timed(name, fn, reps=3, lane="optimizer"):
        tl = Timeline()
        engine.attach_timeline(tl)
        ts = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        engine.attach_timeline(None)
        b = tl.collect()
        total, count = lane_seconds(b["spans"], lane)
        row = dict(name=name, s=round(min(ts), 4), opt_s_per_step=round(total / reps, 4), opt_spans=count,
                   busy={k: v for k, v in b.items() if k.endswith("_busy")})
        rows.append(row)
        print("ROW", json.dumps(row), flush=True)
        return b

    def fwd_bwd():
        engine.forward_backward(batch)
        engine.wait_for_gradients()
        engine.zero_grad()

    timed("fwd_bwd", fwd_bwd)
    engine.forward_backward(batch)
    engine.wait_for_gradients()
    for k in a.threads:
        opt.set_openmp_threads(k)
        timed(f"opt alone t={k}", lambda: (opt.step(), opt.synchronize()))
    opt.set_openmp_threads(a.threads[0])
    engine.zero_grad()
    b = timed("full step", full_step)
    with open(os.path.join(a.out, f"probe_trace{a.tag}.json"), "w") as f:
        json.dump({"spans": b["spans"], "wall_s": b["wall_s"]}, f)
    for k in a.threads[1:]:
        opt.set_openmp_threads(k)
        timed(f"full step t={k}", full_step)
    params = engine.num_parameters
    print(f"\n{a.shape} layers={n_layers} params={params / 1e9:.2f}B tokens/step={a.tokens} clip={a.clip} {a.tag}")
    print(versions_line(stack))
    print(f"{'case':18} {'seconds':>8} {'opt s/step':>10} {'G param/s':>9}  busy")
    for r in rows:
        g = params / r["opt_s_per_step"] / 1e9 if r["opt_s_per_step"] else 0
        busy = " ".join(f"{k[:-5]}={v:.2f}" for k, v in r["busy"].items())
        print(f"{r['name']:18} {r['s']:>8.3f} {r['opt_s_per_step']:>10.4f} {g:>9.2f}  {busy}")
    record = {"date": time.strftime("%Y-%m-%d"), "card": stack["gpu"], "command": " ".join(sys.argv),
              "versions": stack, "rows": rows}
    with open(os.path.join(a.out, f"probe{a.tag}.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
