"""TRL's SFTTrainer through the engine: the same losses, metrics and weights as stock SFTTrainer (fp32, CPU),
for completion-only loss, TRL's packing (BFD, padding-free rows), LoRA and a MoE under gradient accumulation;
TRL's own script shape run as a command; what the engine cannot do is refused by name."""

import json
import os
import subprocess
import sys

import datasets
import pytest
import torch
from safetensors.torch import load_file

trl = pytest.importorskip("trl")
from peft import LoraConfig  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer  # noqa: E402
from hf_megatrain.demo import build_tokenizer, make_words  # noqa: E402
from hf_megatrain.sft import MegaTrainSFTConfig, MegaTrainSFTTrainer  # noqa: E402
from tests.support.preference import peft_config_of  # noqa: E402
from tests.support import ROOT  # noqa: E402
from tests.support.tiny import make_model  # noqa: E402


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


def model_folder(tmp_path, kind):
    folder = tmp_path / f"model-{kind}"
    model, tok = make_model(kind), build_tokenizer()
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


WORDS = make_words(40, seed=0)
DATA = {
    "completion": datasets.Dataset.from_dict({"prompt": [w + ">" for w in WORDS], "completion": [w[::-1] for w in WORDS]}),
    "packing": datasets.Dataset.from_dict({"text": [w + ">" + w[::-1] for w in WORDS]}),
}
# lr 1e-3: Adam divides by the root of tiny second moments, so at larger rates the last-bit differences
# between TRL's fused head and the engine's chunked loss grow past 1e-5 in the weights.
KW = dict(bf16=False, use_cpu=True, max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
          learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
          disable_tqdm=True, dataloader_num_workers=0)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
# LoRA on the fused MoE expert tensors (PEFT parametrizes them during the forward)
LORA_EXPERTS = dict(LORA, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
IA3 = dict(peft_type="IA3", target_modules=["q_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
           task_type="CAUSAL_LM")
METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens", "grad_norm", "aux_loss")


def run(trainer_cls, config_cls, folder, out, data, lora=None, **extra):
    trainer = trainer_cls(model=folder, args=config_cls(output_dir=str(out), **KW, **extra), train_dataset=DATA[data],
                          peft_config=peft_config_of(lora))
    trainer.train()
    trainer.save_model(str(out))
    logs = [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h]
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    return trainer, logs, load_file(os.path.join(out, name))


CASES = {
    "completion_only": ("llama", "completion", None, {}),
    "packing": ("llama", "packing", None, dict(packing=True, max_length=32)),
    "lora": ("llama", "completion", LORA, {}),
    # another PEFT method (patcher/adapters.EXACT_METHODS), its adapters saved as PEFT saves them
    "ia3": ("llama", "completion", IA3, {}),
    # the load-balancing loss averaged over accumulation steps, as SFTTrainer does (stock Trainer does not)
    "moe_aux_loss": ("mixtral", "completion", None, {}),
    # the step's micro-batches through each layer together: metrics still per micro-batch
    "moe_layer_major": ("mixtral", "completion", None, dict(layer_major_accumulation="true")),
    # Qwen3-MoE's load-balancing loss, logged as aux_loss (as every MoE case above)
    "qwen3_moe_aux_loss": ("qwen3_moe", "completion", None, {}),
    "lora_moe_experts_qwen3": ("qwen3_moe", "completion", LORA_EXPERTS, {}),
    "lora_moe_experts_gpt_oss": ("gpt_oss", "completion", LORA_EXPERTS, {}),
    # TRL's DFT loss: each token's NLL weighted by its detached probability, in the engine's chunked head
    "dft_loss": ("llama", "completion", None, dict(loss_type="dft")),
}
MOE = ("mixtral", "qwen3_moe", "gpt_oss")
OURS_ONLY = ("layer_major_accumulation",)  # MegaTrainSFTConfig fields that stock SFTConfig lacks


@pytest.mark.parametrize("case", list(CASES))
def test_sft_equals_stock_sfttrainer(case, tmp_path):
    kind, data, lora, extra = CASES[case]
    folder = model_folder(tmp_path, kind)
    stock_extra = {k: v for k, v in extra.items() if k not in OURS_ONLY}
    _, stock_logs, stock_weights = run(SFTTrainer, SFTConfig, folder, tmp_path / "stock", data, lora, **stock_extra)
    # a plain SFTConfig works as well as MegaTrainSFTConfig: the engine's options keep their defaults
    config_cls = SFTConfig if case == "lora" else MegaTrainSFTConfig
    trainer, logs, weights = run(MegaTrainSFTTrainer, config_cls, folder, tmp_path / "mega", data, lora, **extra)
    assert isinstance(trainer.args, MegaTrainSFTConfig)
    assert trainer._per_pass == (KW["gradient_accumulation_steps"] if "layer_major_accumulation" in extra else 1)
    assert len(logs) == len(stock_logs) == KW["max_steps"]
    for ours, theirs in zip(logs, stock_logs):
        assert ours.keys() == theirs.keys(), (ours, theirs)
        assert ("aux_loss" in ours) == (kind in MOE), ours  # the router loss is on in every tiny MoE
        for k in ours:
            assert ours[k] == pytest.approx(theirs[k], rel=1e-5, abs=1e-6), (k, ours, theirs)
    assert weights.keys() == stock_weights.keys()
    if lora:
        assert all(("ia3_" if lora is IA3 else "lora_") in k for k in weights)
    for k in weights:
        torch.testing.assert_close(weights[k], stock_weights[k], atol=1e-5, rtol=1e-5, msg=k)
    if case == "packing":  # TRL's BFD packing gives the engine padding-free rows of several documents
        batch = next(iter(trainer.get_train_dataloader()))
        assert "attention_mask" not in batch and (batch["position_ids"] == 0).sum() > 1


@pytest.mark.parametrize("loss_type", ["nll", "dft"])  # SFTTrainer's compute_loss weights the eval loss by DFT too
def test_sft_evaluate_equals_stock(loss_type, tmp_path):
    folder = model_folder(tmp_path, "llama")
    kw = dict(KW, max_steps=2, eval_strategy="no", per_device_eval_batch_size=4, loss_type=loss_type)
    losses = {}
    for name, cls in (("stock", SFTTrainer), ("mega", MegaTrainSFTTrainer)):
        trainer = cls(model=folder, args=SFTConfig(output_dir=str(tmp_path / name), **kw),
                      train_dataset=DATA["completion"], eval_dataset=DATA["completion"].select(range(8)))
        trainer.train()
        losses[name] = trainer.evaluate()["eval_loss"]
    assert losses["mega"] == pytest.approx(losses["stock"], rel=1e-5)


def test_trl_configs_of_other_trainers_are_refused(tmp_path):
    folder = model_folder(tmp_path, "llama")
    # each names the trainer that takes the config
    with pytest.raises(MegaTrainError, match="DPOConfig, which MegaTrainTrainer does not take.*MegaTrainDPOTrainer"):
        MegaTrainTrainer(folder, trl.DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[]))
    with pytest.raises(MegaTrainError, match="DPOConfig, which MegaTrainSFTTrainer does not take.*MegaTrainDPOTrainer"):
        MegaTrainSFTTrainer(folder, trl.DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[]),
                            train_dataset=DATA["completion"])


