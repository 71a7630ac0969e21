"""Side-by-side training throughput: hf_megatrain vs stock Trainer (vs FSDP2 / DeepSpeed offload).

One command, one machine, one run: every system trains the same random-init shape on the same
synthetic tokens for a fixed number of optimizer steps, each in its own process (clean GPU
memory and RSS), and the table compares them with ratios. Model FLOPs are 6 * P * tokens
(P = all parameters, every token real: no padding). MFU is against the bf16 matmul peak
measured in the same run after several seconds of load (the H200 power-caps from ~790 to
~660 TFLOP/s); the burst peak is reported beside it.

    python benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 65536 --clip 1.0 0.0 \
        --systems megatrain,stock --steps 8 --out $OUT

Writes $OUT/bench.json (every number) and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


# -- the matmul peak -------------------------------------------------------------------------
def matmul_peak(seconds: float = 8.0) -> dict:
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flop = 2 * n**3

    def rate(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        torch.cuda.synchronize()
        return flop * iters / (time.perf_counter() - t0) / 1e12

    for _ in range(3):
        a @ b
    burst = rate(60)  # ~0.1 s
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        rate(100)
    sustained = rate(400)
    return {"burst_tflops": round(burst, 1), "sustained_tflops": round(sustained, 1)}


# -- a random-init model, fast ---------------------------------------------------------------
def build_model(shape: str, layers: int | None, device: str, seq: int):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_megatrain.shapes import make_config

    cfg = make_config(shape, layers, max_positions=max(seq, 4096))
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = model.to_empty(device=device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # random numbers are made on the GPU: a CPU normal_ of 12 GB takes minutes
                p.copy_(torch.randn(p.shape, device="cuda", generator=gen).mul_(0.02))
    rot = model.model.rotary_emb
    model.model.rotary_emb = type(rot)(config=cfg).to(device)
    return model


class TokenRows:
    """Random token rows (all real tokens; labels = inputs), as a torch Dataset."""

    def __init__(self, rows: int, seq: int, vocab: int):
        import torch

        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _collate(rows):
    import torch

    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


# -- one system, several configs, in this process ----------------------------------------------
def worker(opts) -> None:
    import torch
    from transformers import TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def __init__(self, warmup, on_warm=None):
            self.warmup, self.t0, self.on_warm = warmup, None, on_warm

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == self.warmup:
                torch.cuda.synchronize()
                self.t0 = time.perf_counter()
                torch.cuda.reset_peak_memory_stats()
                if self.on_warm:
                    self.on_warm()

    torch.backends.cuda.matmul.allow_tf32 = True
    device = "cpu" if opts.system == "megatrain" else "cuda"
    model = build_model(opts.shape, opts.layers, device, opts.seq)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    results = []
    for tokens in opts.tokens:
        for clip in opts.clip:
            bs = tokens // opts.seq
            data = TokenRows(bs * (opts.steps + 1), opts.seq, vocab)
            # hf_megatrain takes the whole step as one micro-batch (the GPU holds one layer, so
            # activations fit); stock Trainer would need [B, T, vocab] fp32 logits at once, so it
            # runs micro-batches of --stock_micro rows with gradient accumulation.
            micro = bs if opts.system == "megatrain" else min(bs, opts.stock_micro)
            common = dict(
                output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro,
                gradient_accumulation_steps=bs // micro, max_steps=opts.steps,
                learning_rate=1e-5, max_grad_norm=clip, lr_scheduler_type="constant", bf16=True,
                logging_steps=opts.steps, save_strategy="no", report_to=[], disable_tqdm=True,
                dataloader_num_workers=2, seed=0,
            )
            timeline, on_warm, engine = None, None, None
            if opts.system == "megatrain":
                from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
                from hf_megatrain.engine.timeline import Timeline

                trainer = MegaTrainTrainer(model, MegaTrainArguments(**common, log_pipeline=False,
                                                                     gpu_resident_layers=opts.resident),
                                           train_dataset=data,
                                           data_collator=_collate)
                engine = trainer.engine

                def on_warm():
                    nonlocal timeline
                    timeline = Timeline()
                    engine.pipeline.timeline = timeline
            else:
                from transformers import Trainer

                trainer = Trainer(model=model, args=TrainingArguments(
                    **common, gradient_checkpointing=True, optim="adamw_torch_fused"),
                    train_dataset=data, data_collator=_collate)
            clock = Clock(opts.warmup, on_warm)
            trainer.add_callback(clock)
            trainer.train()
            if engine is not None:
                engine.synchronize()
            torch.cuda.synchronize()
            dt = time.perf_counter() - clock.t0
            steps = opts.steps - opts.warmup
            tps = steps * tokens / dt
            row = dict(
                system=opts.system, shape=opts.shape, layers=model.config.num_hidden_layers, params=params,
                tokens_per_step=tokens, clip=clip, step_s=round(dt / steps, 4), tokens_per_s=round(tps, 1),
                model_tflops=round(6 * params * tps / 1e12, 1),
                gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            )
            if timeline is not None:
                b = timeline.collect()
                row["breakdown"] = {k: v for k, v in b.items() if k.endswith("_busy") or k == "gpu_idle"}
                if opts.trace_out:
                    with open(opts.trace_out, "w") as f:
                        json.dump({"spans": b["spans"][-4000:], "wall_s": b["wall_s"]}, f)
            print("RESULT " + json.dumps(row), flush=True)
            results.append(row)
            # Drop every reference to this run's engine before the next one builds its store:
            # two host stores of a 3B model do not fit in 128 GiB.
            del trainer, engine, timeline, on_warm, clock
            gc.collect()
            torch.cuda.empty_cache()


# -- the driver -------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-3b")
    p.add_argument("--layers", type=int, default=None, help="truncate to this many decoder layers")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536], help="tokens per optimizer step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--clip", type=float, nargs="+", default=[1.0])
    p.add_argument("--systems", default="megatrain,stock")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stock_micro", type=int, default=16, help="stock Trainer rows per micro-batch")
    p.add_argument("--resident", default="0", help="hf_megatrain gpu_resident_layers: 0 (stream all), N or auto")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--trace_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip_peak", action="store_true")
    opts = p.parse_args()
    if opts.system:
        worker(opts)
        return

    os.makedirs(opts.out, exist_ok=True)
    peak = {"burst_tflops": None, "sustained_tflops": None} if opts.skip_peak else matmul_peak()
    print("PEAK " + json.dumps(peak), flush=True)
    rows = []
    for system in opts.systems.split(","):
        cmd = [sys.executable, __file__, "--system", system, "--shape", opts.shape, "--seq", str(opts.seq),
               "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--tokens", *map(str, opts.tokens),
               "--clip", *map(str, opts.clip), "--stock_micro", str(opts.stock_micro),
               "--resident", opts.resident]
        if opts.layers:
            cmd += ["--layers", str(opts.layers)]
        if system == "megatrain":
            cmd += ["--trace_out", os.path.join(opts.out, f"trace_{opts.shape}.json")]
        log = open(os.path.join(opts.out, f"{system}_{opts.shape}.log"), "w")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                rows.append(json.loads(line[7:]))
        if proc.returncode != 0:
            rows.append({"system": system, "shape": opts.shape, "error": f"exit {proc.returncode}, see {log.name}"})
    sustained = peak["sustained_tflops"]
    for r in rows:
        if sustained and "model_tflops" in r:
            r["mfu"] = round(r["model_tflops"] / sustained, 3)
    record = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "peak": peak, "rows": rows}
    try:
        import torch

        record["card"] = torch.cuda.get_device_name()
    except Exception:
        pass
    with open(os.path.join(opts.out, f"bench_{opts.shape}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print_table(record)


def print_table(record) -> None:
    rows = record["rows"]
    print(f"\n{record.get('card', '?')}  {record['date']}  peak bf16 burst/sustained "
          f"{record['peak']['burst_tflops']}/{record['peak']['sustained_tflops']} TFLOP/s")
    stock = {(r["tokens_per_step"], r["clip"]): r["tokens_per_s"] for r in rows
             if r.get("system") == "stock" and "tokens_per_s" in r}
    head = f"{'system':10} {'shape':13} {'L':>3} {'tok/step':>8} {'clip':>4} {'tok/s':>9} {'TFLOPS':>7} " \
           f"{'MFU':>5} {'x stock':>7} {'GPU GiB':>7} {'host GiB':>8}  breakdown"
    print(head)
    for r in rows:
        if "error" in r:
            print(f"{r['system']:10} {r['shape']:13} ERROR {r['error']}")
            continue
        ref = stock.get((r["tokens_per_step"], r["clip"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}" if ref else "-"
        bd = r.get("breakdown")
        bds = " ".join(f"{k.replace('_busy', '')}={v:.2f}" for k, v in bd.items()) if bd else ""
        print(f"{r['system']:10} {r['shape']:13} {r['layers']:>3} {r['tokens_per_step']:>8} {r['clip']:>4} "
              f"{r['tokens_per_s']:>9.0f} {r['model_tflops']:>7.1f} {r.get('mfu', 0):>5.2f} {ratio:>7} "
              f"{r['gpu_peak_gib']:>7.1f} {r['host_peak_gib']:>8.1f}  {bds}")


if __name__ == "__main__":
    main()
