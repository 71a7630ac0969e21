"""The zoo (issue 35): every model type of the installed transformers' causal-LM mapping, built tiny from its
config defaults and trained one step through the engine against stock autograd on the CPU in fp32
(tests/support/zoo.py). Each type is its own test: a crash (any exception that is not the package's
MegaTrainError refusal, made from the config before a weight exists) or a loss or gradient that differs
fails it, and so does a type whose class is not the one this table expects (a regression from exact to
refused, or a refusal that became exact: update the table). A type the table does not know (a newer
transformers) must only not crash. About a minute on 2 cores."""

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tests.support.zoo import classify, prefix_tuning

EXACT = set("""
afmoe apertus apertus1p5_text arcee aria_text axk1 axk2 bamba biogpt bitnet bloom codegen cohere cohere2 cohere2_moe
ctrl cwm deepseek_v2 deepseek_v3 deepseek_v32 diffllama ernie4_5 ernie4_5_moe exaone exaone4 exaone_moe falcon
falcon_h1 falcon_mamba flex_olmo flint gemma gemma2 gemma3_text gemma3n_text gemma4_text gemma4_unified_text glm glm4
glm4_moe glm4_moe_lite glm_moe_dsa gpt-sw3 gpt2
gpt_bigcode gpt_neo gpt_neox gpt_neox_japanese gpt_oss gptj granite granite_swa granitemoe granitemoe_swa
granitemoehybrid granitemoeshared
helium hunyuan_v1_dense hunyuan_v1_moe hy_v3 hyperclovax inkling_text internlm3 iquestcoder jais2 jamba jetmoe
kimi_linear kolibri1 laguna lfm2 lfm2_moe llama llama4_text longcat_flash mamba mamba2 mellum mimo_v2_flash minicpm3 minicpm5_moe
minimax minimax_m2 minimax_m3_vl_text ministral ministral3 mistral mixtral nanochat nemotron nemotron_h olmo olmo2
olmo3 olmo_hybrid olmoe opt param2moe persimmon phi phi3 phimoe qwen2 qwen2_moe qwen3 qwen3_5_moe_text qwen3_5_text
qwen3_moe qwen3_next sarvam_mla sarvam_moe seed_oss smollm3 solar_open stablelm starcoder2 vaultgemma xglm youtu
""".split())
# Refused from the config with a reason: encoder models, positions made outside the layers in a way the engine does
# not repeat (TrOCR's embedding norm after its positions, MPT's ALiBi and bool mask, OpenAI GPT without a final
# norm), layers called with more than the hidden states (Zamba's shared blocks),
# families whose self-check differs from stock. Absolute positions at the embedding (GPT-2 and the others with
# learned tables, XGLM's and CTRL's sinusoids) and BLOOM's ALiBi train through the generic spec
# (patcher/specs.py _embedding_parts).
# Hybrid stacks (linear attention, gated delta nets, Mamba/Mamba-2, short conv beside or instead of attention) train
# through the generic spec, which reads what each layer gets (its kind's mask, rotary embeddings or none) from the
# base model's forward (patcher/specs.py _layer_plan). MoE families outside the registry train with their router
# loss (output_router_logits is on in the zoo): the generic spec takes it from the installed transformers
# (patcher/specs.py _router_loss); where stock itself fails a training step with it on, both compare without it.
# DeepSeek-V3.2's sparse attention (and AXK2, built on it) makes its mask with allow_is_causal_skip=False, which
# the generic spec repeats (patcher/specs.py _mask_extras).
# Inkling picks each layer's mask by a choice on its layer_types (`attention_type = ... if ... else ...`), which
# the generic spec reads (_kind_by_attr's "choice"), norms its embeddings (embed_norm) and divides the last
# hidden state by its µP width multiplier before lm_head (spec.logits).
# NanoChat applies its weightless final norm to the embeddings too: the embedding unit applies a copy (embed_norm).
# Gemma 3n and Gemma 4 text (registered specs): per-layer embeddings as a unit of their own, KV sharing across their
# last layers (the tiny configs share it, tests/support/zoo.py EXTRA), Gemma 4's per-layer head_dim, Gemma 3n's AltUp.
# LongCat-Flash's layer list is half as long as its num_hidden_layers says (two sublayers a layer): one unit per module
# of the list (ArchSpec.depth, the config attribute the base model builds it from).
# GraniteMoE-SWA and Granite-SWA keep a second ModuleList beside their layers: rotary modules, one per rotary base of
# config.layer_rope_theta (no parameters), each layer handed its own base's cos/sin or none (0: NoPE); the generic
# spec reads that choice from the forward (ArchSpec.rotary_list, layer input "rotary_by").
# GLM-5 (glm_moe_dsa) carries its indexer's top-k from each layer to the next (ArchSpec.carried, engine/carried.py).
REFUSED = set("""
bailing_hybrid beam bert bert-generation big_bird camembert cpmant data2vec-text deepseek_v4 dory dots3_note_text
electra ergo ernie hrm_text
hy_v4 inkling2_loop_text inkling2_text lara_mini lfm3 megatron-bert modernbert-decoder mpt openai-gpt
qwen4_exp_text recurrent_gemma reformer rembert roberta roberta-prelayernorm roc_bert roformer rwkv trocr xlm
xlm-roberta xlm-roberta-xl xlnet xlstm xmod zamba zamba2 zaya
""".split())
# Not compared: encoder-decoder, vision/audio towers and other composites (their text models are tried by
# themselves), and configs whose own defaults do not build a stock model (dbrx, dots1, cohere_compass_text,
# musicgen, kolibri1_1), so there is nothing to compare with.
SKIPPED = set("""
bart bigbird_pegasus blenderbot blenderbot-small blt cohere_compass_text dbrx dots1 dots3_note emu3 fuyu gemma3
gemma3n gemma4 gemma4_assistant gemma4_unified gemma4_unified_assistant git got_ocr2 kolibri1_1 llama4 marian
mbart mllama moshi moss_transcribe_diarize musicgen musicgen_melody mvp pegasus phi4_multimodal plbart
prophetnet qwen3_5 qwen3_5_moe qwen4_exp whisper
""".split())
# Types whose class depends on the transformers version: (up to 5.17, later).
# Doge: exact up to 5.17 (stock's router loss fails there, so both compare without it); on 5.25 the self-check
# finds its loss differs from stock's and refuses it.
BY_VERSION = {"doge": ("exact", "refused")}
PINNED = Version(transformers.__version__) < Version("5.18")


