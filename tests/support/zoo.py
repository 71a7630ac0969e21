"""The zoo: every model type of transformers' causal-LM mapping, built tiny from its config defaults and
trained one step through the engine against stock autograd (CPU, fp32). tests/unit/test_zoo.py runs it.

`classify(model_type)` answers one of
  ("exact", note)     the engine's loss and every gradient equal stock's, and the folder stock saves streams into
                      the engine's store as the trainer reads it, every weight equal;
  ("refused", line)   the package refused it from its config alone (hf_megatrain.MegaTrainError), before
                      a weight exists: spec_for, the planner's meta layout or the generic self-check;
  ("skipped", why)    not a decoder-only text model (encoder-decoder, vision or audio towers), or its stock
                      model cannot be built tiny or cannot run a training step, so there is nothing to compare;
and raises for anything else: a crash (any other exception from the package) or a gradient that differs.
"""

from __future__ import annotations

import copy
import math
import tempfile

import torch

from tests.support.tiny import make_batch

# Sizes of the tiny copy; only attributes the config has (and sets, for those that may be None) are changed.
WIDTH = dict(hidden_size=64, n_embd=64, d_model=64, intermediate_size=128, ffn_hidden_size=128,
             num_attention_heads=4, n_head=4, num_heads=4, head_dim=16, vocab_size=128,
             max_position_embeddings=256, n_positions=256,
             # Gemma 3n's and Gemma 4's per-layer embeddings: a table of vocabulary x (layers x this width)
             vocab_size_per_layer_input=128, hidden_size_per_layer_input=16)
MAY_BE_NONE = dict(num_key_value_heads=2, sliding_window=8, attention_chunk_size=8,
                   # MLA: the compressed ranks and the split of each head into its rotary and plain parts
                   q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                   moe_intermediate_size=64, expert_intermediate_size=64, shared_expert_intermediate_size=64,
                   expert_ffn_hidden_size=64,  # LongCat-Flash's experts
                   intermediate_size_mlp=128, n_inner=128)
# zero_expert_num: LongCat-Flash's zero-compute (identity) experts beside the routed ones, 256 by default, which
# would leave the 4 routed ones hardly ever picked
EXPERTS = dict(num_local_experts=4, num_experts=4, n_routed_experts=4, moe_num_experts=4, zero_expert_num=2)
TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k")  # moe_k: ERNIE-4.5-MoE
LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
DEPTH = 3
NOISE = ("router_jitter_noise", "input_jitter_noise")

# Skipped before anything runs: what the mapping holds that is not a decoder-only text model.
TOWERS = {"vision_config": "a vision tower", "audio_config": "an audio tower", "vq_config": "an image tokenizer (VQ)",
          "audio_encoder_config": "an audio encoder", "depth_decoder_config": "a depth decoder beside the text one",
          "patcher_config": "byte patching with local encoder and decoder models"}


def _not_a_text_decoder(config) -> str | None:
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    subs = getattr(type(config), "sub_configs", {}) or {}
    for tower, what in TOWERS.items():
        if tower in subs or _get(config, tower) is not None:
            return f"{what} (multimodal or composite; its text model, where the mapping has one, is tried by itself)"
    if "text_config" in subs or _get(config, "text_config") is not None:
        return "a wrapper around a text config (its text model, where the mapping has one, is tried by itself)"
    return None


class Skip(Exception):
    pass


def _set(config, name, value) -> None:
    if hasattr(config, name):
        setattr(config, name, value)


def _get(config, name):
    try:  # per-layer configs (Gemma 4) refuse reading a global that may vary by layer
        return getattr(config, name, None)
    except Exception:
        return None


def _settable(config, name) -> bool:
    prop = getattr(type(config), name, None)
    return not isinstance(prop, property) or prop.fset is not None


