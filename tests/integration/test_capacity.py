"""Issue 21's memory modes: fewer bytes per parameter, the same numbers.

lean_streamed: streamed decoder layers keep no bf16 copy in host RAM; each use casts the fp32 master
(on a GPU, after it crosses PCIe). Bit for bit against the default path on the CPU in bf16 compute:
losses, clipping norms and masters, for Llama, a tied Llama and Mixtral (load-balancing loss), with
gradient accumulation one at a time and together, with clipping and with steps during the backward;
through the trainer, the saved model loads back with from_pretrained equal to the default's. The
planner counts it, takes it on auto only when the host needs it, and a refusal names it.

transient_grads: streamed units keep no fp32 gradient accumulator; each gradient lands in one of a few
shared buffers and is stepped as soon as it is final. Bit for bit against the default with steps
during the backward; refused wherever a gradient would have to persist; a failed step never leaves
the next buffer claim waiting.
"""

import json
import re
import subprocess
import sys
import threading
from dataclasses import replace

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, default_data_collator

from hf_megatrain import HostAdamW, HostJobError, MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from hf_megatrain.engine.config import EngineConfig
from hf_megatrain.engine.layout import mark_resident
from hf_megatrain.planner.admission import admit, shortfalls
from hf_megatrain.planner.estimator import estimate, GiB, model_sizes
from hf_megatrain.planner.placement import resolve_placement, split_step
from hf_megatrain.planner.run import plan_run
from hf_megatrain.shapes import make_config
from tests.support.tiny import make_batch, make_model, make_rows as rows


def train(kind, lean, ga, together, clip, resident=0, steps=3, **fields):
    """The masters after `steps` steps, the losses and clipping norms on the way, and the engine.
    With clipping, the record ends with every gradient after the last step (clipped in place)."""
    model = make_model(kind, seed=4)
    engine = StreamingEngine(model, compute_dtype=torch.bfloat16, resident_layers=resident, lean_streamed=lean,
                             background_host_jobs=not clip, **fields).train()
    opt = HostAdamW(engine, lr=1e-2, weight_decay=0.1)
    record = []
    for step in range(steps):
        batches = [make_batch(batch=2, seq=10 + 2 * m, seed=10 * step + m, pad_rows=m % 2) for m in range(ga)]
        if not clip:  # each unit steps as soon as its gradient is final
            assert opt.step_during_backward()
        if together:
            record += [float(x) for x in engine.forward_backward_many(batches, None, 1.0 / ga)]
        else:
            record += [float(engine.forward_backward(b, None, 1.0 / ga)) for b in batches]
        if clip:
            record.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        if clip and step == steps - 1:
            record += [g for _, g in engine.named_grads()]
        engine.zero_grad()
    return engine, record, dict(engine.named_master_params())


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
@pytest.mark.parametrize("ga,together,clip", [(1, True, 0.05), (2, True, 0.05), (2, False, 0.05), (2, True, 0.0)])
def test_lean_streamed_is_bit_identical(kind, ga, together, clip):
    _, ref_record, ref = train(kind, False, ga, together, clip)
    engine, record, got = train(kind, True, ga, together, clip)
    layers = [u for u in engine.units if u.kind == "layer"]
    assert all(u.no_compute_copy and engine.store.compute[u.index] is None for u in layers)  # no bf16 copy kept
    assert engine.engine_config.lean_streamed and not engine.engine_config.lean_resident
    assert same(record, ref_record)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_lean_streamed_beside_resident_layers():
    """Resident layers keep their copy (lean_resident off); only the streamed ones go lean."""
    _, ref_record, ref = train("llama", False, 2, True, 0.05, resident=1)
    engine, record, got = train("llama", True, 2, True, 0.05, resident=1)
    assert [u.no_compute_copy for u in engine.units if u.kind == "layer"] == [False, True, True]
    assert same(record, ref_record) and all(torch.equal(got[n], ref[n]) for n in ref)



