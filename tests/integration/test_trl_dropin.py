"""MegaTrainSFTTrainer as a drop-in for TRL's SFTTrainer (issue 32, items 2 to 4), each through the classes a
user swaps, against stock SFTTrainer on the CPU in fp32: evaluation metrics under eval_ names (and as
metric_for_best_model), prompt tuning and p-tuning as stock trains them (prefix tuning refused in one line), the tokenizer of a loaded model found as stock
finds it, trust_remote_code reaching the loader, and a dtype in model_init_kwargs said to be unapplied. The
MoE aux_loss log and LoRA on MoE expert parameters are cases of test_trl.test_sft_equals_stock_sfttrainer."""

import json
import logging
import os

import pytest
import torch

trl = pytest.importorskip("trl")
from peft import PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer  # noqa: E402
from hf_megatrain.sft import MegaTrainSFTTrainer  # noqa: E402
from tests.integration.test_trl import DATA, KW, datasets_cache, model_folder  # noqa: E402,F401

EVAL = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens", "eval_aux_loss")
TRAIN = ("loss", "entropy", "mean_token_accuracy", "num_tokens", "aux_loss", "grad_norm")


def close(a, b):
    return a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_eval_metrics_as_stock_and_metric_for_best_model(tmp_path):
    """Evaluation logs TRL's eval_entropy / eval_mean_token_accuracy / eval_num_tokens (and eval_aux_loss of a
    MoE) from the eval buffer, equal to stock's; evaluate() returns them, so eval_mean_token_accuracy works as
    metric_for_best_model with load_best_model_at_end; the training logs around the evaluations stay stock's."""
    folder = model_folder(tmp_path, "qwen3_moe")  # router aux loss on (tests/support/tiny.py FAMILIES)
    # one training log at step 4: its metrics average steps 1 to 4, across the evaluation at step 2
    kw = dict(KW, max_steps=4, logging_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
              per_device_eval_batch_size=4, load_best_model_at_end=True,
              metric_for_best_model="eval_mean_token_accuracy")
    runs = {}
    for name, cls in (("stock", SFTTrainer), ("mega", MegaTrainSFTTrainer)):
        trainer = cls(model=folder, args=SFTConfig(output_dir=str(tmp_path / name), **kw),
                      train_dataset=DATA["completion"], eval_dataset=DATA["completion"].select(range(12)))
        trainer.train()
        final = trainer.evaluate()
        runs[name] = (trainer, final)
    (stock, stock_final), (mega, mega_final) = runs["stock"], runs["mega"]
    evals = [[h for h in t.state.log_history if "eval_loss" in h] for t in (stock, mega)]
    trains = [[h for h in t.state.log_history if "loss" in h] for t in (stock, mega)]
    assert len(evals[0]) == len(evals[1]) == 3 and len(trains[0]) == len(trains[1]) == 1  # steps 2, 4; the last
    assert all(mega_final[k] == evals[1][-1][k] for k in EVAL)  # evaluate() returns what it logs
    for theirs, ours in zip(evals[0][:2], evals[1]):
        assert {k for k in ours if k in EVAL} == set(EVAL), ours
        assert not {k for k in ours if k in TRAIN}, ours  # no training buffer under training names
        for k in EVAL:
            assert close(ours[k], theirs[k]), (k, ours, theirs)
    assert mega.state.best_global_step == stock.state.best_global_step
    assert close(mega.state.best_metric, stock.state.best_metric)
    assert os.path.basename(mega.state.best_model_checkpoint) == os.path.basename(stock.state.best_model_checkpoint)
    # After load_best_model_at_end the engine evaluates the best checkpoint's weights: the metrics stock logged
    # at that step (the number of training tokens aside, which counts on). Stock's own final evaluation is not
    # the reference: transformers 5.17's _load_best_model loads the checkpoint with load_state_dict(strict=False),
    # and a MoE checkpoint names its experts one by one (experts.0.gate_proj...), so stock keeps the last
    # step's experts under the best step's other weights.
    best = next(h for h in evals[0] if h["step"] == stock.state.best_global_step)
    assert {k for k in mega_final if k in EVAL} == set(EVAL) and not {k for k in mega_final if k in TRAIN}
    for k in EVAL:
        if k != "eval_num_tokens":
            assert close(mega_final[k], best[k]), (k, mega_final, best)
    assert mega_final["eval_num_tokens"] == stock_final["eval_num_tokens"]
    for theirs, ours in zip(*trains):  # the training buffer is neither emptied nor logged by the evaluation
        assert {k for k in ours if k in TRAIN} == set(TRAIN), ours
        for k in TRAIN:
            assert close(ours[k], theirs[k]), (k, ours, theirs)
    assert not mega.model.training and not stock.model.training  # both left in eval mode by evaluate()


