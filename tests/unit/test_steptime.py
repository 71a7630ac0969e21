"""The step-time model (steptime.py) and the rates it runs on (probe.py, `hf-megatrain probe`)."""

import json
from dataclasses import replace

import pytest

from hf_megatrain.planner import probe
from hf_megatrain.engine.config import EngineConfig
from hf_megatrain.planner.estimator import model_sizes
from hf_megatrain.shapes import make_config as shape_config
from hf_megatrain.planner.steptime import (ATTENTION_BACKWARD, GPU_EFFICIENCY, lean_verdict, predict,
                                   routed_per_layer)
from tests.support.tiny import make_config

RATES = replace(probe.REFERENCE, matmul_tflops=100.0, h2d_gbs=50.0, d2h_gbs=50.0, h2d_duplex_gbs=40.0,
                d2h_duplex_gbs=40.0, gpu_mem_gbs=3000.0, host_copy_gbs=80.0, host_update_gbs=90.0, adamw_gparams=2.0,
                adamw_noclip_gparams=2.5, measured="test rates")


def gpu(**fields):
    return EngineConfig(device="cuda", **fields)


def test_all_resident_is_compute_and_counts_every_flop():
    """Nothing streams: the step is the FLOPs at the model's efficiency plus the GPU's own AdamW."""
    cfg = make_config("llama")
    rows, seq, layers = 4, 128, cfg.num_hidden_layers
    t = predict(cfg, rows, seq, gpu(resident_layers=layers), RATES)
    s = model_sizes(cfg)
    tokens = rows * seq
    layer_params = sum(u.numel for u in s.units if u.kind == "layer")
    attention = 2 * rows * seq * seq * cfg.hidden_size * layers
    # matmuls: forward 2, recompute 2, backward 4; attention: forward, recompute, backward
    flops = 8 * layer_params * tokens + (1 + 1 + ATTENTION_BACKWARD) * attention \
        + 6 * cfg.vocab_size * cfg.hidden_size * tokens
    adamw = s.params * 30 / (RATES.gpu_mem_gbs * 1e9)
    assert t.step_s == pytest.approx(flops / (RATES.matmul_tflops * 1e12 * GPU_EFFICIENCY) + adamw, rel=1e-9)
    assert t.bound == "compute" and t.lanes["h2d"] == t.lanes["d2h"] == t.lanes["host_adamw"] == 0
    assert t.tokens_per_s == pytest.approx(tokens / t.step_s)


def test_the_bound_is_the_lane_that_limits():
    """A slow host AdamW bounds a streamed step, after the backward when clipping; without clipping it
    overlaps the backward and the step is shorter; slow PCIe bounds it instead; a fast everything
    else leaves compute."""
    cfg = make_config("llama")
    eng = gpu(resident_layers=0)
    slow_host = replace(RATES, adamw_gparams=1e-4, adamw_noclip_gparams=1e-4)
    clipped = predict(cfg, 4, 128, eng, slow_host, clip=True)
    free = predict(cfg, 4, 128, eng, slow_host, clip=False)
    assert clipped.bound == "host AdamW after the backward (exact clipping)"
    assert free.bound == "host AdamW" and free.step_s < clipped.step_s
    # clipped: the whole AdamW runs after the backward, so the step is at least the backward plus it
    assert clipped.step_s > clipped.lanes["host_adamw"]
    slow_pcie = replace(RATES, h2d_gbs=1e-3, d2h_gbs=1e-3, h2d_duplex_gbs=1e-3, d2h_duplex_gbs=1e-3)
    pcie = predict(cfg, 4, 128, eng, slow_pcie)
    assert pcie.bound == "PCIe" and pcie.step_s >= pcie.lanes["h2d"] / 2 * 50 / 40
    slow_gpu = replace(RATES, matmul_tflops=1e-3)
    assert predict(cfg, 4, 128, eng, slow_gpu).bound == "compute"