def test_trainer_with_lean_streamed_saves_what_the_default_saves(tmp_path):
    """MegaTrainTrainer(lean_streamed=True) in bf16 compute, its weights streamed from a folder into
    the store: the same logged losses and norms as the default, and the saved model loads back with
    from_pretrained, equal to the default's."""
    make_model("llama", seed=2).save_pretrained(tmp_path / "init")
    saved = {}
    for lean in (False, True):
        out = tmp_path / str(lean)
        args = MegaTrainArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                  max_steps=3, learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1,
                                  save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                                  compute_dtype="bfloat16", lean_streamed=lean, save_dtype="float32")
        trainer = MegaTrainTrainer(str(tmp_path / "init"), args, train_dataset=rows(12, 0),
                                   data_collator=default_data_collator)
        assert trainer.engine.engine_config.lean_streamed == lean
        trainer.train()
        trainer.save_model()
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        saved[lean] = (logs, AutoModelForCausalLM.from_pretrained(str(out)).state_dict())
    assert saved[True][0] == saved[False][0] and len(saved[True][0]) == 3
    for name, t in saved[False][1].items():
        assert torch.equal(saved[True][1][name], t), name


def test_the_plan_counts_16_bytes_per_streamed_parameter():
    """estimate: with lean_streamed the host holds no bf16 copy of the streamed decoder layers (the
    embedding and head keep theirs), and the GPU holds one layer's fp32 landing buffer."""
    cfg = make_config("llama-3.1-70b")
    sizes = model_sizes(cfg)
    layer_params = sum(u.numel for u in sizes.units if u.kind == "layer")
    default = estimate(cfg, 16, 1024, sizes=sizes)
    lean = estimate(cfg, 16, 1024, sizes=sizes, lean_streamed=True)
    assert default.host["compute copy (streamed)"] - lean.host["compute copy (streamed)"] == 2 * layer_params
    assert default.host_total - lean.host_total == 2 * layer_params
    assert lean.gpu["fp32 landing of a lean streamed layer"] == 4 * sizes.layer
    for resident in (0, 10):  # the GPU side is the default's plus that buffer, beside resident layers too
        kw = dict(sizes=sizes, resident_layers=resident, lean_resident=True)
        assert estimate(cfg, 16, 1024, lean_streamed=True, **kw).gpu_total == \
            estimate(cfg, 16, 1024, **kw).gpu_total + 4 * sizes.layer
    per_param = (lean.host["fp32 master weights"] + lean.host["compute copy (streamed)"]
                 + lean.host["fp32 gradient accumulator"] + lean.host["Adam moments (fp32 x2)"]) / sizes.params
    assert 16.0 < per_param < 16.1  # 16 B, plus the embedding and head's bf16 copies
    assert lean.host_total / GiB < 1100  # 70B: about 1.04 TiB, against 1.16 with the bf16 copy
    # in fp32 compute the master already streams: nothing changes
    fp32 = dict(compute_dtype=torch.float32)
    assert estimate(cfg, 16, 1024, sizes=sizes, lean_streamed=True, **fp32).host == \
        estimate(cfg, 16, 1024, sizes=sizes, **fp32).host


def test_a_refusal_names_lean_streamed_when_it_would_fit():
    """13B, 19 layers resident: 117 GiB of host. On a 112 GiB host lean_streamed fits (the 21 streamed
    layers' bf16 copies are 12.4 GiB) and the refusal says so first; on 100 GiB only with
    transient_grads too, which it then names; on 80 GiB neither, and it offers neither."""
    cfg = make_config("llama-2-13b")
    plan = estimate(cfg, 16, 1024, resident_layers=19, lean_resident=True)
    assert plan.lean_streamed_saving == 2 * 21 * model_sizes(cfg).layer
    with pytest.raises(MegaTrainError) as fits:
        admit(plan, host_free=112 * GiB, gpu_free=139 * GiB)
    fixes = str(fits.value).split("Would fit with: ", 1)[1]
    assert fixes.startswith("lean_streamed=True: the streamed layers keep no bf16 copy in host RAM (12.4 GiB less")
    with pytest.raises(MegaTrainError) as both:  # lean_streamed alone is short; with transient_grads it fits
        admit(plan, host_free=100 * GiB, gpu_free=139 * GiB)
    assert str(both.value).split("Would fit with: ", 1)[1].startswith(
        "lean_streamed=True and transient_grads=True (")
    with pytest.raises(MegaTrainError) as short:
        admit(plan, host_free=80 * GiB, gpu_free=139 * GiB)
    assert "lean_streamed" not in str(short.value) and "transient_grads" not in str(short.value)
    assert estimate(cfg, 16, 1024, resident_layers=19, lean_streamed=True).lean_streamed_saving == 0


