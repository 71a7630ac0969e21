"""The largest model this box trains: a random checkpoint written to disk, then trained from it.

    python benchmarks/largest.py --shape llama-2-13b --steps 12 --out $OUT
    python benchmarks/largest.py --shape llama-3.1-70b --layers 12 --steps 6 --out $OUT
    python benchmarks/largest.py --shape qwen2.5-32b --layers fit --optim adafactor --steps 6 --out $OUT

--layers fit: the most decoder layers of the shape (its full depth first) whose run the trainer's own
planner admits on this machine (plan_run with its arguments, the free GPU and host memory now) and whose
bf16 checkpoint the disk under --dir holds.

1. Writes a random-init checkpoint of the shape as bf16 safetensors shards (tensor by tensor,
   generated on the GPU: no model is ever materialised in host RAM).
2. Prints the estimator's plan for hf_megatrain (automatic residency), for streaming every layer
   (all state in host RAM) and for stock Trainer (everything on the GPU: 16 bytes per parameter
   plus activations), against what this machine has; then *tries* the all-host run, which the
   admission check must refuse before allocating anything.
3. Trains the checkpoint with MegaTrainTrainer (fp32 master weights, fp32 Adam states or the state of
   --optim, clipping at 1.0) for --steps optimizer steps of --tokens tokens, and reports tokens/s, model TFLOPS
   (6 * P * tokens), GPU and host peaks, and from the pipeline trace the median seconds per
   decoder layer of forward, backward (with its recompute) and host AdamW: the inputs of the
   projection in BENCHMARKS.md.
The record ($OUT/largest_<shape>_<layers>.json) states the versions it ran on
(benchmarks/versions.py), printed as the first line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench import TokenRows, _collate, make_clock, matmul_peak, random_checkpoint  # noqa: E402
from versions import versions, versions_line  # noqa: E402

def plans(cfg, batch: int, seq: int, optim=None) -> dict:
    """optim: the run's optimizer (planner.estimator.optimizer_state; None: AdamW)."""
    import torch

    from hf_megatrain.planner.estimator import ADAMW, estimate, GiB, model_sizes

    from hf_megatrain.planner.machine import host_available

    from hf_megatrain.planner.placement import plan_placement

    opt = optim or ADAMW
    gpu_free = torch.cuda.mem_get_info()[0]
    resident, offload = plan_placement(cfg, batch, seq, gpu_free, host_free=host_available(), optimizer=opt)
    auto = estimate(cfg, batch, seq, resident_layers=resident, offload_activations=offload, optimizer=opt)
    streamed = estimate(cfg, batch, seq, resident_layers=0, optimizer=opt)
    sizes = model_sizes(cfg)
    params = sizes.params
    # fp32 weights and gradients and the optimizer's state (Adam: two moments), before any activation
    stock_gpu = 8 * params + sum(opt.unit_bytes(u) for u in sizes.units)
    return {
        "host_available_gib": round(host_available() / GiB, 1), "gpu_free_gib": round(gpu_free / GiB, 1),
        "auto": {"resident_layers": resident, "host_gib": round(auto.host_total / GiB, 1),
                 "gpu_gib": round(auto.gpu_total / GiB, 1)},
        "all_host": {"host_gib": round(streamed.host_total / GiB, 1), "gpu_gib": round(streamed.gpu_total / GiB, 1)},
        "stock_all_gpu": {"gpu_gib_min": round(stock_gpu / GiB, 1)},
    }


