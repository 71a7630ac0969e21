"""The estimator counts what the engine allocates; admission refuses clearly."""

import os
import re
import sys

import pytest
import torch

from hf_megatrain import HostAdamW, MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from hf_megatrain.cli import main
from hf_megatrain.engine.config import EngineConfig
from hf_megatrain.planner.admission import admit
from hf_megatrain.planner.estimator import estimate, GiB, model_sizes
from tests.support import ROOT
from tests.support.tiny import KINDS, make_model


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_count_from_config(kind):
    model = make_model(kind)
    assert model_sizes(model.config).params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_estimate_equals_the_store(dtype):
    model = make_model("llama")
    plan = estimate(model.config, 2, 16, compute_dtype=str(dtype).split(".")[1], device="cpu")
    engine = StreamingEngine(model, compute_dtype=dtype)
    opt = HostAdamW(engine)
    arenas = engine.store._arenas + opt._arenas
    allocated = sum(a.nbytes for a in arenas)
    counted = plan.host_total - plan.host["runtime (torch, CUDA, Python)"]
    # the arenas round each unit up to a 4 KiB page; nothing else may differ
    assert counted <= allocated <= counted + 4096 * len(engine.units) * len(arenas)


def test_admission_refuses_with_a_way_out():
    model = make_model("llama")
    plan = estimate(model.config, 8, 4096, device="cuda")
    with pytest.raises(MegaTrainError, match="(?s)does not fit.*host RAM.*Would fit with.*gpu_resident_layers"):
        admit(plan, host_free=1e6, gpu_free=1e12)
    with pytest.raises(MegaTrainError, match="(?s)GPU memory.*batch"):
        admit(plan, host_free=1e12, gpu_free=1e6)
    admit(plan, host_free=1e12, gpu_free=1e12)
    # residency the planner chose for this GPU (as many layers as it holds) is not advice to repeat
    with pytest.raises(MegaTrainError, match="(?s)host RAM.*Would fit with: a host with more RAM") as e:
        admit(plan, host_free=1e6, gpu_free=1e12, residency_planned=True)
    assert "gpu_resident_layers" not in str(e.value).split("Would fit with")[1]


def test_admission_counts_every_rank_on_the_host(capsys):
    """8 data-parallel ranks of an 8B model: each holds 1/8 of the fp32 state but a whole bf16
    compute copy, so 8 ranks on one host need about twice what one process needs; admission
    checks the host's total and names it."""
    from hf_megatrain.shapes import make_config

    cfg = make_config("llama-3.1-8b")
    one = estimate(cfg, 1, 4096)
    spread = estimate(cfg, 1, 4096, world_size=8, local_ranks=1)  # one rank on each of 8 hosts
    packed = estimate(cfg, 1, 4096, world_size=8)  # all 8 on this host
    params = model_sizes(cfg).params
    for name in ("fp32 master weights", "fp32 gradient accumulator", "Adam moments (fp32 x2)"):
        assert one.host[name] / 8 <= packed.host[name] <= one.host[name] / 8 + 16 * (cfg.num_hidden_layers + 2)
    assert packed.host["compute copy (streamed)"] == one.host["compute copy (streamed)"] == 2 * params
    assert packed.host_total == spread.host_total < one.host_total
    assert packed.host_per_host == 8 * packed.host_total > one.host_total
    # fp32 compute: one process streams the master itself, a rank needs its own whole copy
    assert estimate(cfg, 1, 4096, compute_dtype="float32", world_size=2).host["compute copy (streamed)"] == 4 * params
    host = 200 * GiB  # enough for one process, and for one rank, not for 8 ranks
    admit(one, host_free=host, gpu_free=1e12)
    admit(spread, host_free=host, gpu_free=1e12)
    with pytest.raises(MegaTrainError, match="(?s)needs {:.1f} GiB for the 8 ranks on this host \\({:.1f} GiB each\\)"
                       ".*fewer ranks on this host".format(packed.host_per_host / GiB, packed.host_total / GiB)):
        admit(packed, host_free=host, gpu_free=1e12)
    # the command says the same for a machine
    assert main(["estimate", "llama-3.1-8b", "--world_size", "8", "--gpu_gib", "139", "--host_gib", "200"]) == 1
    out = capsys.readouterr().out
    assert "host RAM per rank" in out and "for the 8 ranks on this host" in out
    assert main(["estimate", "llama-3.1-8b", "--world_size", "8", "--local_ranks", "1", "--gpu_gib", "139",
                 "--host_gib", "200"]) == 0


