"""Your own training loop (no Trainer) on the streaming engine.

    python examples/custom_loop.py --model meta-llama/Llama-3.1-8B --data corpus.jsonl --steps 500 --out trained
    python examples/custom_loop.py --tiny --out trained   # the embedded tiny default, CPU is fine

The trained model is saved to --out with its tokenizer, then loaded back with from_pretrained.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.utils.data import DataLoader

import hf_megatrain
from hf_megatrain.data import CausalCollator, load_raw_dataset, tokenize_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--max_seq_length", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="custom_loop_output", help="where the trained model and tokenizer are saved")
    a = p.parse_args()

    if a.tiny:
        from hf_megatrain.demo import build_model, build_tokenizer, make_dataset

        tokenizer = build_tokenizer()
        model, data = build_model(), make_dataset(tokenizer, 4000, seed=1)
        a.steps, a.batch, a.lr = 60, 32, 3e-3
    else:
        if not (a.model and a.data):
            p.error("--model and --data are required (or --tiny)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
        model = a.model
        data = tokenize_dataset(load_raw_dataset(a.data), tokenizer, a.max_seq_length, packing=True)

    # planned for the step the loop runs (prepare() refuses a plan that does not fit, before any weight is read)
    engine, optimizer = hf_megatrain.prepare(model, lr=a.lr, weight_decay=0.1, batch=a.batch, seq=a.max_seq_length,
                                             grad_accum=a.grad_accum, max_grad_norm=1.0)
    warmup = max(1, a.steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps))
    )
    loader = DataLoader(data, batch_size=a.batch, shuffle=True, collate_fn=CausalCollator(tokenizer.pad_token_id))
    it = iter(loader)

    def next_batch():
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(loader)
            return next(it)

    for step in range(a.steps):
        # one optimizer step as the trainer runs it: the loss is the mean over the step's label tokens,
        # clipped at 1.0, the host AdamW placed by the engine's step policy
        out = hf_megatrain.train_step(engine, optimizer, [next_batch() for _ in range(a.grad_accum)],
                                      max_grad_norm=1.0)
        scheduler.step()
        engine.zero_grad()
        if step % max(1, a.steps // 10) == 0 or step == a.steps - 1:
            print(f"step {step:5d}  loss {out.loss.item():.4f}  grad_norm {out.grad_norm.item():.3f}  "
                  f"lr {scheduler.get_last_lr()[0]:.2e}")
    engine.save_pretrained(a.out, tokenizer=tokenizer)  # waits for the last step, then writes safetensors

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(a.out, dtype=torch.float32)
    masters = dict(engine.named_master_params())
    same = all(torch.equal(p.detach(), masters[n].to(p.dtype)) for n, p in reloaded.named_parameters())
    print(f"saved to {a.out}; from_pretrained gives back the trained weights: {same}")


if __name__ == "__main__":
    main()
