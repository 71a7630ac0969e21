"""trl.experimental's ORPOTrainer and CPOTrainer through the engine (issue 36): MegaTrainORPOTrainer and
MegaTrainCPOTrainer against the stock trainers on the CPU in fp32, with gradient accumulation 2 and clipping: the
losses, every metric TRL logs (rewards/*, logps/*, logits/*, nll_loss, ORPO's log_odds_ratio and log_odds_chosen),
the evaluation metrics and the final weights, for ORPO and each of CPO's loss types (sigmoid, hinge, ipo, simpo:
SimPO; AlphaPO's reward shaping; no NLL term), full fine-tune and LoRA, Llama and a MoE (Mixtral, its router loss
in the loss), and the engine's step placements. What the engine cannot do is refused by name, before any data is
tokenized."""

import pytest
import torch

trl = pytest.importorskip("trl")
import warnings  # noqa: E402

from trl import DPOConfig  # noqa: E402

with warnings.catch_warnings():  # trl.experimental's warning that its APIs may change
    warnings.simplefilter("ignore")
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from hf_megatrain import MegaTrainError, MegaTrainTrainer  # noqa: E402
from hf_megatrain.cpo import MegaTrainCPOConfig, MegaTrainCPOTrainer  # noqa: E402
from hf_megatrain.dpo import MegaTrainDPOTrainer  # noqa: E402
from hf_megatrain.orpo import MegaTrainORPOConfig, MegaTrainORPOTrainer  # noqa: E402
from tests.support.preference import (  # noqa: E402,F401  (fresh_datasets: an autouse fixture)
    KW, LORA, PREFIX, WORDS, assert_same_weights, fresh_datasets, model_folder, pairs)
from tests.support.preference import run as run_trainer  # noqa: E402

TRAINERS = {"orpo": (ORPOConfig, ORPOTrainer, MegaTrainORPOConfig, MegaTrainORPOTrainer),
            "cpo": (CPOConfig, CPOTrainer, MegaTrainCPOConfig, MegaTrainCPOTrainer)}


def run(cls, config_cls, folder, out, lora=None, **extra):
    # (no dataset first seen after training: these trainers tokenize their datasets in __init__ only)
    return run_trainer(cls, config_cls, folder, out, pairs(), pairs(WORDS[:8]), lora, **extra)


def assert_same_run(logs, stock_logs, weights, stock_weights, kind, abs_tol=1e-6):
    """Every log entry with the same keys and values within 1e-5 (relative) or abs_tol, the saved weights within 1e-5."""
    assert len(logs) == len(stock_logs)
    assert sum("loss" in h for h in logs) == KW["max_steps"]
    names = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected", "nll_loss"]
    names += ["log_odds_ratio", "log_odds_chosen"] if kind == "orpo" else []
    for prefix in ("", "eval_"):  # each one logged, and nothing else beside Trainer's own
        entry = next(h for h in logs if f"{prefix}loss" in h)
        assert {prefix + n for n in names} <= entry.keys(), entry
    for ours, theirs in zip(logs, stock_logs):
        assert ours.keys() == theirs.keys(), (ours, theirs)
        for k in ours:
            assert ours[k] == pytest.approx(theirs[k], rel=1e-5, abs=abs_tol), (k, ours, theirs)
    assert_same_weights(weights, stock_weights)


