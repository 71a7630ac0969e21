"""Checkpoint I/O: hf_megatrain's streamed load/save vs from_pretrained + save_pretrained.

Writes a random-init model of a named shape as bf16 safetensors (the source checkpoint), then,
each in a fresh process (so peak RSS is its own): (a) hf_megatrain loads it into the host store
(fp32 masters + bf16 compute copy, the training layout) and saves it back in HF format;
(b) transformers loads it with from_pretrained (fp32, what a trainer would hold) and saves it
with save_pretrained. GB/s counts the checkpoint's bytes on disk.

    python benchmarks/io_bench.py --shape llama-3.2-3b --dir /tmp/io --out $OUT

The record ($OUT/io_<shape>.json) states the versions it ran on (benchmarks/versions.py),
printed first and in the table's header.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from versions import versions, versions_line  # noqa: E402


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def make_source(shape: str, folder: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_megatrain.shapes import make_config

    cfg = make_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU normal_ of billions of numbers is slow
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=dev).mul_(0.02).to(torch.bfloat16))
    model.save_pretrained(folder, max_shard_size="2GB")


def run_megatrain(src: str, dst: str) -> dict:
    import torch

    from hf_megatrain.checkpoint.hf_format import save_hf_model
    from hf_megatrain.checkpoint.loading import load_model_and_tokenizer
    from hf_megatrain.checkpoint.stream_load import engine_from_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    skeleton, _, folder = load_model_and_tokenizer(src)
    engine = engine_from_checkpoint(skeleton, folder, device=device, compute_dtype=torch.bfloat16)
    t_load = time.perf_counter() - t0
    rss_load = _rss_gib()
    t0 = time.perf_counter()
    save_hf_model(engine.store, skeleton, dst, dtype=torch.bfloat16, max_shard_bytes=2 << 30)
    t_save = time.perf_counter() - t0
    return {"load_s": t_load, "save_s": t_save, "rss_after_load_gib": rss_load, "peak_rss_gib": _rss_gib(),
            "holds": "fp32 master + bf16 compute (+ fp32 grad) store, pinned"}


def run_alloc(src: str, dst: str) -> dict:
    """Only what the load spends before reading a byte: the store's arenas allocated and page-locked
    (the part of hf_megatrain's load time that is not I/O or the fp32 upcast)."""
    import torch

    from hf_megatrain.checkpoint.loading import load_model_and_tokenizer
    from hf_megatrain.engine.store import HostStore, build_units
    from hf_megatrain.patcher.specs import spec_for

    skeleton, _, _ = load_model_and_tokenizer(src)
    units = build_units(skeleton, spec_for(skeleton.config), [n for n, _ in skeleton.named_parameters()])
    t0 = time.perf_counter()
    store = HostStore(units, torch.bfloat16, pin=torch.cuda.is_available())
    for buf in store.master:  # the master is written by the load (first touch), not pinned
        buf.zero_()
    t_alloc = time.perf_counter() - t0
    return {"load_s": t_alloc, "save_s": float("nan"), "rss_after_load_gib": _rss_gib(), "peak_rss_gib": _rss_gib(),
            "holds": "empty store: arenas allocated, pinned where they cross PCIe, master touched"}


def run_hf(src: str, dst: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, device_map="cpu")
    t_load = time.perf_counter() - t0
    rss_load = _rss_gib()
    t0 = time.perf_counter()
    model.save_pretrained(dst, max_shard_size="2GB")
    t_save = time.perf_counter() - t0
    return {"load_s": t_load, "save_s": t_save, "rss_after_load_gib": rss_load, "peak_rss_gib": _rss_gib(),
            "holds": "fp32 model"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-3b")
    p.add_argument("--dir", default="/tmp/megatrain_io")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--worker", choices=["megatrain", "alloc", "hf"])
    a = p.parse_args()
    src = os.path.join(a.dir, "source")
    if a.worker:
        dst = os.path.join(a.dir, f"saved_{a.worker}")
        shutil.rmtree(dst, ignore_errors=True)
        r = {"megatrain": run_megatrain, "alloc": run_alloc, "hf": run_hf}[a.worker](src, dst)
        r["bytes"] = _size(src)
        print("RESULT " + json.dumps(r), flush=True)
        return
    os.makedirs(a.out, exist_ok=True)
    stack = versions()
    print("VERSIONS " + versions_line(stack), flush=True)
    if not os.path.isdir(src):
        t0 = time.perf_counter()
        make_source(a.shape, src)
        print(f"source checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = {}
    for who in ("megatrain", "alloc", "hf"):
        subprocess.run(["sync"])
        r = subprocess.run([sys.executable, __file__, "--worker", who, "--dir", a.dir, "--shape", a.shape],
                           capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        rows[who] = json.loads(line[-1][7:]) if line else {"error": r.stderr[-2000:]}
        print(f"{who}: {json.dumps(rows[who])[:400]}", flush=True)
        record = {"date": time.strftime("%Y-%m-%d"), "card": stack["gpu"], "shape": a.shape,
                  "command": " ".join(sys.argv), "versions": stack, "rows": rows}
        with open(os.path.join(a.out, f"io_{a.shape}.json"), "w") as f:  # after each: a cut-short run keeps it
            json.dump(record, f, indent=1)
    gb_src = max(r.get("bytes", 0) for r in rows.values()) / 1e9
    print(f"\ncheckpoint I/O, {a.shape}, source {gb_src:.2f} GB bf16 safetensors")
    print(versions_line(stack))
    print(f"{'system':10} {'load s':>7} {'load GB/s':>9} {'save s':>7} {'save GB/s':>9} {'RSS load GiB':>12} {'peak GiB':>8}")
    for who, r in rows.items():
        if "error" in r:
            print(f"{who:10} ERROR {r['error'][-300:]}")
            continue
        gb = r["bytes"] / 1e9
        print(f"{who:10} {r['load_s']:>7.1f} {gb / r['load_s']:>9.2f} {r['save_s']:>7.1f} {gb / r['save_s']:>9.2f} "
              f"{r['rss_after_load_gib']:>12.1f} {r['peak_rss_gib']:>8.1f}")


if __name__ == "__main__":
    main()