PROMPT_LEARNING = {
    "prompt_tuning": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "p_tuning": lambda: PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16),
    "prefix_tuning": lambda: PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
}


@pytest.mark.parametrize("as_model", [False, True], ids=["peft_config", "peft_model"])
@pytest.mark.parametrize("kind", list(PROMPT_LEARNING))
def test_prompt_learning_equals_stock_sfttrainer(kind, as_model, tmp_path):
    """Prompt tuning and p-tuning (the prompt encoder's output before each row's token embeddings) and prefix tuning
    (before each layer's keys and values), as PeftModel.forward puts them, trained in the embedding unit. The same
    losses, TRL metrics and grad norms as stock SFTTrainer (gradient accumulation, clipping, weight decay), the
    same saved prompt embeddings, the base model untouched; given as a peft_config with a folder, or as a
    PeftModel."""
    from safetensors.torch import load_file

    folder = model_folder(tmp_path, "llama")
    kw = dict(KW, weight_decay=0.1, save_strategy="no")
    if kind == "prefix_tuning":  # stock fails under checkpointing (test_peft.py), so TRL's own test turns it off
        kw["gradient_checkpointing"] = False
    runs = {}
    for name, cls in (("stock", SFTTrainer), ("mega", MegaTrainSFTTrainer)):
        args = SFTConfig(output_dir=str(tmp_path / name), **kw)
        if as_model:
            torch.manual_seed(0)
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), PROMPT_LEARNING[kind]())
            trainer = cls(model, args, train_dataset=DATA["completion"])
        else:
            trainer = cls(folder, args, train_dataset=DATA["completion"], peft_config=PROMPT_LEARNING[kind]())
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        trainer.save_model(str(tmp_path / name))
        logs = [{k: h[k] for k in TRAIN if k in h} for h in trainer.state.log_history if "loss" in h]
        trained = sorted(n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n]))
        runs[name] = logs, trained, load_file(str(tmp_path / name / "adapter_model.safetensors"))
    (stock_logs, stock_trained, stock_saved), (logs, trained, saved) = runs["stock"], runs["mega"]
    assert len(logs) == len(stock_logs) == KW["max_steps"]
    for ours, theirs in zip(logs, stock_logs):
        assert ours.keys() == theirs.keys()
        for k in ours:
            assert close(ours[k], theirs[k]), (k, ours, theirs)
    assert trained == stock_trained and trained and all(n.startswith("prompt_encoder.") for n in trained)
    assert saved.keys() == stock_saved.keys() == {"prompt_embeddings"}
    torch.testing.assert_close(saved["prompt_embeddings"], stock_saved["prompt_embeddings"], atol=1e-5, rtol=1e-5)


def test_multitask_prompt_tuning_is_refused_at_construction_in_one_line(tmp_path, monkeypatch):
    """Multitask prompt tuning needs task ids, which the engine does not pass: refused before any data is tokenized,
    as a peft_config and as a PEFT model."""
    from peft import MultitaskPromptTuningConfig

    folder = model_folder(tmp_path, "llama")
    config = MultitaskPromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, num_tasks=2)

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", no_tokenizing)
    args = SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, report_to=[])
    match = "MULTITASK_PROMPT_TUNING, which hf_megatrain does not train.*Prompt tuning"
    with pytest.raises(MegaTrainError, match=match) as refused:
        MegaTrainSFTTrainer(folder, args, train_dataset=DATA["completion"], peft_config=config)
    assert "\n" not in str(refused.value)
    prompted = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), config)
    with pytest.raises(MegaTrainError, match=match) as refused:
        MegaTrainSFTTrainer(prompted, args, train_dataset=DATA["completion"])
    with pytest.raises(MegaTrainError, match=match):
        MegaTrainTrainer(AutoModelForCausalLM.from_pretrained(folder),
                         MegaTrainArguments(output_dir=str(tmp_path / "t"), use_cpu=True, report_to=[]),
                         peft_config=config)


