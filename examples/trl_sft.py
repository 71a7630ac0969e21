"""TRL's SFT script, trained by hf_megatrain: SFTTrainer and SFTConfig become MegaTrainSFTTrainer
and MegaTrainSFTConfig, nothing else changes. Needs `pip install "hf_megatrain[trl]"`.

Every SFTConfig flag works, plus the engine's (see `hf-megatrain train --help-all`), and TRL's
`--config run.yaml` with flags that override it:

    python examples/trl_sft.py --model_name_or_path Qwen/Qwen2.5-7B --dataset_name trl-lib/Capybara \
        --output_dir qwen-sft --max_length 4096 --packing --per_device_train_batch_size 4 \
        --gradient_accumulation_steps 8 --learning_rate 2e-5 --use_peft --lora_r 16

`--dataset_name` may also be a local .jsonl/.json/.parquet file or a folder of them (the dataset
must already be in the local cache when the machine has no network).

On the embedded tiny default (no downloads, CPU is fine): a prompt/completion set in which each
word is answered with its reversal.

    python examples/trl_sft.py --tiny --output_dir /tmp/trl-sft --bf16 False
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field


@dataclass
class ExampleArguments:
    tiny: bool = field(default=False, metadata={"help": "Train the embedded tiny model on generated data."})


def tiny_setup(workdir: str) -> tuple[str, str]:
    """The tiny model and tokenizer in a folder, and prompt/completion rows in a .jsonl file."""
    from hf_megatrain.demo import build_model, build_tokenizer, make_words

    model_dir = os.path.join(workdir, "tiny-llama")
    build_model().save_pretrained(model_dir)
    build_tokenizer().save_pretrained(model_dir)
    data = os.path.join(workdir, "train.jsonl")
    with open(data, "w") as f:
        for w in make_words(2000, seed=1):
            f.write(json.dumps({"prompt": w + ">", "completion": w[::-1]}) + "\n")
    return model_dir, data


def load_data(name: str, config: str | None):
    from datasets import load_dataset

    if os.path.exists(name):  # a local file or folder of files
        files = [os.path.join(name, f) for f in sorted(os.listdir(name))] if os.path.isdir(name) else [name]
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}[os.path.splitext(files[0])[1]]
        return load_dataset(kind, data_files=files)
    return load_dataset(name, name=config)


def main() -> None:
    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

    from hf_megatrain.sft import MegaTrainSFTConfig, MegaTrainSFTTrainer

    parser = TrlParser((ScriptArguments, MegaTrainSFTConfig, ModelConfig, ExampleArguments))
    script_args, training_args, model_args, example = parser.parse_args_and_config()
    with tempfile.TemporaryDirectory(prefix="trl-sft-") as work:  # the tiny model and data, removed at the end
        if example.tiny:
            model_args.model_name_or_path, script_args.dataset_name = tiny_setup(work)
            if training_args.max_steps <= 0:
                training_args.max_steps, training_args.learning_rate = 30, 3e-3
        if not (model_args.model_name_or_path and script_args.dataset_name):
            sys.exit("--model_name_or_path and --dataset_name are required (or --tiny)")
        # What TRL's own script passes through model_init_kwargs; the engine honours the revision and the
        # attention implementation (weights stay fp32 masters, whatever the dtype).
        training_args.model_init_kwargs = {"revision": model_args.model_revision,
                                           "attn_implementation": model_args.attn_implementation}
        dataset = load_data(script_args.dataset_name, script_args.dataset_config)
        trainer = MegaTrainSFTTrainer(
            model=model_args.model_name_or_path,
            args=training_args,
            train_dataset=dataset[script_args.dataset_train_split],
            eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
            peft_config=get_peft_config(model_args),
        )
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(training_args.output_dir)
        print(f"saved to {training_args.output_dir}")
        if training_args.push_to_hub:
            trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
