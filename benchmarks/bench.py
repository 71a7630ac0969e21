"""Side-by-side training throughput: hf_megatrain vs stock Trainer vs FSDP2 / DeepSpeed offload.

One command, one machine, one run: every system trains the same random-init shape on the same
synthetic tokens for a fixed number of optimizer steps, each in its own process (clean GPU
memory and RSS), and the table compares them with ratios. Model FLOPs are 6 * P * tokens
(P = all parameters, every token real: no padding); for a mixture of experts P is the active
parameters, those a token computes with (every expert weight counts top_k / num_experts of its
size; attention, router, shared experts, embeddings and head count whole), and the rows give both. MFU is against the bf16 matmul peak
measured in the same run after several seconds of load (the H200 power-caps from ~790 to
~660 TFLOP/s); the burst peak is reported beside it.

Systems:
  megatrain  hf_megatrain (weights and optimizer in host RAM, one layer at a time on the GPU)
  stock      transformers.Trainer, everything on the GPU, gradient checkpointing, fused AdamW
  stock_bf16 the same with bf16 parameters (bf16 weights, gradients and Adam states): not the
             same training, only a speed anchor where stock's fp32 parameters are slow for a reason
             other than memory (HF's MoE expert kernels under autocast)
  fsdp2      Trainer + FSDP2 with CPUOffloadPolicy (params, grads, optimizer state and step on
             the CPU), activation checkpointing per decoder layer, fused AdamW on the CPU
  deepspeed  Trainer + DeepSpeed ZeRO-3, offload_param and offload_optimizer to pinned CPU
             memory, DeepSpeedCPUAdam (JIT-built on first use), gradient checkpointing
fsdp2 and deepspeed run as a one-rank torch.distributed job, one process per (tokens, clip).
deepspeed is imported only from --ds_site (device_run.sh installs .dswhl/*.whl there), so it is
never visible to the other systems: transformers changes behaviour when it can import it.

    python benchmarks/bench.py --shape llama-3.2-3b --tokens 16384 65536 --clip 1.0 0.0 \
        --systems megatrain,stock,fsdp2,deepspeed --steps 8 --out $OUT

Writes $OUT/bench_<shape>.json (every number) and prints a table last. A system that fails gets
a row with its error (the exception, or the last error line of $OUT/<system>_<shape>.log).
The record states the versions it ran on (benchmarks/versions.py: Python, torch, CUDA,
transformers, accelerate, peft, GPU and driver, hf_megatrain commit), printed first and in the
table's header; each row names the checkout whose code ran it ("code": a `megatrain:R@DIR` row
ran DIR's hf_megatrain and bench worker).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from versions import code_version, describe_code, versions, versions_line  # noqa: E402


# -- the matmul peak -------------------------------------------------------------------------
def _matmul_peak(seconds: float) -> dict:
    from hf_megatrain.planner.probe import matmul_rates  # what hf-megatrain probe measures

    burst, sustained = matmul_rates(seconds)
    return {"burst_tflops": round(burst, 1), "sustained_tflops": round(sustained, 1)}


def matmul_peak(seconds: float = 8.0) -> dict:
    import torch

    peak = _matmul_peak(seconds)
    torch.cuda.empty_cache()  # the caller lives on beside the benchmark's workers: keep no GPU cache
    return peak


# -- a random-init model, fast ---------------------------------------------------------------
def build_model(shape: str, layers: int | None, device: str, seq: int, tiny: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_megatrain.shapes import make_config

    cfg = make_config(shape, 2 if tiny else layers, max_positions=max(seq, 4096))
    cfg._attn_implementation = "sdpa"
    if tiny:  # --dry_run: same architecture, toy widths, so the CPU-only check takes seconds
        cfg.update(dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=512))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the tied head its own storage: tie it again (3.2-1B/3B are tied)
    rng = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=rng).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # random numbers are made on the GPU: a CPU normal_ of 12 GB takes minutes
                p.copy_(torch.randn(p.shape, device=rng, generator=gen).mul_(0.02))
    rot = model.model.rotary_emb
    model.model.rotary_emb = type(rot)(config=cfg).to(device)
    return model


def active_parameters(config) -> tuple[int, int]:
    """(all, active) parameters of the config's causal LM, counted on a meta copy. A routed expert's
    weights count top_k / num_experts of their size (the step-time model's rule: routed_per_layer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_megatrain.planner.steptime import routed_per_layer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    idle = sum(n * (1 - frac) for n, frac in routed_per_layer(config).values())
    return total, total - round(idle)


def write_random_checkpoint(shape: str, layers: int | None, folder: str, max_positions: int = 131072) -> int:
    """A random-init checkpoint of the shape as bf16 safetensors shards of ~4 GB, tensor by tensor
    (generated on the GPU: no model is materialised in host RAM). Returns its size in bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from hf_megatrain.shapes import make_config

    cfg = make_config(shape, layers, max_positions=max_positions)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    os.makedirs(folder, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: small shapes, for checking the plumbing)
    gen = torch.Generator(device=dev).manual_seed(0)
    shard, size, files, index = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
            files.append(name)
            index.update({k: name for k in shard})
            shard, size = {}, 0

    total = 0
    for name, p in model.named_parameters():  # a tied head is not written twice
        if "norm" in name:
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(p.shape, device=dev, generator=gen).mul_(0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= (4 << 30):
            flush()
    flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(folder)
    if dev == "cuda":
        torch.cuda.empty_cache()  # the driver process lives on beside the workers: keep no GPU cache
    return total


def random_checkpoint(root: str, shape: str, layers: int | None, max_positions: int = 131072) -> str:
    """The shape's random checkpoint folder under `root`, written on first use (into a .partial
    folder renamed when complete, so a run cut short never leaves a half-written one behind)."""
    folder = os.path.join(root, f"{shape}-{layers or 'full'}")
    if not os.path.isdir(folder):
        t0 = time.perf_counter()
        shutil.rmtree(folder + ".partial", ignore_errors=True)
        nbytes = write_random_checkpoint(shape, layers, folder + ".partial", max_positions)
        os.rename(folder + ".partial", folder)
        print(f"wrote {nbytes / 1e9:.1f} GB of bf16 safetensors in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


class TokenRows:
    """Token rows (all real tokens; labels = inputs), as a torch Dataset: random ones, or with
    `learnable` a task a model learns in a few steps (each row counts through 64 token ids from a
    random start with a random stride, so the loss falls from about ln(vocab) as the model finds
    the 64 ids and then the stride)."""

    def __init__(self, rows: int, seq: int, vocab: int, learnable: bool = False):
        import torch

        g = torch.Generator().manual_seed(1)
        if learnable:
            start = torch.randint(0, 64, (rows, 1), generator=g)
            stride = torch.randint(1, 8, (rows, 1), generator=g)
            self.ids = min(1000, vocab - 64) + (start + stride * torch.arange(seq)) % 64
        else:
            self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _collate(rows):
    import torch

    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


# -- the offload baselines: Trainer set up for FSDP2 or DeepSpeed ---------------------------------
DISTRIBUTED = ("fsdp2", "deepspeed")  # one-rank torch.distributed jobs, one process per config
WHERE: dict = {}  # the config a worker is on, for its error row


def deepspeed_config() -> dict:
    """ZeRO-3 with parameters and optimizer state offloaded to pinned host memory. Trainer fills the
    "auto" values from TrainingArguments (micro-batch, accumulation, clipping, AdamW hyper-parameters,
    bf16) and from the model width (bucket sizes), so the run matches the stock one."""
    return {
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        # With an "optimizer" section DeepSpeed builds the optimizer itself, and with the optimizer
        # offloaded to the CPU that is DeepSpeedCPUAdam (AdamW mode). No "scheduler" section: Trainer's
        # constant schedule is used, as for the other systems.
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
        "steps_per_print": 2**31, "wall_clock_breakdown": False,
    }


def build_cpu_adam() -> str:
    """JIT-compile DeepSpeedCPUAdam before anything else, so that the compile (ninja, the host C++
    compiler, the Python headers) is not part of the run, and a failed build is one readable error row
    rather than a traceback from deep inside Trainer.train(). There is no fallback optimizer."""
    import deepspeed
    from deepspeed.ops.op_builder import CPUAdamBuilder

    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as e:
        # torch puts the ninja / compiler output into the exception text: keep the lines naming the fault
        lines = str(e).splitlines() or [type(e).__name__]
        hits = [ln.strip()[:240] for ln in lines[1:] if re.search(r"error|not found|no such file", ln, re.IGNORECASE)]
        raise RuntimeError("DeepSpeedCPUAdam JIT build failed: "
                           + " | ".join(dict.fromkeys(hits[:4] or [lines[0][:240]]))) from e
    return deepspeed.__version__


def trainer_args(opts, model, common: dict):
    """TrainingArguments for the Trainer systems. --dry_run builds them on the CPU (gloo)."""
    from transformers import TrainingArguments

    kw = dict(common, use_cpu=opts.dry_run)
    if opts.dry_run and opts.system in DISTRIBUTED:
        kw["ddp_backend"] = "gloo"
    if opts.system in ("stock", "stock_bf16"):  # --optim: the optimizer asked for, as hf_megatrain runs it
        return TrainingArguments(**kw, gradient_checkpointing=True, optim=opts.optim or "adamw_torch_fused",
                                 optim_args=opts.optim_args)
    if opts.system == "fsdp2":
        # cpu_offload=True becomes torch's CPUOffloadPolicy (pinned host shards, gradients moved to the
        # host), so the optimizer steps on the CPU: the fused AdamW kernel has a CPU implementation.
        # Checkpointing is FSDP's own (a checkpoint wrapper around each decoder layer): Trainer refuses
        # it together with gradient_checkpointing, which would also gather every layer a second time.
        layer = type(model.model.layers[0]).__name__
        return TrainingArguments(**kw, optim="adamw_torch_fused", fsdp=True, fsdp_config={
            "version": 2, "cpu_offload": True, "activation_checkpointing": True,
            "transformer_layer_cls_to_wrap": [layer]})
    if opts.system == "deepspeed":
        return TrainingArguments(**kw, gradient_checkpointing=True, deepspeed=deepspeed_config())
    raise ValueError(f"unknown system {opts.system!r}")


def describe(trainer) -> dict:
    """--dry_run: what the Trainer is set up to do, read back from its arguments and accelerator."""
    a = trainer.args
    d = dict(micro=a.per_device_train_batch_size, accumulation=a.gradient_accumulation_steps,
             optim=getattr(a.optim, "value", a.optim), gradient_checkpointing=a.gradient_checkpointing,
             bf16=a.bf16, world_size=a.world_size)
    if a.fsdp_plugin_args:  # accelerate attaches FSDP on GPUs only, so build the plugin it would use
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(**a.fsdp_plugin_args)
        d.update(fsdp_version=plugin.fsdp_version, offload=repr(plugin.cpu_offload),
                 activation_checkpointing=plugin.activation_checkpointing,
                 wrap=plugin.transformer_cls_names_to_wrap)
    if trainer.is_deepspeed_enabled:
        cfg = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
        d.pop("optim")  # DeepSpeed builds its own, from the config
        d["deepspeed"] = {k: cfg[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                              "train_batch_size", "gradient_clipping", "bf16", "optimizer",
                                              "zero_optimization")}
    return d


def brief(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:500]


# -- one system, several configs, in this process ----------------------------------------------
def make_clock(warmup: int, steps: int, engine=None, on_warm=None):
    """A Trainer callback timing optimizer steps warmup+1 .. steps.

    The clock stops at the end of the last step, once its work is done: the GPU queue drained and,
    for hf_megatrain, the host optimizer's last unit stepped. What train() does after its loop
    (saving, freeing) is not a training step and is not timed.
    """
    import torch
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.t0 = self.t1 = None

        def on_step_end(self, args, state, control, **kw):
            if state.global_step not in (warmup, steps):
                return
            if engine is not None:
                engine.synchronize()  # every gradient on the host, every unit stepped
            torch.cuda.synchronize()
            now = time.perf_counter()
            if state.global_step == warmup:
                self.t0 = now
                torch.cuda.reset_peak_memory_stats()
                if on_warm:
                    on_warm()
            else:
                self.t1 = now

        @property
        def seconds(self) -> float:
            return self.t1 - self.t0

    return Clock()


def worker(opts) -> None:
    import torch

    if opts.dry_run and opts.system == "megatrain":
        raise RuntimeError("--dry_run covers the Trainer systems (stock, fsdp2, deepspeed) only")
    stock_optim = (opts.optim or "adamw_torch_fused") + (f" ({opts.optim_args})" if opts.optim_args else "")
    setup = {
        "stock": f"all on GPU, gradient checkpointing, {stock_optim}",
        "stock_bf16": f"all on GPU in bf16 parameters (speed anchor), gradient checkpointing, {stock_optim}",
        "fsdp2": "FSDP2 CPUOffloadPolicy, activation checkpointing per layer, adamw_torch_fused on CPU",
        "deepspeed": "ZeRO-3, offload param+optimizer to pinned CPU, DeepSpeedCPUAdam, gradient checkpointing",
    }.get(opts.system)
    if opts.system == "deepspeed":
        setup += f", deepspeed {build_cpu_adam()}"
    torch.backends.cuda.matmul.allow_tf32 = True
    # The offload systems get the model on the GPU, like stock: FSDP2 / ZeRO-3 move the shards to the host.
    device = "cpu" if opts.system == "megatrain" or opts.dry_run else "cuda"
    if opts.system == "megatrain" and opts.checkpoint:
        # Loaded by hf_megatrain itself, straight into its host store: the host peak is the run's
        # own (building an fp32 model on the host first would add 4 bytes/param: 30 GB at 7B).
        from transformers import AutoConfig

        model = opts.checkpoint
        config = AutoConfig.from_pretrained(model)
        params = None  # counted by the engine
    else:
        model = build_model(opts.shape, opts.layers, device, opts.seq, tiny=opts.dry_run)
        if opts.system == "stock_bf16":
            model = model.to(torch.bfloat16)
        config = model.config
        params = sum(p.numel() for p in model.parameters())
    total, active = active_parameters(config)
    vocab = config.vocab_size
    for tokens in opts.tokens:
        for clip in opts.clip:
            WHERE.update(tokens_per_step=tokens, clip=clip)
            bs = tokens // opts.seq
            data = TokenRows(bs * (opts.steps + 1), opts.seq, vocab)
            # hf_megatrain takes the whole step as one micro-batch (the GPU holds one layer, so
            # activations fit); the Trainer systems would need [B, T, vocab] fp32 logits at once, so
            # they run micro-batches of --stock_micro rows with gradient accumulation.
            micro = min(bs, opts.mega_micro or bs) if opts.system == "megatrain" else min(bs, opts.stock_micro)
            common = dict(
                output_dir=tempfile.mkdtemp(), per_device_train_batch_size=micro,
                gradient_accumulation_steps=bs // micro, max_steps=opts.steps,
                learning_rate=1e-5, max_grad_norm=clip, lr_scheduler_type="constant", bf16=True,
                logging_steps=opts.steps, save_strategy="no", report_to=[], disable_tqdm=True,
                dataloader_num_workers=2, seed=0,
            )
            # --optim (TrainingArguments' names) for hf_megatrain and stock; fsdp2 / deepspeed keep their AdamW
            optim = dict(optim=opts.optim, optim_args=opts.optim_args) if opts.optim else {}
            timeline, engine = None, None
            if opts.system == "megatrain":
                from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
                from hf_megatrain.engine.timeline import Timeline

                trainer = MegaTrainTrainer(model, MegaTrainArguments(**common, **optim, log_pipeline=False,
                                                                     gpu_resident_layers=opts.resident,
                                                                     layer_major_accumulation=opts.layer_major),
                                           train_dataset=data,
                                           data_collator=_collate)
                engine = trainer.engine
                params = engine.num_parameters
                active = params - (total - active)  # the engine counts a tied head once, like the model

                def on_warm(engine=engine):
                    nonlocal timeline
                    timeline = Timeline()
                    engine.attach_timeline(timeline)
            else:
                from transformers import Trainer

                on_warm = None
                trainer = Trainer(model=model, args=trainer_args(opts, model, common),
                                  train_dataset=data, data_collator=_collate)
            if opts.dry_run:
                print("DRYRUN " + json.dumps(dict(system=opts.system, shape=opts.shape, tokens_per_step=tokens,
                                                  clip=clip, dry_run=describe(trainer))), flush=True)
                continue
            clock = make_clock(opts.warmup, opts.steps, engine, on_warm)
            trainer.add_callback(clock)
            trainer.train()
            dt = clock.seconds
            steps = opts.steps - opts.warmup
            tps = steps * tokens / dt
            row = dict(
                system=opts.system, shape=opts.shape, layers=config.num_hidden_layers, params=params,
                tokens_per_step=tokens, clip=clip, optim=getattr(trainer.args.optim, "value", trainer.args.optim),
                optim_args=trainer.args.optim_args, step_s=round(dt / steps, 4), tokens_per_s=round(tps, 1),
                active_params=active, model_tflops=round(6 * active * tps / 1e12, 1),
                gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            )
            if setup:
                row["setup"] = setup
            if engine is not None:  # which layers lived on the GPU (the rest streamed), how the step was split
                row["resident_layers"] = engine.resident_layers
                if trainer.step_time is not None:  # the step-time model's prediction (hf_megatrain/planner/steptime.py)
                    row["model"] = trainer.step_time.as_dict()
                    row["vs_model"] = round(tps / trainer.step_time.tokens_per_s, 3)
                cut = trainer._split
                row["micro_batches"] = f"{micro // cut}x{bs // micro * cut}" + (" together" if trainer._per_pass > 1 else "")
            if timeline is not None:
                b = timeline.collect()
                row["breakdown"] = {k: v for k, v in b.items() if k.endswith("_busy") or k == "gpu_idle"}
                if opts.trace_out:
                    with open(opts.trace_out, "w") as f:
                        json.dump({"spans": b["spans"][-4000:], "wall_s": b["wall_s"]}, f)
            print("RESULT " + json.dumps(row), flush=True)
            # Drop every reference to this run's engine before the next one builds its store:
            # two host stores of a 3B model do not fit in 128 GiB.
            trainer = engine = timeline = on_warm = clock = None
            gc.collect()
            torch.cuda.empty_cache()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------------
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)|Fatal Python error"
                        r"|Killed|Segmentation fault)\b.*)")


def log_error(text: str, rc: int) -> str:
    """For a worker that died without an ERROR row (killed, crashed in C++): the last line of its log
    that names an exception, else its last line that is not a warning."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [m.group(1) for m in map(ERROR_LINE.match, lines) if m]
    line = hits[-1] if hits else next((ln for ln in reversed(lines) if "warn" not in ln.lower()), "")
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
    if rc == -signal.SIGKILL:
        how += " (host out of memory?)"
    return f"{how}: {line}"[:500]