@pytest.mark.parametrize("extra, match", [
    (dict(activation_offloading=True), "activation_offloading"),
    (dict(model_init_kwargs={"quantization_config": {"load_in_4bit": True}}), "quantization_config"),
])
def test_what_the_engine_cannot_do_is_refused_before_tokenizing(extra, match, tmp_path, monkeypatch):
    folder = model_folder(tmp_path, "llama")

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", no_tokenizing)
    with pytest.raises(MegaTrainError, match=match):
        MegaTrainSFTTrainer(folder, SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], **extra),
                            train_dataset=DATA["completion"])


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant>{% endif %}")


def template_source(tmp_path):
    """A tokenizer folder whose chat template and added tokens SFTTrainer clones (chat_template_path): 77 new
    tokens take the 99-token model to 128 rows (a multiple of 64), 29 of them drawn from the old rows' mean and
    covariance by resize_token_embeddings."""
    tok = build_tokenizer()
    tok.add_tokens(["<|im_start|>", "<|im_end|>"] + [f"<tool_{i}>" for i in range(75)], special_tokens=True)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    folder = tmp_path / "template-source"
    tok.save_pretrained(folder)
    return str(folder)


# (LoRA on a tied model fails in stock SFTTrainer 1.16 itself: its fused head reads lm_head.bias through PEFT's
# TrainableTokensWrapper)
@pytest.mark.parametrize("kind, loaded, lora", [("llama", False, False), ("llama_tied", False, False),
                                                ("llama", True, False), ("llama", False, True), ("llama", True, True)])
