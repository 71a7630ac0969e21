"""Projection: step time and tokens/s of full-size models, from per-layer costs measured here.

    python benchmarks/project.py $OUT/largest_llama-3.1-70b_11.json

Input: the record of `largest.py` for a model of the target width truncated to what this box
holds (median seconds per decoder layer of forward, backward with its recompute, and host
AdamW, at its tokens per step). Per-layer costs do not depend on depth, so a full-depth model
of the same width costs L times a layer; another width is scaled by its parameters per layer
(the matmuls and the memory-bound AdamW are both linear in them at a fixed row length).

The model of a step (with gradient clipping: the host may step a unit only once the global
norm is known, i.e. after the whole backward):

    R  = resident decoder layers (the planner's, for the target GPU and host)
    S  = L - R streamed layers
    T_bwd = L * t_b                       GPU: every layer's recompute + backward
    T_fwd = max(L * t_f, S * t_o + t_f)   next forward: the first R layers run while the host
                                          steps the streamed ones in order; a streamed layer
                                          cannot run before its step is done
    step  = T_bwd + T_fwd + (embedding, head and loss: measured, scaled by their parameters)
    PCIe per streamed layer: 2 bytes/param up twice (forward, backward), 4 down (fp32
    gradient), overlapped with compute; reported as a check, not added.

t_o scales with the host's memory bandwidth (--host_adam_scale: 2.0 for a host with twice
this box's DRAM bandwidth). Host RAM and GPU memory come from hf_megatrain's estimator.

It measures nothing itself: the output ($RECORD_projection.json) carries the measuring record's
date, card, command and versions ("source"; "versions": null for a record made before
largest.py recorded them) beside the versions of this run ("projected_with": the estimator and
planner are this checkout's hf_megatrain), and the header prints both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PCIE_GBPS = 50.0  # pinned H2D/D2H per direction, measured on the H200 box (DESIGN.md)


def project(record: dict, shape: str, gpu_gib: float, host_gib: float, host_adam_scale: float = 1.0,
            tokens: int | None = None) -> dict:
    from hf_megatrain.memory import GiB, estimate, model_shapes, plan_placement, shortfalls
    from hf_megatrain.shapes import make_config

    measured = make_config(record["shape"], record["layers"])
    target = make_config(shape)
    m, s = model_shapes(measured), model_shapes(target)
    ratio = s.layer / m.layer
    tokens_measured = record["tokens_per_step"]
    tokens = tokens or tokens_measured
    scale_t = tokens / tokens_measured  # matmul time is linear in tokens at a fixed row length
    t_f = record["layer_forward_s"] * ratio * scale_t
    t_b = record["layer_backward_s"] * ratio * scale_t
    t_o = record["host_adamw_unit_s"] * ratio / host_adam_scale
    # embedding, head and loss (forward and backward), scaled by their parameters and the tokens
    rest = (record["head_loss_s"] + record["embedding_s"]) * (s.embed + s.head) / (m.embed + m.head) * scale_t
    seq = 1024
    batch = max(1, tokens // seq)
    resident, offload = plan_placement(target, batch, seq, gpu_gib * GiB, host_free=host_gib * GiB)
    plan = estimate(target, batch, seq, resident_layers=resident, offload_activations=offload)
    layers = s.layers
    streamed = layers - resident
    t_bwd = layers * t_b
    t_fwd = max(layers * t_f, streamed * t_o + t_f)
    step = t_bwd + t_fwd + rest
    pcie_s = streamed * s.layer * 4 / (PCIE_GBPS * 1e9)  # the busier direction: 2+2 up or 4 down
    return {
        "shape": shape, "params_b": round(s.params / 1e9, 1), "gpu_gib": gpu_gib, "host_gib": host_gib,
        "tokens_per_step": tokens, "resident_layers": resident, "streamed_layers": streamed,
        "host_needed_gib": round(plan.host_total / GiB, 1), "gpu_needed_gib": round(plan.gpu_total / GiB, 1),
        "fits": not shortfalls(plan, host_gib * GiB, gpu_gib * GiB),  # admission's own test
        "t_layer_fwd_s": round(t_f, 4), "t_layer_bwd_s": round(t_b, 4), "t_layer_adamw_s": round(t_o, 4),
        "step_s": round(step, 1), "tokens_per_s": round(tokens / step, 1),
        "model_tflops": round(6 * s.params * tokens / step / 1e12, 1),
        "pcie_s_per_step": round(pcie_s, 1), "bound": "host AdamW" if streamed * t_o > layers * t_f else "GPU",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", help="largest.py's JSON for the truncated model")
    p.add_argument("--shapes", nargs="+", default=["llama-3.1-70b", "dense-120b"])
    p.add_argument("--gpu_gib", type=float, nargs="+", default=[80.0, 139.0])
    p.add_argument("--host_gib", type=float, nargs="+", default=[1024.0, 1536.0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536, 262144])
    p.add_argument("--host_adam_scale", type=float, default=1.0,
                   help="the target host's DRAM bandwidth over this box's (AdamW is memory-bound)")
    a = p.parse_args()
    sys.path.insert(0, HERE)
    from versions import versions, versions_line

    with open(a.record) as f:
        record = json.load(f)
    source = {k: record.get(k) for k in ("date", "card", "command", "versions")}
    here = versions()
    rows = [project(record, shape, g, h, a.host_adam_scale, t)
            for shape in a.shapes for g in a.gpu_gib for h in a.host_gib for t in a.tokens]
    print(f"from {record['shape']} x {record['layers']} layers on {record.get('card', '?')}: per layer "
          f"fwd {record['layer_forward_s']} s, bwd {record['layer_backward_s']} s, host AdamW "
          f"{record['host_adamw_unit_s']} s at {record['tokens_per_step']} tokens/step")
    print("measured on: " + (versions_line(source["versions"]) if source["versions"] else "versions not recorded"))
    print("projected with: " + versions_line(here))
    print(f"{'shape':14} {'GPU':>4} {'host':>5} {'tok/step':>8} {'res':>4} {'host GiB':>8} {'GPU GiB':>7} "
          f"{'step s':>7} {'tok/s':>7} {'TFLOPS':>6}  bound")
    for r in rows:
        mark = "" if r["fits"] else "  (does not fit)"
        print(f"{r['shape']:14} {r['gpu_gib']:>4.0f} {r['host_gib']:>5.0f} {r['tokens_per_step']:>8} "
              f"{r['resident_layers']:>4} {r['host_needed_gib']:>8} {r['gpu_needed_gib']:>7} {r['step_s']:>7} "
              f"{r['tokens_per_s']:>7} {r['model_tflops']:>6}  {r['bound']}{mark}")
    out = os.path.splitext(a.record)[0] + "_projection.json"
    with open(out, "w") as f:
        json.dump({"source": source, "projected_with": here, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
