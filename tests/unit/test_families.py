"""Every registered family beyond the first six, exact against stock on the CPU in fp32: loss and every
gradient (sdpa and eager), the estimator's parameter count, a checkpoint folder streamed into the store
(experts fused from per-expert files as HF v5 does), and saved files that load back to the same logits."""

import copy
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_megatrain import MegaTrainError, StreamingEngine
from hf_megatrain.checkpoint.hf_format import save_hf_model
from hf_megatrain.checkpoint.loading import load_model_and_tokenizer
from hf_megatrain.checkpoint.stream_load import engine_from_checkpoint
from hf_megatrain.planner.estimator import model_sizes
from hf_megatrain.patcher.specs import supported_model_types
from tests.support.tiny import FAMILIES, make_batch, make_model, refuses_sdpa

MOE = [k for k, v in FAMILIES.items() if "num_experts_per_tok" in v]


def test_every_family_is_registered():
    assert set(FAMILIES) <= set(supported_model_types())


def assert_engine_matches_stock(model):
    """One step of `model` (one right-padded row) through the engine and through stock autograd, fp32:
    the same loss and every parameter's gradient. Returns stock's outputs."""
    batch = make_batch(batch=3, seq=12)  # one right-padded row
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref = copy.deepcopy(model)
    torch.manual_seed(1234)  # PhiMoE routes by sampling in training: both draw the same numbers
    out = ref(**batch, num_items_in_batch=nib)
    out.loss.backward()
    engine = StreamingEngine(model, compute_dtype=torch.float32, loss_chunk_tokens=7).train()
    torch.manual_seed(1234)
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert abs(float(loss) - float(out.loss)) < 1e-5
    grads = dict(engine.named_grads())
    assert list(grads) == [n for n, _ in ref.named_parameters()]
    for name, p in ref.named_parameters():
        if p.grad is None:  # stock gives it none (DeepSeek-V3.2's indexer runs without grad): the engine, exactly zero
            assert not grads[name].any(), name
            continue
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gradients_match_stock(family, attn):
    try:
        model = make_model(family, attn=attn)
    except ValueError as e:
        if not refuses_sdpa(e):
            raise
        pytest.skip(f"stock {family} refuses attn_implementation={attn!r} in this transformers")
    out = assert_engine_matches_stock(model)
    if family in MOE and model.config.output_router_logits:  # stock's loss holds the router's aux loss
        assert float(out.aux_loss) > 0


@pytest.mark.parametrize("family", ["gemma2", "qwen2_moe", "gpt_oss", "granitemoe"])
def test_tiled_mlp_equals_stock(family):
    """MLP sequence tiles (long context) on families whose MLP differs: an MoE block with a shared expert,
    one that returns its router scores beside its output (gpt-oss), one under another attribute name."""
    model = make_model(family, attn="eager")
    batch = make_batch(batch=2, seq=40, pad_rows=1)
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref = copy.deepcopy(model)
    torch.manual_seed(1234)
    ref(**batch, num_items_in_batch=nib).loss.backward()
    engine = StreamingEngine(model, compute_dtype=torch.float32, mlp_tile_tokens=14).train()  # 7 rows x 2
    torch.manual_seed(1234)
    engine.forward_backward(batch, num_items_in_batch=nib)
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_estimator_counts_the_parameters(family):
    model = make_model(family, attn="eager")
    assert model_sizes(model.config).params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_folder_streams_in_and_saved_files_load_back(family, tmp_path):
    src = make_model(family, attn="eager")
    masters = dict(assert_saved_files_load_back(src, tmp_path).named_master_params())
    for name, p in src.named_parameters():
        assert torch.equal(masters[name], p.detach()), name


def assert_saved_files_load_back(src, tmp_path):
    """`src` saved as HF writes it (per-expert tensors for the MoE families), streamed into an engine,
    saved from the engine's store, loaded back by from_pretrained: the same logits. Returns the engine."""
    src.save_pretrained(tmp_path / "src")
    skeleton, _, folder = load_model_and_tokenizer(str(tmp_path / "src"))
    engine = engine_from_checkpoint(skeleton, folder, compute_dtype=torch.float32, progress=False)
    save_hf_model(engine.store, skeleton, str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    batch = make_batch(batch=2, seq=10, pad_rows=0)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=batch["input_ids"]).logits,
                                   src.eval()(input_ids=batch["input_ids"]).logits)
    return engine


