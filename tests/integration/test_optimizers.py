"""Trainer's other optimizers (sgd, adagrad, rmsprop, adafactor) on the host: MegaTrainTrainer against stock
Trainer with the same `optim` and `optim_args` (fp32, CPU, clipping, GA 2), save and resume, the refusals, and
one through the CLI."""

import contextlib
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
from hf_megatrain.checkpoint.manifest import write_manifest
from hf_megatrain.engine.host_optim import HostParamOptimizer
from hf_megatrain.errors import MegaTrainError
from tests.support.tiny import make_model, make_rows as rows

COMMON = dict(
    per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5, warmup_steps=1,
    lr_scheduler_type="linear", weight_decay=0.1, learning_rate=1e-2, logging_steps=1, save_strategy="no",
    report_to=[], seed=0, use_cpu=True, max_steps=4, dataloader_num_workers=0, disable_tqdm=True,
)
OPTIMS = {  # optim -> optim_args (Trainer's own parsing)
    "sgd": "momentum=0.9,nesterov=True,dampening=0.0",
    "adagrad": "lr_decay=0.01,eps=1e-8",
    "rmsprop": "momentum=0.5,alpha=0.9,centered=True,eps=1e-4",
    "adafactor": None,
}
KEYS = ("loss", "grad_norm", "learning_rate")


def logs(trainer):
    return [{k: h[k] for k in KEYS if k in h} for h in trainer.state.log_history if "loss" in h]


def assert_same_logs(a, b, tol=1e-6):
    """Losses, grad norms and learning rates of two runs' logs, step by step, to `tol` relative."""
    assert len(a) == len(b) == COMMON["max_steps"]
    for x, y in zip(a, b):
        for k in KEYS:
            if k in x:
                assert abs(x[k] - y[k]) <= tol * max(1.0, abs(x[k])), (k, x, y)


def assert_same_run(stock, mega, ref, tol=1e-6, trained=None):
    """Stock's and the engine's logs, and the engine's masters against stock's final weights (`trained`: those
    weights by the engine's names, default every parameter of `ref`), all to `tol` (on the GPU: the two runs'
    kernels differ, so fp32 tolerance)."""
    assert_same_logs(logs(stock), logs(mega), tol)
    masters = dict(mega.engine.named_master_params())
    trained = trained if trained is not None else {n: p.detach() for n, p in ref.named_parameters()}
    for name, p in trained.items():
        torch.testing.assert_close(masters[name].cpu(), p.cpu(), atol=tol, rtol=0 if tol <= 1e-6 else 10 * tol,
                                   msg=name)


def stock_and_mega(model, tmp_path, kw, **mega_kw):
    """Stock Trainer trained on a copy of `model` (its copy is returned as `ref`), and a MegaTrainTrainer over
    `model` with the same arguments plus the engine's `mega_kw`, built, not yet trained."""
    train = rows(16, 0)
    ref = copy.deepcopy(model)
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "stock"), **kw),
                    train_dataset=train, data_collator=default_data_collator)
    stock.train()
    mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path / "mega"), **kw, **mega_kw),
                            train_dataset=train, data_collator=default_data_collator)
    return stock, mega, ref


@contextlib.contextmanager
def no_tf32():
    """fp32 matmuls on the GPU really fp32, for both runs."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("optim", list(OPTIMS))
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
def test_matches_stock(kind, optim, tmp_path):
    stock, mega, ref = stock_and_mega(make_model(kind), tmp_path, dict(COMMON, optim=optim, optim_args=OPTIMS[optim]))
    mega.train()
    assert mega.host_optimizer.stock_cls is type(stock.optimizer.optimizer)  # the very class stock built
    assert_same_run(stock, mega, ref)


def in_shared_buffers(store):
    """Whether a unit's gradient (None once gone) is a view of transient_grads' shared buffers, not its own."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in store._grad_buffers]
    return lambda g: g is None or any(lo <= g.data_ptr() < hi for lo, hi in spans)


TRANSIENT = dict(transient_grads="true", background_host_jobs=True, layer_major_accumulation="true")


