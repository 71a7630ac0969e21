"""One process of a data-parallel run (launched as torchrun does: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment) of stock Trainer / TRL's SFTTrainer (DDP over gloo) or of ours, for tests/integration/test_dp_stock.py,
and `launch`, which starts the processes of one run.

    python -m tests.support.dp_stock OUT IMPL TRAINER KIND [--no_average_tokens] [--no_loss_kwargs] [--prefix_tuning]
        [--ia3]

IMPL: stock or ours; TRAINER: trainer (Trainer / MegaTrainTrainer on tests/support/dp_trainer's rows) or sft
(SFTTrainer / MegaTrainSFTTrainer on prompt/completion pairs); KIND: the tiny model (llama, mixtral).
--no_average_tokens: average_tokens_across_devices=False (each rank's loss is over its own tokens; without it, the
config's default, True in transformers 5.17 and 5.25 and TRL 1.16);
--no_loss_kwargs: the model says it takes no loss kwargs (accepts_loss_kwargs = False), so Trainer counts no
num_items_in_batch and each micro-batch's loss is its own mean, divided by the accumulation steps;
--prefix_tuning: (trainer only) the model under PEFT's prefix tuning (an MLP encoder), only the encoder trained;
--ia3: (trainer only) the model under PEFT's IA3, only its scaling vectors trained.
Every run: 2 rows per rank, GA 2, clipping at 0.5 (below every step's norm), fp32 on the CPU. Rank 0 writes
OUT/result.json: the logged steps (loss, grad_norm, learning_rate and SFT's own metrics) and the trained weights.
"""

import json
import os
import sys
import warnings

import datasets

from tests.support import end_process_group, trained_weights

RUN = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5)
PREFIX_CLIP = 0.05  # --prefix_tuning's max_grad_norm: below every step's norm, as 0.5 is for the others
IA3_CLIP = 0.005  # --ia3's (its steps' norms: from 0.016)
LOGGED = ("step", "loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens", "aux_loss")


def sft_rows():
    """Prompt/completion pairs of unequal lengths (so the ranks' token counts differ), in order."""
    from hf_megatrain.demo import make_words

    words = make_words(40, seed=0)
    return datasets.Dataset.from_dict({"prompt": [w + ">" for w in words], "completion": [w[::-1] for w in words]})


def build(out, impl, trainer, kind, average, loss_kwargs, prefix=False, ia3=False):
    from transformers import Trainer, TrainingArguments, default_data_collator

    own_average = {} if average else {"average_tokens_across_devices": False}  # else the config's own default
    if trainer == "trainer":
        from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
        from tests.support.dp_trainer import TRAINING, train_rows
        from tests.support.tiny import make_model, make_prompted

        model = make_prompted(kind, "prefix_tuning_mlp") if prefix else make_model(kind)
        if ia3:
            from peft import IA3Config, get_peft_model

            model = get_peft_model(model, IA3Config(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj", "down_proj"],
                                                    feedforward_modules=["down_proj"]))
        if not loss_kwargs:  # read by Trainer.__init__ (model_accepts_loss_kwargs), stock's and ours alike
            model.accepts_loss_kwargs = False
        # the adapters' gradients are smaller
        run = dict(RUN, max_grad_norm=PREFIX_CLIP if prefix else IA3_CLIP) if prefix or ia3 else RUN
        kw = dict(TRAINING, **run, output_dir=out, save_strategy="no", **own_average)
        args = TrainingArguments(**kw) if impl == "stock" else MegaTrainArguments(**kw, log_pipeline=False)
        cls = Trainer if impl == "stock" else MegaTrainTrainer
        return cls(model=model, args=args, train_dataset=train_rows(), data_collator=default_data_collator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl import SFTConfig, SFTTrainer

        from hf_megatrain.sft import MegaTrainSFTConfig, MegaTrainSFTTrainer
    from tests.support.preference import KW, model_folder

    import pathlib

    # each rank writes its own copy of the same weights (seed 0): no rank reads a folder another is writing
    folder = model_folder(pathlib.Path(out), kind, name=f"model-{kind}-rank{os.environ.get('RANK', '0')}")
    kw = dict(KW, **RUN, output_dir=out, max_steps=4, learning_rate=1e-3, train_sampling_strategy="sequential",
              **own_average)
    if impl == "stock":
        return SFTTrainer(model=folder, args=SFTConfig(**kw), train_dataset=sft_rows())
    return MegaTrainSFTTrainer(model=folder, args=MegaTrainSFTConfig(**kw), train_dataset=sft_rows())


def main():
    out, impl, trainer, kind = sys.argv[1:5]
    flags = sys.argv[5:]
    datasets.disable_caching()
    run = build(out, impl, trainer, kind, "--no_average_tokens" not in flags, "--no_loss_kwargs" not in flags,
                "--prefix_tuning" in flags, "--ia3" in flags)
    run.train()
    weights = trained_weights(run, impl)  # collective: every rank
    if run.args.process_index == 0:
        logs = [{k: h[k] for k in LOGGED if k in h} for h in run.state.log_history if "loss" in h]
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"logs": logs, "weights": {n: t.tolist() for n, t in weights.items()},
                       "world": run.args.world_size, "accepts_loss_kwargs": run.model_accepts_loss_kwargs,
                       "average_tokens": run.args.average_tokens_across_devices}, f)
    del run  # its DDP model, before the group ends (end_process_group says why)
    end_process_group()


def launch(world: int, out, impl: str, trainer: str, kind: str, *flags: str) -> dict:
    """Start `world` processes of one run as torchrun does and return the run's result.json."""
    from tests.support import launch_ranks

    return launch_ranks(world, "tests.support.dp_stock", [out, impl, trainer, kind, *flags], out)


if __name__ == "__main__":
    main()