@pytest.mark.parametrize("model_type, reason", [
    ("t5", "an encoder-decoder model"), ("zamba", "share weights (shared_transf.self_attn.q_proj: a block shared across layers)"),
    ("llava", "a wrapper around a text model"), ("trocr", "positions made outside the layers"),
    # (NanoChat, once here for its final norm before the first layer, trains: its norm holds no weight; so does GLM-5,
    # once here for the indexer top-k each layer hands the next: engine/carried.py)
])
def test_what_is_not_a_decoder_stack_is_refused_with_its_reason(model_type, reason, tmp_path, capsys):
    """The trainer and `hf-megatrain estimate` refuse it with the same line: the reason and the families."""
    from transformers import AutoConfig

    from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
    from hf_megatrain.cli import main

    AutoConfig.for_model(model_type).save_pretrained(tmp_path / "m")
    with pytest.raises(MegaTrainError) as refused:
        MegaTrainTrainer(str(tmp_path / "m"), MegaTrainArguments(output_dir=str(tmp_path / "o"), use_cpu=True))
    assert reason in str(refused.value) and "Supported decoder-only families: " in str(refused.value)
    assert main(["estimate", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.strip() == f"hf-megatrain estimate: error: {refused.value}"


def test_an_architecture_outside_the_registry_is_refused_by_name():
    from transformers import AutoConfig

    with pytest.raises(MegaTrainError, match="mpt.*Supported decoder-only families: .*gemma2.*qwen3_moe"):
        model_sizes(AutoConfig.for_model("mpt", n_layers=2, d_model=64, n_heads=4))


def test_a_standard_architecture_outside_the_registry_is_verified_then_trained(caplog):
    """OLMo 3 is not in the registry but has the standard layout: the engine tries it through a generic
    spec, checks itself on a 2-layer copy first (logged), then trains it exactly."""
    import logging

    from transformers import AutoConfig

    from hf_megatrain.engine import selfcheck
    from hf_megatrain.patcher.specs import spec_for
    from tests.support.tiny import COMMON

    assert "olmo3" not in supported_model_types()
    cfg = AutoConfig.for_model("olmo3", **COMMON)
    assert spec_for(cfg).generic
    selfcheck._VERIFIED.discard("olmo3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
    batch = make_batch(batch=3, seq=12)
    ref = copy.deepcopy(model)
    out = ref(**batch)
    out.loss.backward()
    with caplog.at_level(logging.INFO, logger="hf_megatrain.engine.selfcheck"):
        engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    assert re.search(r"the engine equals stock on a \d-layer copy", caplog.text)
    loss = engine.forward_backward(batch)
    assert abs(float(loss) - float(out.loss)) < 1e-5
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_the_generic_spec_repeats_what_a_family_does_outside_its_layers(monkeypatch):
    """Granite without its spec: the generic spec reads its embedding multiplier and its logits scaling from the
    base model's and the causal LM's forwards (as it reads soft-capping and Cohere's logit scale), and trains it
    exactly, the tiny Granite setting both (and residual and attention multipliers, inside the layers)."""
    from hf_megatrain.engine import selfcheck
    from hf_megatrain.patcher import specs

    monkeypatch.delitem(specs._REGISTRY, "granite")
    monkeypatch.setattr(specs, "_GENERIC", {})
    monkeypatch.setattr(selfcheck, "_VERIFIED", set())
    model = make_model("granite")
    spec = specs.spec_for(model.config)
    assert spec.generic and spec.embed_multiplier == "embedding_multiplier" and spec.logits is specs._divided_logits
    assert_engine_matches_stock(model)


def test_the_self_check_refuses_what_the_generic_spec_gets_wrong(monkeypatch):
    """Granite without its spec, and with the generic spec blind to what a causal LM does to its logits: the
    standard layout fits, but its logits scaling lives outside the layers, so the 2-layer copy differs from stock
    and the engine refuses, naming the first thing that differs."""
    from hf_megatrain.engine import selfcheck
    from hf_megatrain.patcher import specs

    monkeypatch.delitem(specs._REGISTRY, "granite")
    monkeypatch.setattr(specs, "_LOGITS", ())
    monkeypatch.setattr(specs, "_GENERIC", {})
    monkeypatch.setattr(selfcheck, "_VERIFIED", set())
    with pytest.raises(MegaTrainError, match="'granite' is outside the registry.*-layer random copy the loss "
                                             "differs from stock autograd"):
        StreamingEngine(make_model("granite"), compute_dtype=torch.float32)


@pytest.mark.parametrize("tile", [None, 15])
@pytest.mark.parametrize("model_type", ["flex_olmo", "jetmoe"])
def test_a_generic_moe_family_adds_its_router_loss_as_stock(model_type, tile):
    """MoE families outside the registry with output_router_logits on: the generic spec takes the router
    (module, output index), the load-balancing function, the expert count and the coefficient from the installed
    transformers (the causal LM's own source and `_can_record_outputs`), and the loss, the aux loss and every
    gradient equal stock's, also with MLP tiles (5 tokens a row). JetMoE has two routers a layer (attention and
    MLP) where its causal LM adds the loss from its config (transformers 5.25); up to 5.17 it adds none from its
    config, and neither does the engine."""
    from hf_megatrain.patcher.specs import spec_for
    from tests.support.zoo import tiny_config

    cfg = tiny_config(model_type)
    assert cfg.output_router_logits and model_type not in supported_model_types()
    spec = spec_for(cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
    batch = make_batch(batch=3, seq=12)  # one right-padded row: the aux loss leaves its padding out
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref = copy.deepcopy(model)
    out = ref(**batch, num_items_in_batch=nib)
    out.loss.backward()
    assert (out.aux_loss is not None) == spec.has_router_loss
    engine = StreamingEngine(model, compute_dtype=torch.float32, mlp_tile_tokens=tile).train()
    engine.head_stats = []
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert abs(float(loss) - float(out.loss)) < 1e-5
    if spec.has_router_loss:
        assert abs(float(engine.head_stats[0]["aux_loss"]) - float(out.aux_loss)) < 1e-6
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


# Families added after the shared tiny set (tests/support/tiny.py FAMILIES), with their tiny configs here:
# Cohere 2 (sliding and full layers, a logit scale; its layers take position_ids through **kwargs) and
# GLM-4-MoE (a dense first layer, grouped top-k over sigmoid scores plus a persistent per-layer
# e_score_correction_bias, a shared expert, partial rotary). Persistent buffers get random values of
# each layer's own, so that a layer called with another layer's buffer would show.
LATER = {
    "cohere2": dict(logit_scale=0.5, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "glm4_moe": dict(moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                     n_group=2, topk_group=1, first_k_dense_replace=1, head_dim=16, partial_rotary_factor=0.5,
                     routed_scaling_factor=1.5),
}


def _later_model(family, attn="eager"):
    from transformers import AutoConfig

    from hf_megatrain.patcher.templates import persistent_buffers
    from tests.support.tiny import COMMON

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **{**COMMON, **LATER[family]})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for buf in persistent_buffers(model).values():
            buf.copy_(torch.randn(buf.shape, generator=g))
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(LATER))
def test_later_families_gradients_match_stock(family, attn):
    assert family in supported_model_types()
    model = _later_model(family, attn)
    assert_engine_matches_stock(model)


def _streamed_in(src, tmp_path):
    """(skeleton, engine): `src` saved as HF writes it and streamed into the engine's store (fp32, a small
    loss chunk), every master equal to src's parameter."""
    src.save_pretrained(tmp_path / "src")
    skeleton, _, folder = load_model_and_tokenizer(str(tmp_path / "src"))
    engine = engine_from_checkpoint(skeleton, folder, compute_dtype=torch.float32, progress=False,
                                    loss_chunk_tokens=7).train()
    masters = dict(engine.named_master_params())
    for name, p in src.named_parameters():
        assert torch.equal(masters[name], p.detach()), name
    return skeleton, engine


@pytest.mark.parametrize("family", list(LATER))
def test_later_families_count_and_stream_in(family, tmp_path):
    """The estimator's count; a folder (experts one by one, as HF writes them) streamed into the store, and
    persistent buffers read from it into the skeleton, which the engine gives each layer's call: the
    engine then equals stock autograd on the loaded model."""
    from hf_megatrain.patcher.templates import persistent_buffers

    src = _later_model(family)
    assert model_sizes(src.config).params == sum(p.numel() for p in src.parameters())
    skeleton, engine = _streamed_in(src, tmp_path)
    theirs, ours = persistent_buffers(src), persistent_buffers(skeleton)
    assert ours.keys() == theirs.keys() and (family != "glm4_moe" or theirs)
    for name, buf in theirs.items():
        assert torch.equal(ours[name], buf), name
    batch = make_batch(batch=3, seq=12)
    out = src(**batch)
    out.loss.backward()
    loss = engine.forward_backward(batch)
    grads = dict(engine.named_grads())
    assert abs(float(loss) - float(out.loss)) < 1e-5
    for name, p in src.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", list(LATER))
def test_later_families_saved_files_load_back(family, tmp_path):
    assert_saved_files_load_back(_later_model(family), tmp_path)


# Hybrid stacks outside the registry (issue 35): linear attention / gated delta nets (Qwen3-Next, Qwen3.5, OLMo-hybrid,
# Kimi-Linear, MiniMax), Mamba and Mamba-2 mixers beside attention (Jamba, Bamba, Nemotron-H, Falcon-H1, Granite-4) or
# alone (Mamba, Mamba-2, Falcon-Mamba), short convolutions (LFM2). The generic spec reads from the base model's
# forward what each layer gets: the mask of its kind (a recurrent layer's 2D padding mask, an attention layer's
# causal one), the rotary embeddings (for every layer, only the attention ones, or none) and the positions. On the
# CPU their mixers run transformers' torch paths (no causal-conv1d, mamba-ssm or fla kernels installed); on a GPU
# with those installed, the same calls run the kernels (tests/gpu/test_gpu.py checks them there).
HYBRID = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "minimax", "jamba", "bamba",
          "nemotron_h", "falcon_h1", "granitemoehybrid", "lfm2", "lfm2_moe", "mamba", "mamba2", "falcon_mamba",
          # DeepSeek-V3.2's sparse attention (MLA with a top-k indexer; AXK2 is built on it): its forward makes the
          # causal mask with allow_is_causal_skip=False (the indexer needs it made even where sdpa could skip it),
          # which the generic spec reads and repeats (patcher/specs.py _mask_extras)
          "deepseek_v32", "axk2",
          # Inkling: full or sliding attention by a choice on layer_types, short convs beside attention and MLP (the
          # recurrent mask), an embedding norm, the last hidden state divided by its µP multiplier
          "inkling_text"]


def _hybrid_model(model_type, attn="sdpa"):
    from tests.support.zoo import tiny_config

    cfg = tiny_config(model_type)
    if model_type == "granitemoehybrid":  # stock's own router loss fails a training step (transformers 5.17)
        cfg.output_router_logits = False
    kinds = set(getattr(cfg, "layer_types", None) or ())
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).train()
    except ValueError as e:
        if not refuses_sdpa(e):
            raise
        pytest.skip(f"stock {model_type} refuses attn_implementation={attn!r}")
    return model, kinds


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", HYBRID)
def test_hybrid_stacks_match_stock(model_type, attn):
    """Loss and every gradient equal stock's with one right-padded row (a recurrent layer zeroes its padding by the
    2D mask, attention by the causal one), every layer kind of the family present in the tiny copy."""
    from hf_megatrain.patcher.specs import spec_for

    model, kinds = _hybrid_model(model_type, attn)
    spec = spec_for(model.config)
    assert spec.generic and spec.layer_inputs is not None and model_type not in supported_model_types()
    if len(kinds) > 1:  # the tiny copy has every kind it names, so each kind's layer call is compared
        assert len(set(spec.kinds(model.config))) > 1
    out = assert_engine_matches_stock(model)
    if getattr(model.config, "output_router_logits", False) and spec.has_router_loss:
        assert float(out.aux_loss) > 0


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h", "jamba"])
def test_hybrid_stacks_tile_their_mlps_only(model_type):
    """MLP tiles on a hybrid stack: the per-token blocks (an MoE with a shared expert, Jamba's feed_forward) run tile
    by tile, the sequence mixers (gated delta net, Mamba) whole, and the gradients equal stock's. Nemotron-H's layers
    are a mixer alone each, so none is tiled there."""
    model, _ = _hybrid_model(model_type)
    batch = make_batch(batch=2, seq=40, pad_rows=1)
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref = copy.deepcopy(model)
    torch.manual_seed(1234)
    ref(**batch, num_items_in_batch=nib).loss.backward()
    engine = StreamingEngine(model, compute_dtype=torch.float32, mlp_tile_tokens=14).train()
    tiled = [k for k, t in engine._templates.items() if k.startswith("layer") and engine.spec.mlp
             and getattr(getattr(t.module, engine.spec.mlp, None), "_megatrain_tiled", None)]
    assert bool(tiled) == (model_type != "nemotron_h")
    torch.manual_seed(1234)
    engine.forward_backward(batch, num_items_in_batch=nib)
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("model_type", ["qwen3_next", "jamba", "qwen3_5_text", "mamba2", "falcon_h1"])
def test_hybrid_stacks_count_stream_in_and_load_back(model_type, tmp_path):
    """The layout's count, a saved folder streamed into the store (every master equal; an MoE's experts one by
    one on disk, fused in memory; Falcon-H1's mixers' mup_vector, which is not saved, computed on the host by its
    model's _init_weights), then the engine equals stock on the loaded model; the engine's saved files load back
    to the same logits."""
    assert_streams_in_and_loads_back(lambda: _hybrid_model(model_type, attn="eager")[0], tmp_path)


def assert_streams_in_and_loads_back(build, tmp_path):
    """`build()` (a fresh model, the same weights each call): the layout counts its parameters; its saved folder
    streams into the store; the engine then equals stock on the loaded model; the engine's saved files load back
    to the same logits."""
    from hf_megatrain.engine.layout import config_units

    src = build()
    assert sum(u.numel for u in config_units(src.config)) == sum(p.numel() for p in src.parameters())
    _, engine = _streamed_in(src, tmp_path)
    batch = make_batch(batch=3, seq=12)
    out = src(**batch)
    out.loss.backward()
    loss = engine.forward_backward(batch)
    assert abs(float(loss) - float(out.loss)) < 1e-5
    grads = dict(engine.named_grads())
    for name, p in src.named_parameters():
        if p.grad is None:  # stock gives it none (GLM-5's detached indexer): the engine's is exactly zero
            assert not grads[name].any(), name
            continue
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert_saved_files_load_back(build(), tmp_path / "again")


def test_the_self_check_refuses_a_hybrid_plan_it_gets_wrong(monkeypatch):
    """Qwen3.5 with the generic spec reading its rotary embeddings wrong (handed to no layer): the 2-layer copy
    cannot run or differs from stock, and the engine refuses before training, in one line."""
    from hf_megatrain.engine import selfcheck
    from hf_megatrain.patcher import specs

    real = specs._layer_plan

    def wrong(*args):  # the rotary embeddings for no layer: its attention layers get None
        plan = real(*args)
        plan["layer_inputs"] = tuple((k, ("rotary", ("layer_types", "none")) if v[0] == "rotary" else v)
                                     for k, v in plan["layer_inputs"])
        return plan

    monkeypatch.setattr(specs, "_layer_plan", wrong)
    monkeypatch.setattr(specs, "_GENERIC", {})
    monkeypatch.setattr(selfcheck, "_VERIFIED", set())
    model, _ = _hybrid_model("qwen3_5_text")
    with pytest.raises(MegaTrainError, match="'qwen3_5_text' is outside the registry") as refused:
        StreamingEngine(model, compute_dtype=torch.float32)
    assert "\n" not in str(refused.value)


def test_a_hybrid_mask_read_wrong_is_refused(monkeypatch):
    """Every recurrent layer handed the causal mask of an attention layer instead of its 2D padding mask: the
    padded row's state differs, the self-check sees it and refuses."""
    from hf_megatrain.engine import selfcheck
    from hf_megatrain.patcher import specs

    real = specs._layer_plan

    def wrong(*args):
        plan = real(*args)
        plan["mask_makers"] = tuple((k, "create_causal_mask") for k, _ in plan["mask_makers"])
        return plan

    monkeypatch.setattr(specs, "_layer_plan", wrong)
    monkeypatch.setattr(specs, "_GENERIC", {})
    monkeypatch.setattr(selfcheck, "_VERIFIED", set())
    model, _ = _hybrid_model("qwen3_next")
    with pytest.raises(MegaTrainError, match="'qwen3_next' is outside the registry"):
        StreamingEngine(model, compute_dtype=torch.float32)


@pytest.mark.parametrize("model_type", HYBRID + ["gptj", "codegen"])
def test_the_planner_sizes_every_hybrid_stack(model_type):
    """What the trainer and `hf-megatrain estimate` run before the engine: the planner's sizes of each stack the
    engine trains, its parameter count the layout's (Mamba has no attention heads, GPT-J names them n_head,
    Qwen3.5-MoE has no dense intermediate_size)."""
    from tests.support.zoo import tiny_config

    cfg = tiny_config(model_type)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert model_sizes(cfg).params == params


# Absolute positions added at the embedding (issue 35): learned tables (GPT-2, GPT-BigCode, GPT-Neo, OPT and BioGPT
# with their offset of 2) and fixed sinusoids (XGLM's module, CTRL's buffer indexed by the ids, after the embeddings'
# sqrt(n_embd) scale). The generic spec reads from the base model's forward what it does before the first layer
# (ArchSpec.positions, project_in, embed_scale, embed_dropout, LayerDrop's draws) and after the last (project_out);
# the embedding unit repeats it, and the layers get what the forward hands them (GPT-2's and XGLM's positional
# arguments named by the layer's signature). A learned table is a parameter of the embedding unit (the host store
# places spec.embed_parts and head_parts in their units).
# BLOOM beside them: ALiBi made from the 2D mask by its modeling module's build_alibi_tensor and handed to every layer,
# and a norm of the embeddings (its word_embeddings_layernorm, part of the embedding unit).
ABSOLUTE = ["gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt", "xglm", "ctrl", "bloom"]


def _absolute_model(model_type, attn="sdpa", tied=True, **overrides):
    from tests.support.zoo import tiny_config

    cfg = tiny_config(model_type)
    cfg.tie_word_embeddings = tied
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).train()
    except ValueError as e:
        if not refuses_sdpa(e):
            raise
        pytest.skip(f"stock {model_type} refuses attn_implementation={attn!r}")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ABSOLUTE)
