"""PEFT's other methods on the engine (patcher/adapters.EXACT_METHODS): IA3, LoHa, LoKr, OFT, VeRA and the rest train
with stock peft's loss and gradients; through MegaTrainTrainer they equal stock Trainer and save adapters that load
back; save_merged merges each as PEFT's own merge_and_unload does. The methods the engine cannot run exactly
(AdaLoRA's regularization, OSF's gradient hooks, parameters shared by every layer, activated LoRA's offsets) are
refused in one line before anything trains."""

import copy
import inspect

import peft
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from hf_megatrain.patcher.adapters import EXACT_METHODS
from tests.integration.test_peft import KW, _beside_stock
from tests.support.tiny import make_batch, make_model, make_rows

PREFIX = "base_model.model."
TARGETS = ["q_proj", "v_proj", "down_proj"]
# each method's config on the tiny models (hidden 64, MLP 128), with its adapters drawn at random rather than as the
# identity, so that their gradients reach every adapter parameter
METHODS = {
    "IA3": ("IA3Config", dict(target_modules=TARGETS, feedforward_modules=["down_proj"])),
    "LOHA": ("LoHaConfig", dict(r=4, target_modules=TARGETS, init_weights=False)),
    "LOKR": ("LoKrConfig", dict(r=4, target_modules=TARGETS, init_weights=False)),
    "OFT": ("OFTConfig", dict(r=0, oft_block_size=16, target_modules=TARGETS, init_weights=False)),
    "BOFT": ("BOFTConfig", dict(boft_block_size=16, target_modules=TARGETS, init_weights=False)),
    "VERA": ("VeraConfig", dict(r=4, target_modules=["q_proj", "v_proj"], init_weights=False)),
    "FOURIERFT": ("FourierFTConfig", dict(n_frequency=16, target_modules=TARGETS, init_weights=False)),
    "LN_TUNING": ("LNTuningConfig", dict(target_modules=["input_layernorm", "post_attention_layernorm", "norm"])),
    "HRA": ("HRAConfig", dict(r=4, target_modules=TARGETS, init_weights=False)),
    "RANDLORA": ("RandLoraConfig", dict(r=4, target_modules=TARGETS)),
    "SHIRA": ("ShiraConfig", dict(r=4, target_modules=TARGETS)),
    "C3A": ("C3AConfig", dict(block_size=16, target_modules=TARGETS)),
    "MISS": ("MissConfig", dict(r=4, target_modules=TARGETS)),
    "BEFT": ("BeftConfig", dict(target_modules=TARGETS)),
    "DEFT": ("DeftConfig", dict(target_modules=TARGETS)),
    "DELORA": ("DeloraConfig", dict(r=4, target_modules=TARGETS)),
    "GLORA": ("GloraConfig", dict(r=4, target_modules=TARGETS)),
    "GRALORA": ("GraloraConfig", dict(r=4, target_modules=TARGETS)),
    "HIRA": ("HiraConfig", dict(r=4, target_modules=TARGETS)),
    "PEANUT": ("PeanutConfig", dict(target_modules=TARGETS)),
    "ROAD": ("RoadConfig", dict(group_size=16, target_modules=TARGETS, init_weights=False)),
    "SUPERTUNING": ("SuperTuningConfig", dict(target_modules=TARGETS)),
    "WAVEFT": ("WaveFTConfig", dict(n_frequency=16, target_modules=TARGETS)),
    "TRAINABLE_TOKENS": ("TrainableTokensConfig", dict(target_modules=["embed_tokens"], token_indices=[1, 2, 3])),
    # keeps factors of each layer's own weight as buffers that are not saved: the engine once gave every layer those
    # of the layer its template copies
    "PSOFT": ("PsoftConfig", dict(r=4, target_modules=TARGETS, init_weights=False)),
}
INSTALLED = [m for m in METHODS if hasattr(peft, METHODS[m][0])]


def config(method, **over):
    name, kw = METHODS[method]
    cls = getattr(peft, name)
    kw = {k: v for k, v in {**kw, **over}.items() if k in inspect.signature(cls).parameters}
    return cls(task_type="CAUSAL_LM", **kw)


