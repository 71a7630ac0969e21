"""The written contracts: one source of truth for the layout, one checked config, declared seams,
guarded coupling to Trainer, and patches that undo."""

import ast
import dataclasses
import inspect
import os
import re

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hf_megatrain
from hf_megatrain import HostAdamW, MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from hf_megatrain.engine.config import EngineConfig, parse_count
from hf_megatrain.engine.cuda_pipeline import CudaPipeline
from hf_megatrain.engine.layout import loss_chunk, mark_resident
from hf_megatrain.engine.pipeline import HostPipeline, Pipeline
from hf_megatrain.planner.estimator import estimate, model_sizes
from hf_megatrain.planner.placement import resolve_placement
from hf_megatrain.patcher import specs
from hf_megatrain.patcher.tiling import tile_mlp, untile_mlp
from hf_megatrain.trainer import TRAINER_OVERRIDES, _RECOMPUTE_FLAG, hook_problems
from tests.support.tiny import KINDS, make_batch, make_model

PACKAGE = os.path.dirname(hf_megatrain.__file__)


def _layout(units):
    return [(u.kind, u.layer, u.numel, u.n_train, u.n_decay, u.resident, u.no_compute_copy, u.tied_local)
            for u in units]


# -- one source of truth -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_counts_the_units_the_engine_builds(kind):
    model = make_model(kind)
    sizes = model_sizes(model.config)
    engine = StreamingEngine(model, compute_dtype=torch.float32, resident_layers=2)
    assert sizes.params == engine.num_parameters == sum(p.numel() for p in model.parameters())
    plan = estimate(model.config, 2, 16, compute_dtype="float32", resident_layers=2, sizes=sizes)
    mark_resident(sizes.units, 2)  # as estimate marks its own copy (it leaves the units handed in as they were)
    assert _layout(sizes.units) == _layout(engine.units)
    on_gpu = sum(u.numel for u in engine.units if u.resident)
    assert plan.gpu["resident units (weights, master, grad, Adam)"] == (4 + 16) * on_gpu
    assert plan.host["fp32 master weights"] == 4 * (engine.num_parameters - on_gpu)
    # lean residency: the same layers resident, without their compute copy, and the ring they pass through
    lean = StreamingEngine(make_model(kind), compute_dtype=torch.bfloat16, resident_layers=2, lean_resident=True)
    slim = estimate(model.config, 2, 16, compute_dtype="bfloat16", resident_layers=2, lean_resident=True, sizes=sizes)
    mark_resident(sizes.units, 2, lean=True)
    assert _layout(sizes.units) == _layout(lean.units) and any(u.no_compute_copy for u in lean.units)
    in_ring = [u.numel for u in lean.units if u.no_compute_copy or not u.resident]
    assert slim.gpu["weight ring (prefetch slots)"] == 2 * 2 * max(in_ring)
    kept = sum(u.numel for u in lean.units if u.resident and not u.no_compute_copy)
    assert slim.gpu["resident units (weights, master, grad, Adam)"] == (2 + 16) * kept
    assert slim.gpu["lean resident layers (master, grad, Adam)"] == 16 * (on_gpu - kept)


def test_the_planner_uses_the_engines_loss_chunk():
    model = make_model("llama")
    engine = StreamingEngine(model, compute_dtype=torch.float32)
    assert engine.loss_chunk_tokens == loss_chunk(model.config.vocab_size, "cpu")
    vocab = model.config.vocab_size
    tokens = 4 * 100_000
    plan = estimate(model.config, 4, 100_000)
    assert plan.gpu["[loss] fp32 logits chunk x3"] == min(loss_chunk(vocab, "cuda"), tokens) * vocab * 4 * 3
    asked = estimate(model.config, 4, 100_000, loss_chunk_tokens=7)
    assert asked.gpu["[loss] fp32 logits chunk x3"] == 7 * vocab * 4 * 3
    assert StreamingEngine(make_model("llama"), compute_dtype=torch.float32, loss_chunk_tokens=7).loss_chunk_tokens == 7


