"""LoRA fine-tuning with hf_megatrain: the frozen base streams layer by layer, adapters train.

Real use (model from the local HF cache or a folder; chat .jsonl or raw text):

    python examples/lora.py --model meta-llama/Llama-3.1-70B-Instruct --data chats.jsonl \
        --output_dir out --r 16 --max_seq_length 4096 --batch 8 --steps 1000

writes the adapter (PeftModel.from_pretrained loads it) and, with --merged, a full merged model.

On the embedded tiny default (no downloads, CPU is fine, about a minute): LoRA adapts a pretrained
base, so --tiny first makes one, a full fine-tune of the tiny model that teaches it to copy words
("abc>abc"). The adapters then teach it a new skill, to answer a word with its reversal in a chat;
the base, asked first, copies the words, and the base with the adapters reverses them.

    python examples/lora.py --tiny --output_dir /tmp/lora
"""

from __future__ import annotations

import argparse
import os
import tempfile

from hf_megatrain import MegaTrainArguments, MegaTrainTrainer

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_base(model_dir: str, workdir: str) -> str:
    """A stand-in for a pretrained base: the tiny model at `model_dir` fully fine-tuned to copy words
    (150 steps of 48 rows); saved, with its tokenizer, to a folder that is returned."""
    from hf_megatrain.data import CausalCollator
    from hf_megatrain.demo import build_tokenizer, make_dataset

    rows = make_dataset(build_tokenizer(), 6000, seed=11, answer=lambda word: word)  # 'abc>abc</s>'
    args = MegaTrainArguments(
        output_dir=os.path.join(workdir, "base-run"), max_steps=150, per_device_train_batch_size=48,
        learning_rate=3e-3, warmup_steps=15, lr_scheduler_type="cosine", weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=50, save_strategy="no", report_to=[], disable_tqdm=True,
    )
    trainer = MegaTrainTrainer(model_dir, args, train_dataset=rows, data_collator=CausalCollator(0))
    trainer.train()
    base = os.path.join(workdir, "copy-base")
    trainer.save_model(base)  # with the tokenizer (and its chat template) read from model_dir
    return base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--eval_data", help="held-out data in the same form (optional)")
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
        import torch

        from sft import tiny_setup  # the tiny model with a chat template, and generated chats

        if not torch.cuda.is_available():
            torch.set_num_threads(1)  # the tiny model's ops are too small to split across cores (hf_megatrain.demo)
        work = tempfile.mkdtemp(prefix="lora-tiny-")
        model_dir, a.data, a.eval_data = tiny_setup(work, n_train=6000, system=0.0, turns=(1,))
        print("making the base: the tiny model fully fine-tuned to copy words")
        a.model = tiny_base(model_dir, work)
        a.max_seq_length, a.batch, a.steps, a.lr, a.merged = 64, 16, 150, 4e-3, True
    if not (a.model and a.data):
        p.error("--model and --data are required (or --tiny)")
    args = MegaTrainArguments(
        output_dir=a.output_dir, data_path=a.data, eval_data_path=a.eval_data, max_seq_length=a.max_seq_length,
        packing=True, per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch, max_steps=a.steps,
        learning_rate=a.lr, lr_scheduler_type="cosine", warmup_steps=max(1, a.steps // 20),
        logging_steps=max(1, a.steps // 10), save_strategy="no", report_to=[], disable_tqdm=a.tiny,
        peft_config={"r": a.r, "lora_alpha": a.alpha, "lora_dropout": 0.0, "target_modules": ALL_LINEAR},
    )
    trainer = MegaTrainTrainer(a.model, args)
    if a.tiny:
        from hf_megatrain.demo import make_words
        from sft import tiny_answers

        words = make_words(6, seed=999)
        print("the base, before the adapters train (it copies):")
        before = tiny_answers(trainer, words)  # LoRA's B matrices start at zero: this is the base itself
    eval_before = trainer.evaluate()["eval_loss"] if a.eval_data else None
    trainer.train()
    if eval_before is not None:
        print(f"eval loss: {eval_before:.3f} -> {trainer.evaluate()['eval_loss']:.3f}")
    if a.tiny:
        print("the base with the adapters:")
        after = tiny_answers(trainer, words)
        print(f"{after}/{len(words)} unseen words reversed with the adapters ({before}/{len(words)} by the base alone)")
    trainer.save_model(a.output_dir)
    print("adapter:", sorted(os.listdir(a.output_dir)))
    if a.merged:
        trainer.save_merged(os.path.join(a.output_dir, "merged"))
        print("merged model:", os.path.join(a.output_dir, "merged"))


if __name__ == "__main__":
    main()
