"""The planner counts each optimizer's state as the engine's optimizers allocate it (HostAdamW's moments;
HostParamOptimizer's torch / transformers state, by parameter shape, on the host for streamed units and
beside the master for resident ones), and admission, `hf-megatrain estimate` and the step-time model
use it."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import Trainer
from transformers.optimization import Adafactor

from hf_megatrain import MegaTrainArguments, StreamingEngine
from hf_megatrain.engine.config import EngineConfig
from hf_megatrain.engine.layout import mark_resident
from hf_megatrain.engine.host_optim import PARAM_OPTIMS, HostParamOptimizer
from hf_megatrain.engine.optimizer import HostAdamW
from hf_megatrain.errors import MegaTrainError
from hf_megatrain.planner import Machine, Request, plan_run, request_from_arguments
from hf_megatrain.planner.estimator import (ADAMW, ADAMW_OPTIMS, GiB, copy_units, estimate, model_sizes, optimizer_class,
                                            optimizer_state, state_bytes_per_parameter, state_of)
from hf_megatrain.planner.probe import REFERENCE, host_optim_gparams
from hf_megatrain.planner.steptime import predict
from hf_megatrain.shapes import make_config
from tests.support.tiny import make_batch, make_model

# (optim, optim_args): Trainer's defaults and the settings that change the state
CASES = [("adamw_torch", None), ("sgd", None), ("sgd", "momentum=0.9,nesterov=True"), ("adagrad", None),
         ("rmsprop", None), ("rmsprop", "momentum=0.5,centered=True"), ("adafactor", None)]


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def stepped(kind, optim, optim_args, resident, cls_kwargs=None):
    """The engine and its optimizer for `optim` after one real step (torch allocates most state lazily)."""
    model = make_model(kind, seed=2)
    decay = Trainer.get_decay_parameter_names(None, model)
    engine = StreamingEngine(model, compute_dtype=torch.float32, decay_names=decay, resident_layers=resident,
                             background_host_jobs=False).train()
    if optim in ADAMW_OPTIMS:
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
    else:
        cls, kwargs = cls_kwargs or optimizer_class(optim, optim_args)
        opt = HostParamOptimizer(engine, cls, kwargs, weight_decay=0.1, name=optim)
    engine.forward_backward(make_batch(seed=3))
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.synchronize()
    return model, engine, opt


def allocated(engine, opt):
    """Bytes of the optimizer's state tensors: (streamed units', resident units' beside their master,
    torch's 0-d step counters, which torch keeps on the host whatever the parameter's device)."""
    streamed = beside = counters = 0
    for unit in engine.store.units:
        if isinstance(opt, HostAdamW):
            n = nbytes(opt.exp_avg[unit.index]) + nbytes(opt.exp_avg_sq[unit.index])
            tensors = {}
        else:
            entry = opt.units[unit.index]
            tensors = {} if entry is None else entry.inner.state
            n = 0
        for state in tensors.values():
            for key, val in state.items():
                if not isinstance(val, torch.Tensor):
                    continue
                if key == "step":
                    counters += nbytes(val)
                else:
                    n += nbytes(val)
        if unit.resident:
            beside += n
        else:
            streamed += n
    return streamed, beside, counters


@pytest.mark.parametrize("optim,optim_args", CASES)
@pytest.mark.parametrize("kind,resident", [("llama", 0), ("llama_tied", 1), ("mixtral", 1)])
def test_the_estimate_counts_the_state_the_optimizer_allocates(kind, resident, optim, optim_args):
    model, engine, opt = stepped(kind, optim, optim_args, resident)
    streamed, beside, counters = allocated(engine, opt)
    state = optimizer_state(optim, optim_args)
    assert state.adamw == (optim in ADAMW_OPTIMS)
    # planned for a GPU with the engine's residency: streamed state on the host, resident state on the GPU
    plan = estimate(model.config, 1, 16, EngineConfig(device="cuda", compute_dtype=torch.float32,
                                                      resident_layers=resident), optimizer=state)
    planned = copy_units(model_sizes(model.config).units)
    mark_resident(planned, resident, False, False, 0)
    assert [u.resident for u in engine.store.units] == [u.resident for u in planned]  # the same units
    host = {k: v for k, v in plan.host.items() if k.startswith(("Adam moments", "optimizer state"))}
    assert list(host.values()) == [streamed + counters], (host, streamed, counters)
    units = engine.store.units
    on_gpu = [u for u in units if u.resident]
    gpu = sum(v for k, v in plan.gpu.items() if k.startswith(("resident units", "resident layers")))
    # what a resident unit holds besides its state: fp32 weights (compute = master in fp32 mode counts twice
    # in the plan: the compute copy and the master), the gradient
    assert gpu - sum(4 * u.numel + 8 * u.n_train for u in on_gpu) == beside
    assert bool(beside) == bool(on_gpu and state.per_parameter() > 0)


def test_bytes_per_parameter_by_shape():
    """AdamW 8; sgd 0, or 4 with momentum; adagrad and rmsprop 4 (+ a 4-byte step per parameter), rmsprop +4
    momentum +4 centered; Adafactor's second moment factored for a matrix, whole for a vector."""
    per = {(o, a): optimizer_state(o, a).per_parameter() for o, a in CASES}
    assert per[("adamw_torch", None)] == 8 and per[("sgd", None)] == 0
    assert per[("sgd", "momentum=0.9,nesterov=True")] == 4
    matrix = 4096 * 4096
    for o, a, full in (("adagrad", None, 4), ("rmsprop", None, 4), ("rmsprop", "momentum=0.5,centered=True", 12)):
        assert per[(o, a)] == pytest.approx(full + 4 / matrix)
    adafactor = optimizer_state("adafactor")
    assert adafactor.full == 0  # Trainer's adafactor: beta1 None, no first moment
    assert adafactor.param_bytes((4096, 1024)) == 4 * (4096 + 1024 + 1)
    assert adafactor.param_bytes((8, 4096, 1024)) == 4 * (8 * 4096 + 8 * 1024 + 1)  # fused experts
    assert adafactor.param_bytes((1024,)) == 4 * (1024 + 1)
    with_beta1 = state_of("adafactor", Adafactor, dict(lr=1e-3, beta1=0.9, scale_parameter=False, relative_step=False))
    assert with_beta1.param_bytes((4096, 1024)) == 4 * (4096 * 1024 + 4096 + 1024 + 1)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_adafactor_with_beta1_allocates_what_is_counted(kind):
    cls_kwargs = (Adafactor, dict(lr=1e-3, beta1=0.9, scale_parameter=False, relative_step=False))
    model, engine, opt = stepped(kind, "adafactor", None, 0, cls_kwargs)
    streamed, _, counters = allocated(engine, opt)
    state = state_of("adafactor", *cls_kwargs)
    assert sum(state.unit_bytes(u) for u in engine.store.units) + state.host_scalar_bytes(engine.store.units) \
        == streamed + counters