@pytest.mark.parametrize("given", ["peft_config", "peft_dict", "peft_json", "peft_model"])
def test_prefix_tuning_on_a_refused_family_is_refused_before_tokenizing(given, tmp_path, monkeypatch):
    """Prefix tuning on a family the engine does not train it on (Qwen3-Next's linear-attention layers): refused
    in one line before SFTTrainer tokenizes anything, as a peft_config (checked on a meta copy wrapped as PEFT
    wraps it), as the dict or JSON forms MegaTrainArguments takes, and as a PEFT model."""
    import json

    from hf_megatrain.demo import build_tokenizer
    from hf_megatrain.sft import MegaTrainSFTConfig
    from tests.support.zoo import stock_model, tiny_config

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", no_tokenizing)
    model, config = stock_model(tiny_config("qwen3_next")), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    fields = {"peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM", "num_virtual_tokens": 4}
    kw = {"peft_config": {"peft_config": config, "peft_dict": fields}.get(given)}
    args = SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, report_to=[])
    if given == "peft_model":
        model, kw = get_peft_model(model, config), {}
    elif given == "peft_json":  # the form the CLI and a YAML config give
        kw = {}
        args = MegaTrainSFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, report_to=[],
                                  peft_config=json.dumps(fields))
    with pytest.raises(MegaTrainError, match="prefix tuning on qwen3_next: not all its layers are attention") as refused:
        MegaTrainSFTTrainer(model, args, train_dataset=DATA["completion"], processing_class=build_tokenizer(), **kw)
    assert "\n" not in str(refused.value)



@pytest.mark.parametrize("as_model", [False, True], ids=["peft_config", "peft_model"])
def test_a_peft_method_the_engine_cannot_run_is_refused_before_tokenizing(as_model, tmp_path, monkeypatch):
    """AdaLoRA (its model adds an orthogonal regularization to the loss, which the engine would drop): refused in one
    line before SFTTrainer tokenizes anything, as a peft_config and as a PEFT model."""
    from peft import AdaLoraConfig

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(SFTTrainer, "_prepare_dataset", no_tokenizing)
    folder = model_folder(tmp_path, "llama")
    config = AdaLoraConfig(task_type="CAUSAL_LM", init_r=4, total_step=10, target_modules=["q_proj"])
    model, kw = (get_peft_model(AutoModelForCausalLM.from_pretrained(folder), config), {}) if as_model else \
        (folder, {"peft_config": config})
    args = SFTConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, report_to=[])
    with pytest.raises(MegaTrainError, match="peft_config is ADALORA, which hf_megatrain does not train") as refused:
        MegaTrainSFTTrainer(model, args, train_dataset=DATA["completion"], **kw)
    assert "\n" not in str(refused.value)

def test_loaded_model_without_processing_class_gets_its_tokenizer_as_stock(tmp_path):
    """Stock loads the tokenizer from model.config._name_or_path; so does the engine's trainer, and the
    two train alike."""
    folder = model_folder(tmp_path, "llama")
    trainers = {}
    for name, cls in (("stock", SFTTrainer), ("mega", MegaTrainSFTTrainer)):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = cls(model=model, args=SFTConfig(output_dir=str(tmp_path / name), **dict(KW, max_steps=2)),
                      train_dataset=DATA["completion"])
        trainer.train()
        trainers[name] = trainer
    stock, mega = trainers["stock"].processing_class, trainers["mega"].processing_class
    assert type(mega) is type(stock) and mega.name_or_path == stock.name_or_path == folder
    assert mega.get_vocab() == stock.get_vocab() and mega.pad_token == stock.pad_token
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in trainers.values()]
    assert len(losses[0]) == 2 and all(close(a, b) for a, b in zip(*losses))


def remote_code_folder(tmp_path):
    """A tiny model whose config names a model type transformers does not know, with its own configuration
    and modeling code (a Llama underneath): it loads only with trust_remote_code."""
    folder = model_folder(tmp_path, "llama")
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(model_type="megatrain_remote_llama", architectures=["RemoteLlamaForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteLlamaConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteLlamaForCausalLM"})
    with open(path, "w") as f:
        json.dump(config, f)
    with open(os.path.join(folder, "configuration_remote.py"), "w") as f:
        f.write("from transformers import LlamaConfig\n\n\nclass RemoteLlamaConfig(LlamaConfig):\n"
                "    model_type = 'megatrain_remote_llama'\n")
    with open(os.path.join(folder, "modeling_remote.py"), "w") as f:
        f.write("from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import RemoteLlamaConfig\n\n\n"
                "class RemoteLlamaForCausalLM(LlamaForCausalLM):\n    config_class = RemoteLlamaConfig\n")
    return folder