def fitting_layers(shape: str, arguments: dict, optim: str | None, root: str) -> int:
    """The most decoder layers of `shape` whose run (MegaTrainArguments(**arguments)) the trainer's planner
    admits on this machine, and whose bf16 checkpoint (2 bytes per parameter) the disk under `root` holds
    with 5% to spare; 0 if none."""
    import shutil

    import torch

    from hf_megatrain import MegaTrainArguments
    from hf_megatrain.planner import Machine, plan_run, request_from_arguments
    from hf_megatrain.planner.estimator import GiB, model_sizes
    from hf_megatrain.shapes import make_config

    os.makedirs(root, exist_ok=True)
    disk = shutil.disk_usage(root).free
    machine = Machine.measured("cuda")
    args = MegaTrainArguments(output_dir=tempfile.mkdtemp(), **arguments)
    request = request_from_arguments(args, torch.device("cuda"),
                                     optimizer="adamw" if not optim or optim.startswith("adamw") else optim)
    full = make_config(shape).num_hidden_layers
    for n in range(full, 0, -1):
        cfg = make_config(shape, n)
        params = model_sizes(cfg).params
        written = os.path.isdir(os.path.join(root, f"{shape}-{n}"))  # (bench.random_checkpoint's folder)
        if not written and 2 * params > 0.95 * disk:
            continue
        run = plan_run(cfg, request, machine)
        print(f"FIT {shape} x {n} layers ({params / 1e9:.2f} B): "
              + ("admitted" if run.refusal is None else run.refusal.splitlines()[0])
              + f"; host {run.memory.host_per_host / GiB:.1f} GiB, GPU {run.memory.gpu_total / GiB:.1f} GiB of "
              f"{machine.host_free / GiB:.1f} / {machine.gpu_free / GiB:.1f}, disk {disk / GiB:.0f} GiB free", flush=True)
        if run.refusal is None:
            return n
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-2-13b")
    p.add_argument("--layers", default=None,
                   help="decoder layers (default: the shape's); 'fit': the most the planner admits here (above)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--resident", default="auto", help="gpu_resident_layers of the training run")
    p.add_argument("--micro", type=int, default=0, help="rows per micro-batch (0: the whole step in one)")
    p.add_argument("--layer_major", default="auto", help="layer_major_accumulation: auto | true | false")
    p.add_argument("--skip_all_host", action="store_true", help="do not try the all-host run first")
    p.add_argument("--clip", type=float, default=1.0, help="max_grad_norm of the training run")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--learnable", action="store_true",
                   help="rows of a task the loss visibly falls on (bench.TokenRows)")
    p.add_argument("--lean_streamed", default="auto", help="lean_streamed of the training run: auto | true | false")
    p.add_argument("--transient_grads", default="auto", help="transient_grads of the training run: auto | true | false")
    p.add_argument("--skip_disk_check", action="store_true",
                   help="the training run saves nothing: skip the trainer's check for room to save a checkpoint "
                        "(18B on a 64 GiB disk: the source checkpoint leaves no room for a second one)")
    p.add_argument("--optim", default=None,
                   help="TrainingArguments.optim of the training run (adamw_torch, sgd, adagrad, rmsprop, adafactor; "
                        "default: MegaTrainArguments' default, AdamW)")
    p.add_argument("--optim_args", default=None, help="TrainingArguments.optim_args for --optim")
    p.add_argument("--tag", default="", help="suffix of the record's file name (two runs of one shape in one call)")
    p.add_argument("--dir", default="/tmp/largest")
    p.add_argument("--out", default=os.environ.get("OUT", "largest_out"))
    opts = p.parse_args()
    from hf_megatrain.planner.estimator import optimizer_state

    optim = optimizer_state(opts.optim or "adamw", opts.optim_args)  # a name or optim_args it cannot run: now
    import torch
    from transformers import AutoConfig, TrainerCallback

    from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer
    from hf_megatrain.engine.timeline import Timeline

    os.makedirs(opts.out, exist_ok=True)
    stack = versions()
    print("VERSIONS " + versions_line(stack), flush=True)
    bs = opts.tokens // opts.seq
    micro = min(bs, opts.micro or bs)
    common = dict(per_device_train_batch_size=micro, gradient_accumulation_steps=bs // micro,
                  layer_major_accumulation=opts.layer_major, max_steps=opts.steps, learning_rate=opts.lr,
                  max_grad_norm=opts.clip, lean_streamed=opts.lean_streamed, transient_grads=opts.transient_grads,
                  lr_scheduler_type="constant", bf16=True, logging_steps=1, save_strategy="no", report_to=[],
                  disable_tqdm=True, dataloader_num_workers=2, max_seq_length=opts.seq, log_pipeline=False,
                  save_dtype="bfloat16",  # the disk check then asks room for bf16 files beside the checkpoint
                  **(dict(optim=opts.optim, optim_args=opts.optim_args) if opts.optim else {}))
    layers = None if opts.layers is None else \
        fitting_layers(opts.shape, dict(common, gpu_resident_layers=opts.resident), opts.optim, opts.dir) \
        if opts.layers == "fit" else int(opts.layers)
    if layers == 0:
        raise SystemExit(f"no depth of {opts.shape} fits this machine with these settings")
    folder = random_checkpoint(opts.dir, opts.shape, layers)
    cfg = AutoConfig.from_pretrained(folder)
    record = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
              "versions": stack, "shape": opts.shape, "layers": cfg.num_hidden_layers,
              "optim": opts.optim or "adamw (default)", "optim_args": opts.optim_args,
              "plans": plans(cfg, bs, opts.seq, optim)}
    print("PLANS " + json.dumps(record["plans"]), flush=True)
    record["peak"] = matmul_peak()  # bf16 matmul TFLOP/s, burst and sustained (after ~8 s of load)
    print("PEAK " + json.dumps(record["peak"]), flush=True)
    data = TokenRows(bs * (opts.steps + 1), opts.seq, cfg.vocab_size, learnable=opts.learnable)

    try:  # streaming every layer: all state in host RAM. The admission check must say no, cleanly.
        if opts.skip_all_host:
            raise MegaTrainError("not tried (--skip_all_host)")
        MegaTrainTrainer(folder, MegaTrainArguments(output_dir=tempfile.mkdtemp(), gpu_resident_layers="0", **common),
                         train_dataset=data, data_collator=_collate)
        record["all_host_attempt"] = "accepted (it fits this machine)"
    except MegaTrainError as e:
        record["all_host_attempt"] = "refused: " + str(e).splitlines()[0]
    print("ALL-HOST " + record["all_host_attempt"], flush=True)

    if opts.skip_disk_check:  # the run never saves; its checkpoint alone may fill a small disk
        import hf_megatrain.trainer

        hf_megatrain.trainer.check_disk = lambda args, model: None
    t0 = time.perf_counter()
    trainer = MegaTrainTrainer(folder, MegaTrainArguments(output_dir=tempfile.mkdtemp(), gpu_resident_layers=opts.resident,
                                                          **common),
                               train_dataset=data, data_collator=_collate)
    record["load_s"] = round(time.perf_counter() - t0, 1)
    timeline = Timeline()

    def on_warm():
        trainer.engine.attach_timeline(timeline)

    from hf_megatrain.planner.estimator import GiB

    from hf_megatrain.planner.machine import host_available

    marks = []  # per step: wall time, the allocator's retries so far, the host's MemAvailable

    class Progress(TrainerCallback):  # one line per step: a run cut short still says how far it got
        def on_step_end(self, args, state, control, **kw):
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            # A step much slower than its layers add up to: the caching allocator freeing its cache
            # and retrying near a full card (retries), or the host reclaiming memory (MemAvailable)?
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            marks.append((time.perf_counter(), retries, host_available() / GiB))
            print(f"STEP {state.global_step} t={time.perf_counter() - t0:.1f}s gpu_peak="
                  f"{torch.cuda.max_memory_allocated() / 2**30:.1f}GiB host_peak={rss:.1f}GiB "
                  f"alloc_retries={retries} host_available={marks[-1][2]:.1f}GiB", flush=True)

    clock = make_clock(opts.warmup, opts.steps, trainer.engine, on_warm)
    trainer.add_callback(clock)
    trainer.add_callback(Progress())
    trainer.train()
    dt = clock.seconds
    steps = opts.steps - opts.warmup
    params = trainer.engine.num_parameters
    tps = steps * opts.tokens / dt
    collected = timeline.collect()
    spans = collected["spans"]
    with open(os.path.join(opts.out, f"trace_largest_{opts.shape}_{cfg.num_hidden_layers}{opts.tag}.json"), "w") as f:
        json.dump({"spans": spans[-6000:], "wall_s": collected["wall_s"]}, f)
    n = cfg.num_hidden_layers
    # the per-layer medians below read one micro-batch per step's spans in order
    compute = [b - a for lane, a, b in sorted(spans, key=lambda s: s[1]) if lane == "compute"] if micro == bs else []
    per_step = 2 * n + 3  # embedding, n layers, head + loss, n layer backwards, embedding backward
    fwd = [compute[k * per_step + 1 + i] for k in range(len(compute) // per_step) for i in range(n)]
    bwd = [compute[k * per_step + n + 2 + i] for k in range(len(compute) // per_step) for i in range(n)]
    steps_seen = range(len(compute) // per_step)
    head = [compute[k * per_step + n + 1] for k in steps_seen]  # final norm, lm_head, loss and their backward
    embed = [compute[k * per_step] + compute[k * per_step + 2 * n + 2] for k in steps_seen]
    opt = [b - a for lane, a, b in spans if lane == "optimizer"]
    record.update(
        params=params, resident_layers=trainer.engine.resident_layers, tokens_per_step=opts.tokens,
        micro_batches=f"{micro // trainer._split}x{bs // micro * trainer._split}"
        + (" together" if trainer._per_pass > 1 else "") + (f" (asked {micro}x{bs // micro})" if trainer._split > 1 else ""),
        step_s=round(dt / steps, 3), tokens_per_s=round(tps, 1), model_tflops=round(6 * params * tps / 1e12, 1),
        mfu=round(6 * params * tps / 1e12 / record["peak"]["sustained_tflops"], 3),
        gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        gpu_reserved_peak_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
        host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        layer_forward_s=round(statistics.median(fwd), 4) if fwd else None,
        layer_backward_s=round(statistics.median(bwd), 4) if bwd else None,
        head_loss_s=round(statistics.median(head), 4) if head else None,
        embedding_s=round(statistics.median(embed), 4) if embed else None,
        host_adamw_unit_s=round(statistics.median(opt), 4) if opt else None,  # (--optim's step, if another)
        loss=[round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h],
        step_times_s=[round(b[0] - a[0], 2) for a, b in zip(marks, marks[1:])],
        alloc_retries=[m[1] for m in marks], host_available_gib=[round(m[2], 1) for m in marks],
        breakdown={k: v for k, v in collected.items() if k.endswith("_busy") or k == "gpu_idle"},
    )
    # the estimator for the placement the run used, beside the measured peaks (host: the process's
    # peak RSS; GPU: max_memory_allocated, which leaves out the CUDA context the estimate counts)
    from hf_megatrain.planner.estimator import estimate
    from hf_megatrain.planner.placement import one_at_a_time

    eng = trainer.engine.engine_config  # the placement and memory modes the run was built with
    plan = estimate(cfg, micro // trainer._split, opts.seq, eng, micro_batches=trainer._per_pass,
                    later_contributions=one_at_a_time(bs // micro, trainer._split, trainer._per_pass), optimizer=optim)
    record.update(estimate_host_gib=round(plan.host_total / GiB, 2), estimate_gpu_gib=round(plan.gpu_total / GiB, 2),
                  host_vs_estimate=round(record["host_peak_gib"] / (plan.host_total / GiB), 3),
                  gpu_vs_estimate=round(record["gpu_peak_gib"] / (plan.gpu_total / GiB), 3),
                  clip=opts.clip, lean_resident=eng.lean_resident, lean_streamed=eng.lean_streamed,
                  transient_grads=eng.transient_grads, gpu_grad_layers=eng.gpu_grad_layers)
    if trainer.step_time is not None:  # the step-time model's prediction (hf_megatrain/planner/steptime.py)
        record.update(model=trainer.step_time.as_dict(), vs_model=round(tps / trainer.step_time.tokens_per_s, 3))
    with open(os.path.join(opts.out, f"largest_{opts.shape}_{cfg.num_hidden_layers}{opts.tag}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("\n" + json.dumps({k: v for k, v in record.items() if k not in ("plans", "loss", "alloc_retries",
                                                                           "host_available_gib")}, indent=1))
    if os.environ.get("LARGEST_KEEP") != "1":
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
