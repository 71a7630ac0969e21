"""HostParamOptimizer runs Trainer's own optimizer classes (SGD, Adagrad, RMSprop, Adafactor) over views of
the unit's master (Adafactor: each parameter; the elementwise ones: flat pieces): given the same gradients,
the masters are stock's bit for bit (clipping, a scheduler, Trainer's two weight-decay groups, resident
units, the background stepper, pieces cut anywhere, gradients kept apart and stepped tile by tile)."""

import copy

import pytest
import torch
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

from hf_megatrain import StreamingEngine
from hf_megatrain.engine import host_optim, optimizer as adamw_module
from hf_megatrain.engine.host_optim import ELEMENTWISE_OPTIMS, HostParamOptimizer, unsupported_modes
from hf_megatrain.engine.step import train_step
from hf_megatrain.errors import MegaTrainError
from tests.support.tiny import make_batch, make_model

OPTIM_ARGS = {
    "sgd": "momentum=0.9,nesterov=True",
    "adagrad": "lr_decay=0.01",
    "rmsprop": "momentum=0.5,alpha=0.9,centered=True",  # eps 1e-8: badly conditioned, and still bit for bit
    "adafactor": None,
}


def stock_cls_and_kwargs(optim):
    args = TrainingArguments(output_dir="unused", optim=optim, optim_args=OPTIM_ARGS[optim], learning_rate=1e-2,
                             use_cpu=True, report_to=[])
    return Trainer.get_optimizer_cls_and_kwargs(args)