def test_trainer_checks_before_loading(tmp_path, monkeypatch):
    import hf_megatrain.planner.machine as machine

    monkeypatch.setattr(machine, "host_available", lambda: 1.0 * GiB)
    args = MegaTrainArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(MegaTrainError, match="does not fit"):
        MegaTrainTrainer(make_model("llama"), args)


def test_estimate_command(capsys):
    assert main(["estimate", "llama-3.1-70b", "--batch", "1", "--seq", "8192"]) == 0
    out = capsys.readouterr().out
    assert "70.55 B parameters" in out and "Adam moments" in out and "saved layer inputs" in out
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--help"])
    assert e.value.code == 0 and "known shape" in capsys.readouterr().out


def test_estimate_command_plans_for_a_machine(capsys):
    """--gpu_gib / --host_gib: the trainer's placement for that machine, and whether it fits (exit 1 if not)."""
    args = ["estimate", "llama-3.1-70b", "--batch", "16", "--seq", "1024", "--gpu_gib", "139"]
    assert main(args + ["--host_gib", "1536"]) == 0
    out = capsys.readouterr().out
    assert "on 139 GiB GPU + 1536 GiB host: fits" in out
    resident = int(out.split(" layers resident")[0].rsplit(" ", 1)[1])
    assert resident > 0  # some layers are placed on the GPU
    assert main(args + ["--host_gib", "900"]) == 1  # (1024 fits: lean_streamed, 972 GiB with clipping)
    assert "does not fit: host RAM" in capsys.readouterr().out
    # long rows: the planner offloads layer inputs; MLP tiles are the trainer's default
    assert main(["estimate", "qwen2.5-7b", "--seq", "262144", "--gpu_gib", "139", "--host_gib", "123"]) == 0
    with pytest.raises(SystemExit, match="give its --gpu_gib"):
        main(["estimate", "qwen2.5-7b", "--gpu_resident_layers", "auto"])


def test_long_context_refusal_names_the_longest_row_that_fits(capsys):
    """The 7B shape at 512K on the H200 box (139 GiB GPU, 123 GiB host) is refused; the refusal
    says 256K fits, with the placement the planner would use there (measured: BENCHMARKS run 7)."""
    from functools import partial

    from hf_megatrain.planner.estimator import mlp_tile

    from hf_megatrain.planner.placement import longest_fitting_row, plan_placement
    from hf_megatrain.shapes import make_config

    cfg = make_config("qwen2.5-7b", max_positions=524288)
    gpu, host = 139 * GiB, 123 * GiB
    kw = dict(mlp_tile_tokens=mlp_tile(524288))
    r, o = plan_placement(cfg, 1, 524288, gpu, host_free=host, **kw)
    plan = estimate(cfg, 1, 524288, resident_layers=r, offload_activations=o, **kw)
    hint = partial(longest_fitting_row, cfg, 1, 524288)
    with pytest.raises(MegaTrainError, match=r"(?s)host RAM: needs.*\nmax_seq_length=262144 fits this machine "
                                             r"\(4 layers resident"):
        admit(plan, host_free=host, gpu_free=gpu, hint=hint)
    assert longest_fitting_row(cfg, 1, 524288, gpu_free=2 * GiB, host_free=host) is None  # nothing fits
    assert main(["estimate", "qwen2.5-7b", "--seq", "524288", "--gpu_gib", "139", "--host_gib", "123"]) == 1
    assert "max_seq_length=262144 fits this machine" in capsys.readouterr().out


def test_residency_plan_fills_the_gpu_and_no_more():
    from hf_megatrain.planner.placement import plan_placement
    from hf_megatrain.shapes import make_config

    cfg = make_config("qwen2.5-7b")
    assert plan_placement(cfg, 16, 1024, gpu_free=1e15) == (cfg.num_hidden_layers, 0)
    assert plan_placement(cfg, 16, 1024, gpu_free=20 * GiB) == (0, 0)
    n, off = plan_placement(cfg, 16, 1024, gpu_free=80 * GiB)
    assert off == 0
    assert 0 < n < cfg.num_hidden_layers
    assert estimate(cfg, 16, 1024, resident_layers=n).gpu_total <= 0.9 * 80 * GiB
    assert estimate(cfg, 16, 1024, resident_layers=n + 1).gpu_total > 0.9 * 80 * GiB
    # what moves to the GPU leaves the host: 18 B/param -> 2 B/param (the model's own view)
    host0 = estimate(cfg, 16, 1024, resident_layers=0).host_total
    assert estimate(cfg, 16, 1024, resident_layers=n).host_total < host0