def test_absolute_positions_match_stock(model_type, attn, tied):
    """Loss and every gradient equal stock's (one right-padded row), the head tied to the embedding or not (CTRL's
    tied lm_head keeps a bias of its own), the positions part of the embedding unit."""
    from hf_megatrain.patcher.specs import spec_for

    model = _absolute_model(model_type, attn, tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    spec = spec_for(model.config)
    assert spec.generic and spec.rotary is None and (spec.positions or (spec.alibi and spec.embed_norm))
    assert_engine_matches_stock(model)


@pytest.mark.parametrize("model_type", ["xglm", "ctrl", "gpt2", "biogpt"])
def test_embedding_dropout_and_layerdrop_draws_are_stock(model_type):
    """Dropout on: the embedding dropout (GPT-2's and CTRL's Dropout module, XGLM's and BioGPT's functional one)
    draws its numbers in the embedding unit's forward and again in its recompute, each layer's dropout in its own,
    and XGLM's and BioGPT's forwards draw LayerDrop's number before each layer in training (layerdrop 0): stock's
    random numbers, so the same loss and gradients."""
    drops = {k: 0.2 for k in ("embd_pdrop", "resid_pdrop", "attn_pdrop", "dropout", "attention_dropout",
                              "activation_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob")}
    model = _absolute_model(model_type, "eager", **drops)
    assert assert_engine_matches_stock(model) is not None


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("proj", [None, 32])
@pytest.mark.parametrize("model_type", ["opt"])
def test_opt_positions_and_projections_are_stock(model_type, proj, padding):
    """OPT without position ids counts them from the 2D mask (a left-padded row's tokens start at 0, offset 2 into
    its table), for its table and its layers; with word_embed_proj_dim below the width its project_in (embedding
    unit) and project_out (head, after the final norm) run where its forward runs them."""
    overrides = {} if proj is None else dict(word_embed_proj_dim=proj)
    model = _absolute_model(model_type, "eager", tied=True, **overrides)
    if proj:
        assert model.model.decoder.project_in is not None and model.model.decoder.project_out is not None
    batch = make_batch(batch=3, seq=12)
    if padding == "left":  # the padded row's tokens moved to its end
        for key in batch:
            batch[key][-1] = batch[key][-1].roll(6)
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref = copy.deepcopy(model)
    out = ref(**batch, num_items_in_batch=nib)
    out.loss.backward()
    engine = StreamingEngine(model, compute_dtype=torch.float32, loss_chunk_tokens=7).train()
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert abs(float(loss) - float(out.loss)) < 1e-5
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_layerdrop_is_refused_before_a_weight_is_read():
    from transformers import AutoConfig

    from hf_megatrain.patcher.specs import spec_for
    from tests.support.zoo import tiny_kwargs

    cfg = AutoConfig.for_model("xglm", **{**tiny_kwargs("xglm"), "layerdrop": 0.1})
    with pytest.raises(MegaTrainError, match=r"layerdrop=0\.1 skips random decoder layers.*config\.layerdrop = 0"):
        spec_for(cfg)


@pytest.mark.parametrize("model_type", ["ctrl", "xglm", "gpt2", "gpt_neo",
                                        "gpt_bigcode", "bloom"])
def test_absolute_positions_count_stream_in_and_load_back(model_type, tmp_path):
    """The layout's count; a saved folder streamed into the store, the buffers its model computes when built
    (CTRL's and XGLM's sinusoids, GPT-Neo's and GPT-BigCode's causal masks) rebuilt on the host by its own
    _init_weights; the engine then equals stock on the loaded model; its saved files load back to the same logits."""
    assert_streams_in_and_loads_back(lambda: _absolute_model(model_type, "eager", tied=True), tmp_path)


def test_token_type_ids_are_refused_where_the_forward_adds_their_embeddings():
    """CTRL's (and GPT-2's) model forward embeds token_type_ids and adds them to the hidden states: a batch that
    has them is refused in one line, not trained without them."""
    engine = StreamingEngine(_absolute_model("ctrl", "eager"), compute_dtype=torch.float32).train()
    batch = make_batch(batch=2, seq=8)
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    with pytest.raises(MegaTrainError, match="token_type_ids") as refused:
        engine.forward_backward(batch)
    assert "\n" not in str(refused.value)


# NanoChat (issue 35): its model forward applies its final norm to the embeddings too, before the first layer. That
# norm holds no weight (x * rsqrt(mean(x^2) + eps)), so the generic spec names it the embedding's norm as well
# (spec.embed_norm, patcher/specs.py _outside_the_layers) and the embedding unit applies a copy of it.
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_nanochat_norms_its_embeddings_with_its_final_norm(attn):
    from hf_megatrain.patcher.specs import spec_for
    from tests.support.zoo import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("nanochat"), attn_implementation=attn,
                                             dtype=torch.float32).train()
    spec = spec_for(model.config)
    assert spec.generic and spec.embed_norm == spec.norm and not any(True for _ in model.model.norm.parameters())
    assert_engine_matches_stock(model)


