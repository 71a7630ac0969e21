"""DPO through the engine on a large shape, beside SFT at the same tokens per step (issue 36).

    python benchmarks/dpo_bench.py --shape llama-2-13b --pairs 8 --prompt 512 --completion 512 --steps 6 --out $OUT

MegaTrainDPOTrainer (sigmoid loss, default placement, bf16 compute over fp32 masters, clipping at 1.0) trains
the shape's random checkpoint (benchmarks/bench.py random_checkpoint, kept under --dir so that the SFT row of
the same call, `largest.py --tag _sft`, reads the same one) on made-up preference data: each example a prompt
of --prompt tokens and a chosen and a rejected completion of --completion tokens each (the demo's
character-level tokenizer, one token per letter; the prompt starts with <s>, each completion ends with </s>),
so a step of --pairs examples is 2 * pairs rows of prompt + completion tokens, none of them padding.

The engine computes the reference's log-probabilities in a forward-only pass over the training data before the
first step (inside the trainer's construction, TRL's precompute path): it is timed on its own, and the record
gives the steady tokens/s of the timed steps and the tokens/s with that pass counted once over all the
steps of the run (the data holds exactly --steps steps). Model FLOPs = 6 * P * tokens (every token real), MFU
against the bf16 matmul peak measured in this process after ~8 s of load. The GPU and host peaks stand beside
the planner's estimate for the placement the run used. The record: $OUT/dpo_<shape>_<layers>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench import make_clock, matmul_peak, random_checkpoint  # noqa: E402
from versions import versions, versions_line  # noqa: E402


def preference_data(n: int, prompt: int, completion: int, seed: int = 0):
    """n examples of letters: prompt `prompt - 1` letters (the tokenizer adds <s>), chosen and rejected
    `completion - 1` letters each (TRL appends </s>)."""
    import datasets

    from hf_megatrain.demo import LETTERS

    rng = random.Random(seed)

    def text(k):
        return "".join(rng.choice(LETTERS) for _ in range(k))

    rows = [(text(prompt - 1), text(completion - 1), text(completion - 1)) for _ in range(n)]
    return datasets.Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                                       "rejected": [r[2] for r in rows]})


def cpu_clock(warmup: int, steps: int):
    """make_clock's timing without CUDA (the script's CPU run: a check that it works, not a measurement)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == warmup:
                self.t0 = time.perf_counter()
            elif state.global_step == steps:
                self.seconds = time.perf_counter() - self.t0

    return Clock()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-2-13b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--pairs", type=int, default=8, help="preference examples per step (2 rows each)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--resident", default="auto", help="gpu_resident_layers")
    p.add_argument("--dir", default="/tmp/largest")
    p.add_argument("--folder", default=None, help="train this checkpoint folder instead of the shape's random one "
                   "(a tiny one runs the script on a CPU: no peak, no CUDA timing)")
    p.add_argument("--out", default=os.environ.get("OUT", "dpo_out"))
    opts = p.parse_args()
    import torch
    from transformers import AutoConfig

    from hf_megatrain.demo import build_tokenizer
    from hf_megatrain.dpo import MegaTrainDPOConfig, MegaTrainDPOTrainer

    os.makedirs(opts.out, exist_ok=True)
    stack = versions()
    print("VERSIONS " + versions_line(stack), flush=True)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    folder = opts.folder or random_checkpoint(opts.dir, opts.shape, opts.layers)
    tok = build_tokenizer()
    cfg = AutoConfig.from_pretrained(folder)
    rows, seq = 2 * opts.pairs, opts.prompt + opts.completion
    tokens = rows * seq
    record = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name() if cuda else "cpu", "command": " ".join(sys.argv),
              "versions": stack, "shape": opts.shape, "layers": cfg.num_hidden_layers, "loss_type": "sigmoid",
              "pairs_per_step": opts.pairs, "rows_per_step": rows, "row_tokens": seq, "tokens_per_step": tokens}
    record["peak"] = matmul_peak() if cuda else {"sustained_tflops": float("nan")}
    print("PEAK " + json.dumps(record["peak"]), flush=True)
    data = preference_data(opts.pairs * opts.steps, opts.prompt, opts.completion)

    ref_seconds = []  # the reference pass, timed where the trainer's construction runs it
    precompute = MegaTrainDPOTrainer._precompute_ref_logps

    def timed_precompute(self, *a, **kw):
        sync()
        t = time.perf_counter()
        try:
            return precompute(self, *a, **kw)
        finally:
            sync()
            ref_seconds.append(time.perf_counter() - t)

    MegaTrainDPOTrainer._precompute_ref_logps = timed_precompute
    settings = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=opts.pairs, gradient_accumulation_steps=1,
        max_steps=opts.steps, learning_rate=1e-6, max_grad_norm=opts.clip, lr_scheduler_type="constant", bf16=True,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=2,
        max_length=seq, loss_type=["sigmoid"], gpu_resident_layers=opts.resident, log_pipeline=False,
        save_dtype="bfloat16")
    if not cuda:
        settings.update(use_cpu=True, bf16=False, dataloader_num_workers=0)
    args = MegaTrainDPOConfig(**settings)
    t0 = time.perf_counter()
    trainer = MegaTrainDPOTrainer(model=folder, args=args, train_dataset=data, processing_class=tok)
    record["construct_s"] = round(time.perf_counter() - t0, 1)
    record["ref_pass_s"] = round(sum(ref_seconds), 2)
    print(f"BUILT in {record['construct_s']} s, reference pass {record['ref_pass_s']} s", flush=True)
    clock = make_clock(opts.warmup, opts.steps, trainer.engine) if cuda else cpu_clock(opts.warmup, opts.steps)
    trainer.add_callback(clock)
    t1 = time.perf_counter()
    trainer.train()
    record["train_s"] = round(time.perf_counter() - t1, 1)
    dt, steps = clock.seconds, opts.steps - opts.warmup
    params = trainer.engine.num_parameters
    tps = steps * tokens / dt
    # the reference pass counted once: every step of the run at the timed steps' pace, plus the pass
    tps_with_ref = opts.steps * tokens / (opts.steps * dt / steps + record["ref_pass_s"])
    from hf_megatrain.planner.estimator import GiB, estimate

    eng = trainer.engine.engine_config
    plan = estimate(cfg, rows, seq, eng)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    record.update(
        params=params, resident_layers=trainer.engine.resident_layers, step_s=round(dt / steps, 3),
        tokens_per_s=round(tps, 1), tokens_per_s_with_ref_pass=round(tps_with_ref, 1),
        model_tflops=round(6 * params * tps / 1e12, 1),
        mfu=round(6 * params * tps / 1e12 / record["peak"]["sustained_tflops"], 3),
        mfu_with_ref_pass=round(6 * params * tps_with_ref / 1e12 / record["peak"]["sustained_tflops"], 3),
        gpu_peak_gib=round(gpu_peak, 2), host_peak_gib=round(host_peak, 2),
        estimate_gpu_gib=round(plan.gpu_total / GiB, 2), estimate_host_gib=round(plan.host_total / GiB, 2),
        gpu_vs_estimate=round(gpu_peak / (plan.gpu_total / GiB), 3) if plan.gpu_total else None,
        host_vs_estimate=round(host_peak / (plan.host_total / GiB), 3),
        clip=opts.clip, lean_streamed=eng.lean_streamed, transient_grads=eng.transient_grads,
        loss=[round(h["loss"], 4) for h in logs],
        rewards_margins=[round(h.get("rewards/margins", float("nan")), 4) for h in logs])
    if trainer.step_time is not None:
        record.update(model=trainer.step_time.as_dict(), vs_model=round(tps / trainer.step_time.tokens_per_s, 3))
    name = f"dpo_{opts.shape}_{cfg.num_hidden_layers}.json"
    with open(os.path.join(opts.out, name), "w") as f:
        json.dump(record, f, indent=1)
    print("\n" + json.dumps({k: v for k, v in record.items() if k not in ("versions",)}, indent=1))


if __name__ == "__main__":
    main()