def test_the_planner_takes_lean_streamed_only_when_the_host_needs_it():
    """lean_streamed auto (the trainer's default): off while the host RAM suffices, also when moving
    more layers onto the GPU makes it suffice (that costs no speed); on when only it makes the plan
    fit; off when even it does not. The estimate command says the same."""
    cfg = make_config("llama-2-13b")
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None,
                        lean_streamed=None)

    def placed(host_gib):
        return resolve_placement(cfg, 16, 1024, auto, gpu_free=139 * GiB, host_free=host_gib * GiB).engine

    assert placed(125).lean_streamed is False
    more_resident = placed(112)  # 21 layers resident instead of 19 and the host suffices
    assert more_resident.lean_streamed is False and more_resident.resident_layers > 19
    tight = placed(100)
    assert tight.lean_streamed is True
    assert not shortfalls(estimate(cfg, 16, 1024, tight), 100 * GiB, 139 * GiB)
    assert shortfalls(estimate(cfg, 16, 1024, resolve_placement(
        cfg, 16, 1024, replace(auto, lean_streamed=False), gpu_free=139 * GiB, host_free=100 * GiB).engine),
        100 * GiB, 139 * GiB)  # without it, no placement fits
    assert placed(70).lean_streamed is False  # short either way: the refusal says what would fit
    assert resolve_placement(cfg, 16, 1024, auto, gpu_free=139 * GiB).engine.lean_streamed is False  # no host given
    # the command plans one micro-batch per step: no staging slabs (2 GiB), so its host is 95 GiB
    r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "estimate", "llama-2-13b", "--batch", "16", "--seq",
                        "1024", "--gpu_gib", "139", "--host_gib", "95", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "pinned staging slabs" not in out["host"]
    assert out["verdict"] == "fits" and out["host"]["compute copy (streamed)"] < 2 * GiB  # embedding and head only


