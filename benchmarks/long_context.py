"""Long-context training: hf_megatrain at one long sequence vs the longest stock Trainer manages.

    python benchmarks/long_context.py --shape llama-3.2-3b --seq 524288 --stock_from 8192 --out $OUT
    python benchmarks/long_context.py --shape llama-3.2-3b --seq 524288 --doc_tokens 32768   # packed

hf_megatrain: MegaTrainTrainer with `max_seq_length=SEQ` and nothing else about memory (the
planner picks MLP tiles, activation offload and GPU residency and prints its plan); one row
of SEQ real tokens per optimizer step, fp32 master weights and fp32 Adam states, clipping on.
Stock: Trainer (bf16 autocast, gradient checkpointing, fused AdamW, all on the GPU), doubling
the sequence from --stock_from until it runs out of memory. Each attempt is its own process.

FLOPs per step, stated: 6 * P * T (weights) + 6 * L * T^2 * d_attn (causal attention: QK^T and
AV are 2 * T^2 * d_attn forward, half of it masked away, times 3 for forward and backward), with
P all parameters, L decoder layers, d_attn = heads * head_dim. Recomputation is not counted.
With --doc_tokens D the row packs documents of D tokens (position ids restarting, no attention
across them, the first token of each document not a target, as hf_megatrain's packing lays them
out), and T^2 becomes the sum of the documents' squared lengths.
MFU is against the bf16 matmul peak measured in the same run after ~8 s of load.
The record ($OUT/long_<shape>.json) states the versions it ran on (benchmarks/versions.py),
printed first and in the table's header.
"""

from __future__ import annotations

import argparse
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

from bench import TokenRows, _collate, build_model, matmul_peak, random_checkpoint  # noqa: E402
from versions import versions, versions_line  # noqa: E402


def step_flops(config, params: int, seq: int, doc: int | None = None) -> float:
    d_attn = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    doc = doc or seq
    squares = (seq // doc) * doc**2 + (seq % doc) ** 2  # each document attends within itself
    return 6 * params * seq + 6 * config.num_hidden_layers * squares * d_attn


class PackedRows(TokenRows):
    """TokenRows cut into documents of `doc` tokens: position ids restart at each, and a
    document's first token is not predicted from the one before (labels -100 there)."""

    def __init__(self, rows: int, seq: int, vocab: int, doc: int):
        import torch

        super().__init__(rows, seq, vocab)
        self.pos = torch.arange(seq) % doc
        self.labels = self.ids.masked_fill(self.pos == 0, -100)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i], "position_ids": self.pos}


def attempt(opts) -> None:
    """One system at one length, in this process; prints RESULT {json}."""
    import torch
    from transformers import TrainerCallback, TrainingArguments

    cuda = torch.cuda.is_available()  # (without one, only the plumbing runs: a CPU check)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if mega:  # the step ends when the host optimizer has stepped every unit
                trainer.engine.synchronize()
            sync()
            self.marks.append(time.perf_counter())

    mega = opts.system == "megatrain"
    if mega:  # hf_megatrain loads the checkpoint straight into its store: the host peak is its own
        from transformers import AutoConfig

        model = opts.checkpoint
        cfg = AutoConfig.from_pretrained(model)
    else:
        model = build_model(opts.shape, opts.layers, "cuda" if cuda else "cpu", opts.seq)
        cfg = model.config
    data = (PackedRows(opts.steps, opts.seq, cfg.vocab_size, opts.doc_tokens) if opts.doc_tokens
            else TokenRows(opts.steps, opts.seq, cfg.vocab_size))
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=opts.steps,
                  learning_rate=1e-5, max_grad_norm=1.0, lr_scheduler_type="constant", bf16=cuda, use_cpu=not cuda,
                  logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if mega:
        from hf_megatrain import MegaTrainArguments, MegaTrainTrainer

        trainer = MegaTrainTrainer(model, MegaTrainArguments(**common, max_seq_length=opts.seq, log_pipeline=False),
                                   train_dataset=data, data_collator=_collate)
        params = trainer.engine.num_parameters
    else:
        from transformers import Trainer

        params = sum(p.numel() for p in model.parameters())
        trainer = Trainer(model=model, args=TrainingArguments(**common, gradient_checkpointing=True,
                                                              optim="adamw_torch_fused"),
                          train_dataset=data, data_collator=_collate)
    clock = Clock()
    trainer.add_callback(clock)
    trainer.train()
    if mega:
        trainer.engine.synchronize()
    sync()
    step_s = clock.marks[-1] - clock.marks[-2]
    row = dict(system=opts.system, shape=opts.shape, layers=cfg.num_hidden_layers, params=params, seq=opts.seq,
               step_s=round(step_s, 2), first_step_s=round(clock.marks[1] - clock.marks[0], 2),
               doc_tokens=opts.doc_tokens, tflops=round(step_flops(cfg, params, opts.seq, opts.doc_tokens) / step_s / 1e12, 1),
               gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
               host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
               loss=[round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])
    if mega:
        row["resident_layers"] = trainer.engine.resident_layers
        row["offload_activations"] = trainer.engine.activations.offload
        row["mlp_tile_tokens"] = trainer.engine.mlp_tile_tokens
    print("RESULT " + json.dumps(row), flush=True)


