"""Preflight: every mistake that can be found without the weights is refused before any is read,
in one line that says what is wrong and what to do; a missing local path never reaches the network.
The same refusals through the command, in a process of its own: tests/integration/test_cli_traps.py."""

import json
import os
import shutil
import time

import datasets
import huggingface_hub.constants
import pytest
from transformers import Trainer, default_data_collator

import hf_megatrain.checkpoint.loading as loading
import hf_megatrain.checkpoint.stream_load as stream_load
import hf_megatrain.trainer as trainer_module
from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer
from hf_megatrain.paths import looks_local
from hf_megatrain.demo import build_tokenizer
from hf_megatrain.engine.store import HostStore
from hf_megatrain import preflight
from hf_megatrain.preflight import SMALL_FILES, checkpoint_bytes, check_writable
from tests.support.tiny import make_batch, make_model

# The demo's character tokenizer (a-z, <s>, </s>, ">"): user turns end in ">", assistant turns in "</s>".
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}>{% endif %}{% endfor %}"
)
FAST = 5.0  # seconds: a refusal without the network; the hub's retries take ~25 s


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Data files are cached under tmp_path, not in the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama folder (safetensors) with a tokenizer that has a chat template."""
    folder = tmp_path_factory.mktemp("model")
    make_model("llama").save_pretrained(folder)
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def weights_read(monkeypatch):
    """Every read of model weights, in order: the real loaders still run, each call is recorded."""
    calls = []
    real_load, real_from_model = stream_load.load_into_store, HostStore.from_model.__func__
    real_pretrained = loading.AutoModelForCausalLM.from_pretrained

    def load_into_store(*a, **kw):
        calls.append("load_into_store")
        return real_load(*a, **kw)

    def from_model(cls, *a, **kw):
        calls.append("HostStore.from_model")
        return real_from_model(cls, *a, **kw)

    def from_pretrained(cls, *a, **kw):  # the LoRA base
        calls.append("from_pretrained")
        return real_pretrained(*a, **kw)

    monkeypatch.setattr(stream_load, "load_into_store", load_into_store)
    monkeypatch.setattr(HostStore, "from_model", classmethod(from_model))
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    return calls


@pytest.fixture
def online(monkeypatch):
    """As without HF_HUB_OFFLINE (conftest sets it): a lookup on the hub would now retry for ~25 s."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def args_for(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_seq_length=16, max_steps=2, per_device_train_batch_size=2,
                report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    return MegaTrainArguments(**{**base, **kw})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def text_rows(n=40):
    return [{"text": "abcdefghij"[i % 7:] + "xyz" * (i % 4)} for i in range(n)]


def refused(model, args, weights_read, match, **kw) -> str:
    """The one-line MegaTrainError the trainer raises, after checking that no weight was read."""
    with pytest.raises(MegaTrainError, match=match) as info:
        MegaTrainTrainer(model, args, **kw)
    assert weights_read == []
    message = str(info.value)
    assert "\n" not in message and message.strip() == message, message
    return message


# -- the control: a valid run reads the weights, and only after the data ------------------------------
def test_valid_run_tokenizes_before_reading_weights_and_trains(tmp_path, model_dir, weights_read, monkeypatch):
    real = trainer_module.tokenize_dataset

    def tokenize_dataset(*a, **kw):
        weights_read.append("tokenize_dataset")
        return real(*a, **kw)

    monkeypatch.setattr(trainer_module, "tokenize_dataset", tokenize_dataset)
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    trainer = MegaTrainTrainer(model_dir, args_for(tmp_path, data_path=data, eval_data_path=data))
    assert weights_read == ["tokenize_dataset", "tokenize_dataset", "load_into_store"]
    trainer.train()
    assert trainer.state.global_step == 2


def test_write_probe_leaves_nothing_and_creates_nothing(tmp_path):
    (tmp_path / "existing").mkdir()
    check_writable(tmp_path / "existing", "output_dir")
    check_writable(tmp_path / "new" / "run", "output_dir")  # probed in tmp_path, not created
    assert os.listdir(tmp_path) == ["existing"] and os.listdir(tmp_path / "existing") == []