TEMPORARIES = """
import sys, torch
from hf_megatrain.planner.estimator import optimizer_class
cls, kwargs = optimizer_class(sys.argv[1], sys.argv[2] or None)
p = torch.randn(2048, 8192)  # 64 MiB: each temporary is its own mapping, returned on free
p.grad = torch.randn_like(p)
opt = cls([{"params": [p], "weight_decay": 0.1}], **kwargs)  # the decay group's step (the engine's worst)
opt.step(), opt.step()  # the state exists
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
open("/proc/self/clear_refs", "w").write("5")  # the peak resident size starts again from here
before = status("VmRSS:")
opt.step()
print((status("VmHWM:") - before) / (4 * p.numel()))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads the peak resident size (Linux)")
@pytest.mark.parametrize("optim,optim_args", [c for c in CASES if c[0] not in ADAMW_OPTIMS])
def test_the_step_temporaries_counted_are_what_a_step_allocates(optim, optim_args):
    """A parameter's step allocates as many temporaries of its size as the planner counts (measured: the
    process's peak resident size during one step of one 64 MiB parameter, in a fresh process)."""
    out = subprocess.run([sys.executable, "-c", TEMPORARIES, optim, optim_args or ""], capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == pytest.approx(optimizer_state(optim, optim_args).scratch, abs=0.05)


def test_the_step_temporaries_are_the_largest_parameters_or_pieces():
    """Adafactor steps each parameter whole: its temporaries are the largest parameter's. The elementwise ones
    step pieces of at most PARAM_STEP_TILE elements (8M; the 8B model's embedding is 525M)."""
    from hf_megatrain.engine.layout import PARAM_STEP_TILE

    config = make_config("llama-3.1-8b")
    sizes = model_sizes(config)
    largest = max(s.shape.numel() for u in sizes.units for s in u.train_slots)
    for optim, args, temps, what, size in (("adafactor", None, 2, "parameter", largest),
                                           ("sgd", None, 1, "piece", PARAM_STEP_TILE),
                                           ("sgd", "momentum=0.9,nesterov=True", 2, "piece", PARAM_STEP_TILE)):
        plan = estimate(config, 1, 1024, EngineConfig(device="cuda"), sizes=sizes, optimizer=optimizer_state(optim, args))
        assert plan.host[f"optimizer step temporaries (largest {what})"] == 4 * temps * size
    adamw = estimate(config, 1, 1024, EngineConfig(device="cuda"), sizes=sizes)
    assert not [k for k in adamw.host if "temporaries" in k]  # torch's fused AdamW keeps none
    assert adamw.host == estimate(config, 1, 1024, EngineConfig(device="cuda"), sizes=sizes, optimizer=ADAMW).host


@pytest.mark.parametrize("optim", PARAM_OPTIMS)
def test_trainers_defaults_are_the_installed_classes(optim):
    """optimizer_state reads Trainer's defaults from a table (importing the classes costs an estimate seconds):
    the table says what the installed classes fill in."""
    assert optimizer_state(optim) == state_of(optim, *optimizer_class(optim))
    assert optimizer_state(optim, "") == optimizer_state(optim)


def test_the_optimizer_names_agree_with_the_arguments():
    from hf_megatrain.arguments import SUPPORTED_OPTIM

    assert set(ADAMW_OPTIMS) | set(PARAM_OPTIMS) == set(SUPPORTED_OPTIM)
    with pytest.raises(MegaTrainError, match="not one the engine runs"):
        optimizer_state("lion_32bit")
    with pytest.raises(MegaTrainError, match="optim_args"):
        optimizer_state("sgd", "momentum")


def test_the_trainers_request_carries_optim_args(tmp_path):
    args = MegaTrainArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], optim="rmsprop",
                              optim_args="momentum=0.5,centered=True", max_seq_length=16)
    request = request_from_arguments(args, torch.device("cpu"), optimizer="rmsprop")
    assert request.optim_args == "momentum=0.5,centered=True"
    assert request.optimizer_state == optimizer_state("rmsprop", "momentum=0.5,centered=True")
    assert request.optimizer_state.full == 3