def run(opts, system: str, seq: int, log_dir: str) -> dict:
    cmd = [sys.executable, __file__, "--system", system, "--shape", opts.shape, "--seq", str(seq),
           "--steps", str(opts.steps)]
    if opts.layers:
        cmd += ["--layers", str(opts.layers)]
    if opts.doc_tokens and system == "megatrain":
        cmd += ["--doc_tokens", str(opts.doc_tokens)]
    if system == "megatrain":
        cmd += ["--checkpoint", random_checkpoint(opts.dir, opts.shape, opts.layers, max(opts.seq + [4096]))]
    log_path = os.path.join(log_dir, f"long_{system}_{opts.shape}_{seq}.log")
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    with open(log_path) as f:
        tail = [ln.strip() for ln in f if ln.strip()]
    why = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "")
    return {"system": system, "shape": opts.shape, "seq": seq, "error": f"exit {proc.returncode}: {why[-300:]}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-3b")
    p.add_argument("--layers", type=int, default=None, help="truncate to this many decoder layers")
    p.add_argument("--seq", type=int, nargs="*", default=[524288], help="hf_megatrain sequence lengths (none: stock only)")
    p.add_argument("--stock_from", type=int, default=0, help="double stock Trainer's length from here (0: skip)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--doc_tokens", type=int, default=None,
                   help="hf_megatrain rows packed from documents of this many tokens (default: one document)")
    p.add_argument("--out", default=os.environ.get("OUT", "long_out"))
    p.add_argument("--dir", default="/tmp/long_context", help="where hf_megatrain's random checkpoint is written")
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.system:
        opts.seq = opts.seq[0]
        attempt(opts)
        return
    os.makedirs(opts.out, exist_ok=True)
    stack = versions()
    print("VERSIONS " + versions_line(stack), flush=True)
    peak = matmul_peak()
    print("PEAK " + json.dumps(peak), flush=True)
    rows = []
    if opts.stock_from:
        seq = opts.stock_from
        while True:
            row = run(opts, "stock", seq, opts.out)
            print(json.dumps(row), flush=True)
            rows.append(row)
            if "error" in row:
                break
            seq *= 2
    for seq in opts.seq:
        row = run(opts, "megatrain", seq, opts.out)
        print(json.dumps(row), flush=True)
        rows.append(row)
    for r in rows:
        if "tflops" in r:
            r["mfu"] = round(r["tflops"] / peak["sustained_tflops"], 3)
    record = {"date": time.strftime("%Y-%m-%d"), "card": stack["gpu"], "command": " ".join(sys.argv),
              "versions": stack, "peak": peak, "rows": rows}
    with open(os.path.join(opts.out, f"long_{opts.shape}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{record['card']}  {record['date']}  peak bf16 sustained {peak['sustained_tflops']} TFLOP/s")
    print(versions_line(stack))
    print(f"{'system':10} {'shape':13} {'L':>3} {'seq':>8} {'step s':>7} {'TFLOPS':>7} {'MFU':>5} "
          f"{'GPU GiB':>7} {'host GiB':>8}  placement / error")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:10} {r['shape']:13} {'':>3} {r['seq']:>8}  {r['error'][:120]}")
            continue
        place = ""
        if r["system"] == "megatrain":
            place = f"resident={r['resident_layers']} offload={r['offload_activations']} tile={r['mlp_tile_tokens']}"
            place += f" documents={r['doc_tokens']}" if r.get("doc_tokens") else ""
        print(f"{r['system']:10} {r['shape']:13} {r['layers']:>3} {r['seq']:>8} {r['step_s']:>7.1f} {r['tflops']:>7.1f} "
              f"{r.get('mfu', 0):>5.2f} {r['gpu_peak_gib']:>7.1f} {r['host_peak_gib']:>8.1f}  {place}")


if __name__ == "__main__":
    main()
