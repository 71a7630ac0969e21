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

from tests.support.zoo import classify

EXACT = set("""
afmoe apertus apertus1p5_text arcee aria_text axk1 bitnet cohere cohere2 cohere2_moe cwm deepseek_v2 deepseek_v3
diffllama ernie4_5 ernie4_5_moe exaone exaone4 exaone_moe falcon flex_olmo flint gemma gemma2 gemma3_text glm
glm4 glm4_moe glm4_moe_lite gpt_neox gpt_neox_japanese gpt_oss granite granitemoe helium hunyuan_v1_dense
hunyuan_v1_moe hy_v3 hyperclovax internlm3 iquestcoder jais2 jetmoe kolibri1 laguna lfm2 llama llama4_text
mellum mimo_v2_flash minicpm3 minicpm5_moe minimax_m2 minimax_m3_vl_text ministral ministral3 mistral mixtral
nemotron olmo olmo2 olmo3 olmoe param2moe persimmon phi phi3 phimoe qwen2 qwen2_moe qwen3 qwen3_moe sarvam_mla
sarvam_moe seed_oss smollm3 solar_open stablelm starcoder2 vaultgemma youtu
""".split())
# Refused from the config with a reason: encoder models, hybrid and state-space layers, absolute or ALiBi
# positions (no rotary module), per-layer embeddings or configs, families whose self-check differs from stock.
# MoE families outside the registry train with their router loss (output_router_logits is on in the zoo): the
# generic spec takes it from the installed transformers (patcher/specs.py _router_loss).
REFUSED = set("""
axk2 bailing_hybrid bamba beam bert bert-generation big_bird biogpt bloom camembert codegen cpmant ctrl
data2vec-text deepseek_v32 deepseek_v4 doge dory dots3_note_text electra ergo ernie falcon_h1 falcon_mamba
gemma3n_text gemma4_text gemma4_unified_text glm_moe_dsa gpt-sw3 gpt2 gpt_bigcode gpt_neo gptj granite_swa
granitemoe_swa granitemoehybrid hrm_text hy_v4 inkling2_loop_text inkling2_text inkling_text jamba kimi_linear
lara_mini lfm2_moe lfm3 longcat_flash mamba mamba2 megatron-bert minimax modernbert-decoder mpt nanochat
nemotron_h olmo_hybrid openai-gpt opt qwen3_5_moe_text qwen3_5_text qwen3_next qwen4_exp_text recurrent_gemma
reformer rembert roberta roberta-prelayernorm roc_bert roformer rwkv trocr xglm xlm xlm-roberta xlm-roberta-xl
xlnet xlstm xmod zamba zamba2 zaya
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
# GraniteMoE-shared: stock itself fails a training step of the 5.17 copy; on 5.25 the generic spec trains it with
# its router loss, embedding multiplier and logits scaling.
BY_VERSION = {"granitemoeshared": ("refused", "exact")}
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