def test_a_lean_unit_is_stepped_at_the_lean_rate():
    """lean_streamed: the host AdamW refreshes no compute copy, so its streamed layers are stepped at
    the probe's lean rate; rates without one (an older probe, the reference) scale the measured rate
    by the bytes a tile's ops move (42 -> 36 per parameter clipped, 34 -> 28 unclipped)."""
    cfg = make_config("llama")
    slow_host = replace(RATES, adamw_gparams=1e-4, adamw_noclip_gparams=2e-4)
    assert slow_host.adamw(True, lean=True) == pytest.approx(1e-4 * 42 / 36)
    assert slow_host.adamw(False, lean=True) == pytest.approx(2e-4 * 34 / 28)
    probed = replace(slow_host, adamw_lean_gparams=3e-4, adamw_lean_noclip_gparams=5e-4)
    assert (probed.adamw(True, True), probed.adamw(False, True), probed.adamw(True)) == (3e-4, 5e-4, 1e-4)
    for rates in (slow_host, probed):
        for clip in (True, False):
            full = predict(cfg, 4, 128, gpu(resident_layers=1), rates, clip=clip)
            lean = predict(cfg, 4, 128, gpu(resident_layers=1, lean_streamed=True), rates, clip=clip)
            assert full.lanes["host_adamw"] / lean.lanes["host_adamw"] == pytest.approx(
                rates.adamw(clip, lean=True) / rates.adamw(clip))
            assert lean.step_s < full.step_s  # bound by the host AdamW, which moves fewer bytes


def test_the_cost_of_lean_streamed_taken_on_auto_is_said():
    """The trainer logs lean_verdict when the planner took lean_streamed: at 13B and 16K tokens/step on
    the reference H200 its doubled bytes stay hidden (measured so in run 15); over a PCIe ten times
    slower the verdict says that PCIe binds, and by how much."""
    cfg = shape_config("llama-2-13b")
    slow = replace(probe.REFERENCE, h2d_gbs=probe.REFERENCE.h2d_gbs / 10,
                   h2d_duplex_gbs=probe.REFERENCE.h2d_duplex_gbs / 10)
    for rates, hidden in ((probe.REFERENCE, True), (slow, False)):
        full = predict(cfg, 16, 1024, gpu(resident_layers=21, lean_resident=True), rates)
        lean = predict(cfg, 16, 1024, gpu(resident_layers=21, lean_resident=True, lean_streamed=True), rates)
        said = lean_verdict(lean, full)
        assert f"{lean.step_s:.2f} s/step with it against {full.step_s:.2f} without" in said
        assert f"{full.step_s / lean.step_s:.2f}x the tokens/s" in said
        assert ("stays hidden" in said) == hidden and ("PCIe binds" in said) == (not hidden)
        if not hidden:
            assert lean.step_s > full.step_s and f"{lean.gains['PCIe']:.2f} s/step" in said


def test_clipping_with_transient_grads_adds_a_norm_pass():
    """transient_grads with clipping: a forward and backward that sends no gradient, then the step of
    a run without clipping (each unit stepped as it lands, at the clipped rate): the step time is the
    two together, compute runs twice, and the bound is never the host AdamW after the backward."""
    cfg = make_config("llama")
    eng = gpu(resident_layers=1, transient_grads=True)
    plain = predict(cfg, 4, 128, eng, RATES, clip=False)
    measured = predict(cfg, 4, 128, eng, RATES, clip=True)
    sends_nothing = replace(RATES, d2h_gbs=1e-6, d2h_duplex_gbs=1e-6)  # a pass that sent would take hours
    pass_s = predict(cfg, 4, 128, eng, sends_nothing, clip=True).step_s - predict(cfg, 4, 128, eng, sends_nothing,
                                                                               clip=False).step_s
    assert 0 < pass_s < plain.step_s
    assert measured.step_s > plain.step_s and measured.lanes["compute"] > 1.9 * plain.lanes["compute"] - 1e-9
    assert measured.lanes["d2h"] == pytest.approx(plain.lanes["d2h"])
    assert "after the backward" not in measured.bound
    assert "after the backward" in predict(cfg, 4, 128, gpu(resident_layers=1), replace(RATES, adamw_gparams=1e-4),
                                           clip=True).bound


def test_micro_batches_together_stream_once():
    """The same tokens as 4 micro-batches: together, each layer's weights cross once per pass (the
    one-micro-batch step's PCIe); one at a time, four times, plus the host adding up gradients."""
    cfg = make_config("llama")
    eng = gpu(resident_layers=0)
    slow_pcie = replace(RATES, h2d_gbs=0.01, d2h_gbs=0.01, h2d_duplex_gbs=0.01, d2h_duplex_gbs=0.01)
    one = predict(cfg, 8, 128, eng, slow_pcie)
    together = predict(cfg, 2, 128, eng, slow_pcie, micro_batches=4, together=True)
    apart = predict(cfg, 2, 128, eng, slow_pcie, micro_batches=4, together=False)
    assert together.tokens == apart.tokens == one.tokens
    assert together.lanes["h2d"] == pytest.approx(one.lanes["h2d"])
    assert apart.lanes["h2d"] == pytest.approx(4 * one.lanes["h2d"]) and apart.lanes["accumulate"] > 0
    assert together.step_s == pytest.approx(one.step_s) and apart.step_s > 3 * together.step_s