def adapted(kind, method, seed=0, **over):
    """A tiny model of `kind` with `method`'s adapters (its config's fields replaced by `over`), every trainable
    parameter moved off its start (many start at the identity, whose gradients are degenerate)."""
    torch.manual_seed(seed)
    pm = get_peft_model(make_model(kind, seed=seed), config(method, **over))
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return pm


def test_every_method_the_engine_trains_is_tested_here():
    """EXACT_METHODS is what check_adapter_config lets through: each has a config in METHODS (LoRA and the prompt
    methods have their own tests, test_peft.py)."""
    assert set(EXACT_METHODS) - {"LORA"} == set(METHODS)


@pytest.mark.parametrize("method", INSTALLED)
def test_method_matches_stock_peft(method):
    """The loss and every adapter gradient equal stock peft's on Llama, a padded row among the batch."""
    pm = adapted("llama", method)
    _matches_stock(pm)


@pytest.mark.parametrize("method", [m for m in ("IA3", "LOHA", "OFT", "VERA") if m in INSTALLED])
@pytest.mark.parametrize("kind", ["llama_tied", "mixtral"])
def test_method_matches_stock_peft_on_tied_llama_and_mixtral(kind, method):
    """On a tied model, and on Mixtral (its router loss; the adapters on attention and dense projections, the experts
    being fused tensors that these methods do not wrap)."""
    over = {"target_modules": ["q_proj", "v_proj", "o_proj"], "feedforward_modules": []} if kind == "mixtral" else {}
    _matches_stock(adapted(kind, method, **over))


