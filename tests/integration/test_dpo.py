"""TRL's DPOTrainer through the engine (issue 36): MegaTrainDPOTrainer against stock DPOTrainer on the CPU in
fp32, with gradient accumulation 2 and clipping: the losses, every metric TRL logs (rewards/*, logps/*,
logits/*, entropy, mean_token_accuracy, num_tokens, a MoE's aux_loss), the evaluation metrics and the final
weights, for the loss types of DPOConfig, with and without precompute_ref_log_probs on the stock side (the
engine always computes the reference before the first step), LoRA (the reference is the adapter-disabled
model) and a MoE. What the engine cannot do is refused by name, before any data is tokenized."""

import re

import pytest
import torch

trl = pytest.importorskip("trl")
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.trainer.callbacks import SyncRefModelCallback  # noqa: E402

from hf_megatrain import MegaTrainError, MegaTrainTrainer  # noqa: E402
from hf_megatrain.dpo import MegaTrainDPOConfig, MegaTrainDPOTrainer  # noqa: E402
from hf_megatrain.sft import MegaTrainSFTTrainer  # noqa: E402
from tests.support.preference import (  # noqa: E402,F401  (fresh_datasets: an autouse fixture)
    IA3, KW, LORA, PREFIX, PROMPT, TIMINGS, WORDS, as_folder, assert_same_weights, fresh_datasets, model_folder, pairs, run_peft_model)
from tests.support.preference import run as run_trainer  # noqa: E402
from tests.support.tiny import make_model  # noqa: E402


def run(cls, folder, out, lora=None, evaluate_after=None, config_cls=DPOConfig, **extra):
    return run_trainer(cls, config_cls, folder, out, pairs(), pairs(WORDS[:8]), lora, evaluate_after, **extra)


def assert_same_run(logs, stock_logs, weights, stock_weights, starts_at_reference=True, abs_tol=1e-6):
    """starts_at_reference: the first step's policy is the reference (full fine-tuning, LoRA with B = 0). Its
    rewards are then 0 up to the last bit, so whether a chosen reward beats its rejected one is decided by
    round-off (stock's own two reference paths differ there): rewards/accuracies is not compared at step 1,
    the rewards themselves are (zero within abs_tol on both sides)."""
    assert len(logs) == len(stock_logs)
    assert sum("loss" in h for h in logs) == KW["max_steps"]
    assert any("eval_rewards/margins" in h for h in logs)
    for ours, theirs in zip(logs, stock_logs):
        assert ours.keys() == theirs.keys(), (ours, theirs)
        tie = starts_at_reference and theirs.get("step") == 1 and "loss" in theirs
        if tie:
            assert max(abs(h[k]) for h in (ours, theirs) for k in ("rewards/chosen", "rewards/rejected")) < abs_tol
        for k in ours:
            if not (tie and k == "rewards/accuracies"):
                assert ours[k] == pytest.approx(theirs[k], rel=1e-5, abs=abs_tol), (k, ours, theirs)
    assert_same_weights(weights, stock_weights)


