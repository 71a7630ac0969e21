"""Configs of public model shapes, for the estimator, the benchmarks and the notebooks (no weights)."""

# Each shape names its config by model_type: importing every config class up front (Gemma2's alone
# pulls in transformers' generation code) cost `hf-megatrain estimate` about 3 s before it planned anything.

SHAPES = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       rope_theta=1000000.0),
    "qwen2.5-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
                        rope_theta=1000000.0),
    "llama-2-13b": dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, vocab_size=32000, tie_word_embeddings=False,
                        rope_theta=10000.0),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0),
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                          rope_theta=500000.0),
    "qwen2.5-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
                        rope_theta=1000000.0),
    # the largest dense shape the H200 box (128 GiB host) trains without clipping (issue 21): Llama-style, 18.3 B
    "dense-18b": dict(model_type="llama", hidden_size=6144, intermediate_size=16384, num_hidden_layers=46,
                      num_attention_heads=48, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
                      rope_theta=500000.0),
    # a 120B-class dense shape (Llama-style, 96 layers of width 10240)
    "dense-120b": dict(model_type="llama", hidden_size=10240, intermediate_size=32768, num_hidden_layers=96,
                       num_attention_heads=80, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                       rope_theta=500000.0),
    "gemma-2-9b": dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                       sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    # mixtures of experts (parameter counts are totals; the active share is what a token computes with)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False,
                          rope_theta=1000000.0),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, rope_theta=1000000.0),
    "mixtral-8x22b": dict(model_type="mixtral", hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                          num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                          vocab_size=32768, rope_theta=1000000.0),
    # DeepSeek-V3's width (hidden 7168, MLA with its ranks and head dims, experts of 2048, top-8 in 4 of 8 groups,
    # one shared expert, vocabulary 129280) with 32 routed experts instead of 256 and the first layer dense: one
    # V3 MoE layer (11.3 B) is more than stock Trainer holds on one card, so the issue-35 rows truncate the
    # experts as well as the depth
    "deepseek-v3-width": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                              moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                              num_key_value_heads=128, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=8,
                              n_group=8, topk_group=4, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536,
                              qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
                              tie_word_embeddings=False),
    # the defaults of transformers' Qwen3.5 text config (gated delta-net layers, every fourth full attention)
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                       vocab_size=248320, tie_word_embeddings=False),
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, vocab_size=201088, sliding_window=128),
}


def shape_fields(shape: str, layers: int | None = None, max_positions: int = 131072) -> dict:
    """Every field make_config gives the shape's config (model_type first), as plain data."""
    if shape not in SHAPES:
        from .errors import MegaTrainError

        raise MegaTrainError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    spec = dict(SHAPES[shape], max_position_embeddings=max_positions, attention_dropout=0.0)
    if layers:
        spec["num_hidden_layers"] = layers
    return spec


def make_config(shape: str, layers: int | None = None, max_positions: int = 131072):
    spec = shape_fields(shape, layers, max_positions)
    from transformers import AutoConfig

    return AutoConfig.for_model(spec.pop("model_type"), **spec)