def test_the_planner_reads_the_ring_knobs_of_the_engine_config():
    cfg = make_model("llama").config
    base = estimate(cfg, 1, 64, EngineConfig(device="cuda"))
    more = estimate(cfg, 1, 64, EngineConfig(device="cuda", prefetch_depth=3, grad_slots=4, staging_slabs=3))
    layer = max(u.numel for u in model_sizes(cfg).units if u.kind == "layer")
    assert more.gpu["weight ring (prefetch slots)"] == 3 * 2 * layer == 1.5 * base.gpu["weight ring (prefetch slots)"]
    assert more.gpu["gradient ring (fp32)"] == 4 * 4 * layer
    assert more.host["pinned staging slabs"] == 3 * 4 * layer
    # a streamed embedding larger than a layer: its accumulated gradients need slabs of its size
    wide = make_model("llama", vocab_size=4096).config
    units = model_sizes(wide).units
    assert units[0].numel > max(u.numel for u in units if u.kind == "layer")
    largest = max(u.n_train for u in units)  # the head: the embedding's size and the final norm
    assert largest > max(u.n_train for u in units if u.kind == "layer")
    assert estimate(wide, 1, 64, EngineConfig(device="cuda")).host["pinned staging slabs"] == 2 * 4 * largest
    assert estimate(wide, 1, 64, EngineConfig(device="cuda", resident_layers=1)).host["pinned staging slabs"] \
        == 2 * 4 * max(u.n_train for u in units if u.kind == "layer")  # the embedding is resident now


@pytest.mark.gpu
@pytest.mark.parametrize("resident, lean", [(0, False), (2, True), (4, True)])
def test_the_planner_counts_the_cuda_buffers_the_engine_allocates(resident, lean):
    model = make_model("llama", num_hidden_layers=4)
    config = EngineConfig(device="cuda", resident_layers=resident, lean_resident=lean, prefetch_depth=3, grad_slots=3,
                          staging_slabs=1)
    plan = estimate(model.config, 1, 64, config)
    engine = StreamingEngine(model, config)
    pipe = engine.pipeline

    def nbytes(buffers):
        return sum(t.numel() * t.element_size() for t in buffers)

    assert plan.gpu["weight ring (prefetch slots)"] == nbytes(b.data for b in pipe.ring)
    assert plan.gpu["gradient ring (fp32)"] == nbytes(b.data for b in pipe.grad_ring)
    # the staging slabs are allocated at their first use (a unit's second contribution in a step), each
    # of the planned size: none before, and one (staging_slabs=1) after two micro-batches one at a time
    assert all(s is None for s in pipe.slabs)
    if resident < 4:
        engine.train()
        for seed in (1, 2):
            engine.forward_backward(make_batch(seed=seed), None, 0.5)
        engine.wait_for_gradients()
    assert plan.host["pinned staging slabs"] == nbytes([s for s in pipe.slabs if s is not None])
    streamed_fixed = [pipe.fixed[u.index].data for u in engine.units if not u.resident and u.index in pipe.fixed]
    assert plan.gpu["embedding + head buffers"] == nbytes(streamed_fixed)
    store = engine.store
    resident_bytes = sum(nbytes([store.master[u.index], store.grad[u.index]])
                         + (nbytes([store.compute[u.index]]) if store.compute[u.index] is not None else 0)
                         for u in engine.units if u.resident)
    moments = 8 * sum(u.n_train for u in engine.units if u.resident)  # HostAdamW keeps them beside the master
    planned = plan.gpu.get("resident units (weights, master, grad, Adam)", 0) \
        + plan.gpu.get("lean resident layers (master, grad, Adam)", 0)
    assert planned == resident_bytes + moments