def test_long_context_plan_offloads_activations_only_when_they_do_not_fit():
    """At 512K tokens the 3B shape's 28 layer inputs (84 GiB) do not fit a 139 GiB card beside one
    layer's recompute: the plan offloads just enough of them, none at 32K, and on a 48 GiB card
    it cannot fit even with all of them offloaded, which the admission check refuses."""
    from hf_megatrain.planner.admission import admit
    from hf_megatrain.planner.placement import plan_placement
    from hf_megatrain.shapes import make_config

    cfg = make_config("llama-3.2-3b", max_positions=524288)
    kw = dict(mlp_tile_tokens=16384)
    card = 139 * GiB
    n, off = plan_placement(cfg, 1, 524288, gpu_free=card, **kw)
    assert n == 0 and 0 < off < cfg.num_hidden_layers
    assert estimate(cfg, 1, 524288, offload_activations=off, **kw).gpu_total <= 0.9 * card
    assert estimate(cfg, 1, 524288, offload_activations=off - 1, **kw).gpu_total > 0.9 * card
    plan = estimate(cfg, 1, 524288, offload_activations=off, **kw)
    assert plan.host["offloaded layer inputs (pinned)"] == off * 524288 * cfg.hidden_size * 2
    assert plan_placement(cfg, 1, 32768, gpu_free=card, **kw)[1] == 0
    assert plan_placement(cfg, 1, 524288, gpu_free=1e15, **kw) == (cfg.num_hidden_layers, 0)
    n, off = plan_placement(cfg, 1, 524288, gpu_free=48 * GiB, **kw)
    assert off == cfg.num_hidden_layers
    with pytest.raises(MegaTrainError, match="GPU memory"):
        admit(estimate(cfg, 1, 524288, offload_activations=off, **kw), host_free=1e15, gpu_free=48 * GiB)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's")
def test_host_arenas_are_not_given_to_forked_children():
    """DataLoader workers are forked: they must not get (and copy) the host store's pages."""
    import ctypes
    import signal

    from hf_megatrain.engine.pinned import arena_tensors

    arena, (t,) = arena_tensors([1 << 20], torch.float32, pin=False)
    t.fill_(1.0)
    addr = t.data_ptr()
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    flags = []
    for i, line in enumerate(lines):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= addr < int(m.group(2), 16):
            flags = next(ln for ln in lines[i + 1 :] if ln.startswith("VmFlags:")).split()[1:]
            break
    assert "dc" in flags  # "do not copy this mapping on fork"
    pid = os.fork()
    if pid == 0:  # the child: the arena is not mapped here, so reading it faults
        import faulthandler

        faulthandler.disable()  # (a quiet fault: it is the expected outcome)
        ctypes.string_at(addr, 4)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS)
    assert float(t[0]) == 1.0  # the parent's memory is untouched


def test_planner_moves_layers_to_the_gpu_when_the_host_is_short():
    """The H200 box's 13B case: by the GPU's comfort margin 19 layers are resident and the host plan
    (117.0 GiB) misses admission against 123 GiB; the planner then uses the GPU headroom."""
    from hf_megatrain.planner.admission import ADMIT_MARGIN
    from hf_megatrain.planner.placement import plan_placement
    from hf_megatrain.shapes import make_config

    cfg = make_config("llama-2-13b")
    gpu_free, host_free = 139.3 * GiB, 123.0 * GiB
    gpu_only, _ = plan_placement(cfg, 16, 1024, gpu_free)
    both, _ = plan_placement(cfg, 16, 1024, gpu_free, host_free=host_free)
    assert both > gpu_only
    plan = estimate(cfg, 16, 1024, resident_layers=both)
    assert plan.host_total <= host_free * (1 - ADMIT_MARGIN) and plan.gpu_total <= gpu_free * (1 - ADMIT_MARGIN)
    admit(plan, host_free=host_free, gpu_free=gpu_free)  # accepted
    with pytest.raises(MegaTrainError):
        admit(estimate(cfg, 16, 1024, resident_layers=gpu_only), host_free=host_free, gpu_free=gpu_free)
    # a host far too small stays short: the planner stops at the GPU's admitted limit, admission refuses
    small, _ = plan_placement(cfg, 16, 1024, gpu_free, host_free=40 * GiB)
    assert estimate(cfg, 16, 1024, resident_layers=small + 1).gpu_total > gpu_free * (1 - ADMIT_MARGIN)
    with pytest.raises(MegaTrainError, match="host RAM"):
        admit(estimate(cfg, 16, 1024, resident_layers=small), host_free=40 * GiB, gpu_free=gpu_free)