def same_gradients_same_masters(optim, kind, **engine_kw):
    """Four steps of the engine's optimizer and of stock's class over the model's parameters, from the same
    gradients (the engine's, handed to stock as they are), clipped, with a scheduler: the norms and the masters
    bit for bit. Returns the engine's optimizer."""
    model = make_model(kind, seed=3)
    ref = copy.deepcopy(model)
    decay = Trainer.get_decay_parameter_names(None, ref)
    cls, kwargs = stock_cls_and_kwargs(optim)
    groups = [{"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0}]
    ref_opt = cls(groups, **kwargs)
    ref_sched = get_linear_schedule_with_warmup(ref_opt, 1, 4)
    engine = StreamingEngine(model, compute_dtype=torch.float32, decay_names=decay, **engine_kw).train()
    opt = HostParamOptimizer(engine, cls, kwargs, weight_decay=0.1, name=optim)
    sched = get_linear_schedule_with_warmup(opt, 1, 4)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    params = dict(ref.named_parameters())
    for step in range(4):
        engine.forward_backward(make_batch(seed=step))
        for name, g in engine.named_grads():  # the engine's gradients, handed to stock as they are
            params[name].grad = g.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()
        norm = opt.clip_grad_norm_(0.05)
        opt.step(), sched.step(), engine.zero_grad()
        opt.synchronize()
        assert torch.equal(norm, ref_norm), (step, norm, ref_norm)
    masters = dict(engine.named_master_params())
    for name, p in ref.named_parameters():
        assert torch.equal(masters[name], p.detach()), name
    return opt


@pytest.mark.parametrize("optim", list(OPTIM_ARGS))
@pytest.mark.parametrize("kind,resident,background", [("llama_tied", 0, False), ("mixtral", 1, True)])
def test_same_gradients_same_masters(optim, kind, resident, background):
    opt = same_gradients_same_masters(optim, kind, resident_layers=resident, background_host_jobs=background)
    views = [v for entry in opt.units if entry is not None for v in entry.views]
    if optim == "adafactor":  # each parameter whole, in its shape
        assert sorted(v.shape for v in views) == sorted(p.shape for _, p in opt.engine.named_master_params())
    else:  # flat pieces: a unit's decay and no-decay segments
        assert all(v.dim() == 1 for v in views) and len(views) <= 2 * len(opt.units)


@pytest.mark.parametrize("optim", ELEMENTWISE_OPTIMS)
@pytest.mark.parametrize("kind,resident", [("llama_tied", 0), ("mixtral", 1)])
def test_pieces_cut_anywhere_and_landed_tiles_step_as_stock(optim, kind, resident, monkeypatch):
    """The elementwise optimizers' pieces cut parameters anywhere: 1,000 elements (no multiple of a SIMD
    width), and the last two streamed layers' gradients kept apart (gpu_grad_layers, on the CPU) and stepped
    from the landing tiles (1,024 elements), each tile a piece stepped as it lands. Stock's numbers, bit for
    bit."""
    monkeypatch.setattr(host_optim, "PARAM_STEP_TILE", 1000)
    monkeypatch.setattr(adamw_module, "LANDING_TILE", 1 << 10)
    landed = []
    tiles = HostParamOptimizer._landed_tiles
    monkeypatch.setattr(HostParamOptimizer, "_landed_tiles",
                        lambda self, index, spans, clip: (landed.append((index, len(spans))),
                                                          tiles(self, index, spans, clip))[1])
    opt = same_gradients_same_masters(optim, kind, resident_layers=resident, gpu_grad_layers=2)
    kept = [u.index for u in opt.store.units if u.grad_on_gpu]
    assert len(kept) == 2 and sorted({i for i, _ in landed}) == kept and len(landed) == 2 * 4  # every step
    for u in opt.store.units:
        entry = opt.units[u.index]
        size = 1 << 10 if u.grad_on_gpu else 1000
        assert max(b - a for a, b in entry.spans) == min(size, max(u.n_decay, u.n_train - u.n_decay))
        assert sum(b - a for a, b in entry.spans) == u.n_train  # the pieces tile the unit
        if u.grad_on_gpu:
            assert (u.index, len(entry.spans)) in landed and len(entry.spans) > 8  # dozens of tiles, both reused


def test_refused_modes_say_so_in_one_line():
    """Adafactor needs whole parameters: data parallel and gpu_grad_layers, which cut them, are refused, each
    in one line naming what runs instead; the elementwise optimizers take every mode."""
    for optim in ELEMENTWISE_OPTIMS:
        assert unsupported_modes(optim, world_size=4, gpu_grad_layers=2) is None
    assert unsupported_modes("adafactor") is None
    for kw, says in ((dict(world_size=2), "data parallel"), (dict(gpu_grad_layers=2), "gpu_grad_layers")):
        why = unsupported_modes("adafactor", **kw)
        assert "\n" not in why and why.startswith(f"optim='adafactor' is not combined with {says}")
        assert "whole parameter" in why and "'sgd', 'adagrad', 'rmsprop' or 'adamw_torch'" in why
    engine = StreamingEngine(make_model("llama"), compute_dtype=torch.float32, gpu_grad_layers=1)
    with pytest.raises(ValueError, match="optim='adafactor' is not combined with gpu_grad_layers"):
        HostParamOptimizer(engine, *stock_cls_and_kwargs("adafactor"), name="adafactor")
    assert HostParamOptimizer(engine, *stock_cls_and_kwargs("sgd"), name="sgd").elementwise


def run_policy(optim, kind, clip, compute_dtype=torch.float32, **engine_kw):
    """Four steps of the engine's step policy (engine.step.train_step, one micro-batch a step, a scheduler):
    (grad norms, masters, the optimizer)."""
    model = make_model(kind, seed=3)
    decay = Trainer.get_decay_parameter_names(None, model)
    engine = StreamingEngine(model, compute_dtype=compute_dtype, decay_names=decay, **engine_kw).train()
    opt = HostParamOptimizer(engine, *stock_cls_and_kwargs(optim), weight_decay=0.1, name=optim)
    sched = get_linear_schedule_with_warmup(opt, 1, 4)
    norms = []
    for step in range(4):
        out = train_step(engine, opt, [make_batch(seed=step)], max_grad_norm=clip)
        norms.append(out.grad_norm)
        sched.step()
        engine.zero_grad()
    opt.synchronize()
    return norms, dict(engine.named_master_params()), opt


@pytest.mark.parametrize("optim", list(OPTIM_ARGS))
@pytest.mark.parametrize("kind,resident", [("llama_tied", 0), ("mixtral", 1)])
@pytest.mark.parametrize("transient,clip", [(False, 0.0), (True, 0.0), (True, 0.05)])
def test_stepping_during_the_backward_equals_stepping_after_it(optim, kind, resident, transient, clip):
    """On the worker (background_host_jobs), each unit's instance steps as its last gradient lands, from its
    own accumulator or a shared transient buffer, clipped by the norm pass's coefficient with clipping: the
    masters and norms are bit for bit those of the step after the backward (which test_same_gradients_same_masters
    holds to stock)."""
    after_norms, after, _ = run_policy(optim, kind, clip, resident_layers=resident)
    during_norms, during, opt = run_policy(optim, kind, clip, resident_layers=resident, background_host_jobs=True,
                                           transient_grads=transient)
    assert opt.engine.store.transient == transient
    if clip:
        assert all(torch.equal(a, b) for a, b in zip(after_norms, during_norms)), (after_norms, during_norms)
        assert min(float(n) for n in after_norms) > clip  # every step clipped
    for name in after:
        assert torch.equal(after[name], during[name]), name


@pytest.mark.parametrize("optim", list(OPTIM_ARGS))
def test_lean_modes_step_as_the_default(optim):
    """lean_streamed and lean_resident (bf16 compute): the decoder layers keep no compute copy, each use casts
    the fp32 master into a ring slot instead, the bf16 weights the copy would hold; the step refreshes no copy
    for them. Norms and masters equal the default's bit for bit, with clipping and stepping during the
    backward (no clipping, on the worker)."""
    for clip, kw in ((0.05, {}), (0.0, dict(background_host_jobs=True))):
        ref_norms, ref, _ = run_policy(optim, "mixtral", clip, torch.bfloat16, resident_layers=1, **kw)
        norms, got, opt = run_policy(optim, "mixtral", clip, torch.bfloat16, resident_layers=1, lean_streamed=True,
                                     lean_resident=True, **kw)
        lean = [u for u in opt.store.units if u.no_compute_copy]
        assert {u.resident for u in lean} == {True, False} and all(opt.store.compute[u.index] is None for u in lean)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(ref_norms, norms))
        assert all(torch.equal(ref[n], got[n]) for n in ref)


def test_a_step_during_the_backward_runs_as_each_gradient_lands():
    """step_during_backward arms the step: units are stepped while the backward still runs (final_grad on the
    training thread hands each to the worker), and step() only finishes (the units with no gradient)."""
    engine = StreamingEngine(make_model("llama", seed=3), compute_dtype=torch.float32, transient_grads=True,
                             background_host_jobs=True).train()
    opt = HostParamOptimizer(engine, *stock_cls_and_kwargs("adafactor"), name="adafactor")
    seen = []
    real = opt.step_unit
    opt.step_unit = lambda index, *a: (seen.append((index, engine.store.grad_count[index])), real(index, *a))
    assert opt.step_during_backward() is True
    engine.forward_backward(make_batch(seed=0))
    opt.synchronize()
    assert sorted(i for i, _ in seen) == [u.index for u in engine.units]  # all, before step()
    assert opt.step_count == 0
    opt.step()
    assert opt.step_count == 1 and len(seen) == len(engine.units)  # nothing stepped twice
    with pytest.raises(MegaTrainError, match="transient_grads keeps each gradient only until its step"):
        engine.forward_backward(make_batch(seed=1))  # unarmed: refused, not silently dropped
