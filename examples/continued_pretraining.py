"""Continued pre-training of a causal LM on raw text with hf_megatrain.

Real use (a model in the local HF cache or a folder, text in .txt/.jsonl/.parquet files):

    python examples/continued_pretraining.py --model meta-llama/Llama-3.1-8B --data corpus/ \
        --output_dir out --max_seq_length 4096 --batch 16 --steps 2000

On the embedded tiny default (no downloads, CPU is fine):

    python examples/continued_pretraining.py --tiny --output_dir /tmp/cpt
"""

from __future__ import annotations

import argparse
import os
import tempfile

from hf_megatrain import MegaTrainArguments, MegaTrainTrainer


def tiny_setup(workdir: str) -> tuple[str, str]:
    """Save the embedded tiny model and a small text file; return (model_dir, data_file)."""
    from hf_megatrain.demo import build_model, build_tokenizer, make_words

    model_dir = os.path.join(workdir, "tiny-llama")
    build_model().save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    data = os.path.join(workdir, "words.txt")
    with open(data, "w") as f:
        for w in make_words(2000, seed=7):
            f.write(f"{w}>{w[::-1]}\n")
    return model_dir, data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="hub id (cached) or local folder")
    p.add_argument("--data", help="text file, folder of files, or cached dataset name")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_seq_length", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="rows per optimizer step")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--tiny", action="store_true", help="use the embedded tiny model and generated text")
    a = p.parse_args()
    if a.tiny:
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(1)  # the tiny model's ops are too small to split across cores (hf_megatrain.demo)
        a.model, a.data = tiny_setup(tempfile.mkdtemp())
        a.max_seq_length, a.batch, a.steps, a.lr = 32, 16, 30, 3e-3
    if not (a.model and a.data):
        p.error("--model and --data are required (or --tiny)")
    args = MegaTrainArguments(
        output_dir=a.output_dir, data_path=a.data, max_seq_length=a.max_seq_length, packing=True,
        per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=a.lr, warmup_steps=max(1, a.steps // 20),
        lr_scheduler_type="cosine", max_grad_norm=1.0, weight_decay=0.1, logging_steps=max(1, a.steps // 10),
        save_steps=max(1, a.steps // 2), save_total_limit=2, report_to=[],
    )
    trainer = MegaTrainTrainer(a.model, args)
    trainer.train()
    trainer.save_model(a.output_dir)
    print(f"saved to {a.output_dir}")


if __name__ == "__main__":
    main()