def test_projection_uses_measured_layer_costs_and_the_planner():
    """benchmarks/project.py: the step-time model with the measured per-layer costs in place of its
    rates (scaled in tokens for the compute, not for the AdamW; 7% faster AdamW unclipped, as the
    reference probe), and the planner's placement and admission's verdict for each memory mode."""
    import importlib.util

    from hf_megatrain.engine.config import EngineConfig
    from hf_megatrain.planner.probe import REFERENCE
    from hf_megatrain.shapes import make_config
    from hf_megatrain.planner.steptime import LayerCosts, predict

    cfg = make_config("llama-3.1-70b")
    sizes = model_sizes(cfg)
    layer = sizes.units[1].numel
    engine = EngineConfig(device="cuda", resident_layers=4, offload_activations=0, lean_resident=True)

    def lanes(fwd, bwd, adamw, tokens=16384, clip=True):
        costs = LayerCosts(fwd, bwd, adamw, layer, 16384)
        return predict(cfg, tokens // 1024, 1024, engine, REFERENCE, clip=clip, sizes=sizes, routed={},
                       layer_costs=costs).lanes

    base = lanes(0.0, 0.0, 0.5)
    assert lanes(0.05, 0.15, 0.5)["compute"] - base["compute"] == pytest.approx(80 * 0.2)
    assert lanes(0.05, 0.15, 0.5, tokens=32768)["compute"] - lanes(0.0, 0.0, 0.5, tokens=32768)["compute"] \
        == pytest.approx(2 * 80 * 0.2)  # matmuls scale with tokens
    assert base["host_adamw"] == pytest.approx(76 * 0.5)  # the 76 streamed layers; nothing else streams
    assert lanes(0.0, 0.0, 0.5, tokens=32768)["host_adamw"] == pytest.approx(76 * 0.5)  # AdamW does not
    assert lanes(0.0, 0.0, 0.5, clip=False)["host_adamw"] == pytest.approx(76 * 0.5 * 2.55 / 2.74)

    path = os.path.join(ROOT, "benchmarks", "project.py")
    spec = importlib.util.spec_from_file_location("project", path)
    project = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(project)
    rec = {"shape": "llama-3.1-70b", "layers": 11, "tokens_per_step": 16384, "layer_forward_s": 0.044,
           "layer_backward_s": 0.149, "host_adamw_unit_s": 0.364, "peak": {"sustained_tflops": 656.6}}
    both = project.project(rec, "llama-3.1-70b", 139, 982, 16384, "lean_streamed + transient_grads", False)
    clipped = project.project(rec, "llama-3.1-70b", 139, 982, 16384, "lean_streamed", True)
    assert both["fits"] and not both["clipping"] and both["host_needed_gib"] < 750
    assert not clipped["fits"] and clipped["host_needed_gib"] > 960  # 16 bytes per streamed parameter
    assert both["step_s"] < clipped["step_s"]  # without clipping the host AdamW overlaps the backward
    measured = project.project(rec, "llama-3.1-70b", 139, 982, 16384, "lean_streamed + transient_grads", True)
    assert measured["fits"] and measured["norm_pass"] and measured["host_needed_gib"] == both["host_needed_gib"]
    assert measured["step_s"] > both["step_s"]  # clipping through the norm pass: one more forward and backward