CASES = {
    # stock computes the reference batch by batch from a second model; the engine before the first step
    "sigmoid": ("llama", None, dict(loss_type=["sigmoid"])),
    "sigmoid_precompute": ("llama", None, dict(loss_type=["sigmoid"], precompute_ref_log_probs=True)),
    "ipo": ("llama", None, dict(loss_type=["ipo"])),
    "hinge_precompute": ("llama", None, dict(loss_type=["hinge"], precompute_ref_log_probs=True)),
    "lora": ("llama", LORA, dict(loss_type=["sigmoid"])),
    "lora_precompute_ipo": ("llama", LORA, dict(loss_type=["ipo"], precompute_ref_log_probs=True)),
    # the reference is the adapter-disabled model under any PEFT method
    "ia3": ("llama", IA3, dict(loss_type=["sigmoid"])),
    "prefix_tuning": ("llama", PREFIX, dict(loss_type=["sigmoid"], gradient_checkpointing=False)),
    "prompt_tuning_ipo": ("llama", PROMPT, dict(loss_type=["ipo"], gradient_checkpointing=False)),
    # the router's load-balancing loss added to the DPO loss, logged as aux_loss
    "moe": ("mixtral", None, dict(loss_type=["sigmoid"])),
    "qwen3_moe_hinge": ("qwen3_moe", None, dict(loss_type=["hinge"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_equals_stock_dpotrainer(case, tmp_path):
    kind, lora, extra = CASES[case]
    folder = model_folder(tmp_path, kind)
    after = pairs(WORDS[30:38]) if lora else None  # LoRA: the reference of a late dataset is the base model's
    _, stock_logs, stock_weights = run(DPOTrainer, folder, tmp_path / "stock", lora, after, **extra)
    trainer, logs, weights = run(MegaTrainDPOTrainer, folder, tmp_path / "mega", lora, after, **extra)
    assert isinstance(trainer.args, MegaTrainDPOConfig) and trainer.ref_model is None
    assert ("aux_loss" in logs[0]) == (kind in ("mixtral", "qwen3_moe"))
    if lora:
        marks = {id(IA3): "ia3_", id(PREFIX): "prompt_embeddings", id(PROMPT): "prompt_embeddings"}
        assert all(marks.get(id(lora), "lora_") in k for k in weights) and any("after_loss" in h for h in logs)
    assert_same_run(logs, stock_logs, weights, stock_weights, starts_at_reference=not lora or lora is IA3)


# A ref_model that differs from the policy (another seed): streamed through a second, forward-only engine before the
# first step (every weight frozen: its store holds the compute copy only). Stock is handed the loaded model; ours the
# folder (streamed from disk) or the loaded model. The step-1 rewards are not 0 here: accuracies compared throughout.
# (IPO's full fine-tune against another model's reference starts at a loss of 25, its gradients clipped from 16 to 0.3:
# Adam then carries the last-bit differences of the two head paths to 1.1e-5 in one weight of 2048, as KW's rate note
# says; IPO runs here under LoRA, and against the policy's own reference in test_dpo_equals_stock_dpotrainer.)
REF_CASES = {
    "sigmoid_folder": ("llama", None, True, dict(loss_type=["sigmoid"])),
    "hinge_loaded_precompute": ("llama", None, False, dict(loss_type=["hinge"], precompute_ref_log_probs=True)),
    "lora_folder_ipo": ("llama", LORA, True, dict(loss_type=["ipo"])),
    "mixtral_loaded": ("mixtral", None, False, dict(loss_type=["sigmoid"])),
}


@pytest.mark.parametrize("case", list(REF_CASES))
def test_a_separate_ref_model_equals_stock(case, tmp_path):
    kind, lora, as_path, extra = REF_CASES[case]
    folder, ref = model_folder(tmp_path, kind), model_folder(tmp_path, kind, name="reference", seed=1)
    after = pairs(WORDS[30:38])  # a dataset first seen after training: the kept reference engine computes it
    _, stock_logs, stock_weights = run(DPOTrainer, folder, tmp_path / "stock", lora, after, ref_model=ref, **extra)
    trainer, logs, weights = run(MegaTrainDPOTrainer, folder, tmp_path / "mega", lora, after,
                                 ref_model=as_folder(ref) if as_path else ref, **extra)
    store = trainer._ref_engine.store
    assert all(m.numel() == 0 for m in store.master)  # no fp32 master (nor state): the compute copy only
    assert sum(c.numel() for c in store.compute) == sum(p.numel() for p in make_model(kind, num_hidden_layers=2)
                                                        .parameters())
    assert any("after_loss" in h for h in logs) and logs[0]["rewards/chosen"] != 0
    assert_same_run(logs, stock_logs, weights, stock_weights, starts_at_reference=False)


# The engine's step placements (engine/step.py) under the DPO loss: the step's micro-batches through each layer
# together; the host AdamW stepping each unit during the backward (no clipping); transient gradients, clipped by a
# norm pass that runs the loss once more
MODES = {
    "layer_major": (dict(layer_major_accumulation="true"), {}),
    "step_during_backward": (dict(background_host_jobs=True), dict(max_grad_norm=0.0)),
    "transient_grads": (dict(transient_grads="true", background_host_jobs=True, layer_major_accumulation="true"), {}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_modes_equal_stock(mode, tmp_path):
    ours, both = MODES[mode]
    folder = model_folder(tmp_path, "llama")
    _, stock_logs, stock_weights = run(DPOTrainer, folder, tmp_path / "stock", **both)
    trainer, logs, weights = run(MegaTrainDPOTrainer, folder, tmp_path / "mega", config_cls=MegaTrainDPOConfig,
                                 **ours, **both)
    assert trainer._per_pass == (2 if "layer_major_accumulation" in ours else 1)
    assert_same_run(logs, stock_logs, weights, stock_weights)


# The other loss types, as DPOConfig combines several (loss_weights); each group is one run, each term distinct
GROUPS = {
    "pairs": dict(loss_type=["robust", "bco_pair", "sppo_hard", "nca_pair"], loss_weights=[1.0, 0.7, 0.05, 0.3],
                  label_smoothing=0.1),
    "apo_aot": dict(loss_type=["apo_zero", "apo_down", "aot", "aot_unpaired"], loss_weights=[1.0, 0.5, 0.3, 0.2]),
    "exo_discopop_sft_norm": dict(loss_type=["exo_pair", "discopop", "sft", "sigmoid_norm"],
                                  loss_weights=[1.0, 0.5, 0.1, 0.8], label_smoothing=1e-3),
    "f_divergences": dict(loss_type=["sigmoid", "ipo"], f_divergence_type="js_divergence"),
    "alpha_divergence": dict(loss_type=["hinge", "robust"], f_divergence_type="alpha_divergence",
                             f_alpha_divergence_coef=0.3),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_other_loss_types_equal_stock(group, tmp_path):
    folder = model_folder(tmp_path, "llama")
    extra = dict(GROUPS[group], precompute_ref_log_probs=True)
    _, stock_logs, stock_weights = run(DPOTrainer, folder, tmp_path / "stock", **extra)
    _, logs, weights = run(MegaTrainDPOTrainer, folder, tmp_path / "mega", **extra)
    assert_same_run(logs, stock_logs, weights, stock_weights)


def uneven_pairs(words=WORDS):
    """pairs() whose completions differ in length within each pair (LD-DPO weighs the longer one's tail): the rejected
    completion is the word twice on odd rows, its first two letters on even rows."""
    import datasets

    return datasets.Dataset.from_dict({"prompt": [w + ">" for w in words], "chosen": [w[::-1] for w in words],
                                       "rejected": [w + w if i % 2 else w[:2] for i, w in enumerate(words)]})


# LD-DPO (ld_alpha: a completion's tokens beyond its pair's shared length count ld_alpha times, in the policy's and
# the reference's sums; the sft term averages the plain ones) and WPO (use_weighting: every term of a pair times its
# rows' exp(mean log(p_t / sum_v p_v^2)), constants), with stock's reference batch by batch or precomputed
WEIGHTED = {
    "ld_alpha": dict(loss_type=["sigmoid", "sft", "ipo"], loss_weights=[1.0, 0.3, 0.5], ld_alpha=0.3),
    "ld_alpha_precompute": dict(loss_type=["sigmoid"], ld_alpha=0.5, precompute_ref_log_probs=True),
    # (stock's WPO scales each term in place: it fails on sft's expanded tensor and on hinge's relu output)
    "wpo": dict(loss_type=["sigmoid", "ipo"], use_weighting=True),
    "wpo_ld_precompute": dict(loss_type=["sigmoid", "bco_pair"], use_weighting=True, ld_alpha=0.5,
                              precompute_ref_log_probs=True),
}


@pytest.mark.parametrize("case", list(WEIGHTED))
def test_ld_alpha_and_wpo_equal_stock(case, tmp_path):
    folder = model_folder(tmp_path, "llama")
    train, evaluation = uneven_pairs(), uneven_pairs(WORDS[:8])
    _, stock_logs, stock_weights = run_trainer(DPOTrainer, DPOConfig, folder, tmp_path / "stock", train, evaluation,
                                               **WEIGHTED[case])
    trainer, logs, weights = run_trainer(MegaTrainDPOTrainer, DPOConfig, folder, tmp_path / "mega", train, evaluation,
                                         **WEIGHTED[case])
    assert trainer.engine.row_stats == (("log_sum_sq_probs",) if "wpo" in case else ())
    assert_same_run(logs, stock_logs, weights, stock_weights)


# An IterableDataset to evaluate: TRL cannot precompute its reference (nothing to cache by index), so stock computes it
# batch by batch from its reference model; the engine does too, where it has the reference: before the first step
# (full fine-tuning's starting policy), under LoRA (the adapters disabled) or with a ref_model's engine
def test_a_streamed_eval_dataset_before_training_equals_stock(tmp_path):
    folder = model_folder(tmp_path, "llama")
    metrics = []
    for cls in (DPOTrainer, MegaTrainDPOTrainer):
        trainer = cls(folder, args=DPOConfig(output_dir=str(tmp_path / cls.__name__), **KW), train_dataset=pairs())
        metrics.append({k: v for k, v in trainer.evaluate(pairs(WORDS[:8]).to_iterable_dataset()).items()
                        if not k.endswith(TIMINGS)})
    assert metrics[0].keys() == metrics[1].keys() and "eval_rewards/chosen" in metrics[0]
    for k, v in metrics[0].items():
        assert metrics[1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_streamed_eval_datasets_under_lora_equal_stock(tmp_path):
    """One stream as eval_dataset (evaluated after training), another evaluated after training only."""
    folder = model_folder(tmp_path, "llama")

    def stream(words):
        return pairs(words).to_iterable_dataset()

    def go(cls, out):
        return run_trainer(cls, DPOConfig, folder, out, pairs(), stream(WORDS[:8]), LORA, stream(WORDS[30:38]))

    _, stock_logs, stock_weights = go(DPOTrainer, tmp_path / "stock")
    _, logs, weights = go(MegaTrainDPOTrainer, tmp_path / "mega")
    assert any("after_loss" in h for h in logs)
    assert_same_run(logs, stock_logs, weights, stock_weights, starts_at_reference=False)


# Where stock computes the reference batch by batch and no precomputed copy can stand in, the engine does too: a
# streamed train_dataset (nothing to cache by index) and sync_ref_model (TR-DPO: every ref_model_sync_steps the
# reference becomes (1 - alpha) * reference + alpha * policy). Full fine-tuning without a ref_model takes it from a
# forward-only copy of the starting policy (its store: one compute copy; under sync_ref_model its parameters keep
# fp32 values beside it, into which the policy is mixed), LoRA from the adapter-disabled model, a ref_model from its
# own engine. The reference model's parameters after training equal stock's ref_model's.
PER_BATCH = {
    "stream": (None, None, dict(stream=True)),
    "stream_lora": (LORA, None, dict(stream=True)),
    "stream_ref_folder": (None, "folder", dict(stream=True)),
    "sync": (None, None, dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.3)),
    "sync_stream_ref_loaded": (None, "loaded", dict(stream=True, sync_ref_model=True, ref_model_sync_steps=2,
                                                   ref_model_mixup_alpha=0.6)),
    "sync_ref_folder": (None, "folder", dict(sync_ref_model=True, ref_model_sync_steps=1)),  # TRL's alpha, 0.6
    "sync_stream_mixtral": (None, None, dict(kind="mixtral", stream=True, sync_ref_model=True, ref_model_sync_steps=1)),
}


@pytest.mark.parametrize("case", list(PER_BATCH))
def test_a_reference_batch_by_batch_equals_stock(case, tmp_path):
    lora, ref_kind, extra = PER_BATCH[case]
    extra = dict(extra)
    stream, kind = extra.pop("stream", False), extra.pop("kind", "llama")
    folder = model_folder(tmp_path, kind)
    ref = model_folder(tmp_path, kind, name="reference", seed=1) if ref_kind else None
    train = pairs().to_iterable_dataset() if stream else pairs()
    late = pairs(WORDS[30:38])  # first seen after training: the kept reference computes it
    stock, stock_logs, stock_weights = run_trainer(DPOTrainer, DPOConfig, folder, tmp_path / "stock", train,
                                                   pairs(WORDS[:8]), lora, late, ref_model=ref, **extra)
    ours, logs, weights = run_trainer(MegaTrainDPOTrainer, DPOConfig, folder, tmp_path / "mega", train,
                                      pairs(WORDS[:8]), lora, late,
                                      ref_model=as_folder(ref) if ref_kind == "folder" else ref, **extra)
    assert any("after_loss" in h for h in logs)
    assert ours.args.precompute_ref_log_probs is False and ours.args.sync_ref_model == stock.args.sync_ref_model
    assert_same_run(logs, stock_logs, weights, stock_weights, starts_at_reference=not (lora or ref))
    if lora:
        assert ours.ref_model is None and ours._ref_engine is None  # the policy's engine, its adapters off
        return
    assert all(m.numel() == 0 for m in ours._ref_engine.store.master)  # forward only: no fp32 master nor state
    theirs = dict(stock.ref_model.named_parameters())
    for name, p in ours.ref_model.named_parameters():
        assert p.dtype == theirs[name].dtype == torch.float32
        torch.testing.assert_close(p, theirs[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if extra.get("sync_ref_model"):  # it moved
        start = dict(AutoModelForCausalLM.from_pretrained(ref or folder).named_parameters())
        assert any(not torch.equal(p, start[n]) for n, p in ours.ref_model.named_parameters())


def test_the_reference_copy_is_planned_for_in_host_ram(tmp_path, monkeypatch):
    """The reference engine's host RAM (here the copy of the starting policy a stream needs) is held out of what the
    policy's plan counts as available: a host with room for the policy but not for both is refused when the trainer
    is built, naming the reference; the same host trains a map-style dataset (no copy kept)."""
    import hf_megatrain.planner.machine as machine
    import hf_megatrain.trainer as trainer_module
    from hf_megatrain.planner.admission import ADMIT_MARGIN

    folder, runs = model_folder(tmp_path, "llama"), []
    real = trainer_module.plan_run
    monkeypatch.setattr(trainer_module, "plan_run", lambda *a, **k: runs.append(real(*a, **k)) or runs[-1])

    def build(train, host):
        monkeypatch.setattr(machine, "host_available", lambda: host)
        return MegaTrainDPOTrainer(folder, args=DPOConfig(output_dir=str(tmp_path / "o"), **KW), train_dataset=train)

    trainer = build(pairs().to_iterable_dataset(), 1e12)
    policy = runs[-1].memory.host_per_host
    held, what = trainer._host_held(trainer.args, trainer.model)
    assert held == 4 * sum(p.numel() for p in trainer.model.parameters())  # fp32 compute: one fp32 copy
    host = (policy + held / 2) / (1 - ADMIT_MARGIN)
    build(pairs(), host)  # fits without the copy
    with pytest.raises(MegaTrainError) as e:
        build(pairs().to_iterable_dataset(), host)
    first = str(e.value).splitlines()[0]  # then the plan's table, as for any plan that does not fit
    assert re.fullmatch(r"this run does not fit: host RAM: needs .* GiB available\. \(The host RAM counted excludes "
                        r"0\.0 GiB for the reference, a forward-only copy of the starting policy\.\)", first), first


def test_sync_ref_model_in_bf16_mixes_fp32_parameters(tmp_path):
    """TRL's default bf16 compute (on the CPU): the reference's parameters stay fp32 as stock's ref_model's, the policy's
    fp32 masters are mixed into them (TRL's op order, each step here), and the compute copy that streams is their
    bf16 rounding. The reference starts as the policy: step 1's rewards are 0 (both run the same bf16 weights)."""
    folder = model_folder(tmp_path, "llama")
    alpha, seen = 0.25, []

    class Watch(TrainerCallback):  # runs before the sync (TRL's callback is added last, as ours is)
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(({n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                         {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}))

    args = DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, max_steps=3, per_device_train_batch_size=4,
                     learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                     sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=alpha)
    assert args.bf16
    trainer = MegaTrainDPOTrainer(folder, args=args, train_dataset=pairs(), callbacks=[Watch()])
    assert isinstance(trainer.callback_handler.callbacks[-1], SyncRefModelCallback)  # TRL's class, as stock's
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    assert trainer.state.log_history[0]["rewards/chosen"] == 0 == trainer.state.log_history[0]["rewards/rejected"]
    for k, (policy, before) in enumerate(seen):
        after = seen[k + 1][1] if k + 1 < len(seen) else final
        for n, r in before.items():
            assert r.dtype == torch.float32
            assert torch.equal(after[n], r.mul(1.0 - alpha).add(policy[n], alpha=alpha)), (k, n)
    store = trainer._ref_engine.store
    for unit in store.units:
        for n, view in store.param_views(unit.index).items():
            assert view.dtype == torch.bfloat16 and torch.equal(view, final[n].to(torch.bfloat16)), n


def test_the_reference_cache_is_keyed_by_the_engines_fingerprint(tmp_path, monkeypatch):
    """TRL keys its cache of the reference's log-probabilities by hash_module(model): one thread over every fp32
    master. The engine's key is a hash of the copies its forward streams, taken on threads: TRL's hash_module is not
    called on the policy (and is TRL's own again after __init__); the key changes with any weight and comes back
    with it."""
    import trl.trainer.dpo_trainer as dpo_module

    from hf_megatrain.preference import weights_fingerprint

    original, asked = dpo_module.hash_module, []

    def hash_module(module):
        asked.append(module)
        return original(module)

    monkeypatch.setattr(dpo_module, "hash_module", hash_module)
    trainer = MegaTrainDPOTrainer(model_folder(tmp_path, "llama"), args=DPOConfig(output_dir=str(tmp_path / "o"), **KW),
                                  train_dataset=pairs())
    assert asked == [] and dpo_module.hash_module is hash_module
    key = trainer._precompute_model_hash
    assert key == weights_fingerprint(trainer.engine, trainer.model)
    last = trainer.engine.store.compute[-2]  # the last decoder layer's streamed copy
    kept = last[-1].item()
    last[-1] = kept + 1e-3
    assert weights_fingerprint(trainer.engine, trainer.model) != key
    last[-1] = kept
    assert weights_fingerprint(trainer.engine, trainer.model) == key


@pytest.mark.parametrize("precompute", [False, True])
def test_a_peft_model_with_its_own_adapter_equals_stock(precompute, tmp_path):
    """A PeftModel with an adapter of its own as model: TRL copies the adapter as adapter 'ref', the reference. The
    engine computes the reference before the first step with that copy active, and a dataset's evaluated after
    training too."""
    folder = model_folder(tmp_path, "llama")
    data = pairs(), pairs(WORDS[:8]), pairs(WORDS[30:38])
    stock_logs, stock_weights, stock_adapters = run_peft_model(DPOTrainer, DPOConfig, folder, tmp_path / "stock",
                                                               *data, precompute_ref_log_probs=precompute)
    logs, weights, adapters = run_peft_model(MegaTrainDPOTrainer, DPOConfig, folder, tmp_path / "mega", *data,
                                             precompute_ref_log_probs=precompute)
    assert adapters == stock_adapters == ["default", "ref"] and any("after_loss" in h for h in logs)
    assert_same_run(logs, stock_logs, weights, stock_weights)


def test_a_streamed_eval_dataset_without_a_reference_is_refused_in_one_line(tmp_path, monkeypatch):
    """Full fine-tuning without a ref_model: a stream evaluated during training is refused when the trainer is built
    (before tokenizing), one evaluated after training when it is."""
    folder = model_folder(tmp_path, "llama")

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    with monkeypatch.context() as m:
        m.setattr(DPOTrainer, "_prepare_dataset", no_tokenizing)
        with pytest.raises(MegaTrainError, match="streamed") as e:
            MegaTrainDPOTrainer(folder, args=DPOConfig(output_dir=str(tmp_path / "o"), eval_strategy="steps",
                                                       eval_steps=1, **KW),
                                train_dataset=pairs(), eval_dataset=pairs(WORDS[:8]).to_iterable_dataset())
    assert "\n" not in str(e.value)
    trainer = MegaTrainDPOTrainer(folder, args=DPOConfig(output_dir=str(tmp_path / "o"), **dict(KW, max_steps=1)),
                                  train_dataset=pairs(), eval_dataset=pairs(WORDS[:8]).to_iterable_dataset())
    trainer.train()
    with pytest.raises(MegaTrainError, match="streamed"):
        trainer.evaluate()


ONLINE = ["GRPOConfig", "RLOOConfig"]


@pytest.mark.parametrize("config", ONLINE)
def test_online_methods_are_refused_by_name_before_tokenizing(config, tmp_path, monkeypatch):
    folder = model_folder(tmp_path, "llama")

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(DPOTrainer, "_prepare_dataset", no_tokenizing)
    args = getattr(trl, config)(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], bf16=False)
    name = {"GRPOConfig": "GRPO", "RLOOConfig": "RLOO"}[config]
    for cls in (MegaTrainDPOTrainer, MegaTrainSFTTrainer):
        with pytest.raises(MegaTrainError, match=f"{config}: {name} is an online method .*no generation") as e:
            cls(folder, args=args, train_dataset=pairs())
        assert "\n" not in str(e.value)
    with pytest.raises(MegaTrainError, match=f"{config}: {name} is an online method"):
        MegaTrainTrainer(folder, args)


def test_dpo_config_elsewhere_names_the_dpo_trainer(tmp_path):
    folder = model_folder(tmp_path, "llama")
    args = DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[])
    with pytest.raises(MegaTrainError, match="MegaTrainDPOTrainer"):
        MegaTrainTrainer(folder, args)


@pytest.mark.parametrize("extra, match", [
    (dict(sync_ref_model=True, lora=True), "`sync_ref_model=True` while using a PEFT model"),
    (dict(activation_offloading=True), "activation_offloading"),
    (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha"),
    (dict(loss_type=["kto"]), r"loss_type \['kto'\]"),
    (dict(model_init_kwargs={"quantization_config": {"load_in_4bit": True}}), "quantization_config"),
    (dict(ref_peft=True), "a PeftModel as ref_model"),
    # TRL's reference is then a frozen copy of the model's own prompt encoder ('ref')
    (dict(prompt_model=True), "a PeftModel with a prompt-learning adapter \\(PROMPT_TUNING\\)"),
])
def test_what_the_engine_cannot_do_is_refused_before_tokenizing(extra, match, tmp_path, monkeypatch):
    folder = model_folder(tmp_path, "llama")

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(DPOTrainer, "_prepare_dataset", no_tokenizing)
    from peft import get_peft_model

    ref = get_peft_model(make_model("llama", num_hidden_layers=2), LoraConfig(**LORA)) if extra.pop("ref_peft", None) \
        else None
    from peft import PromptTuningConfig

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), PromptTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=4)) if extra.pop("prompt_model", None) else folder
    lora = LoraConfig(**LORA) if extra.pop("lora", None) else None
    with pytest.raises(MegaTrainError, match=match) as e:
        MegaTrainDPOTrainer(model, ref_model=ref, args=DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True,
                                                                 report_to=[], bf16=False, **extra),
                            train_dataset=pairs(), peft_config=lora)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_what_stock_refuses_before_training_is_refused_in_its_words(kind, tmp_path):
    """No train_dataset; precompute_ref_log_probs=True with a streamed train_dataset, or with sync_ref_model: stock's
    ValueError, its message first (the engine's says more after it)."""
    config, stock, _, ours, data = _trainers(kind)
    folder = model_folder(tmp_path, "llama")
    for extra, train in ((dict(), None), (dict(precompute_ref_log_probs=True), data().to_iterable_dataset()),
                         (dict(precompute_ref_log_probs=True, sync_ref_model=True), data())):
        messages = []
        for cls in (stock, ours):
            args = config(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], bf16=False, max_steps=1, **extra)
            with pytest.raises(ValueError) as e:
                cls(folder, args=args, train_dataset=train)
            messages.append(str(e.value))
        assert messages[1].startswith(messages[0]), messages


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_a_loaded_ref_model_is_left_as_stock_leaves_it(kind, tmp_path):
    """TRL's default bf16 compute with an fp32 ref_model loaded on the CPU: stock leaves the model as it was passed;
    the engine's reference store takes a bf16 copy of it and the model keeps its own fp32 tensors (its parameters
    once viewed that copy: the user's model came back in bf16, its weights rounded)."""
    from transformers import AutoModelForCausalLM

    config, stock, _, ours, data = _trainers(kind)
    folder, ref_folder = model_folder(tmp_path, "llama"), model_folder(tmp_path, "llama", name="reference", seed=1)
    for cls in (stock, ours):
        ref = AutoModelForCausalLM.from_pretrained(ref_folder)
        before = {n: p.detach().clone() for n, p in ref.named_parameters()}
        assert all(p.dtype == torch.float32 for p in before.values())
        args = config(output_dir=str(tmp_path / cls.__name__), use_cpu=True, max_steps=1, per_device_train_batch_size=4,
                      report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
        assert args.bf16
        cls(folder, ref_model=ref, args=args, train_dataset=data()).train()
        after = dict(ref.named_parameters())
        for n, p in before.items():  # dtype and every bit
            torch.testing.assert_close(after[n], p, rtol=0, atol=0, msg=lambda m, n=n: f"{cls.__name__} {n}: {m}")


def test_a_new_dataset_after_full_fine_tuning_is_refused_in_one_line(tmp_path):
    """Full fine-tuning keeps no reference model: a dataset first seen after a step has no reference."""
    trainer = MegaTrainDPOTrainer(model_folder(tmp_path, "llama"), args=DPOConfig(output_dir=str(tmp_path / "o"),
                                  **dict(KW, max_steps=1)), train_dataset=pairs())
    trainer.train()
    with pytest.raises(MegaTrainError, match="eval_dataset when building the trainer"):
        trainer.evaluate(pairs(WORDS[:4]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, separate_ref", [("llama", False), ("mixtral", False), ("llama", True)])
def test_dpo_on_the_cuda_path_equals_stock_in_fp32(kind, separate_ref, tmp_path):
    """The CUDA pipeline (streamed layers, the head's two passes on the device) in fp32 compute against stock
    DPOTrainer on the GPU, TF32 off; with separate_ref, a ref_model folder streamed by a second, forward-only engine
    beside the policy's (stock gets the loaded model, on the GPU as its trainer places it)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        folder = model_folder(tmp_path, kind)
        gpu = dict(use_cpu=False)
        ref = model_folder(tmp_path, kind, name="reference", seed=1) if separate_ref else None
        _, stock_logs, stock_weights = run(DPOTrainer, folder, tmp_path / "stock", ref_model=ref, **gpu)
        _, logs, weights = run(MegaTrainDPOTrainer, folder, tmp_path / "mega", config_cls=MegaTrainDPOConfig,
                               compute_dtype="float32", ref_model=as_folder(ref) if ref else None, **gpu)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    # the reference pass and the training pass run other kernels for other batch shapes: the step-1 rewards
    # (0 in exact arithmetic) carry beta times the logps' last bits, about 1e-6
    assert_same_run(logs, stock_logs, weights, stock_weights, starts_at_reference=not separate_ref, abs_tol=2e-5)


# TRL's default precision (DPOConfig and KTOConfig default bf16=True, gradient_checkpointing=True): what stock does
# with it, ours does. On a machine without a GPU TrainingArguments refuses bf16 unless use_cpu is set: the same
# ValueError from our config and from the trainers given no args (TRL's default config), before any data is
# tokenized; with use_cpu=True both train in bf16 (stock under CPU autocast, the engine with bf16 compute copies).
def _trainers(kind):
    from trl import KTOConfig, KTOTrainer

    from hf_megatrain.kto import MegaTrainKTOConfig, MegaTrainKTOTrainer
    from tests.support.preference import unpaired

    if kind == "kto":
        return KTOConfig, KTOTrainer, MegaTrainKTOConfig, MegaTrainKTOTrainer, unpaired
    return DPOConfig, DPOTrainer, MegaTrainDPOConfig, MegaTrainDPOTrainer, pairs


@pytest.mark.skipif(torch.cuda.is_available(), reason="TrainingArguments accepts bf16 where a GPU is")
@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_trl_default_bf16_without_a_gpu_fails_as_stock_does(kind, tmp_path, monkeypatch):
    config, stock, own_config, ours, data = _trainers(kind)
    folder = model_folder(tmp_path, "llama")
    errors = []
    for make in (lambda: config(output_dir=str(tmp_path / "o")), lambda: own_config(output_dir=str(tmp_path / "o")),
                 lambda: stock(folder, train_dataset=data()), lambda: ours(folder, train_dataset=data())):
        with pytest.raises(ValueError) as e:
            make()
        errors.append(str(e.value))
    assert "bf16" in errors[0] and len(set(errors)) == 1, errors


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_trl_default_bf16_on_the_cpu_runs_as_stock_does(kind, tmp_path):
    config, stock, _, ours, data = _trainers(kind)
    folder = model_folder(tmp_path, "llama")
    steps = {}
    for cls in (stock, ours):
        args = config(output_dir=str(tmp_path / cls.__name__), use_cpu=True, max_steps=2, per_device_train_batch_size=4,
                      logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
        assert args.bf16 and args.gradient_checkpointing  # TRL's defaults, left as they are
        trainer = cls(folder, args=args, train_dataset=data())
        trainer.train()
        steps[cls] = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.engine.compute_dtype == torch.bfloat16
    # TRL's gradient_checkpointing=True is cleared under both names it has from transformers 5.25 (Trainer reads
    # activation_checkpointing, TRL the deprecated mirror), so the skeleton's layers never get checkpointing on
    assert not any(getattr(trainer.args, n, False) for n in ("activation_checkpointing", "gradient_checkpointing"))
    assert not any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
    assert len(steps[stock]) == len(steps[ours]) == 2
    for theirs, own in zip(steps[stock], steps[ours]):  # bf16 round-off apart (the step-2 rewards are at its level)
        assert own["loss"] == pytest.approx(theirs["loss"], abs=2e-4)
        assert own["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)