def _matches_stock(pm):
    ref = copy.deepcopy(pm)
    batch = make_batch()
    nib = batch["labels"][..., 1:].ne(-100).sum()
    expected_loss = ref(**batch, num_items_in_batch=nib).loss
    expected_loss.backward()
    engine = StreamingEngine(pm, compute_dtype=torch.float32).train()
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert float(loss) == pytest.approx(float(expected_loss), abs=1e-5)
    grads = dict(engine.named_grads())
    expected = {n.removeprefix(PREFIX): p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert list(grads) == list(expected) and grads
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def _trained_beside_stock(pm, tmp_path):
    """test_peft's four steps beside stock Trainer (GA, clipping, weight decay: the same losses and grad norms), the
    same trained parameters, and trainer.model showing them. Returns (stock's PeftModel, the engine's trainer)."""
    ref, mega = _beside_stock(pm, tmp_path)
    masters = dict(mega.engine.named_master_params())
    trained = {n.removeprefix(PREFIX): p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(masters) == sorted(trained)
    for n, t in trained.items():
        torch.testing.assert_close(masters[n], t, atol=1e-5, rtol=1e-5, msg=n)
    # what the user reads: trainer.model's adapter parameters are the trained fp32 masters, as stock's are its own
    shown = {n.removeprefix(PREFIX): p.detach() for n, p in mega.model.named_parameters() if p.requires_grad}
    assert shown.keys() == masters.keys() and all(torch.equal(shown[n], masters[n]) for n in masters)
    return ref, mega


def _merged_equals_stock(ref, mega, kind, tmp_path):
    """save_model's adapter loads back with PeftModel.from_pretrained and gives stock's logits; save_merged's folder
    loads as the base class with the weights of stock's merge_and_unload."""
    mega.save_model(str(tmp_path / "adapter"))
    back = PeftModel.from_pretrained(make_model(kind), str(tmp_path / "adapter")).eval()
    batch = make_batch()
    with torch.no_grad():
        torch.testing.assert_close(back(**batch).logits, ref.eval()(**batch).logits, atol=1e-5, rtol=1e-5)
    mega.save_merged(str(tmp_path / "merged"), dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    expect = ref.merge_and_unload().state_dict()
    assert merged.keys() == expect.keys()
    for n, t in expect.items():
        torch.testing.assert_close(merged[n], t, atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize("method", [m for m in ("IA3", "LOHA", "OFT", "VERA", "LN_TUNING", "PSOFT") if m in INSTALLED])
def test_method_trainer_equals_stock_and_saves(method, tmp_path):
    ref, mega = _trained_beside_stock(adapted("llama", method), tmp_path)
    _merged_equals_stock(ref, mega, "llama", tmp_path)


LORA_OPTIONS = {
    "dora": dict(use_dora=True),
    "embedding": dict(target_modules=["embed_tokens", "q_proj"]),
    "modules_to_save": dict(modules_to_save=["lm_head"]),
    "trainable_tokens": dict(trainable_token_indices={"embed_tokens": [1, 2]}),
}


@pytest.mark.parametrize("option", list(LORA_OPTIONS))
def test_lora_options_train_and_merge_as_stock(option, tmp_path):
    """LoRA with DoRA, on the embedding, with a module to save whole, with trainable tokens: trained as stock, and
    merged as merge_and_unload merges them (save_merged once folded B @ A alone: the last three came out as the base
    weights, and DoRA was refused)."""
    torch.manual_seed(0)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    pm = get_peft_model(make_model("llama"), LoraConfig(task_type="CAUSAL_LM", **{**cfg, **LORA_OPTIONS[option]}))
    ref, mega = _trained_beside_stock(pm, tmp_path)
    _merged_equals_stock(ref, mega, "llama", tmp_path)


def test_lora_on_a_tied_embedding_merges_as_stock(tmp_path):
    """A tied model with LoRA on its token embedding: the head reads the embedding's base weight (the one lm_head
    shares), and the merged export keeps the two tied, as merge_and_unload does."""
    torch.manual_seed(0)
    pm = get_peft_model(make_model("llama_tied"), LoraConfig(task_type="CAUSAL_LM", r=4, init_lora_weights=False,
                                                             target_modules=["embed_tokens", "q_proj"]))
    ref, mega = _trained_beside_stock(pm, tmp_path)
    _merged_equals_stock(ref, mega, "llama_tied", tmp_path)


REFUSED = {
    "ADALORA": ("AdaLoraConfig", dict(init_r=4, total_step=10, target_modules=TARGETS), "orthogonal regularization"),
    "OSF": ("OSFConfig", dict(target_modules=TARGETS), "hooks change the adapter's gradients"),
    "PVERA": ("PveraConfig", dict(r=4, target_modules=["q_proj"]), "draws fresh noise"),
    "FROD": ("FrodConfig", dict(target_modules=TARGETS), "joint decomposition of every layer's weights"),
    "TINYLORA": ("TinyLoraConfig", dict(target_modules=TARGETS), "shared by every layer"),
    "ALORA": ("LoraConfig", dict(r=4, target_modules=TARGETS, alora_invocation_tokens=[5, 6]), "activated LoRA"),
    "REPLICATION": ("LoraConfig", dict(r=4, target_modules=TARGETS, layer_replication=[[0, 2], [1, 2]]),
                    "layer_replication"),
}


@pytest.mark.parametrize("what", [w for w in REFUSED if hasattr(peft, REFUSED[w][0])])
def test_methods_the_engine_cannot_run_exactly_are_refused_in_one_line(what, tmp_path):
    """Refused as a PeftModel given to the engine, and as a peft_config given to MegaTrainTrainer (before any data
    is read), naming why and what trains."""
    name, kw, why = REFUSED[what]
    cfg = getattr(peft, name)(task_type="CAUSAL_LM", **kw)
    with pytest.raises(MegaTrainError, match=why) as e:
        MegaTrainTrainer(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path), **KW),
                         train_dataset=make_rows(4, 0), data_collator=default_data_collator, peft_config=cfg)
    assert "\n" not in str(e.value)
    if what != "REPLICATION":  # PEFT itself builds replicated layers only on a model it can copy layers of
        pm = get_peft_model(make_model("llama"), copy.deepcopy(cfg))
        with pytest.raises(MegaTrainError, match=why):
            StreamingEngine(pm, compute_dtype=torch.float32)


@pytest.mark.parametrize("extra", [dict(target_modules=["lm_head", "q_proj"]),
                                   dict(target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [1, 2]})],
                         ids=["lora_on_lm_head", "trainable_tokens"])
def test_adapters_on_a_tied_head_are_refused_in_one_line(extra):
    """PEFT wraps a tied lm_head (LoRA on it, or trainable tokens, which it ties to the head): refused, where the
    engine once failed inside its first step (an attribute error, a StopIteration)."""
    pm = get_peft_model(make_model("llama_tied"), LoraConfig(task_type="CAUSAL_LM", r=4, **extra))
    with pytest.raises(MegaTrainError, match="PEFT wraps lm_head, which is tied"):
        StreamingEngine(pm, compute_dtype=torch.float32)


def test_save_merged_refuses_what_it_cannot_write_as_stock(tmp_path):
    """A tied model whose embedding is a modules_to_save copy comes untied from merge_and_unload (the head keeps the
    original weight): save_merged says so in one line instead of writing the two tied."""
    torch.manual_seed(0)
    pm = get_peft_model(make_model("llama_tied"), LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj"],
                                                             modules_to_save=["embed_tokens"]))
    mega = MegaTrainTrainer(pm, MegaTrainArguments(output_dir=str(tmp_path), **dict(KW, max_steps=1)),
                            train_dataset=make_rows(4, 0), data_collator=default_data_collator)
    mega.train()
    with pytest.raises(MegaTrainError, match="come untied"):
        mega.save_merged(str(tmp_path / "merged"))
    assert not (tmp_path / "merged").exists()