# -- transient gradients --------------------------------------------------------------------------
def train_early(kind, ga, steps=3, **engine):
    """Steps during every backward (no clipping), a step's micro-batches together."""
    engine = StreamingEngine(make_model(kind, seed=4), compute_dtype=torch.bfloat16, background_host_jobs=True,
                             **engine).train()
    opt = HostAdamW(engine, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        batches = [make_batch(batch=2, seq=10 + 2 * m, seed=10 * step + m, pad_rows=m % 2) for m in range(ga)]
        assert opt.step_during_backward()
        losses += [float(x) for x in engine.forward_backward_many(batches, None, 1.0 / ga)]
        opt.step()
        engine.zero_grad()
    return engine, opt, losses, dict(engine.named_master_params())


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
@pytest.mark.parametrize("ga,lean,resident", [(1, False, 0), (2, False, 0), (2, True, 0), (2, True, 1)])
def test_transient_grads_are_bit_identical(kind, ga, lean, resident):
    """With lean_streamed too, a streamed parameter costs 12 bytes of host RAM (master and moments). A
    resident decoder layer keeps no gradient of its own either (on the CPU it takes the host buffers;
    the GPU test covers the shared device buffer); a resident embedding and head keep theirs."""
    _, _, ref_losses, ref = train_early(kind, ga, resident_layers=resident)
    engine, _, losses, got = train_early(kind, ga, resident_layers=resident, lean_streamed=lean, transient_grads=True)
    store = engine.store
    shared = [u for u in engine.units if not u.resident or u.kind == "layer"]
    assert len(store._grad_buffers) == 3 and all(store.grad[u.index] is None or any(
        store.grad[u.index].data_ptr() == b.data_ptr() for b in store._grad_buffers) for u in shared)
    assert all(store.grad[u.index] is not None for u in engine.units if u.resident and u.kind != "layer")
    assert losses == ref_losses
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def train_measured(kind, ga, clip, steps=3, model=None, **engine):
    """Exact clipping with transient_grads: each step first measures the global norm with a pass that
    keeps no gradient (gradient_norm), then steps every unit, clipped, as its gradient lands."""
    engine = StreamingEngine(model or make_model(kind, seed=4), compute_dtype=torch.bfloat16,
                             background_host_jobs=True, transient_grads=True, **engine).train()
    opt = HostAdamW(engine, lr=1e-2, weight_decay=0.1)
    record = []
    for step in range(steps):
        batches = [make_batch(batch=2, seq=10 + 2 * m, seed=10 * step + m, pad_rows=m % 2) for m in range(ga)]
        norm = engine.gradient_norm(batches, None, 1.0 / ga)
        assert opt.step_during_backward(clip_norm=(norm, clip))
        record += [float(x) for x in engine.forward_backward_many(batches, None, 1.0 / ga)]
        record.append(float(norm))
        opt.step()
        engine.zero_grad()
    return engine, record, dict(engine.named_master_params())


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
@pytest.mark.parametrize("ga,lean,resident", [(1, False, 0), (2, True, 0), (2, True, 1)])
def test_transient_grads_clip_exactly_after_a_norm_pass(kind, ga, lean, resident):
    """transient_grads with clipping: the norm pass gives the norm clip_grad_norm_ would take from the
    accumulators, and the steps during the second backward clip by it. Losses, clipping norms and
    masters equal the default path's with clip_grad_norm_ and step() bit for bit, beside lean_streamed
    and a resident layer; the clipping is active (norms far above max_norm)."""
    _, ref_record, ref = train(kind, False, ga, True, 0.05, resident=resident)
    engine, record, got = train_measured(kind, ga, 0.05, resident_layers=resident, lean_streamed=lean)
    assert engine.store.transient and len(engine.store._grad_buffers) == 3
    assert same(record, ref_record[: len(record)]) and min(record[ga :: ga + 1]) > 0.05
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_the_norm_pass_leaves_the_rng_as_it_found_it():
    """With dropout the forward draws random numbers: the norm pass puts the RNG back, so the stepping
    pass draws what the default's one pass draws, and the numbers stay equal bit for bit."""
    model = make_model("llama", seed=4, attention_dropout=0.3)
    torch.manual_seed(7)
    default = StreamingEngine(copy.deepcopy(model), compute_dtype=torch.bfloat16).train()
    opt = HostAdamW(default, lr=1e-2, weight_decay=0.1)
    ref_record = []
    for step in range(3):
        ref_record.append(float(default.forward_backward(make_batch(batch=2, seq=10, seed=10 * step, pad_rows=0))))
        ref_record.append(float(opt.clip_grad_norm_(0.05)))
        opt.step()
        default.zero_grad()
    torch.manual_seed(7)
    _, record, got = train_measured("llama", 1, 0.05, model=copy.deepcopy(model))
    assert same(record, ref_record)
    torch.manual_seed(7)
    undropped = float(StreamingEngine(copy.deepcopy(model), compute_dtype=torch.bfloat16).eval().forward_backward(
        make_batch(batch=2, seq=10, seed=0, pad_rows=0)))
    assert undropped != record[0]  # the dropout did draw
    for name, t in default.named_master_params():
        assert torch.equal(got[name], t), name


def test_transient_grads_refuse_what_would_need_a_persistent_gradient(tmp_path):
    engine, opt, _, _ = train_early("llama", 2, steps=1, transient_grads=True)
    with pytest.raises(MegaTrainError, match="step_during_backward"):  # a backward that does not step as it goes
        engine.forward_backward(make_batch())
    assert opt.step_during_backward()
    with pytest.raises(MegaTrainError, match="second gradient in one optimizer step"):  # micro-batches one at a time
        engine.forward_backward(make_batch(seed=1), None, 0.5)
        engine.forward_backward(make_batch(seed=2), None, 0.5)
    with pytest.raises(MegaTrainError, match="keeps no gradient"):
        dict(engine.named_grads())
    with pytest.raises(MegaTrainError, match="background_host_jobs"):
        StreamingEngine(make_model("llama"), compute_dtype=torch.bfloat16, transient_grads=True)
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], compute_dtype="bfloat16",
                  background_host_jobs=True, transient_grads=True)
    # asked for in the arguments without background_host_jobs: accepted (a GPU's default runs them), and
    # refused on the CPU, where they are off by default, by the trainer that knows the device
    asked = MegaTrainArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], transient_grads="true",
                               max_grad_norm=0)
    with pytest.raises(MegaTrainError, match="needs background_host_jobs"):
        MegaTrainTrainer(make_model("llama"), asked, train_dataset=rows(4, 0))
    with pytest.raises(MegaTrainError, match="layer_major_accumulation=true"):
        MegaTrainTrainer(make_model("llama"), MegaTrainArguments(**common, max_grad_norm=0,
                                                                 gradient_accumulation_steps=2),
                         train_dataset=rows(4, 0))


