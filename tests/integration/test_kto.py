"""TRL's KTOTrainer through the engine (issue 36): MegaTrainKTOTrainer against stock KTOTrainer on the CPU in fp32,
with gradient accumulation 2 and clipping: the losses, every metric TRL logs (kl, rewards/*, logps/*, logits/*,
entropy, num_tokens, a MoE's aux_loss), the evaluation metrics and the final weights, for both loss types, with
and without precompute_ref_log_probs on the stock side (the engine always computes the reference before the first
step), LoRA (the reference is the adapter-disabled model), a MoE and the engine's step placements. The KL term's
policy pass (a forward-only pass of the mismatched rows with the step's weights) runs before each micro-batch's
training pass. What the engine cannot do is refused by name, before any data is tokenized."""

import pytest
import torch

trl = pytest.importorskip("trl")
from peft import LoraConfig  # noqa: E402
from trl import KTOConfig, KTOTrainer  # noqa: E402

from hf_megatrain import MegaTrainError, MegaTrainTrainer  # noqa: E402
from hf_megatrain.kto import MegaTrainKTOConfig, MegaTrainKTOTrainer  # noqa: E402
from tests.support.preference import (  # noqa: E402,F401  (fresh_datasets: an autouse fixture)
    KW, LORA, PREFIX, PROMPT, TIMINGS, WORDS, as_folder, assert_same_weights, fresh_datasets, model_folder, pairs,
    run_peft_model, unpaired)
from tests.support.preference import run as run_trainer  # noqa: E402
from tests.support.tiny import make_model  # noqa: E402


def run(cls, folder, out, lora=None, evaluate_after=None, config_cls=KTOConfig, data=unpaired, **extra):
    return run_trainer(cls, config_cls, folder, out, data(), data(WORDS[:8]), lora, evaluate_after, **extra)


def assert_same_run(logs, stock_logs, weights, stock_weights, abs_tol=1e-6):
    """Every log entry with the same keys (a metric stock logs only for micro-batches with chosen or rejected rows
    is absent on both sides alike) and values within 1e-5, the saved weights within 1e-5. kl is the mean difference
    of two summed log-probabilities of about -30, whose fp32 ulp is 1.9e-6: it is compared within 1e-5 absolute
    (Mixtral's differs by 1.7e-6: its routed experts sum in another order per batch shape)."""
    assert len(logs) == len(stock_logs)
    assert sum("loss" in h for h in logs) == KW["max_steps"]
    assert any("eval_kl" in h for h in logs)
    for ours, theirs in zip(logs, stock_logs):
        assert ours.keys() == theirs.keys(), (ours, theirs)
        for k in ours:
            tol = max(abs_tol, 1e-5) if k.endswith("kl") else abs_tol
            assert ours[k] == pytest.approx(theirs[k], rel=1e-5, abs=tol), (k, ours, theirs)
    assert_same_weights(weights, stock_weights)