# Layer lists whose length differs from num_hidden_layers (issue 35): LongCat-Flash's decoder layers hold two
# attention/MLP sublayers each plus a shortcut MoE (zero-compute experts beside the routed ones), and its
# num_hidden_layers counts the sublayers (2 x num_layers). The engine makes one unit per module of the real list
# (ArchSpec.depth: the config attribute the base model builds it from), in the layout, the planner, the self-check's
# small copy and the store alike.
MULTI_SUBLAYER = ["longcat_flash"]
PINNED = tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) < (5, 18)


def _zoo_model(model_type, attn="sdpa", **overrides):
    """The zoo's tiny copy of `model_type` (tests/support/zoo.py), fp32, in training mode, seeded."""
    from tests.support.zoo import tiny_config

    cfg = tiny_config(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).train()


def assert_trainer_matches_stock(build, tmp_path, steps=4):
    """`build()` (a fresh model, the same weights each call) trained by stock Trainer and by MegaTrainTrainer from
    the same rows (clipping, warmup, weight decay, gradient accumulation 2, evaluation): the same logged loss,
    grad_norm, learning rate and eval loss, and the same parameters after."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
    from tests.support.tiny import make_rows

    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5, warmup_steps=1,
              lr_scheduler_type="linear", weight_decay=0.1, learning_rate=1e-2, eval_strategy="steps", eval_steps=2,
              logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, max_steps=steps,
              dataloader_num_workers=0, disable_tqdm=True)
    train, ev = make_rows(16, 0), make_rows(4, 100)
    ref = build()
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "stock"), **kw), train_dataset=train,
                    eval_dataset=ev, data_collator=default_data_collator)
    stock.train()
    mega = MegaTrainTrainer(build(), MegaTrainArguments(output_dir=str(tmp_path / "mega"), **kw), train_dataset=train,
                            eval_dataset=ev, data_collator=default_data_collator)
    mega.train()
    keys = ("loss", "grad_norm", "learning_rate", "eval_loss")
    logs = [[{k: h[k] for k in keys if k in h} for h in t.state.log_history if any(k in h for k in keys)]
            for t in (stock, mega)]
    assert [sorted(h) for h in logs[0]] == [sorted(h) for h in logs[1]] and len(logs[0]) >= steps
    for a, b in zip(*logs):
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])
    masters = dict(mega.engine.named_master_params())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", MULTI_SUBLAYER)
def test_multi_sublayer_families_match_stock(model_type, attn):
    """One unit per module of the layer list (3), where num_hidden_layers says 6: loss and every gradient equal
    stock's, both sublayers' attention and MLPs and the shortcut MoE's routed experts among them."""
    from hf_megatrain.patcher.specs import spec_for

    model = _zoo_model(model_type, attn)
    layers = len(model.model.layers)
    assert model.config.num_hidden_layers == 2 * layers and spec_for(model.config).n_layers(model.config) == layers
    engine = StreamingEngine(copy.deepcopy(model), compute_dtype=torch.float32)
    assert [u.layer for u in engine.units if u.kind == "layer"] == list(range(layers))
    assert_engine_matches_stock(model)
    model(**make_batch(batch=3, seq=12)).loss.backward()
    assert model.model.layers[0].mlp.experts.down_proj.grad.any()  # routed experts were picked, not only zero ones