def test_a_failed_step_fails_the_next_buffer_claim_instead_of_hanging(monkeypatch):
    """The step of an early unit fails on the host worker: the worker skips the later steps, whose
    buffers are then never freed by a step. The training thread, claiming one of them, gets the
    failure (the unit's ready signal carries it) and does not wait forever."""
    engine = StreamingEngine(make_model("llama", num_hidden_layers=4, seed=4), compute_dtype=torch.bfloat16,
                             background_host_jobs=True, transient_grads=True).train()
    opt = HostAdamW(engine, lr=1e-2)
    last = engine.units[-1].index  # the head: its gradient comes first, so its step is the first to run
    original = HostAdamW.step_unit

    def failing(self, index, *args):
        if index == last:
            raise RuntimeError("injected step failure")
        original(self, index, *args)

    monkeypatch.setattr(HostAdamW, "step_unit", failing)
    errors = []

    def run():
        try:
            for step in range(2):
                opt.step_during_backward()
                engine.forward_backward_many([make_batch(seed=step)], None, 1.0)
                opt.step()
                engine.zero_grad()
        except BaseException as e:  # handed to the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the training thread hangs on a gradient buffer"
    assert errors and isinstance(errors[0], (HostJobError, RuntimeError)), errors
    assert "injected step failure" in str(errors[0])


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_trainer_with_transient_grads_and_lean_streamed_equals_the_default(tmp_path, clip):
    """Through MegaTrainTrainer: GA 2 together, bf16 compute on host workers, without clipping and with
    it (Trainer's clipping hook then returns the norm pass's norm, and the steps during the backward
    clip by it): the same logged losses and gradient norms (taken as each transient gradient landed)
    and the same weights with both modes on and off."""
    data, model = rows(16, 0), make_model("mixtral", seed=3)
    results = {}
    for on in (False, True):
        args = MegaTrainArguments(output_dir=str(tmp_path / str(on)), per_device_train_batch_size=2,
                                  gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2, max_grad_norm=clip,
                                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                                  compute_dtype="bfloat16", background_host_jobs=True,
                                  layer_major_accumulation="true", lean_streamed=str(on).lower(), transient_grads=on)
        trainer = MegaTrainTrainer(copy.deepcopy(model), args, train_dataset=data,
                                   data_collator=default_data_collator)
        assert trainer.engine.store.transient == on
        trainer.train()
        results[on] = ([(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h],
                       dict(trainer.engine.named_master_params()))
    assert results[True][0] == results[False][0] and len(results[True][0]) == 4
    if clip:
        assert min(norm for _, norm in results[True][0]) > clip  # the clipping was active
    for name, t in results[False][1].items():
        assert torch.equal(results[True][1][name], t), name


def test_the_plan_counts_12_bytes_per_streamed_parameter_with_both_modes():
    cfg = make_config("llama-3.1-70b")
    sizes = model_sizes(cfg)
    both = estimate(cfg, 16, 1024, sizes=sizes, lean_streamed=True, transient_grads=True)
    default = estimate(cfg, 16, 1024, sizes=sizes)
    assert "fp32 gradient accumulator" not in both.host and "pinned staging slabs" not in both.host
    assert both.host["fp32 gradient buffers (transient, 3)"] == 4 * 3 * sizes.head  # the largest streamed unit
    state = (both.host["fp32 master weights"] + both.host["Adam moments (fp32 x2)"]) / sizes.params
    assert state == 12
    # 70B: 807 GiB, which a 1 TB host (931 GiB) holds, against 1,194 GiB by default
    assert both.host_total / GiB < 820 and default.host_total / GiB > 1150


def test_the_plan_counts_12_bytes_per_resident_layer_parameter_with_transient_grads():
    """On the GPU side too: a lean resident layer keeps its master and moments, and the resident layers
    share one fp32 gradient buffer of the largest; the embedding and head keep their gradients. More
    layers then fit: 18.3 B parameters (dense-18b) train on one H200 and 122.7 GiB of host without
    clipping, which neither mode alone allows."""
    cfg = make_config("dense-18b")
    sizes = model_sizes(cfg)
    layer = sizes.units[1].numel
    kw = dict(sizes=sizes, resident_layers=20, lean_resident=True, lean_streamed=True)
    plain, both = estimate(cfg, 16, 1024, **kw), estimate(cfg, 16, 1024, transient_grads=True, **kw)
    assert plain.gpu["lean resident layers (master, grad, Adam)"] == 16 * 20 * layer
    assert both.gpu["lean resident layers (master, Adam)"] == 12 * 20 * layer
    assert both.gpu["fp32 gradient of a resident layer (transient, shared)"] == 4 * layer
    assert both.gpu["resident units (weights, master, grad, Adam)"] == plain.gpu["resident units (weights, master, grad, Adam)"]
    assert plain.gpu_total - both.gpu_total == 4 * 19 * layer
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None,
                        lean_streamed=None, transient_grads=True)
    placed = resolve_placement(cfg, 16, 1024, auto, gpu_free=138.5 * GiB, host_free=122.7 * GiB).engine
    assert placed.lean_streamed and not shortfalls(estimate(cfg, 16, 1024, placed, sizes=sizes), 122.7 * GiB, 138.5 * GiB)
    without = resolve_placement(cfg, 16, 1024, replace(auto, transient_grads=False), gpu_free=138.5 * GiB,
                                host_free=122.7 * GiB).engine
    assert shortfalls(estimate(cfg, 16, 1024, without, sizes=sizes), 122.7 * GiB, 138.5 * GiB)


