"""Checkpoints: HF-format round trips, streamed loading, crash-safe resume, local hub, bad files."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, MptConfig

from hf_megatrain import HostAdamW, MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from hf_megatrain.checkpoint.hf_format import save_hf_model
from hf_megatrain.checkpoint.loading import load_model_and_tokenizer
from hf_megatrain.checkpoint.stream_load import engine_from_checkpoint
from hf_megatrain.demo import build_tokenizer
from tests.support import ROOT
from tests.support.tiny import make_batch, make_model


def trained_engine(kind):
    model = make_model(kind)
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    opt = HostAdamW(engine, lr=1e-2)
    for step in range(2):
        engine.forward_backward(make_batch(seed=step))
        opt.step()
        engine.zero_grad()
    return model, engine


@pytest.mark.parametrize("kind", ["llama_tied", "mixtral"])
def test_save_round_trip_weights_and_logits(kind, tmp_path):
    model, engine = trained_engine(kind)
    save_hf_model(engine.store, model, str(tmp_path), max_shard_bytes=40_000)  # force several shards
    assert (tmp_path / "model.safetensors.index.json").exists()
    if kind == "mixtral":  # original checkpoint names, as save_pretrained writes them
        index = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in index
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    masters = dict(engine.named_master_params())
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), masters[name]), name
    batch = make_batch(seed=7)
    engine.eval()
    ours = engine(**batch).logits
    theirs = loaded(**batch).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_streamed_load_equals_from_pretrained(kind, tmp_path):
    src = make_model(kind)
    src.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="50KB")  # bf16 on disk, sharded
    skeleton, _, folder = load_model_and_tokenizer(str(tmp_path))
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    engine = engine_from_checkpoint(skeleton, folder, compute_dtype=torch.float32, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    masters = dict(engine.named_master_params())
    assert list(masters) == [n for n, _ in ref.named_parameters()]
    for name, p in ref.named_parameters():
        assert torch.equal(masters[name], p.detach()), name
    # the skeleton became a real model that views the compute copies
    assert all(p.device.type == "cpu" for p in skeleton.parameters())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("disk_dtype", [torch.float32, torch.bfloat16])
def test_streamed_load_with_resident_layers_equals_from_model(device, disk_dtype, tmp_path):
    """A folder loaded into a store whose first layers are resident (on the device), bf16 compute:
    every compute copy and master equals the store built from the loaded model."""
    make_model("llama", num_hidden_layers=4).to(disk_dtype).save_pretrained(tmp_path, max_shard_size="50KB")
    skeleton, _, folder = load_model_and_tokenizer(str(tmp_path))
    kw = dict(device=device, compute_dtype=torch.bfloat16, resident_layers=2)
    streamed = engine_from_checkpoint(skeleton, folder, progress=False, **kw)
    built = StreamingEngine(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), **kw)
    assert [u.resident for u in streamed.units] == [True, True, True, False, False, True]
    for u in streamed.units:
        for kind in ("compute", "master"):
            a, b = getattr(streamed.store, kind)[u.index], getattr(built.store, kind)[u.index]
            assert a.device == b.device and torch.equal(a.cpu(), b.cpu()), (kind, u.label)


def _run(out, *opts, check=True):
    r = subprocess.run([sys.executable, "-m", "tests.support.train_subprocess", str(out), *opts],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _losses(result):
    return [(h["step"], h["loss"], h["grad_norm"]) for h in result["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    _run(out)
    return json.load(open(out / "result.json"))


@pytest.mark.parametrize("kill", [["--kill-at-step", "7"], ["--kill-in-save", "6"]], ids=["mid-step", "mid-save"])
def test_sigkill_then_resume_equals_uninterrupted(kill, tmp_path, uninterrupted):
    r = _run(tmp_path, *kill, check=False)
    assert r.returncode == -9, r.stderr[-2000:]
    ckpts = sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint-"))
    if kill[0] == "--kill-in-save":
        assert ckpts == ["checkpoint-2", "checkpoint-4"], ckpts  # checkpoint-6 never appeared
        assert os.path.isdir(tmp_path / ".partial-checkpoint-6")
    else:
        assert ckpts == ["checkpoint-4", "checkpoint-6"], ckpts
    _run(tmp_path, "--resume")
    resumed = json.load(open(tmp_path / "result.json"))
    start = 4 if kill[0] == "--kill-in-save" else 6
    full = [x for x in _losses(uninterrupted) if x[0] > start]
    assert _losses(resumed)[-len(full):] == full  # bit for bit
    assert resumed["masters"] == uninterrupted["masters"]
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint-")) == ["checkpoint-6", "checkpoint-8"]


def test_corrupted_checkpoint_is_refused(tmp_path, uninterrupted):
    _run(tmp_path)
    ckpt = tmp_path / "checkpoint-8"
    shard = next(p for p in os.listdir(ckpt) if p.startswith("megatrain_optimizer-"))
    with open(ckpt / shard, "r+b") as f:
        f.seek(200)
        f.write(b"\x00garbage\x00")
    args = MegaTrainArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=9)
    import datasets
    data = datasets.Dataset.from_dict({k: [v[0].tolist()] * 4 for k, v in make_batch(1).items()})
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=data)
    with pytest.raises(MegaTrainError, match="hash"):
        trainer.train(resume_from_checkpoint=str(ckpt))


def _publish_env(hub):
    return dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def test_local_hub_two_revisions_load_offline(tmp_path):
    import datasets

    hub = tmp_path / "hub"
    tok = build_tokenizer()
    rows = [make_batch(1, 12, seed=i) for i in range(8)]
    data = datasets.Dataset.from_dict({k: [r[k][0].tolist() for r in rows] for k in rows[0]})
    args = MegaTrainArguments(output_dir=str(tmp_path / "out"), push_to_hub=True, hub_model_id="org/tiny",
                              hub_dir=str(hub), max_steps=2, report_to=[], use_cpu=True, save_strategy="steps",
                              save_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, disable_tqdm=True)
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=data, processing_class=tok)
    trainer.train()
    first = trainer.push_to_hub()
    first_weights = {n: t.clone() for n, t in trainer.engine.named_master_params()}
    trainer.args.max_steps = 4
    trainer.train()
    second = trainer.push_to_hub()
    assert first != second
    repo = hub / "models--org--tiny"
    assert (repo / "refs" / "main").read_text().strip() == second
    snap = repo / "snapshots" / second / "model.safetensors"
    assert snap.is_symlink() and not os.path.isabs(os.readlink(snap))
    card = (repo / "snapshots" / second / "README.md").read_text()  # the model card
    assert "hf_megatrain 0.1.0" in card and "| learning_rate | 0.01 |" in card and "| optimizer steps | 4 |" in card
    assert "| train_loss |" in card and "hf_megatrain" in card.split("---")[1]
    published = {p.name for p in (repo / "snapshots" / second).iterdir()}
    assert (tmp_path / "out" / "checkpoint-4" / "trainer_state.json").exists()  # training state in output_dir...
    assert not any(n.startswith(("checkpoint-", "optimizer", "megatrain_", "trainer_state", "rng_state", "scheduler"))
                   for n in published), published  # ...but not in the published revision

    code = f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
new = AutoModelForCausalLM.from_pretrained("org/tiny", dtype=torch.float32)
old = AutoModelForCausalLM.from_pretrained("org/tiny", revision="{first}", dtype=torch.float32)
tok = AutoTokenizer.from_pretrained("org/tiny")
print(json.dumps({{"new": {{n: p.sum().item() for n, p in new.named_parameters()}},
                  "old": {{n: p.sum().item() for n, p in old.named_parameters()}}, "vocab": len(tok)}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_publish_env(hub))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["vocab"] == len(tok)
    latest = dict(trainer.engine.named_master_params())
    for n in latest:
        assert abs(got["new"][n] - latest[n].sum().item()) < 1e-3
        assert abs(got["old"][n] - first_weights[n].sum().item()) < 1e-3


def test_push_without_hub_dir_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    args = MegaTrainArguments(output_dir=str(tmp_path), push_to_hub=True, hub_model_id="org/x", report_to=[],
                              use_cpu=True)
    with pytest.raises(MegaTrainError, match="never uploads"):
        MegaTrainTrainer(make_model("llama"), args)


# -- bad files ---------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    make_model("llama").save_pretrained(tmp_path, max_shard_size="60KB")
    return tmp_path


def _shards(folder):
    return sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))


def _load(folder):
    skeleton, _, path = load_model_and_tokenizer(str(folder))
    return engine_from_checkpoint(skeleton, path, compute_dtype=torch.float32, progress=False)


def test_truncated_shard(saved):
    shard = saved / _shards(saved)[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(MegaTrainError, match=f"{shard.name}.*truncated.*tensor"):
        _load(saved)


def test_corrupted_header(saved):
    shard = saved / _shards(saved)[0]
    data = bytearray(shard.read_bytes())
    data[10:20] = b"\xff" * 10
    shard.write_bytes(bytes(data))
    with pytest.raises(MegaTrainError, match=shard.name):
        _load(saved)


def test_missing_tensor(saved):
    from safetensors.torch import load_file, save_file

    shard = saved / _shards(saved)[0]
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(MegaTrainError, match="lacks"):
        _load(saved)


def test_shape_mismatch(saved):
    from safetensors.torch import load_file, save_file

    shard = saved / _shards(saved)[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 5)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(MegaTrainError, match=f"{name}.*shape"):
        _load(saved)


def test_unsupported_architecture_folder(tmp_path):
    MptConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=50).save_pretrained(tmp_path)
    with pytest.raises(MegaTrainError, match="mpt.*Supported"):
        MegaTrainTrainer(str(tmp_path), MegaTrainArguments(output_dir=str(tmp_path / "o"), report_to=[]))
