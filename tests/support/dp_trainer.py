"""MegaTrainTrainer in one process of a data-parallel run (launched like torchrun does).

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python -m tests.support.dp_trainer OUT BATCH
        [--save N] [--resume DIR] [--optim NAME] [--optim_args K=V,..] [--ga N]

from the repository root (or with it on PYTHONPATH).

Trains a tiny Llama on a fixed sequence of rows (sequential sampler, so N ranks x BATCH rows see
the same global batches as 1 rank x N*BATCH rows) and writes OUT/result.json on rank 0.
"""

import json
import os
import sys

import datasets
from transformers import default_data_collator

from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
from tests.support import end_process_group
from tests.support.tiny import make_batch, make_model


def train_rows():
    """The rows every run trains on, in order (48: six steps of 8 rows at the most)."""
    parts = [make_batch(1, 12, seed=i, pad_rows=int(i % 3 == 0)) for i in range(48)]
    return datasets.Dataset.from_dict({k: [p[k][0].tolist() for p in parts] for k in parts[0]})


# What every run is trained with, stock Trainer's reference included (its TrainingArguments take them all)
TRAINING = dict(max_steps=6, learning_rate=1e-2, warmup_steps=1, max_grad_norm=0.5, weight_decay=0.1, logging_steps=1,
                report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                train_sampling_strategy="sequential")


def main():
    out, batch = sys.argv[1], int(sys.argv[2])
    opts = sys.argv[3:]

    def opt(name, default=None):
        return opts[opts.index(name) + 1] if name in opts else default

    train = train_rows()
    save = int(opts[opts.index("--save") + 1]) if "--save" in opts else 0
    args = MegaTrainArguments(
        output_dir=out, per_device_train_batch_size=batch, **TRAINING,
        save_strategy="steps" if save else "no", save_steps=save or 500, log_pipeline=False,
        gradient_accumulation_steps=int(opt("--ga", 1)),
        **({"optim": opt("--optim"), "optim_args": opt("--optim_args")} if "--optim" in opts else {}),
    )
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=train, data_collator=default_data_collator)
    resume = opts[opts.index("--resume") + 1] if "--resume" in opts else None
    trainer.train(resume_from_checkpoint=resume)
    masters = {n: t.tolist() for n, t in trainer.engine.named_master_params()}  # collective: every rank
    if trainer.args.process_index == 0:
        logs = [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate") if k in h}
                for h in trainer.state.log_history if "loss" in h]
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"logs": logs, "masters": masters, "world": trainer.args.world_size}, f)
    end_process_group()


if __name__ == "__main__":
    main()