@pytest.mark.parametrize("where", ["args", "model_init_kwargs"])
def test_trust_remote_code_reaches_the_loader(where, tmp_path):
    """SFTConfig(trust_remote_code=True), or trust_remote_code in model_init_kwargs, builds the folder's own
    model class, as stock's loader does, and trains as stock; without it both refuse (no prompt)."""
    folder = remote_code_folder(tmp_path)
    trust = dict(trust_remote_code=True) if where == "args" else dict(model_init_kwargs={"trust_remote_code": True})
    kw = dict(KW, max_steps=2)
    logs = {}
    for name, cls in (("stock", SFTTrainer), ("mega", MegaTrainSFTTrainer)):
        with pytest.raises(ValueError, match="trust_remote_code"):
            cls(model=folder, args=SFTConfig(output_dir=str(tmp_path / name), **kw), train_dataset=DATA["completion"])
        trainer = cls(model=folder, args=SFTConfig(output_dir=str(tmp_path / name), **kw, **trust),
                      train_dataset=DATA["completion"])
        assert type(trainer.model).__name__ == "RemoteLlamaForCausalLM"
        trainer.train()
        logs[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logs["mega"]) == 2 and all(close(a, b) for a, b in zip(logs["stock"], logs["mega"]))


def test_dtype_in_model_init_kwargs_is_said_to_be_unapplied(tmp_path, caplog):
    """Stock would load the model in that dtype; the engine keeps fp32 masters: one warning line says so.
    float32 (what the masters are) says nothing."""
    folder = model_folder(tmp_path, "llama")
    for dtype, lines in (("bfloat16", 1), (torch.float32, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_megatrain"):
            trainer = MegaTrainSFTTrainer(
                folder, SFTConfig(output_dir=str(tmp_path / "o"), **dict(KW, max_steps=1),
                                  model_init_kwargs={"dtype": dtype}), train_dataset=DATA["completion"])
        said = [r.getMessage() for r in caplog.records if "model_init_kwargs" in r.getMessage()]
        assert len(said) == lines, said
        if lines:
            assert "dtype=bfloat16 is not applied" in said[0] and "fp32 master weights" in said[0]
            assert "float32" in said[0] and "\n" not in said[0]
        assert all(p.dtype == torch.float32 for _, p in trainer.engine.named_master_params())


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning"])
def test_prompt_learning_under_trls_bf16_default_tracks_stock(kind, tmp_path):
    """TRL's default bf16=True (on the CPU): stock trains the prompt encoder in fp32 under bf16 autocast, the engine
    in bf16 compute with fp32 masters. The losses agree to bf16's precision and the encoder's update points where
    stock's does (cosine > 0.99 over all its parameters), so the virtual tokens train in bf16 as they do in fp32."""
    folder = model_folder(tmp_path, "llama")
    kw = dict(KW, bf16=True, save_strategy="no", learning_rate=1e-2)
    if kind == "prefix_tuning":  # stock fails under checkpointing (test_peft.py)
        kw["gradient_checkpointing"] = False
    runs = {}
    for name, cls in (("stock", SFTTrainer), ("mega", MegaTrainSFTTrainer)):
        trainer = cls(folder, SFTConfig(output_dir=str(tmp_path / name), **kw), train_dataset=DATA["completion"],
                      peft_config=PROMPT_LEARNING[kind]())
        before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        after = {n: p.detach().float() for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert all(p.dtype == torch.float32 for n, p in trainer.model.named_parameters() if p.requires_grad)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[name] = losses, torch.cat([(after[n] - before[n]).flatten() for n in sorted(before)])
    (stock_losses, stock_step), (losses, step) = runs["stock"], runs["mega"]
    assert len(losses) == len(stock_losses) == KW["max_steps"]
    # (measured: within 1.5e-4 of stock's, while the losses move by 2e-2 a step)
    assert all(abs(a - b) < 2e-3 for a, b in zip(losses, stock_losses)), (losses, stock_losses)
    assert step.norm() > 0 and float(torch.nn.functional.cosine_similarity(step, stock_step, dim=0)) > 0.99