@pytest.mark.parametrize("optim", list(OPTIMS))
@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
def test_transient_grads_match_stock(kind, optim, tmp_path):
    """transient_grads: no streamed unit keeps a gradient of its own; each step first measures the global norm
    (a norm pass), then the backward steps each unit's stock instance on the host worker as its gradient lands
    in a shared buffer, clipped by that norm (GA 2 through each layer together, as transient_grads needs).
    Losses, grad norms (the norm pass's) and final masters are stock Trainer's."""
    stock, mega, ref = stock_and_mega(make_model(kind), tmp_path, dict(COMMON, optim=optim, optim_args=OPTIMS[optim]),
                                      **TRANSIENT)
    passes = []
    norm_pass = mega.engine.gradient_norm
    mega.engine.gradient_norm = lambda *a, **k: passes.append(1) or norm_pass(*a, **k)
    mega.train()
    store = mega.engine.store
    assert store.transient and len(store._grad_buffers) == 3 and all(map(in_shared_buffers(store), store.grad))
    assert len(passes) == COMMON["max_steps"]  # one norm pass a step: clipping was exact
    assert min(h["grad_norm"] for h in logs(stock)) > COMMON["max_grad_norm"]  # and active at every step
    assert_same_run(stock, mega, ref)


@pytest.mark.parametrize("optim", ["sgd", "adafactor"])
def test_transient_grads_without_clipping_match_stock(optim, tmp_path):
    """Without clipping no norm pass runs: each unit steps as its gradient lands, on Mixtral with a resident
    layer (on the CPU its gradient is in the shared host buffers too)."""
    kw = dict(COMMON, optim=optim, optim_args=OPTIMS[optim], max_grad_norm=0.0)
    stock, mega, ref = stock_and_mega(make_model("mixtral"), tmp_path, kw, gpu_resident_layers="1", **TRANSIENT)
    mega.engine.gradient_norm = None  # never called without clipping
    mega.train()
    assert mega.engine.store.transient and sum(u.resident and u.kind == "layer" for u in mega.engine.units) == 1
    assert_same_run(stock, mega, ref)


