"""trl.experimental's ORPO script, trained by hf_megatrain: ORPOTrainer becomes MegaTrainORPOTrainer (and
ORPOConfig MegaTrainORPOConfig, for the engine's own flags), nothing else changes. Needs
`pip install "hf_megatrain[trl]"`. CPO (and SimPO: `--loss_type simpo`) is the same with
hf_megatrain.cpo.MegaTrainCPOTrainer and MegaTrainCPOConfig.

Every ORPOConfig flag works, plus the engine's (see `hf-megatrain train --help-all`), and TRL's
`--config run.yaml` with flags that override it:

    python examples/orpo.py --model_name_or_path Qwen/Qwen2.5-7B --dataset_name trl-lib/ultrafeedback_binarized \
        --output_dir qwen-orpo --max_length 2048 --per_device_train_batch_size 4 --gradient_accumulation_steps 8 \
        --learning_rate 8e-6 --beta 0.1

ORPO has no reference model: its loss is an NLL on the chosen answers plus an odds-ratio term against
the rejected ones. `--dataset_name` may also be a local .jsonl/.json/.parquet file or a folder of them.

On the embedded tiny default (no downloads, CPU is fine): the pairs of examples/dpo.py (each word's
reversal preferred to a run of z's as long); the held-out pairs' reward margin is printed before and after.

    python examples/orpo.py --tiny --output_dir /tmp/orpo --bf16 False
"""

from __future__ import annotations

import sys
import tempfile

from dpo import ExampleArguments, load_data, tiny_setup  # examples/dpo.py: the tiny pairs and the data loading


def main() -> None:
    import warnings

    from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

    with warnings.catch_warnings():  # trl.experimental's warning that its APIs may change
        warnings.simplefilter("ignore")
        from hf_megatrain.orpo import MegaTrainORPOConfig, MegaTrainORPOTrainer

    parser = TrlParser((ScriptArguments, MegaTrainORPOConfig, ModelConfig, ExampleArguments))
    script_args, training_args, model_args, example = parser.parse_args_and_config()
    with tempfile.TemporaryDirectory(prefix="trl-orpo-") as work:  # the tiny model and data, removed at the end
        if example.tiny:
            model_args.model_name_or_path, script_args.dataset_name = tiny_setup(work)
            if training_args.max_steps <= 0:
                training_args.max_steps, training_args.learning_rate = 20, 5e-3
            training_args.per_device_train_batch_size = 8
        if not (model_args.model_name_or_path and script_args.dataset_name):
            sys.exit("--model_name_or_path and --dataset_name are required (or --tiny)")
        training_args.model_init_kwargs = {"revision": model_args.model_revision,
                                           "attn_implementation": model_args.attn_implementation}
        dataset = load_data(script_args.dataset_name, script_args.dataset_config, example.tiny)
        test = dataset[script_args.dataset_test_split] if script_args.dataset_test_split in dataset else None
        trainer = MegaTrainORPOTrainer(
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
            # ORPO's rewards are beta times each completion's mean token log-probability under the policy
            print(f"held-out reward margin: {before['eval_rewards/margins']:.4f} before ORPO, "
                  f"{after['eval_rewards/margins']:.4f} after; reward accuracy after: "
                  f"{after['eval_rewards/accuracies']:.3f}")
        if training_args.push_to_hub:
            trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