def host_free_gib() -> float:
    from hf_megatrain.planner.estimator import GiB
    from hf_megatrain.planner.machine import host_available

    return round(host_available() / GiB, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(cmd: list, env: dict, log_path: str, header: str) -> tuple[list, int, str]:
    """One worker process, stdout and stderr appended to its log; returns its rows, exit code and log text."""
    with open(log_path, "a") as log:
        log.write(f"===== {header}\n")
        log.flush()
        start = log.tell()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    with open(log_path, errors="replace") as f:
        f.seek(start)
        text = f.read()
    tags = ("RESULT {", "ERROR {", "DRYRUN {")
    rows = [json.loads(ln.split(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(tags)]
    return rows, rc, text


def run_system(system: str, opts) -> list:
    # megatrain:0@DIR: that checkout's hf_megatrain (its own benchmarks/bench.py runs the worker),
    # so an earlier commit and this one are compared in one run, on one card
    system, _, source = system.partition("@")
    system, _, resident = system.partition(":")  # megatrain:auto, megatrain:0 = gpu_resident_layers
    resident = resident or opts.resident
    script = os.path.join(source, "benchmarks", "bench.py") if source else __file__
    tag = f"@{os.path.basename(os.path.normpath(source))}" if source else ""
    code = code_version(source or os.path.dirname(HERE))  # which checkout's code this system's rows ran
    stem = tag.replace("@", "-").replace("-.", "-")  # file names in letters, digits, '-', '_', '.'
    stem += f"_{opts.optim}" if opts.optim else ""

    base = [sys.executable, script, "--system", system, "--shape", opts.shape, "--seq", str(opts.seq),
            "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--stock_micro", str(opts.stock_micro),
            "--resident", resident, "--mega_micro", str(opts.mega_micro or 0), "--layer_major", opts.layer_major]
    if opts.layers:
        base += ["--layers", str(opts.layers)]
    if opts.optim:
        base += ["--optim", opts.optim] + (["--optim_args", opts.optim_args] if opts.optim_args else [])
    if opts.dry_run:
        base += ["--dry_run"]
    if system == "megatrain" and opts.from_disk:
        base += ["--checkpoint", random_checkpoint(opts.from_disk, opts.shape, opts.layers, max(opts.seq, 4096))]
    if system == "megatrain":
        base += ["--trace_out", os.path.join(opts.out, f"trace_{opts.shape}_resident-{resident}{stem}.json")]
    env = dict(os.environ)
    if system in DISTRIBUTED:  # a one-rank job, with the environment `torchrun --nproc_per_node 1` gives
        env.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    if system == "deepspeed":
        if not os.path.isdir(os.path.join(opts.ds_site, "deepspeed")):
            return [dict(system=system + tag, shape=opts.shape, code=code,
                         error=f"no deepspeed package in --ds_site {opts.ds_site} "
                               "(device_run.sh installs .dswhl/*.whl there)")]
        # Only this process sees deepspeed; its bin/ has the ninja that the CPUAdam JIT build runs.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [opts.ds_site, env.get("PYTHONPATH")]))
        env["PATH"] = os.pathsep.join(filter(None, [os.path.join(opts.ds_site, "bin"), env.get("PATH")]))
    # FSDP2 and ZeRO-3 shard and hook the model in place, so it cannot be handed to a second Trainer:
    # those systems get a fresh process (and model) per config, which also keeps each host peak its own.
    clips = opts.baseline_clip if system in DISTRIBUTED and opts.baseline_clip else opts.clip
    # hf_megatrain too: a 3B host store is ~55 GiB, and two of them do not fit a 128 GiB host.
    if system in DISTRIBUTED or system == "megatrain":
        configs = [([t], [c]) for t in opts.tokens for c in clips]
    else:
        configs = [(opts.tokens, clips)]
    log_path = os.path.join(opts.out, f"{system}{resident if system == 'megatrain' else ''}{stem}_{opts.shape}.log")
    open(log_path, "w").close()
    rows = []
    for tokens, clips in configs:
        if system in DISTRIBUTED:
            env["MASTER_PORT"] = str(free_port())
        cmd = base + ["--tokens", *map(str, tokens), "--clip", *map(str, clips)]
        free = host_free_gib()  # a SIGKILL below is easier to read knowing what the host had
        got, rc, text = run_worker(cmd, env, log_path, f"tokens {tokens} clip {clips} (host MemAvailable {free} GiB)")
        for r in got:
            r["system"] += tag
            r["code"] = code
        if rc != 0 and not any("error" in r for r in got):
            err = dict(system=system + tag, shape=opts.shape, code=code,
                       error=f"{log_error(text, rc)} (see {log_path})")
            if len(tokens) == len(clips) == 1:
                err.update(tokens_per_step=tokens[0], clip=clips[0])
            got.append(err)
        rows += got
        if any("error" in r and "tokens_per_step" not in r for r in got):
            break  # it failed before training (import, CPUAdam build, model): the other configs would too
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-3b")
    p.add_argument("--layers", type=int, default=None, help="truncate to this many decoder layers")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536], help="tokens per optimizer step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--clip", type=float, nargs="+", default=[1.0])
    p.add_argument("--systems", default="megatrain,stock", help="comma list of megatrain, stock, stock_bf16, fsdp2, deepspeed")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stock_micro", type=int, default=16,
                   help="rows per micro-batch for the Trainer systems (stock, fsdp2, deepspeed)")
    p.add_argument("--mega_micro", type=int, default=0,
                   help="rows per micro-batch for hf_megatrain (0: the whole step in one)")
    p.add_argument("--layer_major", default="auto",
                   help="hf_megatrain layer_major_accumulation: auto | true | false")
    p.add_argument("--resident", default="0", help="hf_megatrain gpu_resident_layers: 0 (stream all), N or auto; "
                   "per run as a system name: --systems megatrain:0,megatrain:auto,stock")
    p.add_argument("--optim", default=None,
                   help="the optimizer of hf_megatrain and stock (TrainingArguments.optim: adamw_torch, sgd, adagrad, "
                        "rmsprop, adafactor, ...; default: hf_megatrain's default and stock's adamw_torch_fused); "
                        "fsdp2 and deepspeed keep their AdamW")
    p.add_argument("--optim_args", default=None, help="TrainingArguments.optim_args for --optim")
    p.add_argument("--baseline_clip", type=float, nargs="+", default=None,
                   help="--clip values for fsdp2 / deepspeed (default: the same as --clip)")
    p.add_argument("--ds_site", default=os.environ.get("DS_SITE", "/tmp/dssite"),
                   help="folder holding deepspeed and its dependencies, put on the path of the deepspeed run only")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--from_disk", default=None, metavar="DIR",
                   help="hf_megatrain loads a random bf16 checkpoint written under DIR (7B+: no fp32 model "
                        "is built on the host beside its store)")
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trace_out", default=None, help=argparse.SUPPRESS)
    # CPU-only check: a toy-width model, TrainingArguments and Trainer built for each system, no training
    p.add_argument("--dry_run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--skip_peak", action="store_true")
    opts = p.parse_args()
    if opts.system:
        try:
            worker(opts)
        except Exception as e:
            traceback.print_exc()  # the whole story stays in the log; the row gets the gist
            print("ERROR " + json.dumps(dict(system=opts.system, shape=opts.shape, **WHERE, error=brief(e))),
                  flush=True)
            sys.stderr.flush()
            os._exit(1)  # no interpreter teardown: a half-built NCCL group or engine thread could hang it
        return

    os.makedirs(opts.out, exist_ok=True)
    stack = versions()
    print("VERSIONS " + versions_line(stack), flush=True)
    skip = opts.skip_peak or opts.dry_run
    peak = {"burst_tflops": None, "sustained_tflops": None} if skip else matmul_peak()
    print("PEAK " + json.dumps(peak), flush=True)
    rows = []
    record = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "versions": stack, "peak": peak,
              "optim": opts.optim, "optim_args": opts.optim_args, "rows": rows}
    if stack["gpu"]:
        record["card"] = stack["gpu"]
    sustained = peak["sustained_tflops"]
    for system in opts.systems.split(","):
        rows += run_system(system, opts)
        for r in rows:
            if sustained and "model_tflops" in r:
                r["mfu"] = round(r["model_tflops"] / sustained, 3)
        named = f"bench_{opts.shape}" + (f"_{opts.optim}" if opts.optim else "")  # (two optimizers in one $OUT)
        with open(os.path.join(opts.out, f"{named}.json"), "w") as f:  # after each system: a
            json.dump(record, f, indent=1)  # run cut short by a time limit keeps what it measured
    print_table(record)