def test_small_numbers_read_as_written(tmp_path, capsys):
    """A tiny model is '...K parameters', one layer is '1 layer' (not '0.00 B parameters', '1 layers')."""
    from hf_megatrain.cli import main
    from hf_megatrain.errors import counted, parameter_count
    from tests.support.tiny import make_model

    assert (counted(1, "layer"), counted(0, "layer input"), counted(2, "layer")) == ("1 layer", "0 layer inputs",
                                                                                     "2 layers")
    assert (parameter_count(7_615_616_512), parameter_count(135_000_000), parameter_count(98_304),
            parameter_count(12)) == ("7.62 B", "135.0 M", "98.3 K", "12")
    make_model("llama", num_hidden_layers=1).save_pretrained(tmp_path)
    assert main(["estimate", str(tmp_path), "--gpu_resident_layers", "1", "--batch", "1", "--seq", "16"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert " K parameters" in head and "1 layer resident" in head and "0 layer inputs offloaded" in head, head


def test_split_step_picks_micro_batches_that_fit_and_keep_layers_resident(capsys):
    """The 13B shape on the H200 box (139 GiB GPU, 123.7 GiB host; BENCHMARKS.md): 16 x 4 rows together
    keep too few layers resident for the host, 8 x 8 together fit; 64 x 1 does not fit at all but is cut
    to a split that does; 16 x 1 runs as asked; an MoE with its load-balancing loss is never cut; off,
    it runs as asked. `hf-megatrain estimate --grad_accum` says the same."""
    from hf_megatrain.engine.config import EngineConfig
    from hf_megatrain.planner.admission import shortfalls
    from hf_megatrain.planner.placement import resolve_placement, split_step
    from hf_megatrain.shapes import make_config

    cfg = make_config("llama-2-13b")
    gpu, host = 139 * GiB, 123.7 * GiB
    eng = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, resident_layers=None, offload_activations=None,
                       lean_resident=None)

    def split(batch, ga, **kw):
        return split_step(cfg, batch, 1024, eng, ga, gpu_free=gpu, host_free=host, **kw)

    def fits(step, batch):
        plan = estimate(cfg, batch // step.split, 1024, step.placement.engine, micro_batches=step.per_pass)
        return not shortfalls(plan, host, gpu)

    together = resolve_placement(cfg, 16, 1024, eng, gpu_free=gpu, host_free=host, micro_batches=4)
    assert not fits(type(split(16, 4))(1, 4, together), 16)  # uncut, the host is short
    s = split(16, 4)
    assert (s.split, s.per_pass) == (2, 8) and fits(s, 16)
    assert s.describe(16, 4) == "micro-batches of 8 rows x 8 (asked: 16 x 4), through each layer together"
    s = split(64, 1)
    assert s.split > 1 and s.per_pass == s.split and fits(s, 64)
    base = resolve_placement(cfg, 64, 1024, eng, gpu_free=gpu, host_free=host)
    assert shortfalls(estimate(cfg, 64, 1024, base.engine), host, gpu)  # as asked it is refused
    assert split(16, 1)[:2] == (1, 1)
    assert split(16, 4, splittable=False)[:2] == (1, 1)  # uncut together does not fit: one at a time
    assert split(16, 4, asked=False)[:2] == (1, 1)
    assert split(16, 4, asked=True)[:2] == (1, 4)
    assert main(["estimate", "llama-2-13b", "--batch", "16", "--seq", "1024", "--grad_accum", "4", "--gpu_gib", "139",
                 "--host_gib", "123.7"]) == 0
    out = capsys.readouterr().out
    assert "8 x 1024 tokens per micro-batch, micro-batches of 8 rows x 8 (asked: 16 x 4), through each layer together" \
        in out and out.rstrip().endswith("fits")



def test_allocator_advice_near_a_full_gpu(monkeypatch):
    """Near a full card the trainer advises expandable segments unless they are set; the train command
    sets them before torch is imported, and keeps a value the user chose."""
    from hf_megatrain import cli
    from hf_megatrain.planner.admission import allocator_advice
    from hf_megatrain.planner.estimator import MemoryPlan

    full = MemoryPlan(gpu={"everything": 120 * GiB})
    assert "expandable_segments:True" in allocator_advice(full, 130 * GiB, conf="")
    assert allocator_advice(full, 130 * GiB, conf="expandable_segments:True") is None
    assert allocator_advice(full, 130 * GiB, conf="max_split_size_mb:512, expandable_segments: true") is None
    assert allocator_advice(MemoryPlan(gpu={"everything": 60 * GiB}), 130 * GiB, conf="") is None

    class Stop(Exception):
        pass

    def parser():
        raise Stop  # the point where torch and transformers would be imported

    monkeypatch.setattr(cli, "_train_parser", parser)
    for before, after in ((None, "expandable_segments:True"), ("max_split_size_mb:256", "max_split_size_mb:256")):
        if before is None:
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", before)
        with pytest.raises(Stop):
            cli._train(["--model", "m", "--output_dir", "o"])
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == after


# -- the planner's speed (issue 33) -----------------------------------------------------------------
def _count_meta_builds(monkeypatch, cache_dir):
    """Count engine.layout.config_units calls (each builds the model on the meta device), with the memo
    emptied first and a disk cache of the layouts of its own (cache_dir)."""
    monkeypatch.setenv("HF_MEGATRAIN_CACHE", str(cache_dir))
    from hf_megatrain.planner import estimator as estimate

    builds = []
    real = estimate.config_units

    def counting(config, *a, **kw):
        builds.append(config.model_type)
        return real(config, *a, **kw)

    monkeypatch.setattr(estimate, "config_units", counting)
    monkeypatch.setattr(estimate, "_UNITS", type(estimate._UNITS)())
    return builds


@pytest.mark.parametrize("shape", ["llama-3.1-70b", "mixtral-8x7b"])
def test_a_plan_builds_the_model_on_the_meta_device_once(monkeypatch, tmp_path, shape):
    """The planner's search (split_step -> resolve_placement -> place_layers -> plan_placement ->
    estimate), the step-time model and a refusal's costs ask for the same config's units hundreds of
    times: the meta build runs once per config (it once ran 105-115 times for the 70B shape)."""
    from hf_megatrain.engine.config import EngineConfig
    from hf_megatrain.planner.placement import split_step
    from hf_megatrain.planner.probe import REFERENCE as rates
    from hf_megatrain.shapes import make_config
    from hf_megatrain.planner.steptime import mode_cost, predict, routed_per_layer

    builds = _count_meta_builds(monkeypatch, tmp_path)
    cfg = make_config(shape)
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None,
                        lean_streamed=None, transient_grads=None, gpu_grad_layers=None)
    step = split_step(cfg, 4, 4096, auto, 8, host_free=400 * GiB, gpu_free=70 * GiB)
    predict(cfg, 4 // step.split, 4096, step.placement.engine, rates, micro_batches=8 * step.split)
    mode_cost(cfg, 4, 4096, step.placement.engine, rates)({"lean_streamed": True})
    routed_per_layer(cfg)
    estimate(make_config(shape), 1, 1024)  # another object with the same contents: the same units
    assert builds == [cfg.model_type]


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral", "lora"])
def test_the_next_process_reads_the_layout_from_disk(monkeypatch, tmp_path, kind):
    """The units a config lays out are kept on disk (planner/layout_cache.py): a later process (the memo
    emptied) plans without a meta build, from units equal to the built ones; a file that cannot be read
    is built again; another config, or other layout code, is another file."""
    from hf_megatrain.planner import estimator, layout_cache
    from hf_megatrain.planner.estimator import adapter_units_memo, config_units_memo

    builds = _count_meta_builds(monkeypatch, tmp_path)
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]} if kind == "lora" else None
    cfg = make_model("llama" if lora else kind).config

    def units():
        estimator._UNITS.clear()  # as a fresh process starts
        return config_units_memo(cfg) if lora is None else adapter_units_memo(cfg, lora)

    def same(a, b):
        return [vars(u) for u in a] == [vars(u) for u in b]

    first = units()
    files = list((tmp_path / "layouts").iterdir())
    assert len(files) == 1 and (lora is not None or builds == [cfg.model_type])
    again = units()
    assert same(again, first) and (lora is not None or len(builds) == 1)  # read back, not built
    files[0].write_text("{not json")
    assert same(units(), first) and (lora is not None or len(builds) == 2)  # unreadable: built again
    cfg.num_hidden_layers += 1
    units()
    assert len(list((tmp_path / "layouts").iterdir())) == 2
    monkeypatch.setattr(layout_cache, "code_version", lambda: "other layout code")
    units()
    assert len(list((tmp_path / "layouts").iterdir())) == 3