def test_one_ignore_index_and_one_pair_of_checkpoint_names():
    """The -100 ignore index and the safetensors file names appear once in the package's code, as
    constants every other module imports (prose in docstrings may still name them)."""
    found = {-100: [], "model.safetensors": [], "model.safetensors.index.json": []}
    for root, _, files in os.walk(PACKAGE):
        for name in (n for n in files if n.endswith(".py")):
            path = os.path.join(root, name)
            for node in ast.walk(ast.parse(open(path).read())):
                value = node.value if isinstance(node, ast.Constant) else None
                if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
                        and isinstance(node.operand, ast.Constant):
                    value = -node.operand.value
                if isinstance(value, (int, str)) and not isinstance(value, bool) and value in found:
                    found[value].append(os.path.relpath(path, PACKAGE))
    here = os.path.join("checkpoint", "safetensors_io.py")
    assert found == {-100: ["constants.py"], "model.safetensors": [here],
                     "model.safetensors.index.json": [here]}


# -- the configuration -----------------------------------------------------------------------------------
def test_engine_config_is_checked_once_and_frozen():
    config = EngineConfig(device="cpu", compute_dtype="bf16", resident_layers="3", offload_activations="auto")
    assert config.compute_dtype is torch.bfloat16 and config.resident_layers == 3
    assert config.offload_activations is None and not config.planned
    assert config.background_host_jobs is False  # the CPU default, decided once
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.resident_layers = 4
    for bad in (dict(prefetch_depth=1), dict(grad_slots=0), dict(resident_layers="x"), dict(compute_dtype="fp16"),
                dict(loss_chunk_tokens=0), dict(offload_activations=-1)):
        with pytest.raises(MegaTrainError):
            EngineConfig(**bad)
    assert parse_count("auto", "n") is None and parse_count(5, "n") == 5 and parse_count("0", "n") == 0
    with pytest.raises(MegaTrainError, match="resident_layers, offload_activations and lean_resident must be settled"):
        StreamingEngine(make_model("llama"), config)
    with pytest.raises(TypeError, match="not both"):
        StreamingEngine(make_model("llama"), EngineConfig(), compute_dtype=torch.float32)


def test_auto_placement_is_decided_in_one_place():
    cfg = make_model("llama").config
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None)
    placed = resolve_placement(cfg, 1, 64, auto, gpu_free=1e15)
    assert placed.planned and placed.engine.resident_layers == cfg.num_hidden_layers
    assert placed.engine.offload_activations == 0 and placed.engine.planned
    from hf_megatrain.planner import Machine, Request, plan_run

    spread = plan_run(cfg, Request(auto, 1, 64, world_size=2), Machine(1e15, 1e15))  # data parallel streams all
    assert spread.engine.resident_layers == 0 and not spread.placement_planned
    cpu = resolve_placement(cfg, 1, 64, dataclasses.replace(auto, device="cpu"))
    assert (cpu.engine.resident_layers, cpu.engine.offload_activations, cpu.planned) == (0, 0, False)



AUTO_FIELDS = ("resident_layers", "offload_activations", "lean_resident", "lean_streamed", "transient_grads",
               "gpu_grad_layers")


def _package_sources():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(n for n in files if n.endswith(".py")):
            path = os.path.join(root, name)
            yield os.path.relpath(path, PACKAGE), open(path).read()


def test_each_auto_rule_is_decided_in_the_planner_only():
    """An auto (None) placement or memory mode is read and settled only by the planner (planner/run.py's
    settle_autos, and the search in planner/placement.py): no other module tests a mode for auto, so a
    rule cannot be written twice (issue 33 found the transient_grads rule in 4 places)."""
    asks = re.compile(r"\b(?:%s)\s+is\s+None\b" % "|".join(AUTO_FIELDS))
    where = {path for path, text in _package_sources() if asks.search(text)}
    assert where <= {os.path.join("planner", "run.py"), os.path.join("planner", "placement.py")}, where
    assert os.path.join("planner", "run.py") in where



