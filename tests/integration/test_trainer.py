"""MegaTrainTrainer against stock Trainer: same logs, same parameters (fp32, CPU)."""

import copy
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
from tests.support.tiny import make_model, make_rows as rows



COMMON = dict(
    per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5, warmup_steps=2,
    lr_scheduler_type="linear", weight_decay=0.1, learning_rate=1e-2, eval_strategy="steps", eval_steps=2,
    logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, max_steps=6,
    dataloader_num_workers=0, disable_tqdm=True,
)
KEYS = ("loss", "grad_norm", "learning_rate", "eval_loss")


def run_pair(kind, tmp_path, engine_kw=None, **overrides):
    """Stock Trainer and MegaTrainTrainer on the same data; engine_kw: MegaTrainArguments' own fields."""
    train, ev = rows(24, 0), rows(6, 100)
    model = make_model(kind)
    ref = copy.deepcopy(model)
    kw = dict(COMMON, **overrides)
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "stock"), **kw),
                    train_dataset=train, eval_dataset=ev, data_collator=default_data_collator)
    stock.train()
    mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path / "mega"), **kw, **(engine_kw or {})),
                            train_dataset=train, eval_dataset=ev, data_collator=default_data_collator)
    mega.train()
    return stock, mega, ref


def assert_logs_equal(a_hist, b_hist):
    a_hist = [h for h in a_hist if any(k in h for k in KEYS)]
    b_hist = [h for h in b_hist if any(k in h for k in KEYS)]
    assert len(a_hist) == len(b_hist)
    for a, b in zip(a_hist, b_hist):
        for k in KEYS:
            if k in a:
                assert k in b, (k, b)
                assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])


@pytest.mark.parametrize("kind", ["llama", "mixtral", "gemma2", "qwen3_moe"])  # and a dense and an MoE family of tiny.FAMILIES
def test_trainer_matches_stock(kind, tmp_path):
    stock, mega, ref = run_pair(kind, tmp_path)
    assert sum("eval_loss" in h for h in mega.state.log_history) == 3
    assert mega.state.global_step == 6
    assert_logs_equal(stock.state.log_history, mega.state.log_history)
    masters = dict(mega.engine.named_master_params())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind,together", [("llama_tied", "true"), ("llama", "false"), ("granite", "true"),
                                           ("gemma3_text", "true"), ("mixtral", "false")])
def test_neftune_matches_stock(kind, together, tmp_path):
    """neftune_noise_alpha: the same noise on the token embeddings as stock's hook draws (so the same losses, norms
    and weights), before a multiplier the base model applies (Granite) or after one inside the embedding module
    (Gemma 3), with a step's micro-batches through each layer together or one at a time; none in evaluation (the
    eval losses equal stock's), and the user's model keeps no hook after training, as stock's."""
    stock, mega, ref = run_pair(kind, tmp_path, dict(layer_major_accumulation=together), neftune_noise_alpha=5.0)
    assert_logs_equal(stock.state.log_history, mega.state.log_history)
    masters = dict(mega.engine.named_master_params())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)
    quiet = run_pair(kind, tmp_path / "quiet", dict(layer_major_accumulation=together))[1]
    noisy = [h["loss"] for h in mega.state.log_history if "loss" in h]
    assert noisy != [h["loss"] for h in quiet.state.log_history if "loss" in h]  # the noise was drawn
    assert not mega.model.get_input_embeddings()._forward_hooks
    assert mega.engine._templates["embed"].module.noise_alpha is None


def test_no_clipping_and_cosine(tmp_path):
    stock, mega, ref = run_pair("qwen3", tmp_path, max_grad_norm=0.0, lr_scheduler_type="cosine",
                                gradient_accumulation_steps=1, eval_strategy="no")
    assert_logs_equal(stock.state.log_history, mega.state.log_history)