CASES = {
    "orpo": ("orpo", "llama", None, dict()),
    "orpo_beta": ("orpo", "llama", None, dict(beta=0.5)),
    "orpo_lora": ("orpo", "llama", LORA, dict()),
    "orpo_mixtral": ("orpo", "mixtral", None, dict()),
    "cpo_sigmoid": ("cpo", "llama", None, dict()),
    "cpo_simpo": ("cpo", "llama", None, dict(loss_type="simpo", simpo_gamma=0.7, label_smoothing=0.1, beta=2.0)),
    "cpo_hinge_no_nll": ("cpo", "llama", None, dict(loss_type="hinge", cpo_alpha=0.0)),
    "cpo_ipo_lora": ("cpo", "llama", LORA, dict(loss_type="ipo", cpo_alpha=0.5)),
    # prefix tuning keeps the rows' length, so the positions these losses count are stock's
    "orpo_prefix_tuning": ("orpo", "llama", PREFIX, dict(gradient_checkpointing=False)),
    "cpo_simpo_prefix_tuning": ("cpo", "llama", PREFIX, dict(loss_type="simpo", beta=2.0, gradient_checkpointing=False)),
    "cpo_alphapo": ("cpo", "llama", None, dict(loss_type="simpo", alpha=0.05, simpo_gamma=0.3, beta=2.0)),
    "cpo_simpo_mixtral": ("cpo", "mixtral", None, dict(loss_type="simpo", beta=2.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_stock(case, tmp_path):
    kind, model, lora, extra = CASES[case]
    config, stock, _, ours = TRAINERS[kind]
    folder = model_folder(tmp_path, model)
    stock_trainer, stock_logs, stock_weights = run(stock, config, folder, tmp_path / "stock", lora, **extra)
    trainer, logs, weights = run(ours, config, folder, tmp_path / "mega", lora, **extra)
    assert isinstance(trainer.args, TRAINERS[kind][2])
    # the MoE's router loss is in the loss on both sides (TRL logs no aux_loss for these trainers)
    assert trainer.aux_loss_enabled == stock_trainer.aux_loss_enabled == (model == "mixtral")
    if extra.get("cpo_alpha") == 0.0:  # no NLL term: TRL logs 0
        assert all(h["nll_loss"] == 0 for h in logs if "nll_loss" in h)
    if lora:
        assert all(("prompt_embeddings" if lora is PREFIX else "lora_") in k for k in weights)
    assert_same_run(logs, stock_logs, weights, stock_weights, kind)


# The engine's step placements (engine/step.py) under these losses: the step's micro-batches through each layer
# together; the host AdamW stepping each unit during the backward (no clipping); transient gradients, clipped by a
# norm pass that runs the loss once more
MODES = {
    "orpo_layer_major": ("orpo", dict(layer_major_accumulation="true"), {}),
    "cpo_step_during_backward": ("cpo", dict(background_host_jobs=True), dict(max_grad_norm=0.0, loss_type="simpo")),
    "orpo_transient_grads": ("orpo", dict(transient_grads="true", background_host_jobs=True,
                                          layer_major_accumulation="true"), {}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_modes_equal_stock(mode, tmp_path):
    kind, ours, both = MODES[mode]
    config, stock, own_config, own = TRAINERS[kind]
    folder = model_folder(tmp_path, "llama")
    _, stock_logs, stock_weights = run(stock, config, folder, tmp_path / "stock", **both)
    trainer, logs, weights = run(own, own_config, folder, tmp_path / "mega", **ours, **both)
    assert trainer._per_pass == (2 if "layer_major_accumulation" in ours else 1)
    assert_same_run(logs, stock_logs, weights, stock_weights, kind)


REFUSED = [(dict(generate_during_eval=True), "generate_during_eval"),
           (dict(model_init_kwargs={"quantization_config": {"load_in_4bit": True}}), "quantization_config"),
           (dict(lm_head=True), "LoRA adapter on lm_head"),
           (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha"),
           (dict(peft_model=True), "a PeftModel as model"),
           (dict(iterable=True), "IterableDataset"),
           # the virtual tokens before each row would shift the positions these losses count (stock ORPO fails there)
           (dict(prompt_tuning=True), "PROMPT_TUNING, whose virtual tokens the engine's")]


@pytest.mark.parametrize("kind, extra, match", [(kind, *case) for kind in TRAINERS for case in REFUSED] +
                         [("cpo", dict(loss_type="kto_pair"), "loss_type='kto_pair' is not one of CPOTrainer's")])
def test_what_the_engine_cannot_do_is_refused_before_tokenizing(kind, extra, match, tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from tests.support.tiny import make_model

    extra = dict(extra)  # the parameter's dict serves both trainers
    config, stock, _, ours = TRAINERS[kind]
    folder = model_folder(tmp_path, "llama")

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(stock, "tokenize_row", no_tokenizing)
    if extra.pop("peft_model", None):  # a model with an adapter of its own
        folder = get_peft_model(make_model("llama", num_hidden_layers=2), LoraConfig(**LORA))
    lora = LoraConfig(**dict(LORA, target_modules=["q_proj", "lm_head"])) if extra.pop("lm_head", None) else None
    if extra.pop("prompt_tuning", None):
        from peft import PromptTuningConfig

        lora = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    data = pairs().to_iterable_dataset() if extra.pop("iterable", None) else pairs()
    with pytest.raises(MegaTrainError, match=match) as e:
        ours(folder, args=config(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], bf16=False, **extra),
             train_dataset=data, peft_config=lora)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", list(TRAINERS))
def test_configs_of_other_trl_trainers_name_the_trainer_that_takes_them(kind, tmp_path, monkeypatch):
    """An ORPOConfig (CPOConfig) handed to another trainer names ours; a DPOConfig handed to ours names the DPO
    trainer; each before any data is tokenized."""
    config, stock, _, ours = TRAINERS[kind]
    folder = model_folder(tmp_path, "llama")

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(stock, "tokenize_row", no_tokenizing)
    name = kind.upper()
    args = config(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], bf16=False)
    for cls in (MegaTrainDPOTrainer, MegaTrainTrainer):
        with pytest.raises(MegaTrainError, match=f"{name}Config.*hf_megatrain.{kind}.MegaTrain{name}Trainer") as e:
            if cls is MegaTrainTrainer:
                cls(folder, args)
            else:
                cls(folder, args=args, train_dataset=pairs())
        assert "\n" not in str(e.value)
    dpo = DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[], bf16=False)
    with pytest.raises(MegaTrainError, match="DPOConfig.*hf_megatrain.dpo.MegaTrainDPOTrainer"):
        ours(folder, args=dpo, train_dataset=pairs())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["orpo", "cpo_simpo_mixtral"])
def test_on_the_cuda_path_equals_stock_in_fp32(case, tmp_path):
    """The CUDA pipeline (streamed layers, the head's two passes on the device) in fp32 compute against the stock
    trainer on the GPU, TF32 off."""
    kind, model, lora, extra = CASES[case]
    config, stock, own_config, own = TRAINERS[kind]
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        folder = model_folder(tmp_path, model)
        _, stock_logs, stock_weights = run(stock, config, folder, tmp_path / "stock", lora, use_cpu=False, **extra)
        _, logs, weights = run(own, own_config, folder, tmp_path / "mega", lora, use_cpu=False,
                               compute_dtype="float32", **extra)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    # other kernels on the device (the head's chunks, the engine's two head passes) move the logged sums by
    # about 1e-6 of their size; the relative bound still holds
    assert_same_run(logs, stock_logs, weights, stock_weights, kind, abs_tol=2e-5)