def test_moe_compute_counts_active_experts():
    """A routed expert's weights count top_k / experts of their FLOPs: all-resident compute of the
    tiny Mixtral equals the dense count with the experts scaled down."""
    cfg = make_config("mixtral")
    routed = routed_per_layer(cfg)
    assert sorted(routed) == list(range(cfg.num_hidden_layers))
    expert = 3 * cfg.hidden_size * cfg.intermediate_size * cfg.num_local_experts
    assert all(n == expert and frac == cfg.num_experts_per_tok / cfg.num_local_experts for n, frac in routed.values())
    eng = gpu(resident_layers=cfg.num_hidden_layers)
    moe = predict(cfg, 4, 128, eng, RATES)
    dense = predict(cfg, 4, 128, eng, RATES, routed={})
    saved = 8 * sum(n * (1 - f) for n, f in routed.values()) * 4 * 128
    assert dense.lanes["compute"] - moe.lanes["compute"] == pytest.approx(
        saved / (RATES.matmul_tflops * 1e12 * GPU_EFFICIENCY), rel=1e-9)


def test_probe_cache_keeps_the_latest_probe_of_each_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MEGATRAIN_CACHE", str(tmp_path))
    assert probe.load("NVIDIA H200") is None
    assert probe.rates_for_planning() == probe.REFERENCE  # nothing probed: the reference rates
    h100 = replace(RATES, gpu="NVIDIA H100 80GB HBM3", measured="probed 2026-12-01 10:00 UTC")
    h200 = replace(RATES, gpu="NVIDIA H200", matmul_tflops=650.0, measured="probed 2026-12-02 10:00 UTC")
    host_only = replace(RATES, gpu="", matmul_tflops=0.0, measured="probed 2026-12-03 10:00 UTC")
    for r in (h100, h200, host_only, replace(h200, matmul_tflops=640.0)):
        probe.save(r)
    assert probe.load("NVIDIA H200").matmul_tflops == 640.0  # the latest of that GPU
    assert probe.load("NVIDIA H100 80GB HBM3") == h100
    monkeypatch.setattr(probe, "gpu_name", lambda: None)
    assert probe.load().gpu == "NVIDIA H200"  # no GPU here: the newest GPU probe, never the host-only one
    assert json.load(open(tmp_path / "rates.json")).keys() == {"NVIDIA H100 80GB HBM3", "NVIDIA H200", "cpu"}


def test_estimate_prints_the_step_time_with_its_bound(tmp_path, monkeypatch, capsys):
    """In process (the command is cli.main; `hf-megatrain probe` runs as a command in
    tests/integration/test_demo_cli.py)."""
    from hf_megatrain.cli import main

    monkeypatch.setenv("HF_MEGATRAIN_CACHE", str(tmp_path))
    assert main(["estimate", "llama-2-13b", "--batch", "16", "--seq", "1024", "--grad_accum", "4", "--gpu_gib",
                 "139", "--host_gib", "125"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step time (model, clipping at 1)"))
    assert "tokens/s; bound: compute" in line and "reference rates" in line
    main(["estimate", "mixtral-8x7b", "--batch", "16", "--seq", "1024", "--max_grad_norm", "0", "--json"])
    timing = json.loads(capsys.readouterr().out)["step_time"]
    assert timing["bound"] == "host AdamW" and timing["step_s"] > timing["lanes_s"]["host_adamw"] > 0


def test_lean_streamed_layers_cross_pcie_in_fp32():
    """lean_streamed: a streamed layer's weights cross as its fp32 master, twice the bf16 bytes."""
    cfg = make_config("llama")
    s = model_sizes(cfg)
    layers = sum(u.numel for u in s.units if u.kind == "layer")
    base = predict(cfg, 4, 128, gpu(resident_layers=0), RATES)
    lean = predict(cfg, 4, 128, gpu(resident_layers=0, lean_streamed=True), RATES)
    # two passes (forward, backward) of every streamed layer's 2 extra bytes per parameter
    assert lean.lanes["h2d"] - base.lanes["h2d"] == pytest.approx(2 * 2 * layers / (RATES.h2d_gbs * 1e9))
    assert lean.lanes["d2h"] == base.lanes["d2h"]
    slow_pcie = replace(RATES, h2d_gbs=0.01, d2h_gbs=0.01, h2d_duplex_gbs=0.01, d2h_duplex_gbs=0.01)
    assert predict(cfg, 4, 128, gpu(resident_layers=0, lean_streamed=True), slow_pcie).step_s > \
        1.2 * predict(cfg, 4, 128, gpu(resident_layers=0), slow_pcie).step_s  # bound by PCIe: its bytes in