def test_loads_path_and_data_file_and_saves(tmp_path):
    """MegaTrainTrainer(path, args).train() with args.data_path, then from_pretrained of the result."""
    from hf_megatrain.demo import build_tokenizer

    model_dir = tmp_path / "base"
    tok = build_tokenizer()
    make_model("llama").save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    with open(data, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": "abcdefghij"[i % 7:] + "xyz" * (i % 4)}) + "\n")
    out = tmp_path / "out"
    args = MegaTrainArguments(output_dir=str(out), data_path=str(data), max_seq_length=16, max_steps=3,
                              per_device_train_batch_size=2, report_to=[], save_strategy="no", use_cpu=True,
                              disable_tqdm=True)
    trainer = MegaTrainTrainer(str(model_dir), args)
    assert "position_ids" in trainer.train_dataset.column_names
    trainer.train()
    trainer.save_model(str(out))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    masters = dict(trainer.engine.named_master_params())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), masters[name], atol=0, rtol=0, msg=name)
    assert os.path.exists(out / "tokenizer.json")


def test_resume_matches_uninterrupted(tmp_path):
    train = rows(24, 0)
    kw = dict(COMMON, eval_strategy="no", save_strategy="steps", save_steps=3, max_steps=6)
    full = MegaTrainTrainer(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path / "a"), **kw),
                            train_dataset=train, data_collator=default_data_collator)
    full.train()
    resumed = MegaTrainTrainer(make_model("llama", seed=5),
                               MegaTrainArguments(output_dir=str(tmp_path / "a"), **kw),
                               train_dataset=train, data_collator=default_data_collator)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    after = [h for h in resumed.state.log_history if "loss" in h and h["step"] > 3]
    before = [h for h in full.state.log_history if "loss" in h and h["step"] > 3]
    assert len(after) == 3
    for a, b in zip(before, after):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    m1, m2 = dict(full.engine.named_master_params()), dict(resumed.engine.named_master_params())
    for n in m1:
        assert torch.equal(m1[n], m2[n]), n


def test_trainer_recompute_flag_is_switched_off(tmp_path):
    """Asking Trainer for activation checkpointing (gradient_checkpointing before transformers 5.25) leaves the
    model's layers alone: the engine already recomputes at layer boundaries."""
    from hf_megatrain.trainer import _RECOMPUTE_FLAG

    model = make_model("llama")
    kw = dict(COMMON, eval_strategy="no", max_steps=1, **{_RECOMPUTE_FLAG: True})
    trainer = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path), **kw),
                               train_dataset=rows(4, 0), data_collator=default_data_collator)
    trainer.train()
    assert getattr(trainer.args, _RECOMPUTE_FLAG) is False
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


def test_logs_show_throughput_and_pipeline(tmp_path):
    train = rows(16, 0)
    args = MegaTrainArguments(output_dir=str(tmp_path), **dict(COMMON, eval_strategy="no", gpu_peak_tflops=1.0,
                                                                log_pipeline=True))
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=train, data_collator=default_data_collator)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        assert h["tokens_per_second"] > 0 and h["model_tflops"] > 0 and 0 < h["mfu"]
        assert 0 < h["pipe_compute_busy"] <= 1 and 0 < h["pipe_optimizer_busy"] <= 1


def test_tensorboard_logs_offline(tmp_path, monkeypatch):
    """report_to tensorboard writes event files with the engine's metrics (log_pipeline), no network involved."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = MegaTrainArguments(output_dir=str(tmp_path),
                              **dict(COMMON, eval_strategy="no", max_steps=3, report_to=["tensorboard"],
                                     log_pipeline=True))
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=rows(12, 0),
                               data_collator=default_data_collator)
    trainer.train()
    runs = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "tb") for f in fs if "tfevents" in f]
    assert runs
    acc = EventAccumulator(os.path.dirname(runs[0]))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/loss" in tags and "train/tokens_per_second" in tags and "train/pipe_compute_busy" in tags
