"""Issue 21's memory modes: fewer bytes per parameter, the same numbers.

lean_streamed: streamed decoder layers keep no bf16 copy in host RAM; each use casts the fp32 master
(on a GPU, after it crosses PCIe). Bit for bit against the default path on the CPU in bf16 compute:
losses, clipping norms and masters, for Llama, a tied Llama and Mixtral (load-balancing loss), with
gradient accumulation one at a time and together, with clipping and with steps during the backward;
through the trainer, the saved model loads back with from_pretrained equal to the default's. The
planner counts it, takes it on auto only when the host needs it, and a refusal names it.
"""

import json
import subprocess
import sys
from dataclasses import replace

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, default_data_collator

from hf_megatrain import HostAdamW, MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from hf_megatrain.engine.config import EngineConfig
from hf_megatrain.memory import GiB, admit, estimate, model_shapes, resolve_placement, shortfalls
from hf_megatrain.shapes import make_config
from tests.support.tiny import make_batch, make_model


def train(kind, lean, ga, together, clip, resident=0, steps=3):
    model = make_model(kind, seed=4)
    engine = StreamingEngine(model, compute_dtype=torch.bfloat16, resident_layers=resident, lean_streamed=lean,
                             background_host_jobs=not clip).train()
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
        engine.zero_grad()
    return engine, record, dict(engine.named_master_params())


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
@pytest.mark.parametrize("ga,together,clip", [(1, True, 0.05), (2, True, 0.05), (2, False, 0.05), (2, True, 0.0)])
def test_lean_streamed_is_bit_identical(kind, ga, together, clip):
    _, ref_record, ref = train(kind, False, ga, together, clip)
    engine, record, got = train(kind, True, ga, together, clip)
    layers = [u for u in engine.units if u.kind == "layer"]
    assert all(u.lean and engine.store.compute[u.index] is None for u in layers)  # no bf16 copy kept
    assert engine.engine_config.lean_streamed and not engine.engine_config.lean_resident
    assert record == ref_record
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_lean_streamed_beside_resident_layers():
    """Resident layers keep their copy (lean_resident off); only the streamed ones go lean."""
    _, ref_record, ref = train("llama", False, 2, True, 0.05, resident=1)
    engine, record, got = train("llama", True, 2, True, 0.05, resident=1)
    assert [u.lean for u in engine.units if u.kind == "layer"] == [False, True, True]
    assert record == ref_record and all(torch.equal(got[n], ref[n]) for n in ref)


def rows(n, seed):
    parts = [make_batch(1, 12, seed=seed + i, pad_rows=int(i % 3 == 0)) for i in range(n)]
    return datasets.Dataset.from_dict({k: [p[k][0].tolist() for p in parts] for k in parts[0]})


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
    shapes = model_shapes(cfg)
    layer_params = sum(u.numel for u in shapes.units if u.kind == "layer")
    default = estimate(cfg, 16, 1024, shapes=shapes)
    lean = estimate(cfg, 16, 1024, shapes=shapes, lean_streamed=True)
    assert default.host["compute copy (streamed)"] - lean.host["compute copy (streamed)"] == 2 * layer_params
    assert default.host_total - lean.host_total == 2 * layer_params
    assert lean.gpu["fp32 landing of a lean streamed layer"] == 4 * shapes.layer
    for resident in (0, 10):  # the GPU side is the default's plus that buffer, beside resident layers too
        kw = dict(shapes=shapes, resident_layers=resident, lean_resident=True)
        assert estimate(cfg, 16, 1024, lean_streamed=True, **kw).gpu_total == \
            estimate(cfg, 16, 1024, **kw).gpu_total + 4 * shapes.layer
    per_param = (lean.host["fp32 master weights"] + lean.host["compute copy (streamed)"]
                 + lean.host["fp32 gradient accumulator"] + lean.host["Adam moments (fp32 x2)"]) / shapes.params
    assert 16.0 < per_param < 16.1  # 16 B, plus the embedding and head's bf16 copies
    assert lean.host_total / GiB < 1100  # 70B: about 1.04 TiB, against 1.16 with the bf16 copy
    # in fp32 compute the master already streams: nothing changes
    fp32 = dict(compute_dtype=torch.float32)
    assert estimate(cfg, 16, 1024, shapes=shapes, lean_streamed=True, **fp32).host == \
        estimate(cfg, 16, 1024, shapes=shapes, **fp32).host


def test_a_refusal_names_lean_streamed_when_it_would_fit():
    """13B, 19 layers resident: 117 GiB of host. On a 112 GiB host lean_streamed fits (the 21 streamed
    layers' bf16 copies are 12.4 GiB) and the refusal says so first; on 100 GiB it would not, and
    the refusal does not offer it."""
    cfg = make_config("llama-2-13b")
    plan = estimate(cfg, 16, 1024, resident_layers=19, lean_resident=True)
    assert plan.lean_streamed_saving == 2 * 21 * model_shapes(cfg).layer
    with pytest.raises(MegaTrainError) as fits:
        admit(plan, host_free=112 * GiB, gpu_free=139 * GiB)
    fixes = str(fits.value).split("Would fit with: ", 1)[1]
    assert fixes.startswith("lean_streamed=True: the streamed layers keep no bf16 copy in host RAM (12.4 GiB less")
    with pytest.raises(MegaTrainError) as short:
        admit(plan, host_free=100 * GiB, gpu_free=139 * GiB)
    assert "lean_streamed" not in str(short.value)
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
    r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "estimate", "llama-2-13b", "--batch", "16", "--seq",
                        "1024", "--gpu_gib", "139", "--host_gib", "100", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"] == "fits" and out["host"]["compute copy (streamed)"] < 2 * GiB  # embedding and head only
