"""Tiny random models and batches shared by the tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 99
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attention_dropout=0.0,
)


def make_config(kind: str):
    if kind == "llama":
        return LlamaConfig(**COMMON, tie_word_embeddings=False)
    if kind == "llama_tied":
        return LlamaConfig(**COMMON, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**COMMON, sliding_window=5)
    if kind == "qwen2":
        cfg = dict(COMMON, num_hidden_layers=4)
        return Qwen2Config(**cfg, use_sliding_window=True, sliding_window=5, max_window_layers=2,
                           layer_types=["full_attention", "full_attention", "sliding_attention", "sliding_attention"])
    if kind == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)
    if kind == "mixtral":
        return MixtralConfig(**dict(COMMON, intermediate_size=64), num_local_experts=4, num_experts_per_tok=2,
                             output_router_logits=True, router_aux_loss_coef=0.05, router_jitter_noise=0.0)
    raise KeyError(kind)


# The families beyond the six above, each as transformers' own tests make them tiny: hidden 64, 3 layers,
# MoE intermediate 64. Values that are 1.0 by default are set otherwise, so that a multiplier the engine
# forgot would show (Granite's embedding/residual/attention multipliers and logits scaling, Cohere's
# logit scale, Gemma 2's soft-capping), and Qwen2-MoE has a dense layer among its sparse ones.
# EAGER_ONLY: families whose stock model refuses sdpa (gpt-oss's attention sinks).
EAGER_ONLY = {"gpt_oss"}
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)
FAMILIES = {
    # a sliding window shorter than the test rows where the family has one; 4 layers for SmolLM3, whose
    # every fourth layer has no RoPE
    "phi3": dict(sliding_window=8), "olmo2": dict(), "glm4": dict(), "smollm3": dict(num_hidden_layers=4),
    "starcoder2": dict(sliding_window=8), "stablelm": dict(),
    "helium": dict(head_dim=16), "exaone4": dict(),
    "ministral": dict(head_dim=16, sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"]),
    "gemma": dict(head_dim=16), "gemma2": dict(head_dim=16, final_logit_softcapping=2.0),
    "gemma3_text": dict(head_dim=16, sliding_window=4, final_logit_softcapping=2.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "granite": dict(embedding_multiplier=3.0, logits_scaling=2.5, residual_multiplier=0.7, attention_multiplier=0.2),
    "cohere": dict(logit_scale=0.5),
    "qwen2_moe": dict(MOE, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=4,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(MOE, moe_intermediate_size=64, num_experts=4, head_dim=16, sliding_window=8),
    "olmoe": dict(MOE, num_experts=4, intermediate_size=64),
    "phimoe": dict(MOE, num_local_experts=4, intermediate_size=64, sliding_window=8),
    "gpt_oss": dict(MOE, num_local_experts=4, intermediate_size=64, head_dim=16, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # output_router_logits=False: stock GraniteMoeForCausalLM fails with it on in transformers 5.17
    # ("'int' object has no attribute 'to'" where it adds the aux loss), so there is nothing to compare to.
    "granitemoe": dict(MOE, num_local_experts=4, intermediate_size=64, embedding_multiplier=3.0, logits_scaling=2.5,
                       output_router_logits=False),
}

CLASSES = {
    "llama": LlamaForCausalLM,
    "llama_tied": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": MixtralForCausalLM,
}
KINDS = list(CLASSES)


def make_model(kind: str, seed: int = 0, attn: str | None = None, **overrides):
    """A tiny random model of `kind`: one of KINDS, or a model type of FAMILIES. attn: the attention
    implementation; None: sdpa, or eager for a family whose stock class refuses sdpa in the installed
    transformers (Gemma 2 from 5.25 on, gpt-oss). An explicit attn that stock refuses raises its ValueError."""
    torch.manual_seed(seed)
    if kind in FAMILIES:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(kind, **{**COMMON, **FAMILIES[kind]})
        cls = AutoModelForCausalLM.from_config
    else:
        cfg = make_config(kind)
        cls = CLASSES[kind]._from_config
    for k, v in overrides.items():
        setattr(cfg, k, v)
    if attn is None:
        attn = "eager" if kind in EAGER_ONLY else "sdpa"
        try:
            model = cls(cfg, attn_implementation=attn, dtype=torch.float32)
        except ValueError as e:
            if not refuses_sdpa(e):
                raise
            torch.manual_seed(seed)
            model = cls(cfg, attn_implementation="eager", dtype=torch.float32)
        model.train()
        return model
    model = cls(cfg, attn_implementation=attn, dtype=torch.float32)
    model.train()
    return model


def refuses_sdpa(error: Exception) -> bool:
    """Whether `error` is transformers refusing an attention implementation for a model class."""
    return "does not support an attention implementation" in str(error)


def make_batch(batch: int = 3, seq: int = 12, seed: int = 1, pad_rows: int = 1):
    """Random tokens; the last `pad_rows` rows are right-padded with labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for r in range(batch - pad_rows, batch):
        mask[r, seq // 2 :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def make_rows(n: int, seed: int = 0):
    """A datasets.Dataset of `n` one-row batches of 12 tokens (make_batch; every third right-padded, labels
    -100 there), for trainers."""
    import datasets

    parts = [make_batch(1, 12, seed=seed + i, pad_rows=int(i % 3 == 0)) for i in range(n)]
    return datasets.Dataset.from_dict({k: [p[k][0].tolist() for p in parts] for k in parts[0]})


def make_packed_batch():
    """Two rows of 40: three documents (20 + 12 + 8 tokens); two documents (18 + 12) and 10 of
    right padding. Labels -100 at each document's first token (as the collator packs them)."""
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))
    docs = [[(0, 20), (20, 32), (32, 40)], [(0, 18), (18, 30)]]
    pos = torch.zeros(2, 40, dtype=torch.long)
    labels = ids.clone()
    for r, spans in enumerate(docs):
        for s, e in spans:
            pos[r, s:e] = torch.arange(e - s)
            labels[r, s] = -100
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0
    ids[1, 30:] = 0
    labels[1, 30:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": pos}, docs


# PEFT's prompt learning that the engine trains (engine/prompts.py): name -> keyword arguments of its config
PROMPT_METHODS = {
    "prompt_tuning": ("PromptTuningConfig", {}),
    "p_tuning_mlp": ("PromptEncoderConfig", {"encoder_hidden_size": 32}),
    "p_tuning_lstm": ("PromptEncoderConfig", {"encoder_hidden_size": 32, "encoder_reparameterization_type": "LSTM"}),
}


# prefix tuning: every layer's keys and values learned (prefix_projection: through an MLP)
PREFIX_METHODS = {
    "prefix_tuning": ("PrefixTuningConfig", {}),
    "prefix_tuning_mlp": ("PrefixTuningConfig", {"prefix_projection": True, "encoder_hidden_size": 32}),
}


def make_prompted(kind: str, method: str, seed: int = 0, adapter_seed: int | None = None, virtual_tokens: int = 5):
    """A tiny model of `kind` (or GPT-2, whose absolute positions count the virtual tokens too) under a PEFT
    prompt-learning method of PROMPT_METHODS or PREFIX_METHODS; the prompt encoder drawn from `adapter_seed`
    (default `seed`)."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    if kind == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        model = make_model(kind, seed=seed)
    name, kw = {**PROMPT_METHODS, **PREFIX_METHODS}[method]
    torch.manual_seed(seed if adapter_seed is None else adapter_seed)
    config = getattr(peft, name)(task_type="CAUSAL_LM", num_virtual_tokens=virtual_tokens, **kw)
    return peft.get_peft_model(model, config)