def test_looks_local():
    for path in ["missing.jsonl", "./data", "../data", "/abs/x", "~/x", "a/b/c", "data.parquet", "m.safetensors",
                 "c:\\data"]:
        assert looks_local(path), path
    for name in ["gpt2", "org/name", "Qwen/Qwen2.5-7B", "HuggingFaceH4/ultrachat_200k", "meta-llama/Llama-3.1-8B"]:
        assert not looks_local(name), name


# -- data paths --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["data_path", "eval_data_path"])
@pytest.mark.parametrize("missing", ["missing.jsonl", "sub/dir/train", "./corpus", "{tmp}/nope/train.jsonl"])
def test_missing_local_data_fails_at_once(tmp_path, model_dir, weights_read, online, monkeypatch, field, missing):
    monkeypatch.chdir(tmp_path)
    path = missing.format(tmp=tmp_path)
    kw = {"data_path": write_jsonl(tmp_path / "ok.jsonl", text_rows()), field: path}
    start = time.perf_counter()
    message = refused(model_dir, args_for(tmp_path, **kw), weights_read, "does not exist")
    assert time.perf_counter() - start < FAST
    assert repr(path) in message and "check the path" in message


def test_unreadable_data_file(tmp_path, model_dir, weights_read):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "abc"}\n{"text": \n')
    refused(model_dir, args_for(tmp_path, data_path=str(bad)), weights_read, "could not read .*bad.jsonl")


# -- columns, chat fields, the first rows -----------------------------------------------------------
def test_wrong_columns(tmp_path, model_dir, weights_read):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"question": "abc", "answer": "cba"}] * 4)
    message = refused(model_dir, args_for(tmp_path, data_path=data), weights_read, "columns")
    assert "'question', 'answer'" in message and "text_field" in message


def test_wrong_chat_fields(tmp_path, model_dir, weights_read):
    sharegpt = [{"messages": [{"from": "human", "value": "abc"}, {"from": "gpt", "value": "cba"}]}] * 4
    data = write_jsonl(tmp_path / "chat.jsonl", sharegpt)
    refused(model_dir, args_for(tmp_path, data_path=data), weights_read, "'role', 'content'")


def test_chat_without_assistant_turns_is_all_masked(tmp_path, model_dir, weights_read):
    only_user = [{"messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": "def"}]}] * 20
    data = write_jsonl(tmp_path / "chat.jsonl", only_user)
    message = refused(model_dir, args_for(tmp_path, data_path=data), weights_read, "no row has a token to learn")
    assert "first 16 rows" in message and "-100" in message


def test_answers_beyond_max_seq_length(tmp_path, model_dir, weights_read):
    long_prompts = [{"prompt": "abcdefghijklmnopqrst", "completion": "xyz"}] * 4
    data = write_jsonl(tmp_path / "pc.jsonl", long_prompts)
    refused(model_dir, args_for(tmp_path, data_path=data, packing=False, max_seq_length=8), weights_read,
            "max_seq_length=8.*raise max_seq_length")


