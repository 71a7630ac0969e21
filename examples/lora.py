"""LoRA fine-tuning with hf_megatrain: the frozen base streams layer by layer, adapters train.

Real use (model from the local HF cache or a folder; chat .jsonl or raw text):

    python examples/lora.py --model meta-llama/Llama-3.1-70B-Instruct --data chats.jsonl \
        --output_dir out --r 16 --max_seq_length 4096 --batch 8 --steps 1000

writes the adapter (PeftModel.from_pretrained loads it) and, with --merged, a full merged model.

On the embedded tiny default (no downloads, CPU is fine):

    python examples/lora.py --tiny --output_dir /tmp/lora
"""

from __future__ import annotations

import argparse
import os
import tempfile

from hf_megatrain import MegaTrainArguments, MegaTrainTrainer

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=int, default=32)
    p.add_argument("--max_seq_length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--merged", action="store_true", help="also write base + merged adapters as a full model")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args()
    if a.tiny:
        from sft import tiny_setup  # the tiny model with a chat template, and generated chats

        a.model, a.data, _ = tiny_setup(tempfile.mkdtemp())
        a.max_seq_length, a.batch, a.steps, a.lr, a.merged = 48, 32, 40, 1e-2, True
    if not (a.model and a.data):
        p.error("--model and --data are required (or --tiny)")
    args = MegaTrainArguments(
        output_dir=a.output_dir, data_path=a.data, max_seq_length=a.max_seq_length, packing=True,
        per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="cosine",
        warmup_steps=max(1, a.steps // 20), logging_steps=max(1, a.steps // 10), save_strategy="no", report_to=[],
        peft_config={"r": a.r, "lora_alpha": a.alpha, "lora_dropout": 0.0, "target_modules": ALL_LINEAR},
    )
    trainer = MegaTrainTrainer(a.model, args)
    trainer.train()
    trainer.save_model(a.output_dir)
    print("adapter:", sorted(os.listdir(a.output_dir)))
    if a.merged:
        trainer.save_merged(os.path.join(a.output_dir, "merged"))
        print("merged model:", os.path.join(a.output_dir, "merged"))


if __name__ == "__main__":
    main()