def test_the_planner_takes_transient_grads_before_lean_streamed_and_only_where_exact():
    """Auto modes, cheapest first: transient_grads costs no time without clipping (each unit is stepped as
    it lands anyway), lean_streamed costs PCIe bytes. Qwen2.5-14B at 8K tokens on one H200: 139 GiB of
    host needs neither; 122.7 GiB takes transient_grads alone (its resident layers are 4 bytes a parameter
    smaller, so 26 fit instead of 21); 60 GiB fits no mode, and the plan stays the plain one for the
    refusal. Micro-batches one at a time never get it; together they do. The trainer offers it only on a
    GPU without clipping."""
    cfg = make_config("qwen2.5-14b")
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None,
                        lean_streamed=None, transient_grads=None)

    def placed(host_gib, **kw):
        return resolve_placement(cfg, 8, 1024, auto, gpu_free=138.5 * GiB, host_free=host_gib * GiB, **kw).engine

    roomy, tight, short = placed(140), placed(122.7), placed(60)
    assert (roomy.transient_grads, roomy.lean_streamed, roomy.resident_layers) == (False, False, 21)
    assert (tight.transient_grads, tight.lean_streamed, tight.resident_layers) == (True, False, 26)
    assert (short.transient_grads, short.lean_streamed) == (False, False)
    from hf_megatrain.planner.run import Machine, Request, settle_autos  # noqa: I001

    machine = Machine(138.5 * GiB, 122.7 * GiB)
    assert plan_run(cfg, Request(auto, 8, 1024, world_size=2, max_grad_norm=0.0), machine).engine.transient_grads \
        is False  # data parallel: never
    gpu = dict(host_free=122.7 * GiB, gpu_free=138.5 * GiB)
    together = split_step(cfg, 8, 1024, auto, 2, **gpu)
    assert together.per_pass == 2 and together.placement.engine.transient_grads
    apart = split_step(cfg, 8, 1024, auto, 2, asked=False, **gpu)
    assert apart.per_pass == 1 and not apart.placement.engine.transient_grads and apart.placement.engine.lean_streamed

    def offered(device, clip, asked=None):  # what settle_autos leaves for the search to weigh
        eng = replace(auto, device=device, transient_grads=asked)
        return settle_autos(eng, Request(eng, 8, 1024, max_grad_norm=clip), machine).transient_grads

    assert offered("cuda", 0.0) is None and offered("cuda", 1.0) is False and offered("cpu", 0.0) is False
    assert offered("cpu", 0.0, True) is True