@pytest.mark.parametrize("model_type", MULTI_SUBLAYER)
def test_multi_sublayer_families_train_as_stock_trainer(model_type, tmp_path):
    assert_trainer_matches_stock(lambda: _zoo_model(model_type, "eager"), tmp_path)


@pytest.mark.parametrize("model_type", MULTI_SUBLAYER)
def test_multi_sublayer_families_count_stream_in_and_load_back(model_type, tmp_path):
    """The planner counts the real layers and every parameter; a saved folder (experts one by one, as HF writes them)
    streams in and the engine's files load back. Transformers 5.17 lays LongCat's zero-compute experts out as rows of
    gate_up_proj too (5.25 does not); both round-trip."""
    from tests.support.zoo import tiny_config

    cfg = tiny_config(model_type)
    sizes = model_sizes(cfg)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    assert sizes.layers == len(meta.model.layers) == cfg.num_layers
    assert sizes.params == sum(p.numel() for p in meta.parameters())
    assert_streams_in_and_loads_back(lambda: _zoo_model(model_type, "eager"), tmp_path)


def test_checkpoint_tensors_the_model_skips_are_skipped_on_stream_in(tmp_path):
    """LongCat-Flash's checkpoints carry multi-token-prediction layers (model.mtp.*) that its causal LM does not hold
    and from_pretrained skips (_keys_to_ignore_on_load_unexpected): streaming in skips them too, and a tensor no
    pattern names is still refused."""
    from safetensors.torch import load_file, save_file

    src = _zoo_model("longcat_flash", "eager")
    src.save_pretrained(tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    save_file({**tensors, "model.mtp.layers.0.enorm.weight": torch.ones(4)}, path, metadata={"format": "pt"})
    skeleton, _, folder = load_model_and_tokenizer(str(tmp_path / "src"))
    engine = engine_from_checkpoint(skeleton, folder, compute_dtype=torch.float32, progress=False)
    masters = dict(engine.named_master_params())
    for name, p in src.named_parameters():
        assert torch.equal(masters[name], p.detach()), name
    save_file({**tensors, "model.extra.weight": torch.ones(4)}, path, metadata={"format": "pt"})
    skeleton, _, folder = load_model_and_tokenizer(str(tmp_path / "src"))
    with pytest.raises(MegaTrainError, match="model.extra.weight"):
        engine_from_checkpoint(skeleton, folder, compute_dtype=torch.float32, progress=False)


# Gemma 3n and Gemma 4 text (issue 35), registered specs: per-layer embeddings (embed_tokens_per_layer, its
# projection and norm) are a unit of their own after the embedding, and every layer reads its slice of what that unit
# makes; KV sharing hands the last layers the keys and values of an earlier one (the tiny configs share across their
# last 2 of 5 layers: tests/support/zoo.py EXTRA); Gemma 4's full-attention layers have a head_dim of their own and
# every layer a persistent layer_scalar; Gemma 3n's hidden states are AltUp's stack of 4, made in the embedding unit
# and collapsed in the head, and its layers hold laurel blocks and (here, in two layers) activation sparsity.
# Gemma-4-unified text is Gemma 4 without per-layer embeddings.
GEMMA_PLE = ["gemma3n_text", "gemma4_text", "gemma4_unified_text"]


def _gemma_model(model_type, attn="sdpa", **overrides):
    """The zoo's tiny config (KV shared across the last 2 layers), with random persistent buffers (Gemma 4's
    layer_scalar) of each layer's own, so that a layer called with another's would show; Gemma 3n with
    activation sparsity in two layers."""
    from hf_megatrain.patcher.templates import persistent_buffers
    from tests.support.zoo import tiny_config

    cfg = tiny_config(model_type)
    if model_type == "gemma3n_text":
        cfg.activation_sparsity_pattern = [0.95, 0.0, 0.0, 0.5, 0.0]
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for buf in persistent_buffers(model).values():
            buf.copy_(1 + 0.1 * torch.randn(buf.shape, generator=g))
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", GEMMA_PLE)
def test_gemma_per_layer_embeddings_and_shared_kv_match_stock(model_type, attn):
    """Loss and every gradient equal stock's (one right-padded row): the per-layer unit's weights and the token
    embeddings get what every layer's slice sent back, the layers that made the shared keys and values get what
    the layers reading them sent back."""
    from hf_megatrain.patcher.specs import spec_for

    model = _gemma_model(model_type, attn)
    spec = spec_for(model.config)
    assert not spec.generic and spec.shared_kv and model.config.num_kv_shared_layers == 2
    kinds = [u.kind for u in StreamingEngine(copy.deepcopy(model), compute_dtype=torch.float32).units]
    assert ("per_layer" in kinds) == (model_type != "gemma4_unified_text") and kinds.count("layer") == 5
    assert_engine_matches_stock(model)


@pytest.mark.parametrize("overrides", [
    dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0),  # Gemma 4's larger models: neither
    dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=3.0),
    dict(attention_k_eq_v=True, use_double_wide_mlp=True),  # keys as values; the sharing layers' MLPs twice as wide
])
def test_gemma4_variants_match_stock(overrides):
    """Gemma 4's other configurations: without per-layer embeddings and KV sharing (no per-layer unit at all), with
    its MoE block beside the MLP and soft-capped logits, with keys used as values in its full-attention layers and
    double-wide MLPs in the layers that share KV."""
    model = _gemma_model("gemma4_text", "eager", **overrides)
    engine = StreamingEngine(copy.deepcopy(model), compute_dtype=torch.float32)
    assert any(u.kind == "per_layer" for u in engine.units) == bool(model.config.hidden_size_per_layer_input)
    assert_engine_matches_stock(model)


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
def test_gemma_micro_batches_together_and_mlp_tiles_match_stock(model_type):
    """Two micro-batches through each unit together (forward_backward_many: each keeps its own per-layer inputs and
    shared keys and values) with MLP tiles of 7 tokens (Gemma 3n's activation sparsity is per token): the summed
    gradients of stock's two backward passes."""
    model = _gemma_model(model_type, "eager")
    batches = [make_batch(batch=2, seq=14, pad_rows=1), make_batch(batch=3, seq=14, pad_rows=0)]
    nib = sum(b["labels"][..., 1:].ne(-100).sum() for b in batches)
    ref = copy.deepcopy(model)
    for b in batches:
        ref(**b, num_items_in_batch=nib).loss.backward()
    engine = StreamingEngine(model, compute_dtype=torch.float32, mlp_tile_tokens=7).train()
    engine.forward_backward_many(batches, num_items_in_batch=nib)
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("model_type", GEMMA_PLE)
def test_gemma_count_stream_in_and_load_back(model_type, tmp_path):
    """The layout counts the per-layer unit; a saved folder streams into the store (Gemma 4's layer_scalar
    buffers read from it); the engine equals stock on the loaded model; its saved files load back."""
    assert_streams_in_and_loads_back(lambda: _gemma_model(model_type), tmp_path)  # sdpa, as the skeleton is built


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
def test_gemma_trainer_matches_stock_trainer(model_type, tmp_path):
    """MegaTrainTrainer against stock Trainer, 6 steps of 2 accumulated micro-batches with clipping, warmup and
    weight decay, evaluation every 2: the same logged loss, grad_norm, learning rate and eval loss, and the same
    parameters after, the per-layer unit's included."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
    from tests.integration.test_trainer import COMMON, assert_logs_equal
    from tests.support.tiny import make_rows

    train, ev = make_rows(24, 0), make_rows(6, 100)
    model = _gemma_model(model_type, "eager")
    ref = copy.deepcopy(model)
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "stock"), **COMMON),
                    train_dataset=train, eval_dataset=ev, data_collator=default_data_collator)
    stock.train()
    mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path / "mega"), **COMMON),
                            train_dataset=train, eval_dataset=ev, data_collator=default_data_collator)
    mega.train()
    assert_logs_equal(stock.state.log_history, mega.state.log_history)
    masters = dict(mega.engine.named_master_params())
    assert any(n.startswith("model.embed_tokens_per_layer.") for n in masters)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("model_type", GEMMA_PLE)
def test_gemma_bf16_as_close_as_stock_bf16(model_type):
    """bf16 on the CPU: against the fp32 reference, the engine's bf16 compute (fp32 masters) is as close as stock
    with bf16 parameters (its error at most twice stock's plus 1e-2, the loss and every gradient)."""
    model = _gemma_model(model_type, "eager")
    batch = make_batch(batch=3, seq=16, pad_rows=0)
    ref = copy.deepcopy(model)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    low = copy.deepcopy(model).to(torch.bfloat16)
    low_loss = low(**batch).loss
    low_loss.backward()
    engine = StreamingEngine(model, compute_dtype=torch.bfloat16).train()
    loss = engine.forward_backward(batch)

    def err(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    assert abs(float(loss) - float(ref_loss)) <= 2 * abs(float(low_loss) - float(ref_loss)) + 1e-2
    stock = dict(low.named_parameters())
    for name, g in engine.named_grads():
        want = ref.get_parameter(name).grad
        assert err(g, want) <= 2 * err(stock[name].grad, want) + 1e-2, name


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
def test_gemma_checkpoint_keys_of_kv_sharing_layers_are_skipped_as_from_pretrained_skips_them(model_type, tmp_path):
    """Released Gemma 3n/4 checkpoints carry keys, values and their norms for the layers that share another layer's,
    which the model has no parameters for and from_pretrained drops (_keys_to_ignore_on_load_unexpected): the
    streamed load skips them too, and fills every parameter."""
    from safetensors.torch import load_file, save_file

    src = _gemma_model(model_type)
    src.save_pretrained(tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    tensors = load_file(path)
    extra = {f"model.layers.{i}.self_attn.{name}.weight": torch.randn(8, 8)
             for i in (3, 4) for name in ("k_proj", "v_proj", "k_norm")}
    assert not set(extra) & set(tensors)
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    AutoModelForCausalLM.from_pretrained(tmp_path / "src")  # stock loads it
    skeleton, _, folder = load_model_and_tokenizer(str(tmp_path / "src"))
    engine = engine_from_checkpoint(skeleton, folder, compute_dtype=torch.float32, progress=False)
    masters = dict(engine.named_master_params())
    for name, p in src.named_parameters():
        assert torch.equal(masters[name], p.detach()), name


# Rotary bases per layer (issue 35): GraniteMoE-SWA and Granite-SWA keep, beside their decoder layers, a second
# ModuleList in the base model: rotary_embs, one rotary module per distinct non-zero base of config.layer_rope_theta
# (no parameters). Their forward makes each base's cos/sin once a batch and hands every layer its own base's, or None
# where the list says 0 (NoPE). The generic spec reads that (patcher/specs.py _rotary_by_base) and the engine makes
# the same per-base cos/sin from rebuilt copies of those modules (ArchSpec.rotary_list). The tiny copies here have a
# NoPE layer between two bases, sliding and full attention, µP multipliers away from 1 and (MoE) a shared MLP.
ROTARY_PER_LAYER = ["granitemoe_swa", "granite_swa"]
_SWA = dict(layer_rope_theta=[10000.0, 0, 500000.0], layer_types=["full_attention"] + ["sliding_attention"] * 2,
            sliding_window=5, embedding_multiplier=1.5, logits_scaling=2.0, residual_multiplier=0.7,
            attention_multiplier=2.0)


def _swa_model(model_type, attn="eager", init=0.2):
    """The zoo's tiny copy with _SWA's bases and multipliers, weights of std `init` (large enough that attention,
    and so each layer's rotation, matters; the trainer's comparison over several steps takes the default, where
    rounding does not grow). Transformers 5.17 records no router logits for GraniteMoE-SWA (its loss then fails
    with output_router_logits on): off there; 5.25 adds them, and the router loss is compared."""
    extra = dict(shared_intermediate_size=64, initializer_range=init) if model_type == "granitemoe_swa" \
        else dict(initializer_range=init)
    if model_type == "granitemoe_swa" and PINNED:
        extra["output_router_logits"] = False
    model = _zoo_model(model_type, attn, **_SWA, **extra)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # attention sinks start at zero: made random, so that a sink read wrong would show
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
    return model


@pytest.mark.parametrize("model_type", ROTARY_PER_LAYER)
def test_per_layer_rotary_bases_match_stock(model_type):
    """Loss and every gradient equal stock's, each layer rotated by its own base (layer 1 not at all). The bases
    matter here: the same model with every layer at the first base gives another loss."""
    from hf_megatrain.patcher.specs import spec_for

    model = _swa_model(model_type)  # eager only: stock refuses sdpa for these (attention sinks)
    spec = spec_for(model.config)
    assert spec.generic and spec.rotary_list == "model.rotary_embs"
    assert ("position_embeddings", ("rotary_by", "layer_rope_theta")) in spec.layer_inputs
    assert len(model.model.rotary_embs) == 2
    out = assert_engine_matches_stock(model)
    if getattr(model.config, "output_router_logits", False):
        assert float(out.aux_loss) > 0
    same = copy.deepcopy(model)
    same.config.layer_rope_theta = [10000.0] * 3
    batch = make_batch(batch=3, seq=12)
    with torch.no_grad():
        assert (same(**batch).logits - model(**batch).logits).abs().max() > 1e-2


@pytest.mark.parametrize("model_type", ROTARY_PER_LAYER)
def test_per_layer_rotary_bases_train_as_stock_trainer(model_type, tmp_path):
    assert_trainer_matches_stock(lambda: _swa_model(model_type, init=0.02), tmp_path)


@pytest.mark.parametrize("model_type", ROTARY_PER_LAYER)
def test_per_layer_rotary_bases_count_stream_in_and_load_back(model_type, tmp_path):
    """The planner's count (the rotary list holds nothing), a saved folder streamed in (the engine's rotary modules
    are rebuilt from the skeleton's, whose inv_freq is computed, not read), and files that load back."""
    model = _swa_model(model_type)
    assert model_sizes(model.config).params == sum(p.numel() for p in model.parameters())
    assert model_sizes(model.config).layers == 3
    assert_streams_in_and_loads_back(lambda: _swa_model(model_type), tmp_path)


# A state carried from layer to layer (issue 35): GLM-5's DSA layers return their indexer's top-k beside the hidden
# states, and its forward hands each layer the previous one's; a "shared" layer attends over those instead of running
# an indexer. The generic spec reads that from the forward (ArchSpec.carried); the engine hands each layer's forward
# what the previous one returned and its recompute what its forward got (engine/carried.py): token indices, without
# a gradient. The tiny copy's middle layer is shared, and its top-k keeps 4 of 12 tokens.
CARRIED = ["glm_moe_dsa"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", CARRIED)
def test_a_carried_top_k_matches_stock(model_type, attn):
    from hf_megatrain.patcher.specs import spec_for

    model = _zoo_model(model_type, attn)
    assert spec_for(model.config).carried == ("prev_topk_indices", 1)
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, False]
    assert_engine_matches_stock(model)


def test_the_recompute_gets_what_the_forward_was_handed(monkeypatch):
    """Handing the shared layer's recompute other indices than its forward got changes its gradients: the equality
    above rests on the carried top-k."""
    from hf_megatrain.engine.carried import Carried

    model = _zoo_model("glm_moe_dsa", "eager")
    batch = make_batch(batch=3, seq=12)
    ref = copy.deepcopy(model)
    ref(**batch).loss.backward()
    wrong = Carried.recompute_kwargs
    monkeypatch.setattr(Carried, "recompute_kwargs", lambda self, layer: {
        k: (v if v is None else torch.zeros_like(v)) for k, v in wrong(self, layer).items()})
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    engine.forward_backward(batch)
    grads = dict(engine.named_grads())
    name = "model.layers.1.self_attn.q_b_proj.weight"
    assert not torch.allclose(grads[name], ref.get_parameter(name).grad, atol=1e-5)


def test_the_planner_counts_the_carried_top_k_the_engine_keeps(monkeypatch):
    """The estimate's line for the carried indices is what the engine holds for the recompute after a forward: one
    [batch, seq, min(top-k, seq)] int64 tensor per layer with an indexer of its own (a "shared" one reuses it)."""
    from hf_megatrain.engine.carried import Carried
    from hf_megatrain.planner.estimator import estimate

    model = _zoo_model("glm_moe_dsa", "eager")
    kept = []
    monkeypatch.setattr(Carried, "recompute_kwargs", lambda self, layer: (kept.append(self), {
        self.keyword: self.given[layer]})[1])
    batch = make_batch(batch=3, seq=12)
    StreamingEngine(model, compute_dtype=torch.float32).train().forward_backward(batch)
    # the run's (the self-check's small copy ran first): what the layers were handed, and the last one's own
    held = {id(t): t.numel() * t.element_size() for t in [*kept[-1].given.values(), kept[-1].last] if t is not None}
    assert len(held) == 2 and model.config.index_topk < 12  # the tiny copy's two indexers, top-k under seq
    assert estimate(model.config, 3, 12).gpu["carried top-k indices"] == sum(held.values())


@pytest.mark.parametrize("model_type", CARRIED)
def test_a_carried_top_k_trains_as_stock_trainer(model_type, tmp_path):
    assert_trainer_matches_stock(lambda: _zoo_model(model_type, "eager"), tmp_path)


@pytest.mark.parametrize("model_type", CARRIED)
def test_a_carried_top_k_counts_streams_in_and_loads_back(model_type, tmp_path):
    assert_streams_in_and_loads_back(lambda: _zoo_model(model_type, "eager"), tmp_path)


def test_a_carried_state_that_could_carry_a_gradient_is_refused():
    """What a layer hands the next must be indices: a floating tensor would need its gradient sent back across
    units, which the engine does not do, so it refuses it by name instead of training without it."""
    from hf_megatrain.engine.carried import Carried

    carried = Carried("prev_topk_indices", 1)
    assert carried.forward_kwargs(0) == {"prev_topk_indices": None}
    h = torch.zeros(2, 3)
    assert carried.took(0, (h, torch.arange(4).view(2, 2))) is h
    assert torch.equal(carried.forward_kwargs(1)["prev_topk_indices"], torch.arange(4).view(2, 2))
    assert carried.recompute_kwargs(0) == {"prev_topk_indices": None}
    with pytest.raises(MegaTrainError, match="prev_topk_indices that could carry a gradient"):
        carried.took(1, (h, torch.ones(2, requires_grad=True)))