def _needs(config, optim, engine, host):
    return plan_run(config, Request(engine, 16, 1024, optimizer=optim, admit=False),
                    Machine(gpu_free=24 * GiB, host_free=host)).memory


def test_a_host_refusal_names_the_optimizer_that_fits():
    config = make_config("llama-2-13b")
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None)
    adamw, adafactor = _needs(config, "adamw", auto, 1e15), _needs(config, "adafactor", auto, 1e15)
    assert adafactor.host_per_host < 0.6 * adamw.host_per_host
    host = (adafactor.host_per_host + adamw.host_per_host) / 2 / 0.95
    run = plan_run(config, Request(auto, 16, 1024), Machine(gpu_free=24 * GiB, host_free=host))
    assert run.refusal is not None and run.refusal.startswith("this run does not fit: host RAM")
    there = _needs(config, "adafactor", auto, host)  # the run planned again for Adafactor on this machine
    assert f"optim='adafactor' (with optim=adafactor it needs {there.host_per_host / GiB:.1f} GiB" in run.refusal
    fits = plan_run(config, Request(auto, 16, 1024, optimizer="adafactor"), Machine(gpu_free=24 * GiB, host_free=host))
    assert fits.refusal is None and fits.memory.host == there.host
    # where even Adafactor is short, the refusal says by how much
    small = 0.5 * adafactor.host_per_host
    short = plan_run(config, Request(auto, 16, 1024), Machine(gpu_free=24 * GiB, host_free=small))
    need = _needs(config, "adafactor", auto, small).host_per_host
    assert need > small and f"With optim=adafactor it would need {need / GiB:.1f} GiB of host RAM, still short." \
        in short.refusal
    assert "optim='adafactor'" not in short.refusal