@pytest.mark.parametrize("model", ["llama-3.1-70b", "mixtral-8x7b", "gemma-2-9b", "folder"])
def test_a_warm_estimate_plans_from_the_config_record_the_same_plan(monkeypatch, tmp_path, capsys, model):
    """`hf-megatrain estimate` reads a config it laid out before from its record (layout_cache.cached_config:
    no transformers import) and prints the plan it printed from the real config, word for word and as
    JSON; a config.json that changes is a new record; --peft_config plans from the real config."""
    from transformers import PretrainedConfig

    from hf_megatrain.cli import _config_of
    from hf_megatrain.planner import estimator
    from hf_megatrain.planner.layout_cache import ConfigRecord

    monkeypatch.setenv("HF_MEGATRAIN_CACHE", str(tmp_path / "cache"))
    if model == "folder":
        make_model("mixtral").config.save_pretrained(tmp_path / "m")
        model = str(tmp_path / "m")
    args = ["estimate", model, "--batch", "2", "--seq", "2048", "--gpu_gib", "70", "--host_gib", "300"]
    printed = []
    for _ in range(2):
        estimator._UNITS.clear()  # as a fresh process starts
        assert isinstance(_config_of(model), ConfigRecord) == bool(printed)  # the first reads the real config
        printed.append([(main(args + extra), capsys.readouterr().out) for extra in ([], ["--json"])])
    assert printed[0] == printed[1] and all(out for _, out in printed[0])
    assert isinstance(_config_of(model, record=False), PretrainedConfig)
    if model.endswith("/m"):
        cfg = make_model("mixtral").config
        cfg.num_hidden_layers += 1
        cfg.save_pretrained(tmp_path / "m")
        assert isinstance(_config_of(model), PretrainedConfig)  # another config.json: read for real