# -- gradients kept on the GPU (with clipping) ------------------------------------------------------
def test_the_plan_moves_the_last_streamed_layers_gradients_to_the_gpu():
    """gpu_grad_layers=N: 4 bytes per parameter of the last N streamed layers move from the host's
    accumulator to the GPU, beside two 32 MiB pinned landing tiles; nothing else changes. With a step of
    one micro-batch (or its micro-batches together) no staging slab is planned: none is ever allocated."""
    cfg = make_config("qwen2.5-14b")
    sizes = model_sizes(cfg)
    layer = sizes.units[1].n_train
    kw = dict(sizes=sizes, resident_layers=20, lean_resident=True, lean_streamed=True)
    plain, moved = estimate(cfg, 16, 1024, **kw), estimate(cfg, 16, 1024, gpu_grad_layers=3, **kw)
    assert plain.host["fp32 gradient accumulator"] - moved.host["fp32 gradient accumulator"] == 3 * 4 * layer
    assert moved.host["pinned landing tiles (2, gradients kept on the GPU)"] == 2 * 4 * (1 << 23)
    assert moved.gpu["fp32 gradients of streamed layers (gpu_grad_layers)"] == 3 * 4 * layer
    assert moved.gpu_total - plain.gpu_total == 3 * 4 * layer
    assert "pinned staging slabs" in plain.host
    assert "pinned staging slabs" not in estimate(cfg, 16, 1024, later_contributions=False, **kw).host
    units = sizes.units
    mark_resident(units, 20, True, True, gpu_grads=3)
    assert [u.layer for u in units if u.grad_on_gpu] == [45, 46, 47]  # stepped last: they cross while others step
    with pytest.raises(MegaTrainError, match="exclude each other"):
        EngineConfig(device="cuda", gpu_grad_layers=2, transient_grads=True)
    from hf_megatrain.planner import Machine, Request
    from hf_megatrain.planner.run import settle_autos

    def settled(**fields):  # the planner's rules (planner/run.py), not the config's
        eng = EngineConfig(**fields)
        return settle_autos(eng, Request(eng, 1, 1024), Machine(139 * GiB, 120 * GiB)).gpu_grad_layers

    assert settled(device="cuda", gpu_grad_layers="auto", transient_grads=True) == 0  # nothing persists to place
    assert settled(device="cpu", gpu_grad_layers="auto") == 0  # nothing to weigh off a GPU
    assert settled(device="cuda", gpu_grad_layers="auto") is None  # the search's to weigh


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
@pytest.mark.parametrize("ga,together,clip,lean,resident", [(1, True, 0.05, False, 0), (2, True, 0.05, True, 1),
                                                            (2, False, 0.05, False, 1), (2, True, 0.0, True, 0)])
def test_gradients_kept_apart_are_stepped_tile_by_tile_bit_identical(monkeypatch, kind, ga, together, clip, lean,
                                                                      resident):
    """gpu_grad_layers on the CPU, where the device is the host: the last streamed layers' gradients are
    kept apart and each host step clips one in place, then copies it tile by tile through the two landing
    tiles and steps from those (the path a GPU run takes, without its stream). Tiles of 1,024 elements, so
    a layer crosses in dozens and both tiles are reused: losses, clipping norms, the gradients after the
    last step (clipped) and the masters equal the default's bit for bit, with and without clipping, beside
    lean_streamed and a resident layer, micro-batches together and one at a time."""
    import hf_megatrain.engine.optimizer as optimizer

    monkeypatch.setattr(optimizer, "LANDING_TILE", 1 << 10)
    _, ref_record, ref = train(kind, lean, ga, together, clip, resident)
    stepped = []
    landing = optimizer.HostAdamW._adamw_landing
    monkeypatch.setattr(optimizer.HostAdamW, "_adamw_landing",
                        lambda self, index, *a: (stepped.append(index), landing(self, index, *a)))
    engine, record, got = train(kind, lean, ga, together, clip, resident, gpu_grad_layers=2)
    kept = [u.index for u in engine.units if u.grad_on_gpu]
    assert [engine.units[i].layer for i in kept] == [1, 2] and engine.engine_config.gpu_grad_layers == 2
    assert all(engine.store.grad[i].numel() > 8 * optimizer.LANDING_TILE for i in kept)
    assert sorted(set(stepped)) == kept and len(stepped) == 2 * 3  # each kept layer, every step, through the tiles
    assert same(record, ref_record)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_the_planner_keeps_gradients_on_the_gpu_where_that_makes_clipping_fit():
    """Qwen2.5-14B with clipping at 16K tokens on one H200 and 122.7 GiB of host: lean_streamed alone is
    3 GiB short; the GPU's room beside its resident layers holds two layers' gradients, and then the
    plan fits. The trainer's one-micro-batch plan and the estimate command agree."""
    cfg = make_config("qwen2.5-14b")
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None,
                        lean_streamed=None, transient_grads=False, gpu_grad_layers=None)
    machine = dict(gpu_free=138.5 * GiB, host_free=122.7 * GiB)
    placed = split_step(cfg, 16, 1024, auto, 1, **machine).placement.engine
    assert placed.lean_streamed and placed.gpu_grad_layers == 2
    plan = estimate(cfg, 16, 1024, placed, later_contributions=False)
    assert not shortfalls(plan, 122.7 * GiB, 138.5 * GiB)
    without = split_step(cfg, 16, 1024, replace(auto, gpu_grad_layers=0), 1, **machine).placement.engine
    assert shortfalls(estimate(cfg, 16, 1024, without, later_contributions=False), 122.7 * GiB, 138.5 * GiB)
    assert split_step(cfg, 16, 1024, auto, 1, gpu_free=138.5 * GiB, host_free=200 * GiB).placement.engine \
        .gpu_grad_layers == 0  # the host has room: nothing moves
    r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "estimate", "qwen2.5-14b", "--batch", "16", "--seq",
                        "1024", "--gpu_gib", "138.5", "--host_gib", "122.7", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"] == "fits" and out["gpu"]["fp32 gradients of streamed layers (gpu_grad_layers)"] > 0