# Gemma 4 with its last 2 of 5 layers sharing KV: a sliding and a full layer before them to take it from
_GEMMA4_KV_SHARED = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
# Per type: what its config needs beyond the generic shrinking to be built tiny.
EXTRA = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=8),
    "mamba2": dict(num_heads=8),  # its heads times head_dim must be twice the width
    "gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8),  # the rotary part of a 16-wide head
    # KV sharing across the last layers, on a depth that keeps a sliding and a full layer before them
    "gemma3n_text": dict(num_hidden_layers=5, num_kv_shared_layers=2, layer_types=["sliding_attention"] * 2
                         + ["full_attention", "sliding_attention", "full_attention"],
                         intermediate_size=128),  # its default is a list of 16384s, one per layer
    # Gemma 4 (E2B/E4B) shares KV across its last layers too (the unified text model as well); its full-attention
    # layers keep a head_dim of their own (global_head_dim: 512 by default, where attention is unscaled, would make
    # the tiny copy's softmax so sharp that fp32 rounding alone moves the first layer's gradients past 1e-5)
    "gemma4_text": dict(num_hidden_layers=5, num_kv_shared_layers=2, layer_types=_GEMMA4_KV_SHARED, global_head_dim=32),
    "gemma4_unified_text": dict(num_hidden_layers=5, num_kv_shared_layers=2, layer_types=_GEMMA4_KV_SHARED,
                                global_head_dim=32),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 16]),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),  # its default has none
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"]),  # its default's layer_types has no conv layer
    # hybrid stacks whose defaults put their first attention layer deeper than the tiny depth
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # µP multipliers away from their default 1.0, so that each one the engine missed would show
    "falcon_h1": dict(embedding_multiplier=1.5, lm_head_multiplier=0.7, key_multiplier=0.9, attention_in_multiplier=1.2,
                      attention_out_multiplier=0.8, ssm_in_multiplier=1.1, ssm_out_multiplier=0.9,
                      mlp_multipliers=[1.3, 0.6], ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05]),
    # shared attention blocks on two layers (one alone has nothing to share with)
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                  layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
    # GLM-5: a layer that reuses the previous one's indexer top-k ("shared"), so that the carried top-k is used
    "glm_moe_dsa": dict(indexer_types=["full", "shared", "full"], index_topk=4),  # of 12 tokens: a real choice
    "zamba2": dict(num_hidden_layers=4, hybrid_layer_ids=[1, 3],
                   layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
}


