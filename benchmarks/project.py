"""Projection: host RAM, step time and tokens/s of models this box cannot hold, per optimizer and memory mode.

    python benchmarks/project.py benchmarks/results/2026-12-03_h200_largest_llama-3.1-70b_11.json
    python benchmarks/project.py benchmarks/results/2026-12-03_h200_largest_llama-3.1-70b_11.json \
        --on llama-3.1-70b=491 mixtral-8x22b=982 --optim adamw_torch adafactor --tokens 16384    (issue 34)
    python benchmarks/project.py --fit qwen2.5-32b=122.7 --gpu_gib 138.5 --optim adamw_torch adafactor \
        --tokens 16384    (how many layers of a shape the planner admits on this box: no record needed)

Input: the record of `largest.py` for a model of the target width truncated to what this box holds:
the median seconds per decoder layer of forward, backward (with its recompute) and host AdamW, at
its tokens per step. For each shape, host size and memory mode it prints what hf_megatrain itself
would do on one GPU and that host:

- the placement: `planner.resolve_placement` (the trainer's planner) with the mode forced, the
  gradients kept on the GPU left on auto where clipping keeps gradients;
- host RAM and GPU memory: `planner.estimate` of that placement, and whether admission accepts it;
- the step: `steptime.predict` (the step-time model that `hf-megatrain estimate` prints, validated
  against measured steps in BENCHMARKS.md runs 14 and 15) with the measured per-layer costs in place
  of its FLOP-rate compute and host AdamW, scaled linearly in a layer's parameters and in tokens;
  PCIe, the engine's dependencies (the host AdamW after the backward with clipping, during it
  without) and the probe's reference rates for the rest.

Modes: default (clipping 1.0), lean_streamed (clipping 1.0), lean_streamed + transient_grads without
clipping and with clipping 1.0 (then each step runs a norm pass first: one more forward and backward,
which the step-time model counts), and transient_grads alone both ways too, for every optimizer (--optim, TrainingArguments' names: each steps a
transient gradient as it lands, engine/host_optim.py). Another optimizer's state is the planner's count for
the class Trainer builds (estimator.optimizer_state) and its host step is the record's host AdamW seconds
scaled by the rates' ratio (Rates.host_step: modelled from the bytes each step moves, the reference
rates having measured AdamW only). An MoE's layers are scaled by their active parameters (top-k of
the experts), its host step by all of them. Model FLOPs are 6 * P * tokens (P: active parameters); MFU is against the record's sustained bf16 peak. It
measures nothing itself: the output ($RECORD_projection.json) carries the measuring record's date,
card, command and versions beside the versions of this run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def project_modes() -> tuple:
    """The modes `hf-megatrain estimate` shows, and transient_grads alone (the auto rule's first choice
    where the host is short: it costs no PCIe bytes, lean_streamed doubles the streamed weights')."""
    from hf_megatrain.planner.estimator import MODES

    return MODES[:2] + (("transient_grads", dict(transient_grads=True)),) + MODES[2:]


def project(record: dict, shape: str, gpu_gib: float, host_gib: float, tokens: int, mode: str, clip: bool,
            optim: str = "adamw_torch") -> dict:
    from hf_megatrain.engine.config import EngineConfig
    from hf_megatrain.planner.admission import shortfalls
    from hf_megatrain.planner.estimator import estimate, GiB, model_sizes, optimizer_state
    from hf_megatrain.planner.placement import resolve_placement
    from hf_megatrain.planner.probe import REFERENCE
    from hf_megatrain.shapes import make_config
    from hf_megatrain.planner.steptime import LayerCosts, norm_pass, predict, routed_per_layer

    fields = dict(project_modes())[mode]
    opt = optimizer_state(optim)
    measured = model_sizes(make_config(record["shape"], record["layers"]))
    costs = LayerCosts(record["layer_forward_s"], record["layer_backward_s"], record["host_adamw_unit_s"],
                       measured.units[1].numel, record["tokens_per_step"])
    config = make_config(shape)
    sizes = model_sizes(config)
    seq = 1024
    rows = max(1, tokens // seq)
    auto = EngineConfig(device="cuda", resident_layers=None, offload_activations=None, lean_resident=None,
                        gpu_grad_layers=None if opt.adamw else 0, **fields)  # (AdamW's alone: plan_run's rule;
    # its tiles cut parameters, which the other optimizers step whole)
    engine = resolve_placement(config, rows, seq, auto, gpu_free=gpu_gib * GiB, host_free=host_gib * GiB,
                               later_contributions=False, sizes=sizes, optimizer=opt).engine
    plan = estimate(config, rows, seq, engine, sizes=sizes, later_contributions=False, optimizer=opt)
    step = predict(config, rows, seq, engine, REFERENCE, clip=clip, sizes=sizes, routed=routed_per_layer(config),
                   layer_costs=costs, optimizer=opt)
    peak = record["peak"]["sustained_tflops"]
    routed = routed_per_layer(config)  # an MoE's model FLOPs count the experts a token runs through
    active = sizes.params - sum(n * (1 - frac) for n, frac in routed.values())
    tflops = 6 * active * tokens / step.step_s / 1e12
    return {
        "shape": shape, "params_b": round(sizes.params / 1e9, 1), "gpu_gib": gpu_gib, "host_gib": host_gib,
        "tokens_per_step": tokens, "optim": opt.name, "mode": mode, "clipping": clip,
        "norm_pass": norm_pass(engine, clip), "resident_layers": engine.resident_layers,
        "gpu_grad_layers": engine.gpu_grad_layers, "offloaded_inputs": engine.offload_activations,
        "host_needed_gib": round(plan.host_total / GiB, 1), "gpu_needed_gib": round(plan.gpu_total / GiB, 1),
        "fits": not shortfalls(plan, host_gib * GiB, gpu_gib * GiB),  # admission's own test
        "step_s": round(step.step_s, 1), "tokens_per_s": round(step.tokens_per_s, 1),
        "model_tflops": round(tflops, 1), "mfu": round(tflops / peak, 3), "bound": step.bound,
    }


def fitting_depth(shape: str, gpu_gib: float, host_gib: float, optim: str, clip: bool,
                  transient: bool | None, tokens: int = 16384, seq: int = 1024) -> dict:
    """The most decoder layers of `shape` whose run the trainer's planner admits on a machine of `gpu_gib`
    free GPU and `host_gib` available host (plan_run with the trainer's autos; transient None: auto), as
    `largest.py --layers fit` asks it on the GPU box; a CPU estimate, nothing measured."""
    import torch

    from hf_megatrain.engine.config import EngineConfig
    from hf_megatrain.planner import Machine, Request, plan_run
    from hf_megatrain.planner.estimator import GiB, model_sizes, optimizer_state
    from hf_megatrain.shapes import make_config

    name = optimizer_state(optim).name
    engine = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, resident_layers=None, offload_activations=None,
                          lean_resident=None, lean_streamed=None, transient_grads=transient, gpu_grad_layers=None)
    machine = Machine(gpu_gib * GiB, host_gib * GiB)
    full = make_config(shape).num_hidden_layers
    for n in range(full, 0, -1):
        config = make_config(shape, n)
        run = plan_run(config, Request(engine, tokens // seq, seq, max_grad_norm=1.0 if clip else 0.0,
                                       optimizer=name), machine)
        if run.refusal is None:
            e = run.engine
            return {"shape": shape, "layers": n, "of": full, "params_b": round(model_sizes(config).params / 1e9, 2),
                    "optim": name, "clipping": clip, "transient_grads_asked": transient,
                    "transient_grads": e.transient_grads, "lean_streamed": e.lean_streamed,
                    "resident_layers": e.resident_layers, "lean_resident": e.lean_resident,
                    "gpu_grad_layers": e.gpu_grad_layers, "host_needed_gib": round(run.memory.host_per_host / GiB, 1),
                    "gpu_needed_gib": round(run.memory.gpu_total / GiB, 1),
                    "step_s": round(run.step_time.step_s, 2), "tokens_per_s": round(run.step_time.tokens_per_s)}
    return {"shape": shape, "layers": 0, "of": full, "optim": name, "clipping": clip, "transient_grads_asked": transient}


def print_fits(shape: str, gpu_gib: float, host_gib: float, optims: list, tokens: int) -> None:
    """fitting_depth for each optimizer: clipping 1.0 with transient_grads on auto and asked for, and no clipping."""
    print(f"{shape} on {gpu_gib:g} GiB GPU + {host_gib:g} GiB host, {tokens} tokens/step (planner only, step-time model "
          "on the reference rates)")
    for optim in optims:
        for clip, transient in ((True, None), (True, True), (False, None)):
            r = fitting_depth(shape, gpu_gib, host_gib, optim, clip, transient, tokens)
            asked = "auto" if transient is None else "true"
            head = f"  {r['optim']:9} clip {'1.0' if clip else 'none':4} transient_grads={asked:4}:"
            if not r["layers"]:
                print(f"{head} no depth fits")
                continue
            print(f"{head} {r['layers']}/{r['of']} layers ({r['params_b']} B), {r['resident_layers']} resident"
                  f"{' (lean)' if r['lean_resident'] else ''}, lean_streamed {r['lean_streamed']}, transient_grads "
                  f"{r['transient_grads']}; host {r['host_needed_gib']} GiB, GPU {r['gpu_needed_gib']} GiB; "
                  f"{r['step_s']} s/step, {r['tokens_per_s']} tok/s (modelled)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", nargs="?", help="largest.py's JSON for the truncated model (not with --fit)")
    p.add_argument("--shapes", nargs="+", default=["llama-3.1-70b", "dense-120b"])
    p.add_argument("--gpu_gib", type=float, default=139.0, help="the GPU's free memory (an H200: 139)")
    p.add_argument("--host_gib", type=float, nargs="+", default=[982.0, 1473.0],
                   help="hosts' available RAM (MemAvailable): a '1 TB' server has 1024 GiB installed, a '1.5 TB' one "
                        "1536; this box has 95.9%% of its 128 GiB available, and so would they: 982 and 1473")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--on", nargs="+", default=None, metavar="SHAPE=HOST_GIB",
                   help="pairs of a shape and its host's available RAM in place of --shapes x --host_gib (a '512 GB' "
                        "host: 491, a '1 TB' one: 982)")
    p.add_argument("--optim", nargs="+", default=["adamw_torch"],
                   help="optimizers to project, as TrainingArguments.optim (Trainer's defaults for each)")
    p.add_argument("--fit", nargs="+", default=None, metavar="SHAPE=HOST_GIB",
                   help="instead: the most layers of SHAPE the planner admits on --gpu_gib and HOST_GIB, per --optim "
                        "(the CPU estimate of `largest.py --layers fit`; this box: qwen2.5-32b=122.7 --gpu_gib 138.5)")
    a = p.parse_args()
    if a.fit:
        for pair in a.fit:
            shape, host = pair.split("=")
            for tokens in a.tokens:
                print_fits(shape, a.gpu_gib, float(host), a.optim, tokens)
        return
    if not a.record:
        p.error("a record (largest.py's JSON) is needed, or --fit")
    sys.path.insert(0, HERE)
    from versions import versions, versions_line

    with open(a.record) as f:
        record = json.load(f)
    source = {k: record.get(k) for k in ("date", "card", "command", "versions")}
    here = versions()
    # transient_grads both ways: without clipping, and with it through a norm pass; the others clip
    runs = [(mode, clip) for mode, fields in project_modes() for clip in ([False, True] if fields.get("transient_grads")
                                                               else [True])]
    pairs = [(s.split("=")[0], float(s.split("=")[1])) for s in a.on] if a.on else \
        [(shape, h) for shape in a.shapes for h in a.host_gib]
    rows = [project(record, shape, a.gpu_gib, h, t, mode, clip, optim)
            for shape, h in pairs for t in a.tokens for optim in a.optim for mode, clip in runs]
    print(f"from {record['shape']} x {record['layers']} layers on {record.get('card', '?')}: per layer "
          f"fwd {record['layer_forward_s']} s, bwd {record['layer_backward_s']} s, host AdamW "
          f"{record['host_adamw_unit_s']} s at {record['tokens_per_step']} tokens/step")
    print("measured on: " + (versions_line(source["versions"]) if source["versions"] else "versions not recorded"))
    print("projected with: " + versions_line(here))
    print(f"{'shape':14} {'host':>5} {'tok/step':>8} {'optim':9} {'mode':32} {'clip':9} {'res':>3} {'gg':>3} "
          f"{'host GiB':>8} {'GPU GiB':>7} {'step s':>6} {'tok/s':>6} {'MFU':>5}  bound")
    for r in rows:
        mark = "" if r["fits"] else "  (does not fit)"
        clip = "norm pass" if r["norm_pass"] else "yes" if r["clipping"] else "no"
        print(f"{r['shape']:14} {r['host_gib']:>5.0f} {r['tokens_per_step']:>8} {r['optim']:9} {r['mode']:32} {clip:9} "
              f"{r['resident_layers']:>3} {r['gpu_grad_layers']:>3} {r['host_needed_gib']:>8} {r['gpu_needed_gib']:>7} "
              f"{r['step_s']:>6} {r['tokens_per_s']:>6} {r['mfu']:>5}  {r['bound']}{mark}")
    out = os.path.splitext(a.record)[0] + ("_projection.json" if not a.on else
                                           "_projection_" + "_".join(s.replace("=", "-") for s in a.on) + ".json")
    with open(out, "w") as f:
        json.dump({"source": source, "projected_with": here, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