def test_cloned_chat_template_equals_stock(kind, loaded, lora, tmp_path):
    """chat_template_path naming a tokenizer: SFTTrainer's clone_chat_template adds its tokens and resizes the
    embeddings (new rows drawn at random); from a folder the engine reads only the embedding and head for that and
    streams the rest. With LoRA, TRL trains the new tokens through PEFT's trainable_token_indices and lm_head through
    modules_to_save, and makes the adapters from the RNG the resize left. The same rows, losses and weights (or
    adapter) as stock SFTTrainer, and the saved folder loads back."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, source = model_folder(tmp_path, kind), template_source(tmp_path)
    data = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": w}, {"role": "assistant",
                                                                                    "content": w[::-1]}]
                                                    for w in WORDS]})
    results = {}
    for name, cls in (("stock", SFTTrainer), ("mega", MegaTrainSFTTrainer)):
        model = AutoModelForCausalLM.from_pretrained(folder) if loaded else folder
        args = SFTConfig(output_dir=str(tmp_path / name), chat_template_path=source, **KW)
        trainer = cls(model=model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(folder),
                      peft_config=LoraConfig(**LORA) if lora else None)
        trainer.train()
        trainer.save_model(str(tmp_path / name))
        assert trainer.args.chat_template_path == source
        logs = [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h]
        saved = "adapter_model.safetensors" if lora else "model.safetensors"
        results[name] = logs, load_file(str(tmp_path / name / saved))
    (stock_logs, stock_weights), (logs, weights) = results["stock"], results["mega"]
    assert len(logs) == len(stock_logs) == KW["max_steps"]
    for ours, theirs in zip(logs, stock_logs):
        assert ours.keys() == theirs.keys()
        for k in ours:
            assert ours[k] == pytest.approx(theirs[k], rel=1e-5, abs=1e-6), (k, ours, theirs)
    assert weights.keys() == stock_weights.keys()
    if lora:  # the LoRA weights, the new tokens' rows and lm_head, as PEFT saves them
        assert any("trainable_tokens" in k for k in weights) and any("lm_head" in k for k in weights), list(weights)
    else:
        assert weights["model.embed_tokens.weight"].shape[0] == 128
    for k in weights:
        torch.testing.assert_close(weights[k], stock_weights[k], atol=1e-5, rtol=1e-5, msg=k)
    if lora:
        base = AutoModelForCausalLM.from_pretrained(folder)
        base.resize_token_embeddings(128)
        back = PeftModel.from_pretrained(base, str(tmp_path / "mega"))
        assert back.get_input_embeddings().weight.shape[0] == 128
        return
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "mega"))
    assert back.config.vocab_size == 128 and back.config.eos_token_id == AutoTokenizer.from_pretrained(
        str(tmp_path / "mega")).convert_tokens_to_ids("<|im_end|>")


def test_sft_config_carries_the_engine_options(tmp_path):
    args = MegaTrainSFTConfig(output_dir="o", use_cpu=True, max_length=48, gpu_resident_layers="0", report_to=[])
    assert isinstance(args, MegaTrainArguments) and isinstance(args, SFTConfig)
    assert args.max_seq_length == 48 and args.gpu_resident_layers == "0"
    other = MegaTrainSFTConfig(output_dir="o", use_cpu=True, optim="adamw_bnb_8bit", report_to=[])  # parses
    with pytest.raises(MegaTrainError, match="optim"):  # refused when the trainer is built
        MegaTrainSFTTrainer(model_folder(tmp_path, "llama"), other, train_dataset=DATA["completion"])


def test_trl_script_runs_as_a_command_with_yaml_and_lora(tmp_path):
    """examples/trl_sft.py is TRL's own SFT script with the two classes swapped: TrlParser, a YAML --config
    whose values flags override, --use_peft, a local .jsonl. The adapter loads back with PeftModel."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, out, data = model_folder(tmp_path, "llama"), tmp_path / "out", tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": w + ">", "completion": w[::-1]}) + "\n" for w in WORDS))
    config = tmp_path / "run.yaml"  # JSON is YAML
    config.write_text(json.dumps(dict(max_steps=6, per_device_train_batch_size=8, logging_steps=1, bf16=False,
                                      report_to="none", save_strategy="no", learning_rate=1e-3, use_cpu=True)))
    cmd = [sys.executable, os.path.join(ROOT, "examples", "trl_sft.py"), "--config", str(config),
           "--model_name_or_path", folder, "--dataset_name", str(data), "--output_dir", str(out),
           "--max_steps", "3", "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [line for line in r.stdout.splitlines() if "'mean_token_accuracy'" in line]
    assert len(logged) == 3, r.stdout[-2000:]  # the flag's 3 steps, not the YAML's 6
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), str(out))
    saved = load_file(str(out / "adapter_model.safetensors"))
    trained = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert trained and all(v.abs().max() > 0 for v in trained.values())  # B starts at zero: it was trained
    assert len(saved) == 2 * len(trained)


