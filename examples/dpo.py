"""TRL's DPO script, trained by hf_megatrain: DPOTrainer becomes MegaTrainDPOTrainer (and DPOConfig
MegaTrainDPOConfig, for the engine's own flags), nothing else changes. Needs `pip install "hf_megatrain[trl]"`.

Every DPOConfig flag works, plus the engine's (see `hf-megatrain train --help-all`), and TRL's
`--config run.yaml` with flags that override it:

    python examples/dpo.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
        --dataset_name trl-lib/ultrafeedback_binarized --output_dir qwen-dpo --max_length 2048 \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 8 --learning_rate 5e-7 --beta 0.1

The reference is the starting policy: the engine computes its log-probabilities in a forward-only
pass over the data before the first step (no second model). `--dataset_name` may also be a local
.jsonl/.json/.parquet file or a folder of them. With `--dataset_streaming True` the data is read as
training goes (set `--max_steps`), and the reference's log-probabilities come batch by batch from a
forward-only copy of the starting policy, as stock computes them from its second model.

On the embedded tiny default (no downloads, CPU is fine): pairs in which each word's reversal is
preferred to a run of z's as long; the held-out pairs' reward margin is printed before and after.

    python examples/dpo.py --tiny --output_dir /tmp/dpo --bf16 False
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field


@dataclass
class ExampleArguments:
    tiny: bool = field(default=False, metadata={"help": "Train the embedded tiny model on generated pairs."})


def tiny_setup(workdir: str) -> tuple[str, str]:
    """The tiny model and tokenizer in a folder, and prompt/chosen/rejected rows in a .jsonl file (the last
    64 rows are the test split)."""
    from hf_megatrain.demo import build_model, build_tokenizer, make_words

    model_dir = os.path.join(workdir, "tiny-llama")
    build_model().save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    data = os.path.join(workdir, "pairs.jsonl")
    with open(data, "w") as f:
        for w in make_words(576, seed=1):
            f.write(json.dumps({"prompt": w + ">", "chosen": w[::-1], "rejected": "z" * len(w)}) + "\n")
    return model_dir, data


def load_data(name: str, config: str | None, tiny: bool, streaming: bool = False):
    """The dataset's splits: a hub id, or a local file or folder of files. streaming (TRL's --dataset_streaming):
    IterableDatasets, read as training goes (the reference's log-probabilities then come batch by batch)."""
    from datasets import IterableDatasetDict, load_dataset

    if os.path.exists(name):  # a local file or folder of files
        files = [os.path.join(name, f) for f in sorted(os.listdir(name))] if os.path.isdir(name) else [name]
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}[os.path.splitext(files[0])[1]]
        if not tiny:
            return load_dataset(kind, data_files=files, streaming=streaming)
        data = load_dataset(kind, data_files=files)["train"].train_test_split(test_size=64, shuffle=False)
        return IterableDatasetDict({k: v.to_iterable_dataset() for k, v in data.items()}) if streaming else data
    return load_dataset(name, name=config, streaming=streaming)


def main() -> None:
    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

    from hf_megatrain.dpo import MegaTrainDPOConfig, MegaTrainDPOTrainer

    parser = TrlParser((ScriptArguments, MegaTrainDPOConfig, ModelConfig, ExampleArguments))
    script_args, training_args, model_args, example = parser.parse_args_and_config()
    with tempfile.TemporaryDirectory(prefix="trl-dpo-") as work:  # the tiny model and data, removed at the end
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
        trainer = MegaTrainDPOTrainer(
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
            # before training the policy is the reference: every reward is 0 (its accuracy is round-off)
            print(f"held-out reward margin: {before['eval_rewards/margins']:.4f} before DPO, "
                  f"{after['eval_rewards/margins']:.4f} after; reward accuracy after: "
                  f"{after['eval_rewards/accuracies']:.3f}")
        if training_args.push_to_hub:
            trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
