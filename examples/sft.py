"""Supervised fine-tuning (SFT) of a causal LM on chat data with hf_megatrain.

The data is a .jsonl file (or a folder of them, or a cached dataset) with rows like

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

rendered with the tokenizer's chat template; the loss is on the assistant turns only. Rows with
"prompt"/"completion" columns work too (loss on the completion).

Real use (a model in the local HF cache or a folder):

    python examples/sft.py --model Qwen/Qwen2.5-7B-Instruct --data chats.jsonl --output_dir out \
        --max_seq_length 4096 --batch 8 --grad_accum 4 --epochs 2

A base model without a chat template needs one: --chat_template template.jinja.

On the embedded tiny default (no downloads, CPU is fine, under a minute): chats in which the assistant
answers the user's word with its reversal. It ends by asking for six words it has never seen.

    python examples/sft.py --tiny --output_dir /tmp/sft
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

from hf_megatrain import MegaTrainArguments, MegaTrainTrainer

# The tiny tokenizer knows only a-z and <s> </s> >, so the template marks turns with those:
# "<s>" system/user turns end in ">", assistant turns end in "</s>".
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}>{% endif %}{% endfor %}"
)


TINY_SYSTEM = "reverse"


def tiny_chats(n: int, seed: int, system: float = 0.5, turns=(1, 1, 2)) -> list[dict]:
    """n chats: a system turn (with probability `system`), then user word / assistant reversal, as many
    times as a draw from `turns`."""
    from hf_megatrain.demo import make_words

    rng = random.Random(seed)
    words = iter(make_words(2 * n, seed=seed))
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": TINY_SYSTEM}] if rng.random() < system else []
        for _ in range(rng.choice(turns)):
            w = next(words)
            messages += [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]
        rows.append({"messages": messages})
    return rows


def tiny_setup(workdir: str, n_train: int = 2000, **chats) -> tuple[str, str, str]:
    """Save the embedded tiny model (tokenizer with a chat template) and chat data (tiny_chats with
    `chats`); return the paths."""
    from hf_megatrain.demo import build_model, build_tokenizer

    model_dir = os.path.join(workdir, "tiny-llama")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    build_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    paths = []
    for name, n, seed in (("train.jsonl", n_train, 1), ("eval.jsonl", 100, 2)):
        paths.append(os.path.join(workdir, name))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in tiny_chats(n, seed, **chats))
    return model_dir, *paths


def show_learned_tokens(trainer, n_chars: int = 160) -> None:
    """What the loss sees in the first row: a check that the chat template masked the right turns."""
    row = trainer.train_dataset[0]
    tok = trainer.processing_class
    learned = tok.decode([t for t, lab in zip(row["input_ids"], row["labels"]) if lab != -100])
    print(f"first row: {len(row['input_ids'])} tokens, {sum(x != -100 for x in row['labels'])} learned: "
          f"{learned[:n_chars]!r}")


def tiny_answers(trainer, words: list[str], system: str | None = None) -> int:
    """Ask the trained model for each word (after a system turn `system`, if given); print the answers;
    return how many are the reversal."""
    import torch

    tok, model = trainer.processing_class, trainer.model
    right = 0
    first = [{"role": "system", "content": system}] if system else []
    for w in words:
        ids = tok.apply_chat_template(first + [{"role": "user", "content": w}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        ids = ids.to(model.device)  # GPU-resident layers (all of them, for this tiny model) are on the GPU
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(w) + 1,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        got = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        right += got == w[::-1]
        print(f"  {w:>8} > {got:<8} {'ok' if got == w[::-1] else 'expected ' + w[::-1]}")
    return right


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="hub id (cached) or local folder")
    p.add_argument("--data", help="chat .jsonl, folder of files, or cached dataset name")
    p.add_argument("--eval_data", help="held-out data in the same form (optional)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--chat_template", help="Jinja file to use as the chat template (for base models)")
    p.add_argument("--max_seq_length", type=int, default=2048)
    p.add_argument("--no_packing", action="store_true", help="one conversation per row, padded per batch")
    p.add_argument("--batch", type=int, default=8, help="rows per micro-batch")
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=-1, help="optimizer steps (overrides --epochs when > 0)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--tiny", action="store_true", help="use the embedded tiny model and generated chat data")
    a = p.parse_args()
    if a.tiny:
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(1)  # the tiny model's ops are too small to split across cores (hf_megatrain.demo)
        # One turn each, no system turn: the tiny model learns that in 200 steps. With a system turn in half
        # of the chats and two turns in a third (tiny_setup's default, the notebook's) it reversed 0 to 8 of
        # 20 unseen words after 150 steps, 14 of 20 with one plain turn.
        a.model, a.data, a.eval_data = tiny_setup(tempfile.mkdtemp(prefix="sft-tiny-"), n_train=6000, system=0.0,
                                                  turns=(1,))
        a.max_seq_length, a.batch, a.steps, a.lr = 64, 16, 200, 3e-3
    if not (a.model and a.data):
        p.error("--model and --data are required (or --tiny)")

    tokenizer = None
    if a.chat_template:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
        with open(a.chat_template) as f:
            tokenizer.chat_template = f.read()
    log_every = max(1, a.steps // 10) if a.steps > 0 else 10
    args = MegaTrainArguments(
        output_dir=a.output_dir, data_path=a.data, eval_data_path=a.eval_data, max_seq_length=a.max_seq_length,
        packing=not a.no_packing, per_device_train_batch_size=a.batch, per_device_eval_batch_size=a.batch,
        gradient_accumulation_steps=a.grad_accum, num_train_epochs=a.epochs, max_steps=a.steps,
        learning_rate=a.lr, warmup_steps=0.05, lr_scheduler_type="cosine", max_grad_norm=1.0, weight_decay=0.0,
        logging_steps=log_every, save_strategy="no" if a.tiny else "epoch", save_total_limit=2, report_to=[],
        disable_tqdm=a.tiny,
    )
    trainer = MegaTrainTrainer(a.model, args, processing_class=tokenizer)
    show_learned_tokens(trainer)
    before = trainer.evaluate()["eval_loss"] if a.eval_data else None
    trainer.train()
    if before is not None:
        print(f"eval loss: {before:.3f} -> {trainer.evaluate()['eval_loss']:.3f}")
    if a.tiny:
        from hf_megatrain.demo import make_words

        words = make_words(6, seed=999)
        print(f"{tiny_answers(trainer, words)}/{len(words)} unseen words answered correctly")
    trainer.save_model(a.output_dir)
    print(f"saved to {a.output_dir}")


if __name__ == "__main__":
    main()