@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_the_arguments_and_the_engine_config_leave_every_auto_to_the_planner(tmp_path, device, clip):
    """What the user leaves on auto reaches plan_run as None, whatever the device or clipping: neither
    MegaTrainArguments' engine_config nor EngineConfig settles an auto by a rule of its own. (bf16: in fp32
    the config's own invariant turns the lean modes off, there being no compute copy to drop.)"""
    from hf_megatrain.arguments import engine_config

    autos = dict(gpu_resident_layers="auto", offload_activations="auto", lean_resident="auto", lean_streamed="auto",
                 transient_grads="auto", gpu_grad_layers="auto")
    args = MegaTrainArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_grad_norm=clip,
                              compute_dtype="bfloat16", **autos)
    asked = engine_config(args, torch.device(device), host_jobs=True)
    assert all(getattr(asked, name) is None for name in AUTO_FIELDS), asked
    built = EngineConfig(device=device, compute_dtype=torch.bfloat16, **{n: None for n in AUTO_FIELDS})
    assert all(getattr(built, n) is None for n in AUTO_FIELDS), built


def test_each_data_parallel_refusal_is_decided_once_in_the_planner():
    """Each memory mode that data parallel does not combine with is refused once by the planner (before any
    weight is read) and at most once more by the engine, as its own invariant (a StreamingEngine built by
    hand); no other module forces or refuses it."""
    phrase = re.compile(r"(\w+) is not combined with data parallel")
    found = {}
    for path, text in _package_sources():
        for mode in phrase.findall(text):
            found.setdefault(mode, []).append(path)
    run, engine = os.path.join("planner", "run.py"), os.path.join("engine", "schedule.py")
    for mode in ("transient_grads", "lean_streamed", "gpu_grad_layers", "layer_major_accumulation"):
        assert found[mode].count(run) == 1, (mode, found[mode])
        assert set(found[mode]) <= {run, engine, os.path.join("engine", "config.py")}, (mode, found[mode])
        assert found[mode].count(engine) <= 1, (mode, found[mode])


def test_the_trainer_never_changes_the_users_arguments(tmp_path):
    args = MegaTrainArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to="none",
                              per_device_train_batch_size=2, max_seq_length=16, **{_RECOMPUTE_FLAG: True})
    before = args.to_dict()
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=[make_batch(batch=1, seq=16)] * 2)
    assert args.to_dict() == before
    assert getattr(args, _RECOMPUTE_FLAG)  # the trainer cleared it on its own copy only
    assert trainer.args is not args and not getattr(trainer.args, _RECOMPUTE_FLAG)


def test_plain_training_arguments_become_megatrain_arguments(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = MegaTrainTrainer(make_model("llama"), args)
    assert isinstance(trainer.args, MegaTrainArguments) and type(args) is TrainingArguments
    assert trainer.args.max_seq_length == MegaTrainArguments.max_seq_length  # the field's own default

    @dataclasses.dataclass
    class OtherLibraryArguments(TrainingArguments):
        extra: int = 0

    with pytest.raises(MegaTrainError, match="OtherLibraryArguments.*Pass MegaTrainArguments"):
        MegaTrainTrainer(make_model("llama"), OtherLibraryArguments(output_dir=str(tmp_path), use_cpu=True))


# -- declared seams --------------------------------------------------------------------------------------
def _attributes_used(path, owner):
    tree = ast.parse(open(path).read())
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == owner and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}


def test_both_pipelines_implement_the_protocol_and_the_schedule_uses_nothing_else():
    members = {n for n in vars(Pipeline) if not n.startswith("_")} | set(Pipeline.__annotations__)
    for cls in (HostPipeline, CudaPipeline):
        assert Pipeline in cls.__mro__  # declared, not duck-typed
        for name in members - set(Pipeline.__annotations__):
            assert getattr(cls, name) is not getattr(Pipeline, name), (cls.__name__, name)  # its own
    schedule = os.path.join(PACKAGE, "engine", "schedule.py")
    used = _attributes_used(schedule, "pipeline")
    text = open(schedule).read()
    used |= set(re.findall(r"\bpipe\.(\w+)", text))
    assert used <= members, used - members