CASES = {
    # stock computes the reference batch by batch from a second model; the engine before the first step
    "kto": ("llama", None, dict()),
    "kto_precompute_weighted": ("llama", None, dict(precompute_ref_log_probs=True, desirable_weight=0.7,
                                                   undesirable_weight=1.4, beta=0.3)),
    "apo_zero_unpaired": ("llama", None, dict(loss_type="apo_zero_unpaired")),
    # paired data, unpaired by TRL into one desirable and one undesirable row per pair
    "paired_data": ("llama", None, dict(data=pairs)),
    "lora": ("llama", LORA, dict()),
    "lora_precompute_apo": ("llama", LORA, dict(loss_type="apo_zero_unpaired", precompute_ref_log_probs=True)),
    # prompt learning, its reference the base model (the adapter disabled)
    "prefix_tuning": ("llama", PREFIX, dict(gradient_checkpointing=False)),
    "prompt_tuning": ("llama", PROMPT, dict(gradient_checkpointing=False)),
    # the router's load-balancing loss added to the KTO loss, logged as aux_loss
    "mixtral": ("mixtral", None, dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kto_equals_stock_ktotrainer(case, tmp_path):
    kind, lora, extra = CASES[case]
    folder = model_folder(tmp_path, kind)
    after = unpaired(WORDS[30:38]) if lora else None  # LoRA: the reference of a late dataset is the base model's
    _, stock_logs, stock_weights = run(KTOTrainer, folder, tmp_path / "stock", lora, after, **extra)
    trainer, logs, weights = run(MegaTrainKTOTrainer, folder, tmp_path / "mega", lora, after, **extra)
    assert isinstance(trainer.args, MegaTrainKTOConfig) and trainer.ref_model is None
    assert ("aux_loss" in logs[0]) == (kind == "mixtral")
    if extra.get("loss_type") == "apo_zero_unpaired":  # no KL term: TRL logs kl 0
        assert all(h["kl"] == 0 for h in logs if "kl" in h)
    elif case in ("kto", "lora"):  # the KL term moves off 0 (clamped there while the estimate is negative)
        assert any(h.get("kl", 0) > 0 for h in logs)
    if lora:
        mark = "prompt_embeddings" if lora in (PREFIX, PROMPT) else "lora_"
        assert all(mark in k for k in weights) and any("after_loss" in h for h in logs)
    assert_same_run(logs, stock_logs, weights, stock_weights)


@pytest.mark.parametrize("as_path", [True, False], ids=["folder", "loaded"])
def test_a_separate_ref_model_equals_stock(as_path, tmp_path):
    """A ref_model that differs from the policy (another seed): its rows' and KL rows' log-probabilities from a second,
    forward-only engine before the first step (its store: the compute copy only); a late dataset's too."""
    folder, ref = model_folder(tmp_path, "llama"), model_folder(tmp_path, "llama", name="reference", seed=1)
    after = unpaired(WORDS[30:38])
    _, stock_logs, stock_weights = run(KTOTrainer, folder, tmp_path / "stock", None, after, ref_model=ref)
    trainer, logs, weights = run(MegaTrainKTOTrainer, folder, tmp_path / "mega", None, after,
                                 ref_model=as_folder(ref) if as_path else ref)
    assert all(m.numel() == 0 for m in trainer._ref_engine.store.master)
    assert any("after_loss" in h for h in logs) and logs[0]["rewards/chosen"] != 0
    assert_same_run(logs, stock_logs, weights, stock_weights)


# The reference batch by batch where stock computes it so and no precomputed copy can stand in (test_dpo.py's
# PER_BATCH says how): a streamed train_dataset and sync_ref_model; the KL rows' reference too
PER_BATCH = {
    "stream": (None, None, dict(stream=True)),
    "stream_lora_apo": (LORA, None, dict(stream=True, loss_type="apo_zero_unpaired")),
    "sync": (None, None, dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.3)),
    "sync_stream_ref_folder": (None, "folder", dict(stream=True, sync_ref_model=True, ref_model_sync_steps=2)),
}


@pytest.mark.parametrize("case", list(PER_BATCH))
def test_a_reference_batch_by_batch_equals_stock(case, tmp_path):
    lora, ref_kind, extra = PER_BATCH[case]
    extra = dict(extra)
    train = unpaired().to_iterable_dataset() if extra.pop("stream", False) else unpaired()
    folder = model_folder(tmp_path, "llama")
    ref = model_folder(tmp_path, "llama", name="reference", seed=1) if ref_kind else None
    late = unpaired(WORDS[30:38])
    stock, stock_logs, stock_weights = run_trainer(KTOTrainer, KTOConfig, folder, tmp_path / "stock", train,
                                                   unpaired(WORDS[:8]), lora, late, ref_model=ref, **extra)
    ours, logs, weights = run_trainer(MegaTrainKTOTrainer, KTOConfig, folder, tmp_path / "mega", train,
                                      unpaired(WORDS[:8]), lora, late, ref_model=as_folder(ref) if ref else None,
                                      **extra)
    assert any("after_loss" in h for h in logs)
    assert ours.args.precompute_ref_log_probs is False and ours.args.sync_ref_model == stock.args.sync_ref_model
    assert_same_run(logs, stock_logs, weights, stock_weights)
    if lora:
        assert ours.ref_model is None and ours._ref_engine is None
        return
    assert all(m.numel() == 0 for m in ours._ref_engine.store.master)
    theirs = dict(stock.ref_model.named_parameters())
    for name, p in ours.ref_model.named_parameters():
        torch.testing.assert_close(p, theirs[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# The engine's step placements (engine/step.py) with the KL term's forward-only pass before each micro-batch's
# training pass: the step's micro-batches through each layer together (the KL passes of all of them first); the
# host optimizer stepping each unit during the backward (after the last micro-batch's KL pass, no clipping);
# transient gradients, clipped by a norm pass that runs the loss once more (with the same KL)
MODES = {
    "layer_major": (dict(layer_major_accumulation="true"), {}),
    "step_during_backward": (dict(background_host_jobs=True), dict(max_grad_norm=0.0)),
    "transient_grads": (dict(transient_grads="true", background_host_jobs=True, layer_major_accumulation="true"), {}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_modes_equal_stock(mode, tmp_path):
    ours, both = MODES[mode]
    folder = model_folder(tmp_path, "llama")
    _, stock_logs, stock_weights = run(KTOTrainer, folder, tmp_path / "stock", **both)
    trainer, logs, weights = run(MegaTrainKTOTrainer, folder, tmp_path / "mega", config_cls=MegaTrainKTOConfig,
                                 **ours, **both)
    assert trainer._per_pass == (2 if "layer_major_accumulation" in ours else 1)
    assert_same_run(logs, stock_logs, weights, stock_weights)


# An IterableDataset to evaluate: TRL cannot precompute its reference (nothing to cache by index), so stock computes it
# batch by batch from its reference model; the engine does too, where it has the reference: before the first step
# (full fine-tuning's starting policy), under LoRA (the adapters disabled) or with a ref_model's engine
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_a_streamed_eval_dataset_before_training_equals_stock(loss_type, tmp_path):
    folder = model_folder(tmp_path, "llama")
    metrics = []
    for cls in (KTOTrainer, MegaTrainKTOTrainer):
        args = KTOConfig(output_dir=str(tmp_path / cls.__name__), loss_type=loss_type, **KW)
        trainer = cls(folder, args=args, train_dataset=unpaired())
        metrics.append({k: v for k, v in trainer.evaluate(unpaired(WORDS[:8]).to_iterable_dataset()).items()
                        if not k.endswith(TIMINGS)})
    assert metrics[0].keys() == metrics[1].keys() and "eval_rewards/chosen" in metrics[0]
    for k, v in metrics[0].items():
        assert metrics[1][k] == pytest.approx(v, rel=1e-5, abs=1e-5 if k.endswith("kl") else 1e-6), k


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_streamed_eval_datasets_under_lora_equal_stock(loss_type, tmp_path):
    """One stream as eval_dataset (evaluated after training), another evaluated after training only."""
    folder = model_folder(tmp_path, "llama")

    def stream(words):
        return unpaired(words).to_iterable_dataset()

    def go(cls, out):
        return run_trainer(cls, KTOConfig, folder, out, unpaired(), stream(WORDS[:8]), LORA, stream(WORDS[30:38]),
                           loss_type=loss_type)

    _, stock_logs, stock_weights = go(KTOTrainer, tmp_path / "stock")
    _, logs, weights = go(MegaTrainKTOTrainer, tmp_path / "mega")
    assert any("after_loss" in h for h in logs)
    assert_same_run(logs, stock_logs, weights, stock_weights)


@pytest.mark.parametrize("precompute", [False, True])
def test_a_peft_model_with_its_own_adapter_equals_stock(precompute, tmp_path):
    """A PeftModel with an adapter of its own as model: TRL copies the adapter as adapter 'ref', the reference (rows
    and KL rows). The engine computes the reference before the first step with that copy active, and a dataset's
    evaluated after training too."""
    folder = model_folder(tmp_path, "llama")
    data = unpaired(), unpaired(WORDS[:8]), unpaired(WORDS[30:38])
    stock_logs, stock_weights, stock_adapters = run_peft_model(KTOTrainer, KTOConfig, folder, tmp_path / "stock",
                                                               *data, precompute_ref_log_probs=precompute)
    logs, weights, adapters = run_peft_model(MegaTrainKTOTrainer, KTOConfig, folder, tmp_path / "mega", *data,
                                             precompute_ref_log_probs=precompute)
    assert adapters == stock_adapters == ["default", "ref"] and any("after_loss" in h for h in logs)
    assert_same_run(logs, stock_logs, weights, stock_weights)


def test_kto_config_elsewhere_names_the_kto_trainer(tmp_path):
    folder = model_folder(tmp_path, "llama")
    args = KTOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[])
    with pytest.raises(MegaTrainError, match="MegaTrainKTOTrainer"):
        MegaTrainTrainer(folder, args)


@pytest.mark.parametrize("extra, match", [
    (dict(loss_type="bco"), "loss_type='bco'"),
    (dict(sync_ref_model=True, lora=True), "`sync_ref_model=True` while using a PEFT model"),
    (dict(activation_offloading=True), "activation_offloading"),
    (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha"),
    (dict(model_init_kwargs={"quantization_config": {"load_in_4bit": True}}), "quantization_config"),
    (dict(ref_peft=True), "a PeftModel as ref_model"),
])
def test_what_the_engine_cannot_do_is_refused_before_tokenizing(extra, match, tmp_path, monkeypatch):
    folder = model_folder(tmp_path, "llama")

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(KTOTrainer, "_prepare_dataset", no_tokenizing)
    from peft import get_peft_model

    ref = get_peft_model(make_model("llama", num_hidden_layers=2), LoraConfig(**LORA)) if extra.pop("ref_peft", None) \
        else None
    lora = LoraConfig(**LORA) if extra.pop("lora", None) else None
    with pytest.raises(MegaTrainError, match=match) as e:
        MegaTrainKTOTrainer(folder, ref_model=ref, args=KTOConfig(output_dir=str(tmp_path / "o"), use_cpu=True,
                                                                  report_to=[], bf16=False, **extra),
                            train_dataset=unpaired(), peft_config=lora)
    assert "\n" not in str(e.value)


def test_a_new_dataset_after_full_fine_tuning_is_refused_in_one_line(tmp_path):
    """Full fine-tuning keeps no reference model: a dataset first seen after a step has no reference."""
    trainer = MegaTrainKTOTrainer(model_folder(tmp_path, "llama"), args=KTOConfig(output_dir=str(tmp_path / "o"),
                                  **dict(KW, max_steps=1)), train_dataset=unpaired())
    trainer.train()
    with pytest.raises(MegaTrainError, match="eval_dataset when building the trainer"):
        trainer.evaluate(unpaired(WORDS[:4]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_kto_on_the_cuda_path_equals_stock_in_fp32(kind, tmp_path):
    """The CUDA pipeline (streamed layers, the KL rows' forward-only pass, the head's two passes on the device) in
    fp32 compute against stock KTOTrainer on the GPU, TF32 off."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        folder = model_folder(tmp_path, kind)
        gpu = dict(use_cpu=False)
        _, stock_logs, stock_weights = run(KTOTrainer, folder, tmp_path / "stock", **gpu)
        _, logs, weights = run(MegaTrainKTOTrainer, folder, tmp_path / "mega", config_cls=MegaTrainKTOConfig,
                               compute_dtype="float32", **gpu)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    # other kernels for the reference pass's batch shapes: the step-1 rewards and kl (0 in exact arithmetic) carry
    # beta times the logps' last bits (as in test_dpo's CUDA test)
    assert_same_run(logs, stock_logs, weights, stock_weights, abs_tol=2e-5)
