"""TRL's KTO script, trained by hf_megatrain: KTOTrainer becomes MegaTrainKTOTrainer (and KTOConfig
MegaTrainKTOConfig, for the engine's own flags), nothing else changes. Needs `pip install "hf_megatrain[trl]"`.

Every KTOConfig flag works, plus the engine's (see `hf-megatrain train --help-all`), and TRL's
`--config run.yaml` with flags that override it:

    python examples/kto.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
        --dataset_name trl-lib/kto-mix-14k --output_dir qwen-kto --max_length 2048 \
        --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --learning_rate 5e-7 --beta 0.1

The reference is the starting policy: the engine computes its log-probabilities (of each row and of
its mismatched KL row) in a forward-only pass over the data before the first step (no second model).
`--dataset_name` may also be a local .jsonl/.json/.parquet file or a folder of them; with
`--dataset_streaming True` (and `--max_steps`) the reference comes batch by batch, as in dpo.py.

On the embedded tiny default (no downloads, CPU is fine): each word's reversal is desirable, a run of
z's as long undesirable; the held-out reward margin is printed before and after.

    python examples/kto.py --tiny --output_dir /tmp/kto --bf16 False
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field

from dpo import load_data  # examples/dpo.py: the data loading (a hub id or local files, streamed or not)


@dataclass
class ExampleArguments:
    tiny: bool = field(default=False, metadata={"help": "Train the embedded tiny model on generated rows."})


def tiny_setup(workdir: str) -> tuple[str, str]:
    """The tiny model and tokenizer in a folder, and prompt/completion/label rows in a .jsonl file (the last
    64 rows are the test split)."""
    from hf_megatrain.demo import build_model, build_tokenizer, make_words

    model_dir = os.path.join(workdir, "tiny-llama")
    build_model().save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    data = os.path.join(workdir, "unpaired.jsonl")
    with open(data, "w") as f:
        for i, w in enumerate(make_words(576, seed=1)):
            good = i % 2 == 0
            f.write(json.dumps({"prompt": w + ">", "completion": w[::-1] if good else "z" * len(w),
                                "label": good}) + "\n")
    return model_dir, data


def main() -> None:
    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

    from hf_megatrain.kto import MegaTrainKTOConfig, MegaTrainKTOTrainer

    parser = TrlParser((ScriptArguments, MegaTrainKTOConfig, ModelConfig, ExampleArguments))
    script_args, training_args, model_args, example = parser.parse_args_and_config()
    with tempfile.TemporaryDirectory(prefix="trl-kto-") as work:  # the tiny model and data, removed at the end
        if example.tiny:
            model_args.model_name_or_path, script_args.dataset_name = tiny_setup(work)
            if training_args.max_steps <= 0:
                training_args.max_steps, training_args.learning_rate = 20, 5e-3
            training_args.per_device_train_batch_size = 8
        if not (model_args.model_name_or_path and script_args.dataset_name):
            sys.exit("--model_name_or_path and --dataset_name are required (or --tiny)")
        training_args.model_init_kwargs = {"revision": model_args.model_revision,
                                           "attn_implementation": model_args.attn_implementation}
        dataset = load_data(script_args.dataset_name, script_args.dataset_config, example.tiny,
                            script_args.dataset_streaming)
        test = dataset[script_args.dataset_test_split] if script_args.dataset_test_split in dataset else None
        trainer = MegaTrainKTOTrainer(
            model=model_args.model_name_or_path,
            args=training_args,
            train_dataset=dataset[script_args.dataset_train_split],
            eval_dataset=test if (training_args.eval_strategy != "no" or example.tiny) else None,
            peft_config=get_peft_config(model_args),
        )
        if example.tiny:
            before = trainer.evaluate()
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(training_args.output_dir)
        print(f"saved to {training_args.output_dir}")
        if example.tiny:
            after = trainer.evaluate()
            # before training the policy is the reference: every reward is 0
            print(f"held-out reward margin: {before['eval_rewards/margins']:.4f} before KTO, "
                  f"{after['eval_rewards/margins']:.4f} after; KL estimate after: {after['eval_kl']:.4f}")
        if training_args.push_to_hub:
            trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