def test_layers_import_downward_only():
    """engine/ never imports checkpoint/ (loading is a factory there), and the engine never holds the
    optimizer; the trainer reaches the engine through its own methods, never two levels down."""
    for name in os.listdir(os.path.join(PACKAGE, "engine")):
        if name.endswith(".py"):
            text = open(os.path.join(PACKAGE, "engine", name)).read()
            assert "checkpoint" not in re.findall(r"^\s*from \.\.(\w+)", text, re.M), name
            assert ".optimizer" not in re.sub(r"from \.optimizer|engine\.optimizer import", "", text) or \
                name == "optimizer.py", name
    trainer = open(os.path.join(PACKAGE, "trainer.py")).read()
    assert not re.findall(r"\.engine\.(?!store\b)\w+\.\w", trainer), re.findall(r"\.engine\.\w+\.\w+", trainer)
    assert not re.findall(r"\.engine\._", trainer)


def test_the_optimizer_listens_only_while_armed():
    engine = StreamingEngine(make_model("llama"), compute_dtype=torch.float32, background_host_jobs=True).train()
    opt = HostAdamW(engine, lr=1e-2)
    assert not hasattr(engine, "optimizer") and engine.pipeline.on_final_grad is None
    assert opt.step_during_backward()
    assert engine.pipeline.on_final_grad is not None
    engine.forward_backward(make_batch())
    opt.step()
    assert engine.pipeline.on_final_grad is None  # the step finished the job and stopped listening
    engine.synchronize()
    assert opt.step_count == 1


# -- guarded coupling to Trainer ---------------------------------------------------------------------------
def test_every_trainer_method_we_override_exists_with_the_signature_we_take():
    assert hook_problems() == []
    own = {n for n, v in vars(MegaTrainTrainer).items() if callable(v) and not n.startswith("__")}
    # every method of ours is either a declared override or a name Trainer does not have
    assert {n for n in own if hasattr(Trainer, n)} == set(TRAINER_OVERRIDES)

    class Resigned(Trainer):  # a release in which Trainer passes training_step one more argument
        def training_step(self, model, inputs, num_items_in_batch=None, sync=True):
            return None

    assert hook_problems(Resigned) == [
        "Trainer.training_step takes 'sync', which ours does not take where Trainer passes it"]
    gone = type("Release", (), {n: getattr(Trainer, n) for n in TRAINER_OVERRIDES if n != "_wrap_model"})
    assert hook_problems(gone) == ["Trainer._wrap_model is gone"]


def test_the_mirrored_checkpoint_body_matches_the_installed_trainer():
    src = inspect.getsource(Trainer._save_checkpoint)
    calls = {f"self.{m}" for m in re.findall(r"self\.(\w+)\(", src)}
    calls |= set(re.findall(r"(?<![.\w])([a-z_]\w*)\(", src)) - {"_save_checkpoint", "isinstance", "len", "str"}
    assert calls == MegaTrainTrainer.STOCK_CHECKPOINT_CALLS


# -- patches with undo -----------------------------------------------------------------------------------------
def test_tiling_off_restores_the_mlp():
    model = make_model("llama")
    engine = StreamingEngine(model, compute_dtype=torch.float32, mlp_tile_tokens=8)
    mlps = [t.module.mlp for k, t in engine._templates.items() if k.startswith("layer")]
    assert all("forward" in vars(m) for m in mlps)
    engine.set_mlp_tiling(None)
    assert all("forward" not in vars(m) and not hasattr(m, "_megatrain_tiled") for m in mlps)
    assert engine.mlp_tile_tokens is None
    untile_mlp(mlps[0])  # undoing twice is harmless
    tile_mlp(mlps[0], 4)
    untile_mlp(mlps[0])
    assert type(mlps[0]).forward is mlps[0].forward.__func__