@pytest.mark.parametrize("optim", ["adagrad", "adafactor"])
def test_lora_with_transient_grads_matches_stock(optim, tmp_path):
    """LoRA: the units train only their adapters, which the stock instance steps during the backward from the
    shared buffers (clipping through the norm pass, GA 2 together), as stock Trainer steps the PEFT model."""
    from peft import LoraConfig, get_peft_model

    kw = dict(COMMON, optim=optim, optim_args=OPTIMS[optim], max_grad_norm=0.1)  # adapters' norms are smaller
    torch.manual_seed(0)
    model = get_peft_model(make_model("llama_tied"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                 target_modules=["q_proj", "v_proj", "down_proj"],
                                                                 init_lora_weights=False))
    stock, mega, ref = stock_and_mega(model, tmp_path, kw, **TRANSIENT)
    mega.train()
    assert mega.engine.store.transient
    assert min(h["grad_norm"] for h in logs(stock)) > kw["max_grad_norm"]  # clipping active at every step
    trained = {n.removeprefix("base_model.model."): p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    assert trained and set(trained) == set(dict(mega.engine.named_master_params())) and all("lora_" in n for n in trained)
    assert_same_run(stock, mega, ref, trained=trained)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("optim", list(OPTIMS))
@pytest.mark.parametrize("transient,clip", [(True, 0.5), (True, 0.0), (False, 0.0), (False, 0.5)])
def test_on_the_cuda_path_matches_stock(optim, transient, clip, tmp_path, monkeypatch):
    """On the GPU in fp32 (TF32 off), one resident layer and the rest streamed, GA 2 through each layer together.
    Where the step policy steps during the backward (without clipping, or with transient_grads after a norm
    pass), each unit's stock instance steps as its gradient is final: the resident layer's on the compute stream
    (with transient_grads from the one shared device buffer, which the next layer's backward then overwrites),
    the streamed ones on the host worker (with transient_grads from the shared pinned buffers); with clipping
    and kept gradients, all after the backward (the resident one on the device). Losses, grad norms and final
    weights against stock Trainer on the GPU, to fp32 tolerance."""
    kw = dict(COMMON, optim=optim, optim_args=OPTIMS[optim], use_cpu=False, max_grad_norm=clip)
    with no_tf32():
        stock, mega, ref = stock_and_mega(make_model("llama_tied"), tmp_path, kw, compute_dtype="float32",
                                          gpu_resident_layers="1", layer_major_accumulation="true",
                                          transient_grads=str(transient).lower())
        armed = []
        arm = HostParamOptimizer.step_during_backward
        monkeypatch.setattr(HostParamOptimizer, "step_during_backward",
                            lambda self, *a, **k: armed.append(arm(self, *a, **k)) or armed[-1])
        mega.train()
    during = transient or not clip
    assert armed == [True] * COMMON["max_steps"] if during else armed == []  # where each step ran
    assert mega.engine.store.transient == transient
    assert sum(u.resident and u.kind == "layer" for u in mega.engine.units) == 1
    if clip:
        assert min(h["grad_norm"] for h in logs(stock)) > clip  # clipping active at every step
    assert_same_run(stock, mega, ref, tol=1e-5)


def gradients_kept_apart_match_stock(optim, tmp_path, monkeypatch, cuda):
    """gpu_grad_layers=1 beside one resident layer, clipping at every step, GA 2 through each layer together:
    the last streamed layer keeps its fp32 gradient on the device; each host step clips it there, brings it
    over tile by tile through the two pinned landing tiles (1,024 elements: dozens per layer, both reused; on
    a GPU on the optimizer's copy stream) and steps each tile, as it lands, as a piece of the stock class.
    Losses, grad norms and final weights are stock Trainer's."""
    import hf_megatrain.engine.optimizer as adamw_module

    monkeypatch.setattr(adamw_module, "LANDING_TILE", 1 << 10)
    landed = []
    tiles = HostParamOptimizer._landed_tiles
    monkeypatch.setattr(HostParamOptimizer, "_landed_tiles",
                        lambda self, index, spans, clip: (landed.append(len(spans)), tiles(self, index, spans, clip))[1])
    kw = dict(COMMON, optim=optim, optim_args=OPTIMS[optim], use_cpu=not cuda)
    with no_tf32():
        stock, mega, ref = stock_and_mega(make_model("llama_tied"), tmp_path, kw, compute_dtype="float32",
                                          gpu_resident_layers="1", gpu_grad_layers="1",
                                          layer_major_accumulation="true")
        mega.train()
    kept = [u for u in mega.engine.units if u.grad_on_gpu]
    assert len(kept) == 1 and kept[0].kind == "layer" and not kept[0].resident
    assert mega.engine.store.grad[kept[0].index].device.type == ("cuda" if cuda else "cpu")
    assert len(landed) == COMMON["max_steps"] and min(landed) > 8  # every step, dozens of tiles
    assert min(h["grad_norm"] for h in logs(stock)) > COMMON["max_grad_norm"]  # clipping active at every step
    assert_same_run(stock, mega, ref, tol=1e-5 if cuda else 1e-6)


@pytest.mark.parametrize("optim", ["sgd", "adagrad", "rmsprop"])
def test_gradients_kept_apart_match_stock(optim, tmp_path, monkeypatch):
    """gpu_grad_layers on the CPU, where the device is the host: the landing path without a stream."""
    gradients_kept_apart_match_stock(optim, tmp_path, monkeypatch, cuda=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("optim", ["sgd", "adagrad", "rmsprop"])
def test_gpu_grad_layers_on_the_cuda_path_match_stock(optim, tmp_path, monkeypatch):
    """On the GPU in fp32 (TF32 off): the gradient kept in GPU memory, clipped there, copied on the
    optimizer's landing stream into pinned tiles, each stepped on the host; to fp32 tolerance (stock's
    kernels on the GPU differ from the host's)."""
    gradients_kept_apart_match_stock(optim, tmp_path, monkeypatch, cuda=True)


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd"])
def test_parameters_stock_leaves_without_a_gradient_stay_as_stock_leaves_them(optim, tmp_path):
    """DeepSeek-V3.2's indexer runs detached: stock's step leaves its weights without a gradient, and torch's
    optimizers skip them, weight decay too. The engine's gradient for them is zero and it keeps them out of
    weight decay: every weight ends as stock's, the indexer's unchanged."""
    from transformers import AutoModelForCausalLM

    from tests.support.zoo import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v32"), dtype=torch.float32).train()
    start = {n: p.detach().clone() for n, p in model.named_parameters() if "indexer" in n}
    assert start
    kw = dict(COMMON, optim=optim, optim_args=OPTIMS.get(optim), weight_decay=0.1, max_grad_norm=0.0)
    stock, mega, ref = stock_and_mega(model, tmp_path, kw, compute_dtype="float32")
    mega.train()
    assert_same_run(stock, mega, ref)
    masters = dict(mega.engine.named_master_params())
    assert all(torch.equal(masters[n], t) for n, t in start.items())  # as stock: never moved


def build(out, optim, model=None, **overrides):
    kw = dict(COMMON, optim=optim, optim_args=OPTIMS.get(optim))
    kw.update(overrides)
    return MegaTrainTrainer(model if model is not None else make_model("llama_tied"),
                            MegaTrainArguments(output_dir=str(out), **kw), train_dataset=rows(16, 0),
                            data_collator=default_data_collator)


@pytest.mark.parametrize("optim,transient", [(name, False) for name in OPTIMS] + [("adafactor", True)])
def test_resume_matches_uninterrupted(optim, transient, tmp_path):
    kw = dict(save_strategy="steps", save_steps=2)
    if transient:  # its state saved after steps run during the backward, resumed into the same
        kw.update(transient_grads="true", background_host_jobs=True, layer_major_accumulation="true")
    full = build(tmp_path / "a", optim, **kw)
    full.train()
    meta = json.loads((tmp_path / "a" / "checkpoint-2" / "megatrain_optimizer.json").read_text())
    # Adafactor's state per parameter in files of its own; the elementwise ones' per piece, beside the master
    assert meta["optimizer"] == optim and (meta["state_files"] if optim == "adafactor" else meta["piece_state"])
    resumed = build(tmp_path / "a", optim, model=make_model("llama_tied", seed=5), **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert logs(resumed)[-2:] == logs(full)[-2:]  # losses, grad norms and lr after the resume: exactly
    m1, m2 = dict(full.engine.named_master_params()), dict(resumed.engine.named_master_params())
    for n in m1:
        assert torch.equal(m1[n], m2[n]), n
    s1, _ = full.host_optimizer.state_tensors()
    s2, _ = resumed.host_optimizer.state_tensors()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_elementwise_state_written_per_parameter_still_resumes(tmp_path):
    """Before sgd, adagrad and rmsprop stepped flat pieces, their checkpoints kept each parameter's state in
    its shape (`<unit>.<slot>.<key>` in megatrain_optimizer_state files, as Adafactor's still are). A checkpoint
    rewritten so resumes as the one written by pieces: the same logs and masters, bit for bit."""
    from safetensors.torch import load_file, save_file

    kw = dict(save_strategy="steps", save_steps=2)
    full = build(tmp_path / "a", "rmsprop", **kw)
    full.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    meta = json.loads((ckpt / "megatrain_optimizer.json").read_text())
    files = [f for f in os.listdir(ckpt) if f.startswith("megatrain_optimizer-r")]
    saved = {k: v for f in files for k, v in load_file(str(ckpt / f)).items()}
    old = {}
    for unit in full.engine.store.units:
        record = meta["piece_state"].get(str(unit.index))
        if record is None:
            continue
        for key, ranges in record["tensors"].items():
            flat = torch.cat([saved[f"{unit.index}.{key}.{a}"] for _, a, _ in sorted(ranges, key=lambda r: r[1])])
            for j, slot in enumerate(unit.train_slots):
                old[f"{unit.index}.{j}.{key}"] = flat[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        for key, (value, dtype) in record["scalars"].items():
            for j in range(len(unit.train_slots)):
                old[f"{unit.index}.{j}.{key}"] = torch.tensor(value, dtype=getattr(torch, dtype))
    for f in files:  # the masters alone, as they were
        save_file({k: v for k, v in load_file(str(ckpt / f)).items() if k.endswith(".master")}, str(ckpt / f),
                  metadata={"format": "pt"})
    save_file(old, str(ckpt / "megatrain_optimizer_state-00001.safetensors"), metadata={"format": "pt"})
    del meta["piece_state"]
    meta.update(state_files={name: "megatrain_optimizer_state-00001.safetensors" for name in old}, state_values={})
    (ckpt / "megatrain_optimizer.json").write_text(json.dumps(meta))
    write_manifest(str(ckpt))
    resumed = build(tmp_path / "a", "rmsprop", model=make_model("llama_tied", seed=5), **kw)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert logs(resumed)[-2:] == logs(full)[-2:]
    m1, m2 = dict(full.engine.named_master_params()), dict(resumed.engine.named_master_params())
    assert all(torch.equal(m1[n], m2[n]) for n in m1)
    s1, _ = full.host_optimizer.state_tensors()
    s2, _ = resumed.host_optimizer.state_tensors()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_resume_with_another_optimizer_is_refused(tmp_path):
    build(tmp_path / "a", "sgd", save_strategy="steps", save_steps=2, max_steps=2).train()
    for optim, says in (("adafactor", "holds the state of sgd, but this run steps adafactor: resume with optim='sgd'"),
                        ("adamw_torch", "holds the state of sgd, but this run steps adamw")):
        trainer = build(tmp_path / "a", optim)
        with pytest.raises(MegaTrainError) as e:
            trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
        assert says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(MegaTrainError, match="holds the state of sgd, but this run steps adagrad"):  # in the arguments:
        build(tmp_path / "a", "adagrad", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))  # when built
    # a checkpoint the host AdamW wrote (its JSON has no "optimizer" before this change: it means adamw)
    trainer = build(tmp_path / "b", "adamw_torch", save_strategy="steps", save_steps=2, max_steps=2)
    trainer.train()
    state = tmp_path / "b" / "checkpoint-2" / "megatrain_optimizer.json"
    meta = json.loads(state.read_text())
    assert meta.pop("optimizer") == "adamw"
    state.write_text(json.dumps(meta))
    write_manifest(str(tmp_path / "b" / "checkpoint-2"))
    with pytest.raises(MegaTrainError, match="holds the state of adamw, but this run steps rmsprop: resume with an "
                                             "AdamW variant"):
        build(tmp_path / "b", "rmsprop").train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))


def test_modes_adafactor_does_not_combine_with_are_refused_before_weights(tmp_path, monkeypatch):
    """gpu_grad_layers (and data parallel: tests/unit/test_optimizer_plan.py, tests/integration/test_distributed.py)
    with Adafactor, and an optim the engine does not run, are refused by the plan, before the engine reads a
    weight; transient_grads is not, nor gpu_grad_layers with sgd: their runs get as far as building the engine."""
    import hf_megatrain.trainer as trainer_module

    def read(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(trainer_module.StreamingEngine, "__init__", read)
    with pytest.raises(MegaTrainError, match="optim='adafactor' is not combined with gpu_grad_layers: ") as e:
        build(tmp_path, "adafactor", gpu_grad_layers="2")
    assert "\n" not in str(e.value) and "use 'sgd', 'adagrad', 'rmsprop' or 'adamw_torch'" in str(e.value)
    with pytest.raises(AssertionError, match="weights were read"):  # planned and admitted
        build(tmp_path, "sgd", gpu_grad_layers="2")
    with pytest.raises(MegaTrainError, match="optim='lion_32bit' is not supported: hf_megatrain runs these on the host"):
        build(tmp_path, "lion_32bit")
    with pytest.raises(AssertionError, match="weights were read"):  # planned and admitted
        build(tmp_path, "adafactor", transient_grads="true", background_host_jobs=True,
              gradient_accumulation_steps=1)


def test_cli_sgd_matches_stock(tmp_path):
    """`hf-megatrain train --optim sgd --optim_args ...` in a process of its own: the model it saves and the
    losses it logs are stock Trainer's with the same optim on the same rows; a resume with another optim is
    one line, exit status 2."""
    from hf_megatrain.demo import build_tokenizer
    from tests.support import ROOT

    make_model("llama").save_pretrained(tmp_path / "model")
    build_tokenizer().save_pretrained(tmp_path / "model")
    texts = [{"text": "abcdefghij"[i % 7:] + "xyz" * (i % 4)} for i in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in texts))
    flags = dict(optim="sgd", optim_args="momentum=0.9,nesterov=True", max_steps=3, max_seq_length=16,
                 per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5,
                 learning_rate=1e-2, weight_decay=0.1, logging_steps=1, save_strategy="steps", save_steps=3,
                 report_to="none", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))

    def cli(*extra):
        argv = ["--model", tmp_path / "model", "--data", tmp_path / "train.jsonl", "--use_cpu"]
        argv += [x for k, v in flags.items() for x in (f"--{k}", v)]
        return subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "train", *map(str, argv + list(extra))],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)

    r = cli("--output_dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr[-3000:]
    # stock Trainer on the rows the CLI trained on (its tokenizing and packing, its collator)
    args = dict(flags, data_path=str(tmp_path / "train.jsonl"), save_strategy="no", use_cpu=True, report_to=[])
    mega = MegaTrainTrainer(str(tmp_path / "model"), MegaTrainArguments(output_dir=str(tmp_path / "x"), **args))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    stock_args = {k: v for k, v in args.items() if k not in ("data_path", "max_seq_length")}
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "stock"), **stock_args),
                    train_dataset=mega.train_dataset, data_collator=mega.data_collator)
    stock.train()
    state = json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())
    got = [{k: h[k] for k in KEYS if k in h} for h in state["log_history"] if "loss" in h]
    want = logs(stock)
    assert len(got) == len(want) == 3
    for x, y in zip(want, got):
        for k in KEYS:
            assert abs(x[k] - y[k]) <= 1e-6 * max(1.0, abs(x[k])), (k, x, y)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for (name, p), q in zip(ref.named_parameters(), saved.parameters()):
        d = (p.detach() - q.detach()).abs().max().item()
        assert d <= 1e-6, (name, d)
    r = cli("--output_dir", tmp_path / "out", "--resume_from_checkpoint", tmp_path / "out" / "checkpoint-3",
            "--optim", "rmsprop", "--optim_args", "momentum=0.9")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "holds the state of sgd, but this run steps rmsprop" in r.stderr.strip().splitlines()[-1]
