"""Hybrid residency: units kept (and stepped) on the compute device give identical numerics.

On the CPU the "device" is the host itself, so these tests exercise every code path of resident
units (their own buffers, stepping in the main thread, gradients accumulated in place, saving)
and demand bit-identical results to all-streamed; tests/gpu/test_gpu.py repeats it on a GPU.
"""

import pytest
import torch

from hf_megatrain import HostAdamW, StreamingEngine
from hf_megatrain.checkpoint.hf_format import save_hf_model
from tests.support.tiny import make_batch, make_model


def train(kind, resident, steps=4, ga=2, device="cpu"):
    model = make_model(kind, seed=2)
    engine = StreamingEngine(model, device=device, compute_dtype=torch.float32, resident_layers=resident).train()
    opt = HostAdamW(engine, lr=3e-3, weight_decay=0.1)
    norms = []
    for step in range(steps):
        for micro in range(ga):
            engine.forward_backward(make_batch(seed=10 * step + micro), scale=1.0 / ga)
        norms.append(float(opt.clip_grad_norm_(0.2)))
        opt.step()
        engine.zero_grad()
    return engine, model, norms


@pytest.mark.parametrize("kind", ["llama_tied", "mixtral"])
def test_residency_none_some_all_identical(kind):
    ref, _, ref_norms = train(kind, 0)
    masters = dict(ref.named_master_params())
    for resident in (1, 99):
        engine, model, norms = train(kind, resident)
        assert engine.resident_layers == min(resident, model.config.num_hidden_layers)
        assert sum(u.resident for u in engine.units) > 0
        assert norms == ref_norms
        for name, t in engine.named_master_params():
            assert torch.equal(t, masters[name]), (resident, name)
        # the model object sees the resident units' current weights after synchronize()
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), masters[name]), name


def test_resident_units_hold_no_host_state():
    engine, model, _ = train("llama", 99, steps=1)
    opt = HostAdamW(engine)  # what the run's optimizer allocated, allocated again
    store = engine.store
    params = dict(model.named_parameters())
    for u in engine.units:
        assert u.resident
        # the model object's parameters view the device copy itself: there is no host copy
        copy = store.compute[u.index]
        lo, hi = copy.data_ptr(), copy.data_ptr() + copy.numel() * copy.element_size()
        for s in u.slots:
            assert lo <= params[s.name].data_ptr() < hi, s.name
    host_state = sum(a.nbytes for a in store._arenas) + sum(a.nbytes for a in opt._arenas)
    assert host_state <= 4096 * 5 * len(engine.units)  # only page-rounding slack: no weights, masters, moments


def test_resident_model_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    engine, model, _ = train("llama", 2, steps=2)
    save_hf_model(engine.store, model, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    masters = dict(engine.named_master_params())
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), masters[name]), name


def train_bf16(kind, resident, lean, clip=0.2, steps=3, ga=2, early=True):
    """bf16 compute, where a resident layer has a compute copy to drop (lean) or keeps one.
    early: without clipping, step each unit during the last backward (as the trainer does)."""
    model = make_model(kind, seed=4)
    engine = StreamingEngine(model, device="cpu", compute_dtype=torch.bfloat16, resident_layers=resident,
                             lean_resident=lean, background_host_jobs=True).train()  # host jobs on threads, as on a GPU
    opt = HostAdamW(engine, lr=3e-3, weight_decay=0.1)
    record = []
    for step in range(steps):
        for micro in range(ga):
            if early and not clip and micro == ga - 1:
                assert opt.step_during_backward()  # no clipping: each unit steps as its gradient lands
            loss = engine.forward_backward(make_batch(seed=10 * step + micro), scale=1.0 / ga)
            record.append(float(loss))
        if clip:
            record.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        engine.zero_grad()
    return engine, model, record


@pytest.mark.parametrize("kind", ["llama_tied", "mixtral"])
@pytest.mark.parametrize("clip", [0.2, 0.0])
def test_lean_residency_is_bit_identical(kind, clip):
    """Lean resident layers (no bf16 copy: the master is cast for each use) give the numbers of
    resident layers with a copy, bit for bit: losses, clipping norms, masters, with gradient
    accumulation, with clipping and with steps taken during the backward."""
    for resident in (1, 99):
        ref, _, ref_record = train_bf16(kind, resident, lean=False, clip=clip)
        if not clip:  # the steps taken during the backward equal the plain step after it
            plain, _, plain_record = train_bf16(kind, resident, lean=False, clip=clip, early=False)
            assert plain_record == ref_record
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain.named_master_params(),
                                                                  ref.named_master_params()))
        engine, model, record = train_bf16(kind, resident, lean=True, clip=clip)
        assert engine.engine_config.lean_resident
        lean = [u for u in engine.units if u.no_compute_copy]
        assert lean and all(u.kind == "layer" and u.resident for u in lean)
        assert len(lean) == engine.resident_layers
        assert record == ref_record
        masters = dict(ref.named_master_params())
        for name, t in engine.named_master_params():
            assert torch.equal(t, masters[name]), (resident, name)
        params = dict(model.named_parameters())
        for u in lean:  # no compute copy; the model object views the master, the one copy
            assert engine.store.compute[u.index] is None
            for s in u.slots:
                assert params[s.name].dtype == torch.float32
                assert torch.equal(params[s.name].detach(), masters[s.name]), s.name


def test_lean_resident_loads_and_saves(tmp_path):
    """A lean engine loads a checkpoint straight into its masters (no compute copy to land in) and
    saves files that reload with from_pretrained to its masters."""
    import copy

    from transformers import AutoModelForCausalLM

    from hf_megatrain.checkpoint.stream_load import engine_from_checkpoint

    model = make_model("llama", seed=6)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")  # bf16 on disk, as hub checkpoints are

    def run(lean):
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=torch.float32)
        engine = engine_from_checkpoint(skeleton, str(tmp_path / "src"), progress=False, compute_dtype=torch.bfloat16,
                                        resident_layers=2, lean_resident=lean).train()
        opt = HostAdamW(engine, lr=3e-3)
        loss = float(engine.forward_backward(make_batch(seed=1)))
        opt.clip_grad_norm_(1.0)
        opt.step()
        return engine, skeleton, loss

    ref, _, ref_loss = run(False)
    engine, skeleton, loss = run(True)
    assert loss == ref_loss and any(u.no_compute_copy for u in engine.units)
    masters = dict(ref.named_master_params())
    for name, t in engine.named_master_params():
        assert torch.equal(t, masters[name]), name
    save_hf_model(engine.store, skeleton, str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), masters[name]), name
