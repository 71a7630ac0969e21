"""A training run in its own process, for the crash tests (tests/integration/test_checkpoints.py).

    python -m tests.support.train_subprocess OUT_DIR [--kill-at-step N] [--kill-in-save N] [--resume]

from the repository root (or with it on PYTHONPATH). Writes OUT_DIR/result.json (the log history
and the final fp32 masters) when it finishes. --kill-at-step sends SIGKILL to itself at the start of step N (mid-training);
--kill-in-save kills it while checkpoint N is being written, after the model files and before the
optimizer state.
"""

import json
import os
import signal
import sys

import datasets
from transformers import TrainerCallback, default_data_collator

from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
from hf_megatrain.checkpoint import optimizer_state
from tests.support.tiny import make_batch, make_model


class KillAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    out = sys.argv[1]
    opts = sys.argv[2:]
    parts = [make_batch(1, 12, seed=i, pad_rows=int(i % 3 == 0)) for i in range(32)]
    train = datasets.Dataset.from_dict({k: [p[k][0].tolist() for p in parts] for k in parts[0]})
    args = MegaTrainArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=8,
        learning_rate=1e-2, warmup_steps=2, max_grad_norm=0.5, weight_decay=0.1, logging_steps=1,
        save_strategy="steps", save_steps=2, save_total_limit=2, report_to=[], seed=0, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=train, data_collator=default_data_collator)
    if "--kill-at-step" in opts:
        trainer.add_callback(KillAt(int(opts[opts.index("--kill-at-step") + 1])))
    if "--kill-in-save" in opts:
        at = int(opts[opts.index("--kill-in-save") + 1])
        real = optimizer_state.save_optimizer_state

        def dying_save(optimizer, path):
            if trainer.state.global_step == at:
                os.kill(os.getpid(), signal.SIGKILL)
            real(optimizer, path)

        import hf_megatrain.trainer as trainer_module

        trainer_module.save_optimizer_state = dying_save
    trainer.train(resume_from_checkpoint=True if "--resume" in opts else None)
    masters = {n: t.tolist() for n, t in trainer.engine.named_master_params()}
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"log_history": trainer.state.log_history, "masters": masters}, f)


if __name__ == "__main__":
    main()