def test_a_warm_estimate_imports_no_transformers(tmp_path):
    """The point of the record: a warm `hf-megatrain estimate` of a 70B shape, in a fresh process, never
    imports transformers (3-4 s of a 2-core box, more than the planning)."""
    import subprocess

    code = ("import sys; from hf_megatrain.cli import main; "
            "main(['estimate', 'llama-3.1-70b', '--batch', '4', '--seq', '4096', '--grad_accum', '8', "
            "'--gpu_gib', '70', '--host_gib', '400']); print('IMPORTED', 'transformers' in sys.modules)")
    env = {**os.environ, "HF_MEGATRAIN_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env) for _ in range(2)]
    assert [r.stdout.splitlines()[-1] for r in runs] == ["IMPORTED True", "IMPORTED False"], runs[1].stderr[-2000:]
    assert runs[0].stdout.splitlines()[:-1] == runs[1].stdout.splitlines()[:-1]  # the same plan, printed


def test_estimate_and_predict_leave_the_units_they_are_handed_as_they_were():
    """estimate and steptime.predict mark residency on units of their own: the ModelSizes handed in (sizes=)
    keep their marks, so one ModelSizes serves every plan of a search."""
    from hf_megatrain.shapes import make_config

    cfg = make_config("qwen2.5-14b")
    sizes = model_sizes(cfg)
    before = [(u.resident, u.no_compute_copy, u.grad_on_gpu) for u in sizes.units]
    estimate(cfg, 16, 1024, sizes=sizes, resident_layers=20, lean_resident=True, lean_streamed=True,
             gpu_grad_layers=3)
    assert [(u.resident, u.no_compute_copy, u.grad_on_gpu) for u in sizes.units] == before
    assert model_sizes(cfg).units is not sizes.units  # each caller gets units of its own


LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
# a prompt-learning encoder lives in the embedding unit (engine/prompts.py); with prefix_projection it is an MLP
# whose output is every layer's keys and values (on a 70B shape most of a billion parameters)
ADAPTERS = {"lora": LORA, "ia3": {"peft_type": "IA3", "target_modules": ["q_proj", "down_proj"],
                                  "feedforward_modules": ["down_proj"]},
            "prefix_projection": {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 4, "prefix_projection": True,
                                  "encoder_hidden_size": 32},
            "prompt_tuning": {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 4}}


@pytest.mark.parametrize("adapters", list(ADAPTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_plan_counts_what_the_store_allocates(dtype, adapters):
    """A PEFT run's plan holds the fp32 master, gradient and Adam moments of the adapters alone (each
    unit's trainable prefix, n_train: a prompt encoder's in the embedding unit) and the compute copy of every
    weight: what the built engine's store and HostAdamW allocate, unit by unit as StreamingEngine lays them out."""
    from peft import get_peft_model

    from hf_megatrain.checkpoint.loading import peft_config_from

    model = make_model("llama")
    sizes = model_sizes(model.config, ADAPTERS[adapters])
    plan = estimate(model.config, 2, 16, compute_dtype=str(dtype).split(".")[1], device="cpu", sizes=sizes)
    engine = StreamingEngine(get_peft_model(model, peft_config_from(ADAPTERS[adapters])), compute_dtype=dtype)
    opt = HostAdamW(engine)
    assert [(u.numel, u.n_train) for u in sizes.units] == [(u.numel, u.n_train) for u in engine.units]
    trained = sum(u.n_train for u in engine.units)
    assert 0 < trained < sum(u.numel for u in engine.units) // 10

    def numel(tensors):
        return sum(t.numel() for t in tensors if t is not None)

    store = engine.store
    assert plan.host["fp32 master weights"] == 4 * numel(store.master) == 4 * trained
    assert plan.host["fp32 gradient accumulator"] == 4 * numel(store.grad) == 4 * trained
    assert plan.host["Adam moments (fp32 x2)"] == 4 * (numel(opt.exp_avg) + numel(opt.exp_avg_sq)) == 8 * trained
    assert plan.host["compute copy (streamed)"] == dtype.itemsize * numel(store.compute) \
        == dtype.itemsize * sum(u.numel for u in engine.units)
    allocated = sum(a.nbytes for a in store._arenas + opt._arenas)
    counted = plan.host_total - plan.host["runtime (torch, CUDA, Python)"]
    assert counted <= allocated <= counted + 4096 * len(engine.units) * len(store._arenas + opt._arenas)


def test_lora_resident_units_count_the_state_of_their_adapters():
    """On the GPU a resident LoRA unit holds its compute copy and the fp32 state of its adapters only."""
    config = make_model("llama").config
    full = estimate(config, 1, 16, resident_layers=config.num_hidden_layers, offload_activations=0)
    lora = estimate(config, 1, 16, resident_layers=config.num_hidden_layers, offload_activations=0,
                    sizes=model_sizes(config, LORA))
    units = model_sizes(config, LORA).units
    key = "resident units (weights, master, grad, Adam)"
    assert lora.gpu[key] == sum(2 * u.numel + 16 * u.n_train for u in units)
    assert full.gpu[key] == 18 * model_sizes(config).params
    assert lora.host["fp32 master weights"] == 0


def test_trainer_admits_a_lora_run_that_a_full_fine_tune_does_not_fit(tmp_path):
    """On a host capped (max_host_memory) between the two plans, the full fine-tune is refused and the
    LoRA run of the same model is admitted: the plan counts what the LoRA store holds."""
    from hf_megatrain.planner.admission import ADMIT_MARGIN
    from hf_megatrain.planner import Machine, Request, plan_run

    config = make_model("llama").config
    engine = EngineConfig(device="cpu", compute_dtype=torch.float32)
    need = {lora: plan_run(config, Request(engine, 2, 16, peft_config=LORA if lora else None),
                           Machine()).memory.host_per_host for lora in (False, True)}
    assert need[True] < need[False]
    cap = (need[True] + need[False]) / 2 / (1 - ADMIT_MARGIN) / GiB

    def args(**kw):
        return MegaTrainArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_seq_length=16,
                                  max_host_memory=cap, report_to=[], use_cpu=True, **kw)

    with pytest.raises(MegaTrainError, match="(?s)does not fit.*estimate --peft_config"):
        MegaTrainTrainer(make_model("llama"), args())
    trainer = MegaTrainTrainer(make_model("llama"), args(peft_config=dict(LORA)))
    assert sum(u.n_train for u in trainer.engine.units) < sum(u.numel for u in trainer.engine.units)


def test_estimate_command_plans_a_lora_run(capsys):
    """`estimate --peft_config` plans the LoRA run: a 70B model whose full fine-tune needs over 1 TB of
    host RAM fits an 80 GiB GPU and 256 GiB host with adapters on q_proj and v_proj."""
    machine = ["llama-3.1-70b", "--batch", "1", "--seq", "1024", "--gpu_gib", "80", "--host_gib", "256"]
    assert main(["estimate", *machine]) == 1  # does not fit
    full = capsys.readouterr().out
    assert "this run does not fit" in full and "--peft_config" in full
    assert main(["estimate", "--peft_config", '{"r": 8, "target_modules": ["q_proj","v_proj"]}', *machine]) == 0
    lora = capsys.readouterr().out
    assert "LoRA:" in lora and "does not fit" not in lora and "256 GiB host: fits" in lora
    with pytest.raises(SystemExit, match="--peft_config"):
        main(["estimate", "--peft_config", "{not json", *machine])
