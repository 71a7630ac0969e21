"""Bad input gives a clear MegaTrainError, never a traceback from deep inside torch."""

import datasets
import pytest
import torch
from transformers import MptConfig, MptForCausalLM, T5Config, T5ForConditionalGeneration

from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from tests.support.tiny import make_batch, make_model


def test_unsupported_architectures_name_the_supported_ones():
    mpt = MptForCausalLM(MptConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=50))  # its own ALiBi and mask
    with pytest.raises(MegaTrainError, match="mpt.*Supported.*llama.*mistral.*mixtral.*qwen2.*qwen3"):
        StreamingEngine(mpt)
    t5 = T5ForConditionalGeneration(T5Config(num_layers=1, d_model=32, d_ff=32, num_heads=2, vocab_size=50))
    with pytest.raises(MegaTrainError, match="t5"):
        MegaTrainTrainer(t5, MegaTrainArguments(output_dir="unused", report_to=[]))


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(fp16=True), "fp16"),
        (dict(deepspeed={"zero_optimization": {"stage": 3}}), "DeepSpeed"),
        (dict(torch_compile=True), "torch_compile"),
        (dict(optim="adamw_bnb_8bit"), "optim"),
        (dict(prefetch_depth=1), "prefetch_depth"),
    ],
)
def test_refused_options(kwargs, pattern, tmp_path):
    """Trainer's options the engine cannot honour are refused when a trainer is built (code that only parses
    arguments keeps working); malformed values of the engine's own fields already when the arguments are."""
    own = "prefetch_depth" in kwargs
    with pytest.raises(MegaTrainError, match=pattern):
        args = MegaTrainArguments(output_dir=str(tmp_path), report_to=[], **kwargs)
        assert not own, "an engine field's bad value is refused with the arguments"
        MegaTrainTrainer(make_model("llama"), args)


def test_empty_dataset(tmp_path):
    empty = datasets.Dataset.from_dict({"input_ids": [], "labels": []})
    with pytest.raises(MegaTrainError, match="empty"):
        MegaTrainTrainer(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path), report_to=[]),
                         train_dataset=empty)


def test_token_ids_outside_vocabulary():
    engine = StreamingEngine(make_model("llama"), compute_dtype=torch.float32)
    batch = make_batch()
    batch["input_ids"][0, 3] = 1000
    with pytest.raises(MegaTrainError, match="outside the model's vocabulary"):
        engine.forward_backward(batch)
    batch = make_batch()
    batch["labels"][0, 3] = -5
    with pytest.raises(MegaTrainError, match="labels"):
        engine.forward_backward(batch)


def test_missing_labels_and_bad_model_arguments(tmp_path):
    engine = StreamingEngine(make_model("llama"), compute_dtype=torch.float32)
    batch = make_batch()
    del batch["labels"]
    with pytest.raises(MegaTrainError, match="labels"):
        engine.forward_backward(batch)
    with pytest.raises(MegaTrainError, match="hub id"):
        MegaTrainTrainer(42, MegaTrainArguments(output_dir=str(tmp_path), report_to=[]))
    with pytest.raises(MegaTrainError, match="does not exist"):
        MegaTrainTrainer(str(tmp_path / "nowhere"), MegaTrainArguments(output_dir=str(tmp_path), report_to=[]))