def print_table(record) -> None:
    rows = record["rows"]
    print(f"\n{record.get('card', '?')}  {record['date']}  peak bf16 burst/sustained "
          f"{record['peak']['burst_tflops']}/{record['peak']['sustained_tflops']} TFLOP/s")
    if "versions" in record:
        print(versions_line(record["versions"]))
    def by_config(system):
        return {(r["tokens_per_step"], r["clip"]): r["tokens_per_s"] for r in rows
                if r.get("system") == system and "tokens_per_s" in r}

    stock, anchor = by_config("stock"), by_config("stock_bf16")
    head = f"{'system':24} {'shape':13} {'L':>3} {'tok/step':>8} {'clip':>4} {'tok/s':>9} {'TFLOPS':>7} " \
           f"{'MFU':>5} {'x stock':>7} {'x bf16':>6} {'x model':>7} {'GPU GiB':>7} {'host GiB':>8}  breakdown"
    print(head)
    for r in rows:
        if "tokens_per_s" not in r:  # an error, or a --dry_run row
            what = f"ERROR {r['error']}" if "error" in r else f"DRY RUN {json.dumps(r.get('dry_run'))}"
            print(f"{r['system']:24} {r['shape']:13} {'':>3} {r.get('tokens_per_step', '-'):>8} "
                  f"{r.get('clip', '-'):>4}  {what}")
            continue
        ref, fair = stock.get((r["tokens_per_step"], r["clip"])), anchor.get((r["tokens_per_step"], r["clip"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}" if ref else "-"
        ratio_bf16 = f"{r['tokens_per_s'] / fair:.2f}" if fair else "-"
        bd = r.get("breakdown")
        bds = " ".join(f"{k.replace('_busy', '')}={v:.2f}" for k, v in bd.items()) if bd else ""
        name = r["system"] + (f"/r{r['resident_layers']}" if "resident_layers" in r else "") \
            + (f" {r['micro_batches'].replace(' together', 't')}" if "micro_batches" in r else "")
        mfu = f"{r['mfu']:.2f}" if "mfu" in r else "-"  # no peak measured (--skip_peak)
        print(f"{name:24} {r['shape']:13} {r['layers']:>3} {r['tokens_per_step']:>8} {r['clip']:>4} "
              f"{r['tokens_per_s']:>9.0f} {r['model_tflops']:>7.1f} {mfu:>5} {ratio:>7} {ratio_bf16:>6} "
              f"{r.get('vs_model', '-'):>7} {r['gpu_peak_gib']:>7.1f} {r['host_peak_gib']:>8.1f}  {bds}"
              + (f" | model: {r['model']['bound']}" if "model" in r else ""))
    # rows that ran another checkout's code (megatrain:R@DIR): which code that was
    for tag, code in {r["system"].partition("@")[2]: r["code"] for r in rows
                      if "@" in r.get("system", "") and "code" in r}.items():
        print(f"@{tag}: {code['path']}, hf_megatrain {describe_code(code)}")


if __name__ == "__main__":
    main()