def test_peft_config_dict_with_a_peft_type_builds_that_method(tmp_path):
    """MegaTrainArguments.peft_config as a dict (what the CLI's JSON becomes): LoraConfig fields without a peft_type,
    another method's with one; an adapter_config.json's inference_mode=true and an unknown method are refused."""
    from hf_megatrain.checkpoint.loading import peft_config_from

    assert type(peft_config_from({"r": 4})).__name__ == "LoraConfig"
    ia3 = peft_config_from({"peft_type": "ia3", "target_modules": ["q_proj"], "feedforward_modules": []})
    assert type(ia3).__name__ == "IA3Config" and ia3.task_type == "CAUSAL_LM"
    with pytest.raises(MegaTrainError, match="inference_mode=true"):
        peft_config_from({"peft_type": "IA3", "inference_mode": True})
    with pytest.raises(MegaTrainError, match="'NOT_A_METHOD' is not a PEFT method"):
        peft_config_from({"peft_type": "not_a_method"})
    with pytest.raises(MegaTrainError, match="unexpected keyword argument 'rank'"):
        peft_config_from({"rank": 4})
    ia3 = {"peft_type": "IA3", "target_modules": ["q_proj"], "feedforward_modules": []}
    args = MegaTrainArguments(output_dir=str(tmp_path), peft_config=ia3, **dict(KW, max_steps=1))
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=make_rows(4, 0),
                               data_collator=default_data_collator)
    trainer.train()
    names = [n for n, _ in trainer.engine.named_master_params()]
    assert names and all(".ia3_l." in n for n in names)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_lora_started_from_the_weights_equals_stock_from_a_folder(init, tmp_path):
    """LoRA whose adapters start from the weights themselves (PiSSA, OLoRA: an SVD or QR of each weight, which also
    leaves the residual in the base weight), given as peft_config with a model folder: the plan and the disk check
    lay the adapters out on a meta copy with the default start (they once failed there in PEFT's init), and the run
    equals stock Trainer on the loaded PeftModel: losses, grad norms, adapters, and the merged export."""
    make_model("llama").save_pretrained(tmp_path / "model")
    cfg = dict(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
    train = make_rows(16, 0)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), LoraConfig(task_type="CAUSAL_LM",
                                                                                             **cfg))
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "s"), **KW), train_dataset=train,
                    data_collator=default_data_collator)
    stock.train()
    mega = MegaTrainTrainer(str(tmp_path / "model"), MegaTrainArguments(output_dir=str(tmp_path / "m"), peft_config=cfg,
                                                                        **KW),
                            train_dataset=train, data_collator=default_data_collator)
    mega.train()
    a = [(h["loss"], h["grad_norm"]) for h in stock.state.log_history if "loss" in h]
    b = [(h["loss"], h["grad_norm"]) for h in mega.state.log_history if "loss" in h]
    assert len(a) == len(b) == KW["max_steps"]
    for x, y in zip(a, b):
        assert x[0] == pytest.approx(y[0], abs=1e-5) and x[1] == pytest.approx(y[1], rel=1e-5, abs=1e-6), (a, b)
    masters = dict(mega.engine.named_master_params())
    for n, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(masters[n.removeprefix(PREFIX)], p.detach(), atol=1e-5, rtol=1e-5, msg=n)
    mega.save_merged(str(tmp_path / "merged"), dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    for n, t in ref.merge_and_unload().state_dict().items():
        torch.testing.assert_close(merged[n], t, atol=1e-5, rtol=1e-5, msg=n)
