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
