"""The step-time model: how long a step should take on this machine, and what bounds it.

A step keeps four lanes busy: the GPU's compute, PCIe in (weights of the streamed layers, offloaded
layer inputs), PCIe out (their fp32 gradients) and the host AdamW over the streamed units. From
the plan (which units stream, the tokens a step holds, how its micro-batches run) and the machine's
measured rates (probe.py), `predict` walks one steady-state step unit by unit with the engine's own
dependencies:

- backward, last unit first: a streamed unit's weights come in, its recompute and backward run once
  they are in and the previous unit's backward is done, its gradient goes out after them;
- host AdamW of the streamed units: with exact clipping, only once the whole backward is done (the
  global norm scales every gradient) and then unit by unit in forward order; without clipping (or with
  it through transient_grads' norm pass), each unit as soon as its gradient has landed; another optimizer
  (sgd, adagrad, rmsprop, adafactor: engine/host_optim.py) is placed the same way (the engine's step
  policy is one for all), at its own host rate (Rates.host_step: the probe's measurement, else modelled
  from the bytes its step moves against AdamW's);
- next forward, first unit first: a streamed unit's weights come in after its AdamW has refreshed
  them, and its forward runs after they are in.

Compute is FLOPs at a fixed fraction of the measured bf16 matmul rate (GPU_EFFICIENCY): matmuls
8 x active parameters x tokens per decoder layer (forward, the backward's recompute, the backward),
6 x for the head, plus causal attention. The bound is the lane whose unlimited speed would shorten
the step most. What the model leaves out: DRAM contention between DMA and the host AdamW, CPU-side
launch gaps, and padding (it counts every token as real).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.layout import mark_resident

# The fraction of the sustained bf16 matmul rate a decoder layer's compute reaches on the GPU
# (matmuls, attention, norms, activations, casts together), from the compute lane's busy time in
# measured runs (BENCHMARKS.md, "Measurements the code's defaults rest on").
GPU_EFFICIENCY = 0.68
ATTENTION_BACKWARD = 2.5  # flash attention's backward, in forward FLOPs


@dataclass
class StepTime:
    step_s: float
    tokens: int
    bound: str  # "compute", "PCIe in", "PCIe out", "host AdamW", "host AdamW after the backward"
    lanes: dict = field(default_factory=dict)  # busy seconds per step: compute, h2d, d2h, host_adamw
    gains: dict = field(default_factory=dict)  # seconds a step would lose if that lane were free
    measured: str = ""  # where the rates came from

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    def busy(self) -> dict:
        return {k: v / self.step_s for k, v in self.lanes.items()}

    def describe(self) -> str:
        busy = ", ".join(f"{k} {v:.0%}" for k, v in self.busy().items() if v > 0.005)
        return (f"{self.step_s:.2f} s/step, {self.tokens_per_s:,.0f} tokens/s; bound: {self.bound} "
                f"(busy: {busy}); rates: {self.measured}")

    def as_dict(self) -> dict:
        return {"step_s": round(self.step_s, 4), "tokens_per_s": round(self.tokens_per_s, 1), "bound": self.bound,
                "lanes_s": {k: round(v, 4) for k, v in self.lanes.items()},
                "gains_s": {k: round(v, 4) for k, v in self.gains.items()}, "rates": self.measured}



def _mean_head_dim(config, heads: int) -> float:
    """A layer's head_dim on average: the config's, or the mean over its layers where it varies by layer (Gemma 4's
    per_layer_config: its full-attention layers' own, which the config refuses to read as one global)."""
    if getattr(config, "per_layer_config", None) is not None and "head_dim" in (getattr(config, "per_layer_attributes",
                                                                                          None) or ()):
        dims = [config.per_layer_config[i].head_dim for i in range(config.num_hidden_layers)]
        return sum(dims) / len(dims)
    return getattr(config, "head_dim", None) or config.hidden_size // heads

def routed_per_layer(config) -> dict[int, tuple[int, float]]:
    """{layer: (routed expert parameters, fraction active per token)} from the model's units (a meta copy):
    a routed expert's weights (named `.experts.`, HF v5's fused tensors) count top_k / experts."""
    from .estimator import config_units_memo

    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return {}
    out: dict[int, tuple[int, float]] = {}
    for u in config_units_memo(config):  # the planner's meta build, not one of its own
        for slot in u.slots:
            if u.kind == "layer" and ".experts." in slot.name and ".layers." in slot.name:
                n, _ = out.get(u.layer, (0, 0.0))
                out[u.layer] = (n + slot.shape.numel(), config.num_experts_per_tok / experts)
    return out


@dataclass(frozen=True)
class LayerCosts:
    """Seconds measured per decoder layer in a real run (benchmarks/largest.py's record): its forward,
    its recompute + backward, and its host AdamW with clipping and a compute copy to refresh (not
    lean; other modes scale it as the probe's rates do), for a layer of `params` parameters at
    `tokens` tokens per step. `predict` scales them linearly in a layer's active parameters and in
    tokens (the matmuls are; attention's share at 1K-token rows is small) and the AdamW in parameters
    only; the head and embedding stay on the FLOP model."""
    forward_s: float
    backward_s: float
    adamw_s: float
    params: int
    tokens: int


def norm_pass(engine, clip: bool) -> bool:
    """Exact clipping with transient_grads runs a norm pass before each step's backward
    (StreamingEngine.gradient_norm): no gradient outlives its step to take the norm from."""
    return clip and bool(engine.transient_grads)


def predict(config, rows: int, seq: int, engine, rates, *, micro_batches: int = 1, together: bool = True,
            clip: bool = True, sizes=None, routed=None, layer_costs: LayerCosts | None = None,
            optimizer=None) -> StepTime:
    """The step time of `micro_batches` micro-batches of `rows` x `seq` tokens per optimizer step.

    engine: the EngineConfig the run is built with, placements settled (placement.resolve_placement).
    together: the micro-batches run through each layer together (one weight pass per step); else
    one at a time, each re-streaming the weights and adding its gradient into the host accumulator.
    clip: exact gradient clipping (max_grad_norm > 0): the host AdamW waits for the whole backward;
    with transient_grads a norm pass (forward and backward, no gradient sent) runs first instead and
    each unit is stepped, clipped, as its gradient lands.
    layer_costs: measured per-layer seconds to use for the decoder layers' compute and host AdamW
    instead of the rates (a projection of a model this box cannot hold from one it trained); its AdamW
    seconds scale to another optimizer by the rates' ratio.
    optimizer: what steps the run (estimator.optimizer_state; default AdamW)."""
    from .estimator import ADAMW, copy_units, model_sizes

    opt = optimizer or ADAMW

    s = sizes or model_sizes(config)
    units = copy_units(s.units)  # marked here: the units handed in stay as they were
    mark_resident(units, engine.resident_layers or 0, engine.lean_resident, engine.lean_streamed,
                  engine.gpu_grad_layers or 0)
    routed = routed_per_layer(config) if routed is None else routed
    cbytes = engine.compute_dtype.itemsize
    n = max(1, micro_batches)
    passes = 1 if together else n  # weight passes per step
    measure = norm_pass(engine, clip)
    tokens = rows * seq * n
    flops_rate = rates.matmul_tflops * 1e12 * GPU_EFFICIENCY
    heads = config.num_attention_heads
    head_dim = _mean_head_dim(config, heads)
    attention_fwd = 2 * rows * n * seq * seq * heads * head_dim  # causal QK^T and PV, one layer
    offload = min(engine.offload_activations or 0, s.layers)
    layer_input = rows * seq * s.hidden * cbytes * n  # bytes, all micro-batches

    def active(u) -> float:
        if u.kind != "layer":
            return u.numel
        expert, frac = routed.get(u.layer, (0, 1.0))
        return u.numel - expert + expert * frac

    fwd, bwd, h2d, d2h, adam = [], [], [], [], []  # per unit, in forward order
    for u in units:
        if u.kind == "layer":
            f = 2 * active(u) * tokens + attention_fwd
            b = 6 * active(u) * tokens + (1 + ATTENTION_BACKWARD) * attention_fwd
        elif u.kind == "head":
            f, b = 6 * s.vocab * s.hidden * tokens, 0.0  # the chunked loss: logits and their gradients at once
        else:
            f = b = 0.0  # the embedding: a gather
        streamed = not u.resident
        if u.kind == "layer" and layer_costs is not None:  # measured, scaled to this layer and step
            scale = active(u) / layer_costs.params * tokens / layer_costs.tokens
            fwd.append(layer_costs.forward_s * scale)
            bwd.append(layer_costs.backward_s * scale)
        else:
            fwd.append(f / flops_rate)
            bwd.append(b / flops_rate)
        h2d.append(u.numel * (4 if u.no_compute_copy else cbytes) if streamed else 0)  # a lean streamed unit: its fp32 master
        d2h.append(u.n_train * 4 if streamed else 0)
        # a lean unit has no compute copy to refresh, nor does an fp32 one (the master streams itself)
        rate = rates.host_step(opt, clip, u.no_compute_copy or (cbytes == 4 and u.n_train == u.numel))
        if u.kind == "layer" and layer_costs is not None:  # the measured rate, as much faster as the probe's
            rate = layer_costs.params / layer_costs.adamw_s / 1e9 * rate / rates.adamw(True)
        adam.append(u.n_train / rate / 1e9 if streamed else 0)
    layer_units = [i for i, u in enumerate(units) if u.kind == "layer"]
    acts = {i: layer_input for i in layer_units[s.layers - offload:]} if offload else {}
    # resident units step on the GPU: read master, m, v, grad and write them and the compute copy (another
    # optimizer: its step's bytes, modelled, and the compute copy)
    gpu_bytes = 30 if opt.adamw else opt.step_bytes + 6
    gpu_adam = sum(u.n_train for u in units if u.resident) * gpu_bytes / (rates.gpu_mem_gbs * 1e9)
    accumulate = 0.0
    if passes > 1:  # one at a time: each later micro-batch's gradient is added on the host (read 2, write 1)
        accumulate = (passes - 1) * sum(d2h) * 3 / (rates.host_update_gbs * 1e9)

    depth = max(1, engine.prefetch_depth)  # weight slots: a load waits for the slot `depth` units back

    def simulate(compute_scale=1.0, pcie_scale=1.0, adam_scale=1.0) -> float:
        """One step's seconds: a pass of the step's tokens (together), or one pass per micro-batch."""
        up1, up2 = rates.h2d_gbs * 1e9 / pcie_scale, rates.h2d_duplex_gbs * 1e9 / pcie_scale
        down2 = rates.d2h_duplex_gbs * 1e9 / pcie_scale

        def backward(send: bool = True) -> tuple[float, dict]:
            """From t = 0 (the forward's end), last unit first: (end, when each gradient landed);
            send=False: the norm pass, whose gradients never leave the GPU."""
            load = gpu = out = 0.0
            landed, finished = {}, []
            for i in reversed(range(len(units))):
                if h2d[i] or i in acts:
                    free = finished[-depth] if len(finished) >= depth else 0.0
                    load = max(load, free) + (h2d[i] + acts.get(i, 0) / passes) / up2
                    gpu = max(gpu, load)
                gpu += bwd[i] * compute_scale / passes
                finished.append(gpu)
                out = max(out, gpu) + (d2h[i] / down2 if send else 0.0)
                landed[i] = out
            return max(gpu, out), landed

        def forward(start: float, done: dict) -> float:
            """From `start`, first unit first, each streamed one loaded once its AdamW is `done`."""
            load, gpu, finished = start, start, []
            for i in range(len(units)):
                if h2d[i]:
                    free = finished[-depth] if len(finished) >= depth else 0.0
                    load = max(load, free, done.get(i, 0.0)) + h2d[i] / up1
                    gpu = max(gpu, load)
                gpu += fwd[i] * compute_scale / passes
                finished.append(gpu)
            return gpu

        end, landed = backward()
        done, host = {}, end  # host AdamW of the streamed units
        if clip and not measure:  # after the whole backward, in forward order
            for i in range(len(units)):
                if adam[i]:
                    host += adam[i] * adam_scale
                    done[i] = host
        else:  # each unit once its gradient has landed
            host = 0.0
            for i in reversed(range(len(units))):
                if adam[i]:
                    host = max(host, landed[i]) + adam[i] * adam_scale
                    done[i] = host
        # the next forward, after the backward and the GPU's own AdamW of the resident units
        step = forward(end + gpu_adam * compute_scale, done)
        if passes > 1:  # one at a time: the earlier micro-batches, weights streamed again, no AdamW between
            step += (passes - 1) * (forward(0.0, {}) + backward()[0])
        if measure:  # the norm pass before it: weights streamed in twice more, nothing sent or stepped
            step += forward(0.0, {}) + backward(send=False)[0]
        return max(step, accumulate)

    step = simulate()
    sweeps = 2 if measure else 1  # forward-backward sweeps over the step's tokens
    lanes = {"compute": sweeps * (sum(fwd) + sum(bwd)) + gpu_adam,
             "h2d": (sum(h2d) * 2 * (passes + sweeps - 1) + sweeps * sum(acts.values())) / (rates.h2d_gbs * 1e9),
             "d2h": (sum(d2h) * passes + sweeps * sum(acts.values())) / (rates.d2h_gbs * 1e9),
             "host_adamw" if opt.adamw else f"host_{opt.name}": sum(adam)}
    if accumulate:
        lanes["accumulate"] = accumulate
    host = "host AdamW" if opt.adamw else f"host {opt.name}"
    gains = {"compute": step - simulate(compute_scale=1e-9),
             "PCIe": step - simulate(pcie_scale=1e-9),
             host: step - simulate(adam_scale=1e-9)}
    bound = max(gains, key=gains.get)
    if bound == host and clip and not measure:
        bound = f"{host} after the backward (exact clipping)"
    return StepTime(step, tokens, bound, lanes, gains, rates.measured)


def lean_verdict(with_it: StepTime, without: StepTime) -> str:
    """What lean_streamed costs a run the planner took it for (the host RAM is short without it), in
    words: the modelled step with and without it, and whether its doubled PCIe bytes stay hidden (a
    free PCIe would shorten the step by under 2%). It may come out faster: its host AdamW writes no
    bf16 copy (measured 1.076x at 13B, BENCHMARKS.md run 15)."""
    hidden = with_it.gains.get("PCIe", 0.0) < 0.02 * with_it.step_s
    pcie = ("its weights' PCIe time stays hidden" if hidden else
            f"PCIe binds: a free PCIe would save {with_it.gains['PCIe']:.2f} s/step")
    return f"{compared(with_it, without, 'without')}; {pcie}"


def compared(with_it: StepTime, other: StepTime, other_is: str) -> str:
    """The modelled step with a mode against another plan ("without", "as asked"), in words."""
    return (f"the step-time model gives {with_it.step_s:.2f} s/step with it against {other.step_s:.2f} "
            f"{other_is}, {other.step_s / with_it.step_s:.2f}x the tokens/s")


def mode_cost(config, rows: int, seq: int, engine, rates, *, micro_batches: int = 1, together: bool = True,
              clip: bool = True, sizes=None, routed=None, optimizer=None):
    """For a refusal that names a memory mode (admission.admit's step_cost): a function of the mode's
    EngineConfig fields that says, in words, the modelled step time with it against the plan as asked.
    With clipping, transient_grads is priced with the norm pass it then runs first. Nothing is computed
    until a refusal asks. routed: routed_per_layer(config), where the caller has it already."""
    from .estimator import mode_engine

    def cost(fields: dict) -> str:
        kw = dict(micro_batches=micro_batches, together=together, sizes=sizes, optimizer=optimizer,
                  routed=routed_per_layer(config) if routed is None else routed)
        asked = predict(config, rows, seq, engine, rates, clip=clip, **kw)
        with_it = predict(config, rows, seq, mode_engine(engine, fields), rates, clip=clip, **kw)
        return compared(with_it, asked, "as asked")

    return cost
