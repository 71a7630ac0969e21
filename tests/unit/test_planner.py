"""plan_run (issue 33): one planning sequence, the same plan wherever it is asked for."""

import json

import pytest
import torch

from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer
from hf_megatrain.engine.config import EngineConfig
from hf_megatrain.planner.estimator import GiB
from hf_megatrain.planner.placement import split_step
from hf_megatrain.planner import Machine, Request, plan_run, request_from_arguments
from hf_megatrain.shapes import make_config
from tests.support.tiny import KINDS, make_model


def recorded_plans(monkeypatch) -> list:
    """Every RunPlan that estimate, the trainer and prepare() get from plan_run, in order."""
    import hf_megatrain.planner as planner
    import hf_megatrain.trainer as trainer_module

    plans = []

    def recorded(*a, **k):
        plans.append(plan_run(*a, **k))
        return plans[-1]

    monkeypatch.setattr(planner, "plan_run", recorded)
    monkeypatch.setattr(trainer_module, "plan_run", recorded)
    return plans


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ga", [1, 2])
def test_the_trainer_builds_what_plan_run_plans(tmp_path, kind, ga):
    """The trainer's planning is plan_run on its arguments: the engine it builds is the plan's, and
    so is its step split."""
    args = MegaTrainArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_seq_length=16,
                              gradient_accumulation_steps=ga, report_to=[], use_cpu=True)
    model = make_model(kind)
    trainer = MegaTrainTrainer(model, args)
    run = plan_run(model.config, request_from_arguments(trainer.args, torch.device("cpu")),
                   Machine.measured("cpu"))
    assert run.refusal is None
    assert trainer.engine.engine_config == run.engine
    assert (trainer._split, trainer._per_pass) == (run.split, run.per_pass)



@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ga", [1, 2])
def test_prepare_builds_what_the_trainer_builds(tmp_path, kind, ga):
    """prepare() plans through plan_run as the trainer does: for the same request (rows, tokens,
    accumulation, clipping) the same EngineConfig and the same plan."""
    from hf_megatrain import prepare

    args = MegaTrainArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_seq_length=16,
                              gradient_accumulation_steps=ga, report_to=[], use_cpu=True)
    trainer = MegaTrainTrainer(make_model(kind), args)
    engine, _ = prepare(make_model(kind), device="cpu", batch=2, seq=16, grad_accum=ga)
    assert engine.engine_config == trainer.engine.engine_config
    trainer_plan = plan_run(make_model(kind).config, request_from_arguments(trainer.args, torch.device("cpu")),
                            Machine.measured("cpu"))
    assert engine.run_plan.summary() == trainer_plan.summary()



def test_prepare_takes_the_residency_under_the_trainers_name(tmp_path):
    """gpu_resident_layers is the one name users type (MegaTrainArguments, the CLI, prepare()); prepare()
    also takes EngineConfig's own resident_layers, and refuses the two together, in one line."""
    from hf_megatrain import prepare

    args = MegaTrainArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_seq_length=16,
                              gpu_resident_layers="1", report_to=[], use_cpu=True)
    trainer = MegaTrainTrainer(make_model("llama"), args)
    engine, _ = prepare(make_model("llama"), device="cpu", batch=2, seq=16, gpu_resident_layers=1)
    assert engine.engine_config == trainer.engine.engine_config and engine.engine_config.resident_layers == 1
    engine, _ = prepare(make_model("llama"), device="cpu", batch=2, seq=16, resident_layers=1)
    assert engine.engine_config == trainer.engine.engine_config
    with pytest.raises(MegaTrainError, match="two names of one setting"):
        prepare(make_model("llama"), device="cpu", gpu_resident_layers=1, resident_layers=1)
    with pytest.raises(MegaTrainError, match="gpu_resident_layers='some'"):
        prepare(make_model("llama"), device="cpu", gpu_resident_layers="some")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ga", [1, 2])