def test_the_engine_patches_its_own_config_never_the_users():
    model = make_model("llama")
    engine = StreamingEngine(model, compute_dtype=torch.float32)
    assert engine.config is not model.config
    layer = next(t.module for k, t in engine._templates.items() if k.startswith("layer"))
    assert layer.self_attn.config is engine.config  # every template shares the engine's copy
    assert model.model.layers[0].self_attn.config is model.config


def test_a_second_register_of_a_type_is_an_error_unless_asked():
    llama = specs.spec_for(make_model("llama").config)
    with pytest.raises(MegaTrainError, match="already has a spec"):
        specs.register(specs.ArchSpec("llama", llama.layer_kind))
    other = specs.ArchSpec("llama", llama.layer_kind, mlp="mlp")
    undo = specs.register(other, replace=True)
    assert specs._REGISTRY["llama"] is other
    undo()
    assert specs._REGISTRY["llama"] is llama
    undo_new = specs.register(specs.ArchSpec("made_up_family", llama.layer_kind))
    assert "made_up_family" in specs.supported_model_types()
    undo_new()
    assert "made_up_family" not in specs.supported_model_types()


def test_the_planner_takes_lean_residency_exactly_when_it_keeps_more_layers():
    cfg = make_model("llama", num_hidden_layers=4).config
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None)
    plans = {n: {lean: estimate(cfg, 1, 64, auto, resident_layers=n, offload_activations=0, lean_resident=lean)
                 .gpu_total for lean in (False, True)} for n in range(5)}
    # a GPU where 2 layers fit with their copies and 3 only lean (the planner keeps 10% free)
    assert plans[3][True] < plans[3][False]
    gpu = plans[3][True] / 0.9 + 1
    assert plans[3][False] > 0.9 * gpu >= plans[2][False]
    placed = resolve_placement(cfg, 1, 64, auto, gpu_free=gpu).engine
    assert (placed.resident_layers, placed.lean_resident) == (3, True)
    roomy = resolve_placement(cfg, 1, 64, auto, gpu_free=1e15).engine  # all fit with copies: no casts
    assert (roomy.resident_layers, roomy.lean_resident) == (4, False)
    asked = resolve_placement(cfg, 1, 64, dataclasses.replace(auto, lean_resident=False), gpu_free=gpu).engine
    assert (asked.resident_layers, asked.lean_resident) == (2, False)
    fp32 = dataclasses.replace(auto, compute_dtype=torch.float32)  # the master is what the GPU reads
    assert fp32.lean_resident is False and not resolve_placement(cfg, 1, 64, fp32, gpu_free=gpu).engine.lean_resident
    with pytest.raises(MegaTrainError, match="lean_resident='sometimes'; use auto, true or false"):
        EngineConfig(lean_resident="sometimes")


# -- the front hall stays small ------------------------------------------------------------------------
@pytest.mark.parametrize("path, owner, name", [("trainer.py", "MegaTrainTrainer", "__init__"),
                                                ("cli.py", None, "_estimate"), ("loop.py", None, "prepare")])
def test_the_doors_hand_their_work_to_the_planner(path, owner, name):
    """The three doors (the trainer's construction, `estimate`, prepare()) stay short: the planning
    sequence is planner.plan_run's alone (issue 33), so none of them grows it again."""
    tree = ast.parse(open(os.path.join(PACKAGE, path)).read())
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner) if owner else tree
    fn = next(n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == name)
    assert fn.end_lineno - fn.lineno + 1 < 80
    assert any(isinstance(n, ast.Name) and n.id in ("plan_run", "_plan") or
               isinstance(n, ast.Attribute) and n.attr in ("plan_run", "_plan") for n in ast.walk(fn))