def expected(model_type: str) -> str | None:
    if model_type in BY_VERSION:
        return BY_VERSION[model_type][0 if PINNED else 1]
    for cls, names in (("exact", EXACT), ("refused", REFUSED), ("skipped", SKIPPED)):
        if model_type in names:
            return cls
    return None


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: their ops are too small to split across threads (tests/unit/conftest.py says why)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_tables_do_not_overlap():
    assert not (EXACT & REFUSED or EXACT & SKIPPED or REFUSED & SKIPPED or set(BY_VERSION) & (EXACT | REFUSED | SKIPPED))


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_zoo(model_type):
    cls, reason = classify(model_type)  # raises on a crash or a difference from stock
    if cls == "refused":
        assert reason and "\n" not in reason, "a refusal is one line with its reason"
    want = expected(model_type)
    if want is None:
        pytest.skip(f"{model_type} is not in the zoo's table (a newer transformers): {cls}"
                    + (f" ({reason})" if reason else ""))
    assert cls == want, f"{model_type}: {cls} where the table expects {want}" + (f": {reason}" if reason else "")


# Prefix tuning (PEFT's, engine/prompts.py) over the exact families: equal to stock peft, or refused in one line
# where stock peft fails too, but for these, which stock trains and the engine refuses: PEFT cuts Gemma 4's prefix
# to each layer's width and skips the layers that share keys and values (Gemma 3n's too).
PREFIX_REFUSED_STOCK_TRAINS = {"gemma3n_text", "gemma4_text", "gemma4_unified_text"}


@pytest.mark.parametrize("model_type", sorted(EXACT | {k for k, v in BY_VERSION.items() if v[0 if PINNED else 1] == "exact"}))
def test_zoo_prefix_tuning(model_type):
    cls, note, stock_trains = prefix_tuning(model_type)  # raises on a crash or a difference from stock
    if cls == "skipped":
        pytest.skip(note)
    if cls == "refused":
        assert "\n" not in note, "a refusal is one line with its reason"
        assert stock_trains == (model_type in PREFIX_REFUSED_STOCK_TRAINS), \
            f"{model_type}: refused ({note}) where stock peft {'trains' if stock_trains else 'fails'}"