def test_chat_data_with_a_tokenizer_without_template(tmp_path, model_dir, weights_read):
    folder = tmp_path / "no_template"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(model_dir, name), folder)
    build_tokenizer().save_pretrained(folder)  # the same tokenizer, without chat_template
    chat = [{"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]}] * 4
    data = write_jsonl(tmp_path / "chat.jsonl", chat)
    refused(str(folder), args_for(tmp_path, data_path=data), weights_read, "no chat template")


# -- output_dir and hub_dir ---------------------------------------------------------------------------
def test_output_dir_under_a_file(tmp_path, model_dir, weights_read):
    (tmp_path / "file.txt").write_text("not a folder")
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    out = str(tmp_path / "file.txt" / "out")
    message = refused(model_dir, args_for(tmp_path, data_path=data, output_dir=out), weights_read, "is a file")
    assert f"output_dir={out!r}" in message and "choose another output_dir" in message


def test_output_dir_on_a_filesystem_that_refuses_writes(tmp_path, model_dir, weights_read):
    # sysfs refuses new files even to root, while os.access says yes: only the write probe sees it
    if not os.access("/sys", os.W_OK) or os.path.exists("/sys/megatrain-out"):
        pytest.skip("needs a sysfs that os.access calls writable")
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    refused(model_dir, args_for(tmp_path, data_path=data, output_dir="/sys/megatrain-out/run"), weights_read,
            "output_dir='/sys/megatrain-out/run' is not writable")


def test_hub_dir_checked_when_publishing(tmp_path, model_dir, weights_read, monkeypatch):
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    refused(model_dir, args_for(tmp_path, data_path=data, push_to_hub=True), weights_read, "set hub_dir=")
    (tmp_path / "file.txt").write_text("not a folder")
    refused(model_dir, args_for(tmp_path, data_path=data, push_to_hub=True, hub_dir=str(tmp_path / "file.txt/hub")),
            weights_read, "hub_dir=.* is a file")


def test_not_enough_disk_for_one_checkpoint(tmp_path, model_dir, weights_read, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(preflight, "disk_usage", lambda p: real(p)._replace(free=10 * 1024**2))  # a full disk
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    message = refused(model_dir, args_for(tmp_path, data_path=data, save_strategy="steps"), weights_read,
                      "not enough disk")
    assert "optimizer state" in message and "0.01 GiB free" in message and "save_only_model=True" in message
    message = refused(model_dir, args_for(tmp_path, data_path=data, save_strategy="no"), weights_read,
                      "not enough disk")
    assert "optimizer state" not in message and "save_only_model" not in message  # nothing to leave out


def test_output_and_hub_on_one_disk_add_up(tmp_path, model_dir, weights_read, monkeypatch):
    real = shutil.disk_usage
    # room for what either folder needs alone (64 MiB of small files and the tiny model), not for both
    monkeypatch.setattr(preflight, "disk_usage", lambda p: real(p)._replace(free=100 * 1024**2))
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    MegaTrainTrainer(model_dir, args_for(tmp_path, data_path=data))
    weights_read.clear()
    hub = str(tmp_path / "hub")
    refused(model_dir, args_for(tmp_path, data_path=data, push_to_hub=True, hub_dir=hub), weights_read,
            f"not enough disk: output_dir=.* and hub_dir={hub!r} need about 0.13 GiB")


# -- resuming ---------------------------------------------------------------------------------------
def _rows(n):
    parts = [make_batch(1, 12, seed=i, pad_rows=0) for i in range(n)]
    return datasets.Dataset.from_dict({k: [p[k][0].tolist() for p in parts] for k in parts[0]})


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run that wrote checkpoint-2 (save_dtype bfloat16, so the model files are not the master dtype)."""
    out = tmp_path_factory.mktemp("run")
    args = MegaTrainArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, save_strategy="steps",
                              save_steps=2, save_dtype="bfloat16", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=_rows(8), data_collator=default_data_collator)
    trainer.train()
    return trainer, out / "checkpoint-2"


def test_checkpoint_estimate_matches_what_is_written(saved_run):
    trainer, ckpt = saved_run
    weights, optimizer = checkpoint_bytes(trainer.model, trainer.args)
    params = sum(p.numel() for p in trainer.model.parameters())
    assert weights == 2 * params and optimizer == 12 * params
    sizes = {f: os.path.getsize(ckpt / f) for f in os.listdir(ckpt)}
    opt_files = sum(v for f, v in sizes.items() if f.startswith("megatrain_optimizer-"))
    assert 0 <= sizes["model.safetensors"] - weights < 64 * 1024  # safetensors headers
    assert 0 <= opt_files - optimizer < 64 * 1024
    assert weights + optimizer <= sum(sizes.values()) <= weights + optimizer + SMALL_FILES


def _resume_args(tmp_path, **kw):
    return MegaTrainArguments(**{**dict(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2,
                                        report_to=[], use_cpu=True, disable_tqdm=True), **kw})


def test_resume_checked_in_the_constructor(tmp_path, model_dir, weights_read):
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    missing = str(tmp_path / "out" / "checkpoint-7")
    refused(model_dir, _resume_args(tmp_path, data_path=data, resume_from_checkpoint=missing), weights_read,
            "resume_from_checkpoint=.*checkpoint-7' is not a folder")
    refused(model_dir, _resume_args(tmp_path, data_path=data, resume_from_checkpoint=model_dir), weights_read,
            "has no hf_megatrain optimizer state")


@pytest.fixture
def no_training(monkeypatch):
    """Stock Trainer.train, the training work itself, must not start."""
    started = []
    monkeypatch.setattr(Trainer, "train", lambda self, *a, **kw: started.append(True))
    return started


def test_resume_true_without_checkpoints(tmp_path, no_training):
    trainer = MegaTrainTrainer(make_model("llama"), _resume_args(tmp_path), train_dataset=_rows(4),
                               data_collator=default_data_collator)
    with pytest.raises(MegaTrainError, match="resume_from_checkpoint=True, but output_dir=.* holds no checkpoint-N"):
        trainer.train(resume_from_checkpoint=True)
    assert no_training == []


def test_incomplete_checkpoint_refused_before_training(tmp_path, saved_run, no_training):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(saved_run[1], ckpt)
    shard = next(f for f in os.listdir(ckpt) if f.startswith("megatrain_optimizer-"))
    with open(ckpt / shard, "r+b") as f:  # a save cut short
        f.truncate(100)
    trainer = MegaTrainTrainer(make_model("llama"), _resume_args(tmp_path), train_dataset=_rows(4),
                               data_collator=default_data_collator)
    with pytest.raises(MegaTrainError, match=f"{shard} has 100 bytes, the manifest says .*resume from another") as e:
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert "\n" not in str(e.value) and no_training == []
    os.remove(ckpt / shard)
    with pytest.raises(MegaTrainError, match=f"is missing {shard}"):
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert no_training == []


def test_complete_checkpoint_goes_on_to_training(tmp_path, saved_run, no_training):
    trainer = MegaTrainTrainer(make_model("llama"), _resume_args(tmp_path), train_dataset=_rows(4),
                               data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=str(saved_run[1]))
    assert no_training == [True]


# -- the model, LoRA, memory ---------------------------------------------------------------------------
def test_missing_model_fails_at_once(tmp_path, weights_read, online, monkeypatch):
    start = time.perf_counter()
    message = refused(str(tmp_path / "nowhere"), args_for(tmp_path), weights_read, "model path .* does not exist")
    assert message.endswith("check the path, or pass a hub id such as org/name.")
    # a hub id that is not cached downloads when online (tests/unit/test_hub.py); offline it is refused at once
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    refused("megatrain-tests/never-downloaded", args_for(tmp_path), weights_read,
            "not in the local HF cache .*HF_HUB_OFFLINE=1 forbids downloading it")
    assert time.perf_counter() - start < FAST


def test_lora_that_does_not_fit_the_model(tmp_path, model_dir, weights_read):
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    args = args_for(tmp_path, data_path=data, peft_config={"r": 4, "target_modules": ["no_such_proj"]})
    refused(model_dir, args, weights_read, "peft_config does not fit this llama model.*no_such_proj")


def test_lora_estimate_counts_the_adapters_peft_adds(tmp_path, model_dir, weights_read):
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    args = args_for(tmp_path, data_path=data, peft_config={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    trainer = MegaTrainTrainer(model_dir, args)
    assert weights_read == ["from_pretrained", "HostStore.from_model"]  # the base, after every check
    adapters = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert adapters == 3 * 4 * ((64 + 64) + (64 + 32))  # layers x r x (q: in + out, v: in + kv out)
    skeleton, _, _ = loading.load_model_and_tokenizer(model_dir)  # what preflight saw: no adapters yet
    assert checkpoint_bytes(skeleton, args) == checkpoint_bytes(trainer.model, args) == (4 * adapters, 12 * adapters)


def test_run_that_does_not_fit_is_refused_before_weights(tmp_path, model_dir, weights_read, monkeypatch):
    import hf_megatrain.planner.machine as machine

    monkeypatch.setattr(machine, "host_available", lambda: 1024.0**3)  # a 1 GiB machine
    data = write_jsonl(tmp_path / "train.jsonl", text_rows())
    with pytest.raises(MegaTrainError) as info:
        MegaTrainTrainer(model_dir, args_for(tmp_path, data_path=data))
    assert weights_read == []
    assert str(info.value).splitlines()[0].startswith("this run does not fit: host RAM: needs")