def tiny_kwargs(model_type: str, with_layer_types: bool = True) -> dict:
    """The overrides that make `model_type`'s default config tiny, read from its default config (its
    serialized fields: a per-layer config refuses reading some globals as attributes)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    d = default.to_dict()

    def num(k):
        return d.get(k) if isinstance(d.get(k), int) and not isinstance(d.get(k), bool) else None

    mla = num("kv_lora_rank") is not None
    kw = {k: v for k, v in {**WIDTH, **MAY_BE_NONE}.items() if num(k) is not None}
    if "head_dim" in d and d["head_dim"] is None and not mla:
        kw["head_dim"] = WIDTH["head_dim"]  # None where the default's stock model cannot build (Ministral)
    if mla:
        kw.pop("head_dim", None)  # MLA's head_dim is its rotary part: left to the config
        if num("head_dim") is not None and num("head_dim") == num("qk_rope_head_dim"):
            kw["head_dim"] = MAY_BE_NONE["qk_rope_head_dim"]  # a field of its own that must stay it (LongCat-Flash)
    heads = num("num_attention_heads") or num("n_head") or num("num_heads")
    if num("num_key_value_heads") is not None and num("num_key_value_heads") == heads:
        kw["num_key_value_heads"] = WIDTH["num_attention_heads"]  # one key/value head per head stays so (MLA)
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None:
        kw["num_key_value_heads"] = MAY_BE_NONE["num_key_value_heads"]  # None where stock cannot build (Nemotron)
    kw.update({k: v for k, v in EXPERTS.items() if num(k)})
    kw.update({k: min(num(k), 2) for k in TOP_K if num(k)})
    if any(num(k) for k in EXPERTS) and "num_experts_per_tok" in d and d["num_experts_per_tok"] is None:
        kw["num_experts_per_tok"] = 2  # DeepSeek-V2's default routes to None experts
    if num("n_group") is not None:
        kw.update(n_group=1, topk_group=1)
    if num("first_k_dense_replace") is not None:
        kw["first_k_dense_replace"] = min(d["first_k_dense_replace"], 1)
    if "output_router_logits" in d:
        kw["output_router_logits"] = True
    for k, v in d.items():
        if ("dropout" in k or k in NOISE or k.endswith("_pdrop")) and isinstance(v, float):
            kw[k] = 0.0
    # State-space mixers: SSM heads shrink with the width (heads x head size is the mixer's width), the state
    # and the scan's chunk shrink too
    hidden = num("hidden_size")
    for key, dim in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim")):
        if num(key) and hidden:
            kw[key] = max(1, num(key) * WIDTH["hidden_size"] // hidden)
            for groups in ("mamba_n_groups", "n_groups"):
                if num(groups):
                    kw[groups] = math.gcd(num(groups), kw[key])
            if num("mamba_d_ssm") and num(dim):
                kw["mamba_d_ssm"] = kw[key] * num(dim)
    kw.update({k: min(num(k), 16) for k in ("mamba_d_state", "state_size", "ssm_state_size", "mamba_chunk_size",
                                            "chunk_size") if num(k)})
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if num(k) is not None and num(k) >= WIDTH["vocab_size"]:
            kw[k] = 0
    depth = DEPTH
    types = d.get("layer_types")
    if with_layer_types and isinstance(types, (list, tuple)) and types:
        kinds = list(dict.fromkeys(types))
        picked = list(types[:DEPTH])
        for kind in kinds:  # every kind the default has, at least once
            if kind not in picked:
                spare = [i for i, k in enumerate(picked) if picked.count(k) > 1]
                if spare:
                    picked[spare[-1]] = kind
                else:
                    picked.append(kind)
        depth = len(picked)
        kw["layer_types"] = picked
    kw.update({k: depth for k in LAYERS if num(k) is not None})
    kw.update(EXTRA.get(model_type, {}))
    return {k: v for k, v in kw.items() if _settable(default, k)}


def tiny_config(model_type: str):
    """The tiny config: with the default's layer kinds picked for the smaller depth, or (where the config
    derives them itself, or that does not build) without them. Raises Skip when neither builds a stock model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    error = None
    for with_types in (True, False):
        try:
            config = AutoConfig.for_model(model_type, **tiny_kwargs(model_type, with_types))
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(copy.deepcopy(config))
            return config
        except Exception as e:
            error = error or e
    raise Skip(f"stock cannot build it tiny ({type(error).__name__}: {first_line(error)})") from error


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def refusal(config) -> str | None:
    """The package's refusal of `config`, from the config alone (what the trainer runs before reading any
    weight): the spec, the planner's layout on a meta model, the generic self-check. None: accepted."""
    from hf_megatrain import MegaTrainError
    from hf_megatrain.engine.layout import config_units
    from hf_megatrain.engine.selfcheck import verify
    from hf_megatrain.patcher.specs import spec_for

    try:
        spec = spec_for(config)
        config_units(config)
        if spec.generic:
            verify(spec, config)
    except MegaTrainError as e:
        return first_line(e)
    return None


def stock_model(config):
    from transformers import AutoModelForCausalLM

    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        try:
            return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn,
                                                    dtype=torch.float32).train()
        except ValueError as e:
            if "does not support an attention implementation" not in str(e):
                raise
    raise AssertionError("unreachable")


def stock_step(model, batch, nib):
    ref = copy.deepcopy(model)
    torch.manual_seed(1234)
    out = ref(**batch, num_items_in_batch=nib)
    out.loss.backward()
    return ref, out


def assert_folder_streams_in(model_type: str, model, folder: str) -> None:
    """The folder stock's save_pretrained wrote (the checkpoint's own names: transformers reverts its conversion
    mapping, e.g. Nemotron-H's `backbone.`, experts one by one) streams into the engine's store as the trainer
    reads a folder: every parameter (the master of a trained one, the compute copy of a frozen one) and every
    persistent buffer equal to `model`'s."""
    from hf_megatrain.checkpoint.loading import load_model_and_tokenizer
    from hf_megatrain.checkpoint.stream_load import engine_from_checkpoint

    skeleton, _, folder = load_model_and_tokenizer(folder)
    engine = engine_from_checkpoint(skeleton, folder, compute_dtype=torch.float32, progress=False)
    masters = dict(engine.named_master_params())
    views = {k: v for u in engine.units for k, v in engine.store.param_views(u.index).items()}
    for name, p in model.named_parameters():
        assert torch.equal(masters[name] if p.requires_grad else views[name], p.detach()), f"{model_type}: {name}"
    loaded, saved = dict(skeleton.named_buffers()), model.state_dict()
    for name, b in model.named_buffers():
        if name in saved:
            assert torch.equal(loaded[name], b), f"{model_type}: buffer {name}"