def test_estimate_the_trainer_and_prepare_make_the_same_plan(tmp_path, monkeypatch, capsys, kind, ga):
    """One request (2 rows of 16 tokens, GA ga, clipping at 1, fp32 on the CPU) through the three doors:
    `hf-megatrain estimate`, MegaTrainTrainer and prepare() each get the same RunPlan from plan_run."""
    from hf_megatrain import prepare
    from hf_megatrain.cli import main

    plans = recorded_plans(monkeypatch)
    model = make_model(kind)
    model.config.save_pretrained(tmp_path / "m")
    assert main(["estimate", str(tmp_path / "m"), "--batch", "2", "--seq", "16", "--grad_accum", str(ga),
                 "--device", "cpu", "--compute_dtype", "float32", "--host_gib", "1000"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("on 1000 GiB host: fits")
    args = MegaTrainArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_seq_length=16,
                              gradient_accumulation_steps=ga, report_to=[], use_cpu=True)
    MegaTrainTrainer(model, args)
    prepare(make_model(kind), device="cpu", batch=2, seq=16, grad_accum=ga)
    assert len(plans) == 3
    estimated, trained, prepared = (p.summary() for p in plans)
    assert estimated == trained == prepared



LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("kind", KINDS)
def test_a_lora_run_gets_the_same_plan_through_the_three_doors(tmp_path, monkeypatch, capsys, kind):
    """A LoRA request with GA 2: `estimate --peft_config`, the trainer (args.peft_config) and prepare() of the
    PEFT model plan the same adapters on the same frozen base."""
    from peft import LoraConfig, get_peft_model

    from hf_megatrain import prepare
    from hf_megatrain.cli import main

    plans = recorded_plans(monkeypatch)
    model = make_model(kind)
    model.config.save_pretrained(tmp_path / "m")
    assert main(["estimate", str(tmp_path / "m"), "--batch", "2", "--seq", "16", "--grad_accum", "2",
                 "--device", "cpu", "--compute_dtype", "float32", "--host_gib", "1000",
                 "--peft_config", json.dumps(LORA)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("on 1000 GiB host: fits")
    args = MegaTrainArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_seq_length=16,
                              gradient_accumulation_steps=2, report_to=[], use_cpu=True, peft_config=LORA)
    MegaTrainTrainer(model, args)
    prepare(get_peft_model(make_model(kind), LoraConfig(**LORA)), device="cpu", batch=2, seq=16, grad_accum=2)
    assert len(plans) == 3
    estimated, trained, prepared = (p.summary() for p in plans)
    assert estimated == trained == prepared
    full = plan_run(model.config, Request(plans[0].engine, 2, 16, grad_accum=2)).memory.host
    assert plans[0].memory.host["fp32 master weights"] < full["fp32 master weights"]  # only the adapters


class _Ranks(MegaTrainArguments):
    """The trainer's arguments as one rank of a data-parallel launch sees them (no process group here)."""
    @property
    def world_size(self):
        return 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ga", [1, 2])
def test_a_data_parallel_run_gets_the_same_plan_from_estimate_and_the_trainer(tmp_path, monkeypatch, capsys,
                                                                             kind, ga):
    """Four ranks, two on this host: `estimate --world_size 4 --local_ranks 2` and the trainer's request on its
    arguments plan alike: every layer streams, the modes are off, each rank holds a quarter of the fp32 state."""
    from hf_megatrain.cli import main

    plans = recorded_plans(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = make_model(kind)
    model.config.save_pretrained(tmp_path / "m")
    assert main(["estimate", str(tmp_path / "m"), "--batch", "2", "--seq", "16", "--grad_accum", str(ga),
                 "--device", "cpu", "--compute_dtype", "float32", "--host_gib", "1000",
                 "--world_size", "4", "--local_ranks", "2"]) == 0
    capsys.readouterr()
    args = _Ranks(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_seq_length=16,
                  gradient_accumulation_steps=ga, report_to=[], use_cpu=True)
    trained = plan_run(model.config, request_from_arguments(args, torch.device("cpu")), Machine.measured("cpu"))
    assert plans[0].summary() == trained.summary()
    eng = trained.engine
    assert (eng.resident_layers, eng.transient_grads, eng.lean_streamed, eng.gpu_grad_layers) == (0, False, False, 0)
    assert trained.memory.world_size == 4 and trained.memory.local_ranks == 2 and trained.per_pass == 1


def test_prepare_refuses_a_plan_that_does_not_fit_before_reading_a_weight(monkeypatch):
    """prepare() admits as the trainer does (here against a host capped at a sliver): refused before
    the engine is built, in admission's words; memory_check=False builds it."""
    import hf_megatrain.loop as loop
    from hf_megatrain import prepare

    built = []
    monkeypatch.setattr(loop, "StreamingEngine", lambda *a, **k: built.append(1) or pytest.fail("built"))
    with pytest.raises(MegaTrainError, match="this run does not fit: host RAM"):
        prepare(make_model("llama"), device="cpu", max_host_memory=1e-6)
    assert not built


def test_the_machine_caps_are_gib_and_cap_what_is_measured():
    machine = Machine.measured("cpu", max_host_memory=1.5)
    assert machine.host_free == 1.5 * GiB and machine.gpu_free is None
    with pytest.raises(MegaTrainError, match="max_gpu_memory is a number of GiB"):
        Machine.measured("cpu", max_gpu_memory=0)


def _auto(**kw):
    return EngineConfig(**{**dict(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None,
                                  lean_streamed=None, transient_grads=None, gpu_grad_layers=None), **kw})


def test_plan_run_settles_every_auto_and_agrees_with_the_split_search():
    cfg = make_config("llama-3.1-70b")
    machine = Machine(70 * GiB, 400 * GiB)
    run = plan_run(cfg, Request(_auto(), 4, 4096, grad_accum=8), machine)
    assert run.engine.planned
    step = split_step(cfg, 4, 4096, _auto(transient_grads=False), 8, gpu_free=70 * GiB, host_free=400 * GiB)
    assert (run.split, run.per_pass, run.engine) == (step.split, step.per_pass, step.placement.engine)
    assert run.step_time is not None and run.refusal.startswith("this run does not fit: host RAM: needs 1174.5 GiB")


def test_with_no_machine_the_autos_are_off_and_nothing_is_admitted():
    run = plan_run(make_config("llama-3.1-8b"), Request(_auto(), 1, 4096))
    e = run.engine
    assert (e.resident_layers, e.offload_activations, e.lean_resident, e.lean_streamed, e.transient_grads,
            e.gpu_grad_layers) == (0, 0, False, False, False, 0)
    assert run.refusal is None


def test_a_run_that_does_not_fit_is_refused_in_admissions_words():
    run = plan_run(make_config("llama-3.1-70b"), Request(_auto(), 1, 4096), Machine(70 * GiB, 100 * GiB))
    assert run.refusal.startswith("this run does not fit: host RAM")


@pytest.mark.parametrize("asked", [dict(layer_major=True), dict(engine=EngineConfig(device="cuda", lean_streamed=True)),
                                   dict(engine=EngineConfig(device="cuda", transient_grads=True))])
def test_data_parallel_refuses_the_modes_it_does_not_combine_with(asked):
    request = Request(**{"engine": _auto(), "batch": 1, "seq": 1024, "world_size": 2, **asked})
    with pytest.raises(MegaTrainError, match="not combined with data parallel"):
        plan_run(make_config("llama-3.2-1b"), request, Machine(70 * GiB, 400 * GiB))


def test_the_trainer_plans_for_the_memory_its_arguments_cap(tmp_path):
    """max_host_memory caps what the trainer's plan counts as available: a sliver is refused in
    admission's words, before the engine is built."""
    args = MegaTrainArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_seq_length=16,
                              report_to=[], use_cpu=True, max_host_memory=1e-6)
    with pytest.raises(MegaTrainError, match="this run does not fit: host RAM: needs .* 0.0 GiB available"):
        MegaTrainTrainer(make_model("llama"), args)


def test_optimizers_other_than_adamw_get_transient_grads_and_only_adafactor_no_mode_that_cuts_parameters():
    """Every host optimizer steps during the backward (transient_grads); all but Adafactor step tile by tile or
    a slice of each parameter. For another optimizer the planner weighs transient_grads on auto as for AdamW
    (here Adafactor's plan fits without it, where AdamW's needs it: tests/unit/test_optimizer_plan.py has one
    that needs it) and takes it asked for; Adafactor gets gpu_grad_layers off on auto and refuses it asked for,
    or data parallel, before any weight is read; sgd (elementwise) takes both as asked."""
    cfg = make_config("qwen2.5-14b")
    auto = _auto()
    machine = Machine(138.5 * GiB, 122.7 * GiB)  # the host is short without a memory mode (test_capacity)
    adamw = plan_run(cfg, Request(auto, 8, 1024, max_grad_norm=0.0), machine).engine
    assert adamw.transient_grads
    other = plan_run(cfg, Request(auto, 8, 1024, max_grad_norm=0.0, optimizer="adafactor"), machine)
    assert (other.engine.transient_grads, other.engine.gpu_grad_layers, other.refusal) == (False, 0, None)
    asked = plan_run(cfg, Request(_auto(transient_grads=True), 8, 1024, optimizer="sgd"), machine)
    assert asked.engine.transient_grads and asked.engine.gpu_grad_layers == 0
    for engine, world, says in ((_auto(transient_grads=False, gpu_grad_layers=2), 1, "gpu_grad_layers"),
                                (auto, 2, "data parallel")):
        with pytest.raises(MegaTrainError, match=f"optim='adafactor' is not combined with {says}"):
            plan_run(cfg, Request(engine, 8, 1024, world_size=world, optimizer="adafactor"), machine)
        run = plan_run(cfg, Request(engine, 8, 1024, world_size=world, optimizer="sgd", admit=False), machine)
        assert run.engine.gpu_grad_layers == (2 if world == 1 else 0) and run.memory.world_size == world