def test_the_step_time_model_places_other_optimizers_steps_as_adamws_at_their_rate():
    """The engine's step policy is one for every optimizer: after the backward with exact clipping, during it
    (each unit as its gradient lands) without clipping or with transient_grads' norm pass first."""
    config = make_config("llama-2-13b")
    sizes = model_sizes(config)
    engine = EngineConfig(device="cuda", resident_layers=0, offload_activations=0)
    adafactor = optimizer_state("adafactor")
    steps = {}
    for clip in (True, False):
        for transient in (False, True):
            eng = dataclasses.replace(engine, transient_grads=transient)
            a = predict(config, 16, 1024, eng, REFERENCE, clip=clip, sizes=sizes, routed={})
            b = predict(config, 16, 1024, eng, REFERENCE, clip=clip, sizes=sizes, routed={}, optimizer=adafactor)
            ratio = REFERENCE.adamw(clip) / REFERENCE.host_step(adafactor, clip)
            assert b.lanes["host_adafactor"] == pytest.approx(a.lanes["host_adamw"] * ratio)
            after = clip and not transient
            assert b.bound.startswith("host adafactor after the backward") == after, (clip, transient, b.bound)
            assert b.lanes["compute"] == pytest.approx(a.lanes["compute"])  # the same passes (a norm pass: two)
            if after:  # never under the backward plus the whole host step
                assert b.step_s >= b.lanes["host_adafactor"] + b.lanes["compute"] * 0.75 * 0.99
            else:  # the host step overlaps the backward: shorter than backward + host step, never under the host step
                assert b.lanes["host_adafactor"] <= b.step_s < b.lanes["host_adafactor"] + b.lanes["compute"] * 0.75
            steps[clip, transient] = b.step_s
    assert steps[False, False] == steps[False, True] < steps[True, False]  # without clipping transient costs nothing
    measured = REFERENCE.__class__(**{**REFERENCE.__dict__, "optim_gparams": {"adafactor": [0.5, 84]}})
    assert measured.host_step(adafactor, True) == pytest.approx(0.5)
    assert measured.host_step(adafactor, False) == pytest.approx(0.5 * 98 / 90)


def test_the_probe_steps_each_optimizer():
    for name in PARAM_OPTIMS:
        assert host_optim_gparams(name, shape=(64, 32)) > 0


def _estimate(capsys, *flags):
    from hf_megatrain.cli import main

    code = main(["estimate", "llama-3.2-1b", "--batch", "4", "--seq", "1024", *flags])
    return code, capsys.readouterr().out


def test_estimate_prints_the_optimizer_and_its_alternatives(capsys):
    machine = ["--gpu_gib", "20", "--host_gib", "60", "--gpu_resident_layers", "4"]
    _, text = _estimate(capsys, *machine)
    assert "optim=" not in text.splitlines()[0]
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("  optim=adafactor")]
    assert [r[0] for r in rows] == ["optim=adafactor"] * 3  # default, + lean_streamed, + lean_streamed + transient
    _, out = _estimate(capsys, *machine, "--json")
    modes = json.loads(out)["modes"]
    asked = [m for m in modes if m["optimizer"] == "adamw"]
    assert [m["mode"] for m in asked] == ["default", "lean_streamed", "lean_streamed + transient_grads"]
    other = [m for m in modes if m["optimizer"] == "adafactor"]
    config = make_config("llama-3.2-1b")
    run = plan_run(config, Request(EngineConfig(device="cuda", resident_layers=4, offload_activations=None), 4, 1024,
                                   admit=False), Machine(20 * GiB, 60 * GiB))
    plan = estimate(config, 4, 1024, dataclasses.replace(run.engine, gpu_grad_layers=0, transient_grads=False,
                                                          lean_streamed=False),
                    later_contributions=False, optimizer=optimizer_state("adafactor"))
    assert other[0]["host_gib"] == round(plan.host_per_host / GiB, 1)

    code, out = _estimate(capsys, *machine, "--optim", "sgd", "--optim_args", "momentum=0.9", "--json")
    data = json.loads(out)
    state = [v for k, v in data["host"].items() if k.startswith("optimizer state (sgd")]
    sgd = plan_run(config, Request(EngineConfig(device="cuda", resident_layers=4, offload_activations=None), 4, 1024,
                                   admit=False, optimizer="sgd", optim_args="momentum=0.9"), Machine(20 * GiB, 60 * GiB))
    units = copy_units(model_sizes(config).units)
    mark_resident(units, 4, sgd.engine.lean_resident, sgd.engine.lean_streamed, 0)
    assert state == [4 * sum(u.n_train for u in units if not u.resident)]  # a momentum buffer per streamed weight
    assert {m["optimizer"] for m in data["modes"]} == {"sgd", "adafactor", "adamw"}
    transient = [m for m in data["modes"] if m["optimizer"] == "sgd" and "transient" in m["mode"]]
    lean = [m for m in data["modes"] if m["optimizer"] == "sgd" and m["mode"] == "lean_streamed"]
    assert len(transient) == len(lean) == 1  # sgd with transient_grads: priced, less (no streamed accumulator)
    assert transient[0]["state_bytes_per_parameter"] < lean[0]["state_bytes_per_parameter"]
    assert transient[0]["host_gib"] < lean[0]["host_gib"]
    with pytest.raises(SystemExit, match="--optim / --optim_args"):
        _estimate(capsys, "--optim", "lion")