def classify(model_type: str):
    from hf_megatrain import StreamingEngine

    from transformers import AutoConfig

    try:
        why = _not_a_text_decoder(AutoConfig.for_model(model_type))
    except Exception as e:
        why = f"its default config cannot be built ({type(e).__name__}: {first_line(e)})"
    if why:
        return "skipped", why
    try:
        config = tiny_config(model_type)
    except Skip as e:
        return "skipped", str(e)
    refused = refusal(config)
    if refused is not None and "stock transformers itself fails" in refused and getattr(config, "output_router_logits", False):
        config.output_router_logits = False  # stock's aux loss fails in some families (below): compare without it
        refused = refusal(config)
    if refused is not None:
        return "refused", refused
    model = stock_model(config)
    batch = make_batch(batch=3, seq=12)  # one right-padded row
    nib = batch["labels"][..., 1:].ne(-100).sum()
    try:
        ref, out = stock_step(model, batch, nib)
    except Exception as e:
        if not getattr(config, "output_router_logits", False):
            return "skipped", f"stock cannot train it tiny ({type(e).__name__}: {first_line(e)})"
        config.output_router_logits = False  # stock's aux loss fails in some families: compare without it
        try:
            model = stock_model(config)
            ref, out = stock_step(model, batch, nib)
        except Exception as e2:
            return "skipped", f"stock cannot train it tiny ({type(e2).__name__}: {first_line(e2)})"
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)  # before the engine binds the model's parameters to its store
        assert_folder_streams_in(model_type, ref, folder)
    engine = StreamingEngine(model, compute_dtype=torch.float32, loss_chunk_tokens=7).train()
    torch.manual_seed(1234)
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert abs(float(loss) - float(out.loss)) <= 1e-5 * max(1.0, abs(float(out.loss))), \
        f"{model_type}: loss {float(loss)} against stock's {float(out.loss)}"
    grads = dict(engine.named_grads())
    trained = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert list(grads) == trained, f"{model_type}: the engine names other parameters than stock trains"
    for name in trained:
        p = ref.get_parameter(name)
        torch.testing.assert_close(grads[name], p.grad if p.grad is not None else torch.zeros_like(p),
                                   atol=1e-6, rtol=1e-5, msg=f"{model_type}: {name}")
    return "exact", None


def prefix_tuning(model_type: str):
    """PEFT's prefix tuning on the tiny model of `model_type` (its router loss off), stock peft against the engine,
    one step on a padded batch: ("exact", None, True) when the loss and the prefix encoder's gradients equal
    stock's; ("refused", line, stock_trains) when the engine refuses it in one line; ("skipped", why, None) when
    there is nothing to compare (no tiny stock model, or PEFT cannot make a prefix for it). Raises for a crash, a
    difference from stock, or an engine that trains what stock fails on."""
    from peft import PrefixTuningConfig, get_peft_model

    from hf_megatrain import MegaTrainError, StreamingEngine

    try:
        config = tiny_config(model_type)
    except Skip as e:
        return "skipped", str(e), None
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False  # its loss reads the mask PEFT lengthens (test_peft.py)
    torch.manual_seed(0)
    try:
        model = get_peft_model(stock_model(config), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    except ValueError as e:  # Mamba's config names no attention heads
        return "skipped", f"peft cannot make a prefix for it ({first_line(e)})", None
    for p in model.parameters():
        if p.requires_grad:  # away from PEFT's initial values, so that every gradient counts
            torch.nn.init.normal_(p, std=0.5)
    batch = make_batch(batch=3, seq=12)  # one right-padded row
    ref = copy.deepcopy(model)
    try:
        out = ref(**batch)
        out.loss.backward()
        stock = None
    except Exception as e:
        stock = first_line(e)
    try:
        engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    except MegaTrainError as e:
        return "refused", first_line(e), stock is None
    assert stock is None, f"{model_type}: stock peft fails ({stock}) where the engine neither refuses nor fails"
    loss = engine.forward_backward(batch)
    assert abs(float(loss) - float(out.loss)) <= 1e-5 * max(1.0, abs(float(out.loss))), \
        f"{model_type}: loss {float(loss)} against stock's {float(out.loss)}"
    grads = dict(engine.named_grads())
    expected = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert list(grads) == list(expected), f"{model_type}: the engine trains other parameters than stock"
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=f"{model_type}: {name}")
    return "exact", None, True
