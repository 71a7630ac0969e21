"""Where stock's time goes on a mixture of experts: one forward+backward of a few decoder layers of a
shape, stock transformers on the GPU, profiled op by op, with fp32 parameters under bf16 autocast
(what Trainer does with `bf16=True`) beside bf16 parameters (the speed anchor).

    python benchmarks/moe_profile.py --shape qwen3-30b-a3b --layers 2 --rows 4 --seq 1024 --out $OUT

Prints, for each setting, the milliseconds of one step and the aten ops whose GPU time is most of it, with
their share; writes $OUT/moe_profile_<shape>.json. The experts kernel is the model's default
(`grouped_mm` in transformers 5.x)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from versions import versions, versions_line  # noqa: E402


def profile(shape: str, layers: int, rows: int, seq: int, params_dtype, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from bench import build_model

    model = build_model(shape, layers, "cuda", seq).to(params_dtype).train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: kernels chosen, allocator settled
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / 3 * 1e3
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    # GPU time by aten op (self time: an op's own kernels, not its children's), so that the expert
    # kernels (aten::_grouped_mm), the dense matmuls, the dtype casts and the loss can be told apart
    # (operator rows only: the kernels also get rows of their own, which would count twice)
    cpu = torch.autograd.DeviceType.CPU
    ops = {e.key: e.self_device_time_total / 1e3 for e in prof.key_averages()
           if e.device_type == cpu and e.self_device_time_total > 0}
    busy = sum(ops.values())
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    del model
    torch.cuda.empty_cache()
    return {"params_dtype": str(params_dtype).replace("torch.", ""), "step_ms": round(step_ms, 1),
            "gpu_ms": round(busy, 1),
            "top": [{"op": k[:90], "ms": round(v, 1), "share": round(v / busy, 3)} for k, v in ranked]}


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    opts = p.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    stack = versions()
    print("VERSIONS " + versions_line(stack), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    runs = [profile(opts.shape, opts.layers, opts.rows, opts.seq, dt, opts.top)
            for dt in (torch.float32, torch.bfloat16)]
    record = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "versions": stack,
              "shape": opts.shape, "layers": opts.layers, "tokens": opts.rows * opts.seq, "runs": runs}
    with open(os.path.join(opts.out, f"moe_profile_{opts.shape}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{stack.get('gpu')}  {record['date']}  {opts.shape}, {opts.layers} layers, "
          f"{record['tokens']} tokens, forward+backward under bf16 autocast")
    for r in runs:
        print(f"parameters {r['params_dtype']}: step {r['step_ms']} ms, GPU busy {r['gpu_ms']} ms")
        for t in r["top"]:
            print(f"   {t['share']:6.1%} {t['ms']:8.1f} ms  {t['op']}")


if __name__ == "__main__":
    main()
