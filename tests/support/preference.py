"""Offline fixtures shared by the preference-tuning tests (test_dpo, test_kto, test_orpo): tiny models saved to a
folder with a tokenizer, preference data made here, the run settings both sides share, and the run itself."""

import os

import datasets
import pytest
import torch
from safetensors.torch import load_file

from hf_megatrain.demo import build_tokenizer, make_words
from tests.support.tiny import make_model


@pytest.fixture(autouse=True)
def fresh_datasets(tmp_path, monkeypatch):
    """No dataset cache shared between the stock run and ours: TRL caches the reference log-probs under a
    fingerprint of the data and the weights, which the two runs share; without caching each run computes its own.
    Autouse where a test module imports it."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))
    datasets.disable_caching()
    yield
    datasets.enable_caching()


def model_folder(tmp_path, kind, name=None, seed=0):
    """A tiny model of `kind` (hidden 64, 2 layers) and the demo tokenizer, saved to a folder."""
    folder = tmp_path / (name or f"model-{kind}")
    model, tok = make_model(kind, seed=seed, num_hidden_layers=2), build_tokenizer()
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


WORDS = make_words(40, seed=0)


def pairs(words=WORDS):
    """Prompt 'word>', chosen the word reversed, rejected the word itself or rotated (lengths differ by row)."""
    return datasets.Dataset.from_dict({"prompt": [w + ">" for w in words], "chosen": [w[::-1] for w in words],
                                       "rejected": [w[1:] + w[0] if i % 2 else w for i, w in enumerate(words)]})


def unpaired(words=WORDS):
    """KTO's unpaired data: prompt 'word>', the word reversed (desirable) or the word itself (undesirable). The first
    four rows are desirable and the next four undesirable (micro-batches of 4 with one kind only: TRL then logs no
    rewards/margins, and no rewards/rejected or rewards/chosen for it), then every third row is undesirable."""
    labels = [i < 4 if i < 8 else i % 3 != 0 for i in range(len(words))]
    return datasets.Dataset.from_dict({"prompt": [w + ">" for w in words],
                                       "completion": [w[::-1] if good else w for w, good in zip(words, labels)],
                                       "label": labels})


# lr 5e-4: Adam divides by the root of tiny second moments, so the last-bit differences between TRL's fused head
# and the engine's two head passes grow with the rate in the weights (to 1.1e-5 at 1e-3 on DPO's f-divergence group)
KW = dict(bf16=False, use_cpu=True, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
          per_device_eval_batch_size=4, learning_rate=5e-4, max_grad_norm=0.3, logging_steps=1, save_strategy="no",
          report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0)
TIMINGS = ("runtime", "samples_per_second", "steps_per_second")
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM",
            init_lora_weights=False)  # random B: the adapter-enabled model is not the reference
# another PEFT method (patcher/adapters.EXACT_METHODS): IA3 starts at the identity, so the first step's policy is the
# reference, as under full fine-tuning
IA3 = dict(peft_type="IA3", target_modules=["q_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
           task_type="CAUSAL_LM")
# prompt learning: its reference is the base model (the adapter disabled). Stock fails with the prefix under gradient
# checkpointing (test_peft.py), which TRL's configs turn on: the cases turn it off for both sides.
PREFIX = dict(peft_type="PREFIX_TUNING", num_virtual_tokens=4, task_type="CAUSAL_LM")
PROMPT = dict(peft_type="PROMPT_TUNING", num_virtual_tokens=4, task_type="CAUSAL_LM")


def peft_config_of(fields):
    """A dict of LoraConfig fields, or of another method's with its peft_type, as the config it makes; None: none."""
    from peft import LoraConfig, PeftConfig

    if not fields:
        return None
    return PeftConfig.from_peft_type(**fields) if "peft_type" in fields else LoraConfig(**fields)


def run(cls, config_cls, folder, out, train, evaluation, lora=None, evaluate_after=None, ref_model=None, **extra):
    """Train `cls` (stock or ours) for KW's steps, evaluate, save: (trainer, logs without timings, saved weights).
    ref_model: a folder, loaded here for a stock trainer (which takes a model object), or as_folder(folder) to hand
    ours the folder itself."""
    from transformers import AutoModelForCausalLM

    if isinstance(ref_model, str):
        ref_model = AutoModelForCausalLM.from_pretrained(ref_model)
    elif isinstance(ref_model, as_folder):
        ref_model = str(ref_model)
    refs = {} if ref_model is None else {"ref_model": ref_model}  # ORPO and CPO take none
    trainer = cls(model=folder, args=config_cls(output_dir=str(out), **{**KW, **extra}), train_dataset=train,
                  eval_dataset=evaluation, peft_config=peft_config_of(lora), **refs)
    trainer.train()
    trainer.evaluate()
    if evaluate_after is not None:  # a dataset first seen after training: its reference computed then
        trainer.evaluate(evaluate_after, metric_key_prefix="after")
    trainer.save_model(str(out))
    logs = [{k: v for k, v in h.items() if not k.endswith(TIMINGS)} for h in trainer.state.log_history]
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    return trainer, logs, load_file(os.path.join(out, name))


def peft_model(folder, seed=0):
    """The model in `folder` with a LoRA adapter of its own (LORA's random B: the adapter is not the base's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(**LORA))


def run_peft_model(cls, config_cls, folder, out, train, evaluation, after, **extra):
    """run() for a PeftModel as model: (logs without timings, the saved adapter, the model's adapters)."""
    trainer = cls(model=peft_model(folder), args=config_cls(output_dir=str(out), **{**KW, **extra}),
                  train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    trainer.evaluate()
    trainer.evaluate(after, metric_key_prefix="after")  # first seen after training: the reference is the 'ref' copy
    trainer.save_model(str(out))
    logs = [{k: v for k, v in h.items() if not k.endswith(TIMINGS)} for h in trainer.state.log_history]
    return logs, load_file(os.path.join(out, "adapter_model.safetensors")), sorted(trainer.model.peft_config)


class as_folder(str):
    """A ref_model folder that `run` hands over as the folder (a hub id or path), not as a loaded model."""


def assert_same_weights(weights, stock_weights):
    assert weights.keys() == stock_weights.keys()
    for k in weights:
        torch.testing.assert_close(weights[k], stock_weights[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