def test_estimate_shows_each_mode_and_a_refusal_names_the_one_that_fits(tmp_path):
    """70B on one H200 and a host with 953 GiB available: the default (1,100 GiB) and lean_streamed
    (978) are short, lean_streamed + transient_grads (739) fits; with clipping (the command's default,
    1.0) through a norm pass. The modes table says so with each mode's host bytes per parameter and
    modelled step time, and admission's refusal names the combination first, priced with that pass."""
    r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "estimate", "llama-3.1-70b", "--batch", "16",
                        "--seq", "1024", "--gpu_gib", "139", "--host_gib", "953", "--json"], capture_output=True,
                       text=True)
    assert r.returncode == 1, r.stderr  # does not fit as asked
    modes = {m["mode"]: m for m in json.loads(r.stdout)["modes"]}
    default, lean, both = (modes[k] for k in ("default", "lean_streamed", "lean_streamed + transient_grads"))
    assert default["host_gib"] > lean["host_gib"] > 950 > both["host_gib"]
    assert default["state_bytes_per_parameter"] - lean["state_bytes_per_parameter"] == pytest.approx(1.8, abs=0.1)
    assert lean["state_bytes_per_parameter"] - both["state_bytes_per_parameter"] == pytest.approx(3.6, abs=0.2)
    assert (default["fits"], lean["fits"], both["fits"]) == (False, False, True)
    assert default["clipping"] and both["clipping"] and both["norm_pass"] and not default["norm_pass"]
    assert both["step_s"] > default["step_s"]  # one more forward and backward per step
    cfg = make_config("llama-3.1-70b")
    placed = resolve_placement(cfg, 16, 1024, EngineConfig(device="cuda", resident_layers=None, offload_activations=None,
                                                          lean_resident=None, lean_streamed=None),
                               gpu_free=139 * GiB, host_free=953 * GiB).engine
    from hf_megatrain.planner.probe import REFERENCE
    from hf_megatrain.planner.steptime import mode_cost

    with pytest.raises(MegaTrainError) as refused:
        admit(estimate(cfg, 16, 1024, placed), host_free=953 * GiB, gpu_free=139 * GiB,
              step_cost=mode_cost(cfg, 16, 1024, placed, REFERENCE, clip=True))
    fixes = str(refused.value).split("Would fit with: ", 1)[1]
    assert fixes.startswith("lean_streamed=True and transient_grads=True (") and "norm with a forward" in fixes
    # its speed cost from the step-time model: with clipping, the norm pass's forward and backward
    slower = re.search(r"gives ([\d.]+) s/step with it against ([\d.]+) as asked, ([\d.]+)x the tokens/s", fixes)
    assert slower and float(slower[1]) > float(slower[2]) and float(slower[3]) < 1
    unclipped = mode_cost(cfg, 16, 1024, placed, REFERENCE, clip=False)(dict(lean_streamed=True, transient_grads=True))
    faster = re.search(r"gives ([\d.]+) s/step with it against ([\d.]+) as asked", unclipped)
    assert float(faster[1]) < float(faster[2])  # without clipping the host AdamW overlaps the backward
    text = json.loads(r.stdout)["verdict"]  # the estimate command's refusal says the same
    assert "Would fit with: lean_streamed=True and transient_grads=True" in text and "s/step with it" in text
    asked = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "estimate", "llama-3.1-70b", "--transient_grads"],
                           capture_output=True, text=True)
    assert asked.returncode == 0, asked.stderr
    assert "step time (model, clipping at 1 through a norm pass, transient_grads)" in asked.stdout