def test_estimate_plans_the_elementwise_optimizers_with_data_parallel_and_refuses_adafactor(capsys):
    """`hf-megatrain estimate --optim rmsprop --world_size 4`: each rank holds 1/4 of the master and of
    RMSprop's square_avg and momentum buffer; `--optim adafactor --world_size 2` is refused in one line."""
    code, out = _estimate(capsys, "--optim", "rmsprop", "--optim_args", "momentum=0.5", "--world_size", "4", "--json")
    data = json.loads(out)
    per_rank = 4 * sum(-(-u.n_train // 4) for u in model_sizes(make_config("llama-3.2-1b")).units)
    state = [v for k, v in data["host"].items() if k.startswith("optimizer state (rmsprop")]
    assert code == 0 and data["world_size"] == 4 and data["host"]["fp32 master weights"] == per_rank
    assert len(state) == 1 and 2 * per_rank < state[0] < 2 * per_rank + 4096  # the buffers, and a counter a piece
    from hf_megatrain.cli import main

    code = main(["estimate", "llama-3.2-1b", "--batch", "4", "--seq", "1024", "--optim", "adafactor", "--world_size", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "optim='adafactor' is not combined with data parallel" in err[0]


# -- transient_grads with the other optimizers ---------------------------------------------------------
def test_with_transient_grads_a_streamed_adafactor_parameter_keeps_no_fp32_gradient():
    """Llama-3.1-70B, all streamed: with transient_grads a parameter costs its fp32 master, its bf16 copy and
    Adafactor's factored state; the gradient is 3 shared buffers of the largest streamed unit, not 4 B each."""
    config = make_config("llama-3.1-70b")
    sizes = model_sizes(config)
    adafactor = optimizer_state("adafactor")
    engine = EngineConfig(device="cuda", resident_layers=0, offload_activations=0)
    kw = dict(sizes=sizes, later_contributions=False, optimizer=adafactor)
    plain = estimate(config, 16, 1024, engine, **kw)
    transient = estimate(config, 16, 1024, dataclasses.replace(engine, transient_grads=True), **kw)
    units = sizes.units
    assert "fp32 gradient accumulator" not in transient.host
    assert transient.host["fp32 gradient buffers (transient, 3)"] == 4 * 3 * max(u.n_train for u in units)
    assert transient.host["fp32 master weights"] == 4 * sizes.params
    assert transient.host["compute copy (streamed)"] == 2 * sizes.params
    state = transient.host["optimizer state (adafactor: factored second moment)"]
    assert state == sum(adafactor.unit_bytes(u) for u in units) < 0.01 * sizes.params  # rows + columns
    assert plain.host_total - transient.host_total == 4 * sizes.params - 4 * 3 * max(u.n_train for u in units)
    assert 6.0 < state_bytes_per_parameter(transient, sizes.params) < 6.2  # 4 + 2 + buffers + state
    assert 10.0 <= state_bytes_per_parameter(plain, sizes.params) < 10.1
    # and a GPU run prices it as a saving, for admission to offer
    assert plain.transient_saving == pytest.approx(plain.host_total - transient.host_total)


def test_the_auto_rule_takes_transient_grads_for_adafactor_where_it_takes_it_for_adamw():
    """Qwen2.5-32B at 16K tokens on one H200 without clipping (transient_grads is free of time then): with
    400 GiB of host, AdamW needs transient_grads and Adafactor fits without it; on this box's 122.7 GiB AdamW
    fits in no mode and Adafactor takes transient_grads (and, its resident layers sharing one gradient buffer,
    46 layers on the GPU). With clipping auto never takes it (a norm pass costs time); asked for, it runs
    clipped through the norm pass and fits. gpu_grad_layers stays 0 on auto for Adafactor."""
    config = make_config("qwen2.5-32b")
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None,
                        lean_streamed=None, transient_grads=None, gpu_grad_layers=None)

    def planned(host_gib, optim, clip=0.0, engine=auto):
        return plan_run(config, Request(engine, 16, 1024, max_grad_norm=clip, optimizer=optim),
                        Machine(138.5 * GiB, host_gib * GiB))

    big_adamw, big_adafactor = planned(400, "adamw"), planned(400, "adafactor")
    assert big_adamw.engine.transient_grads and big_adamw.refusal is None
    assert not big_adafactor.engine.transient_grads and big_adafactor.refusal is None
    box_adamw, box_adafactor = planned(122.7, "adamw"), planned(122.7, "adafactor")
    assert box_adamw.refusal is not None
    assert box_adafactor.refusal is None and box_adafactor.engine.transient_grads
    assert box_adafactor.engine.resident_layers == 46 and box_adafactor.engine.gpu_grad_layers == 0
    assert "fp32 gradient accumulator" not in box_adafactor.memory.host
    clipped = planned(122.7, "adafactor", clip=1.0)
    assert not clipped.engine.transient_grads and clipped.refusal is not None
    assert "transient_grads=True" in clipped.refusal.splitlines()[-1]  # the fix it offers
    asked = planned(122.7, "adafactor", clip=1.0, engine=dataclasses.replace(auto, transient_grads=True))
    assert asked.refusal is None and asked.engine.transient_grads
    assert asked.step_time.step_s > box_adafactor.step_time.step_s  # the norm pass: one more forward and backward
    assert any("norm pass" in n or "measures the global gradient norm" in n for n in asked.notes)


def test_adafactor_refuses_data_parallel_and_gpu_grad_layers_in_one_line_the_elementwise_ones_plan_them():
    """Adafactor's state spans whole parameters: data parallel and gpu_grad_layers are refused in one line.
    sgd, adagrad and rmsprop are elementwise: planned with either, their state counted per rank as a slice,
    like AdamW's moments."""
    config = make_config("llama-3.2-1b")
    engine = EngineConfig(device="cuda", resident_layers=0, offload_activations=0)
    cases = ((dict(world_size=2), dict(), "data parallel"),
             (dict(), dict(gpu_grad_layers=2), "gpu_grad_layers"))
    for request_kw, engine_kw, says in cases:
        with pytest.raises(MegaTrainError) as e:
            plan_run(config, Request(dataclasses.replace(engine, **engine_kw), 4, 1024, optimizer="adafactor",
                                     admit=False, **request_kw))
        assert str(e.value).startswith(f"optim='adafactor' is not combined with {says}") and "\n" not in str(e.value)
        for optim in ("sgd", "adagrad", "rmsprop"):
            run = plan_run(config, Request(dataclasses.replace(engine, **engine_kw), 4, 1024, optimizer=optim,
                                           optim_args="momentum=0.9" if optim == "sgd" else None, admit=False,
                                           **request_kw))
            assert run.engine.gpu_grad_layers == engine_kw.get("gpu_grad_layers", 0)
    run = plan_run(config, Request(dataclasses.replace(engine, transient_grads=True), 4, 1024, optimizer="sgd",
                                   admit=False))
    assert run.engine.transient_grads
    # the state per rank: 1/N of every unit's, as the master (4 B of momentum per parameter, ceil(n / N) each)
    units = model_sizes(config).units
    for world in (1, 2, 4):
        plan = plan_run(config, Request(engine, 4, 1024, optimizer="sgd", optim_args="momentum=0.9", admit=False,
                                        world_size=world)).memory
        state = next(v for k, v in plan.host.items() if k.startswith("optimizer state (sgd"))
        assert plan.host["fp32 master weights"] == sum(4 * -(-u.n_train // world) for u in units)
        assert state == plan.host["fp32 master weights"]  # no step counter: SGD keeps none
        assert plan.host["optimizer step temporaries (largest piece)"] == 4 * (1 << 23)  # `grad + wd * p` of a piece
