"""The engine's layout as facts: what the engine allocates, said once for the engine and the planner.

The engine builds itself from these functions and the planner (`planner.estimate`) counts with
them, so an estimate cannot drift from what a run allocates:

- `config_units(config)`: the units (embedding, decoder layers, head) with their exact parameter
  counts, laid out by the same `build_units` the engine runs, on a meta copy of the model (no
  memory; ~0.1 s for a 120B config). Per-family facts (biases, q/k norms, experts, tied heads)
  come from the family's own modeling code, never from a formula here.
- `mark_resident`: which units a number of resident layers keeps on the GPU.
- `ring_numel` / `grad_slot_numel` / `slab_numel` / `fixed_buffer_numel`: the CUDA pipeline's buffers.
- `loss_chunk`: rows of logits per loss chunk.
"""

from __future__ import annotations

import torch

# transient_grads (EngineConfig): the shared gradient buffers of the streamed units. One is being
# filled while the host steps the units of the others; a third gives the step slack.
TRANSIENT_GRAD_BUFFERS = 3
# gpu_grad_layers (EngineConfig): a gradient kept on the GPU comes over for its host step tile by
# tile, through two pinned tiles of LANDING_TILE elements (the next one's copy runs while the host
# steps the current one): 64 MiB of host RAM, where whole-layer buffers would take back much of
# what keeping the gradients on the GPU saves. A multiple of 64 elements, as the host step's tiles.
GRAD_LANDING_BUFFERS = 2
LANDING_TILE = 1 << 23
# The elementwise stock optimizers (sgd, adagrad, rmsprop: engine/host_optim.py) step a unit's slice of
# its flat master in pieces of at most this many elements, each a parameter of the stock class: their
# step allocates temporaries as large as what it steps, which a piece bounds (32 MiB each) where a
# whole layer would cost gigabytes. Elementwise math, so the cut does not change a number.
PARAM_STEP_TILE = 1 << 23

# Peak bytes of fp32 logits (+ their grad and softmax: 3 copies) per loss chunk, by device type.
LOSS_CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 2 << 30}
LOSS_CHUNK_COPIES = 3


def loss_chunk(vocab: int, device_type: str, asked: int | None = None) -> int:
    """Rows of [rows, vocab] fp32 logits the chunked loss computes at once."""
    if asked:
        return asked
    return max(1, LOSS_CHUNK_BYTES.get(device_type, 1 << 30) // (vocab * 4 * LOSS_CHUNK_COPIES))


def mark_resident(units, layers: int, lean: bool = False, lean_streamed: bool = False, gpu_grads: int = 0) -> int:
    """Mark the embedding, the head and the first `layers` decoder layers resident (none if 0).

    The first layers are the ones the next forward needs first: while the GPU runs them the
    host optimizer can work on the streamed ones behind them. With `lean`, the resident decoder
    layers whose parameters are all trained keep no compute copy (EngineConfig.lean_resident);
    with `lean_streamed`, the streamed ones (EngineConfig.lean_streamed). A layer with frozen
    parts keeps its copy, since the master does not cover those. The last `gpu_grads` streamed
    layers keep their fp32 gradient on the GPU (EngineConfig.gpu_grad_layers): the host steps them
    last, so their gradients come over while it steps the others. Returns the number of resident
    layers."""
    decoder = [u for u in units if u.kind == "layer"]
    layers = max(0, min(int(layers or 0), len(decoder)))
    for u in units:
        u.resident = bool(layers) and (u.kind != "layer" or u.layer < layers)
        wanted = bool(lean) if u.resident else bool(lean_streamed)
        u.no_compute_copy = wanted and u.kind == "layer" and u.n_train == u.numel
        u.grad_on_gpu = False
    for u in streamed_layers(units)[::-1][: max(0, int(gpu_grads or 0))]:
        u.grad_on_gpu = bool(u.n_train)
    return layers


def streamed_layers(units) -> list:
    return [u for u in units if u.kind == "layer" and not u.resident]


def ring_layers(units) -> list:
    """The decoder layers the GPU reads from a ring slot: the streamed ones and the lean resident
    ones (cast from their fp32 master into the slot)."""
    return [u for u in units if u.kind == "layer" and (u.no_compute_copy or not u.resident)]


def ring_numel(units) -> int:
    """Elements of one GPU weight slot: the largest decoder layer that passes through the ring
    (0: none does)."""
    return max((u.numel for u in ring_layers(units)), default=0)


def grad_slot_numel(units) -> int:
    """Elements of one fp32 gradient slot on the GPU: the largest streamed layer's trainable
    prefix (0: no layer streams; a streamed embedding or head gets a fresh gradient tensor; a layer
    whose gradient stays on the GPU is written straight into it)."""
    return max((u.n_train for u in streamed_layers(units) if not u.grad_on_gpu), default=0)


def slab_numel(units) -> int:
    """Elements of one pinned staging slab: the largest trainable prefix of any unit that is not
    resident, since every such unit's later gradient contributions (accumulation) cross PCIe
    through a slab, the embedding and head included (0: everything is resident)."""
    return max((u.n_train for u in units if not u.resident), default=0)


def fixed_buffer_numel(units) -> int:
    """Elements of the GPU buffers a streamed embedding and head get for the whole step."""
    return sum(u.numel for u in units if u.kind != "layer" and not u.resident)


def config_units(config, decay_names=None):
    """The units the engine would build for `config`, from a meta copy of its causal LM."""
    import copy

    from transformers import AutoModelForCausalLM

    from ..patcher.specs import spec_for
    from .store import build_units

    spec = spec_for(config)
    with torch.device("meta"):
        # a copy: building a model settles attributes on its config (the attention choice)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    names = decay_names if decay_names is not None else [n for n, _ in model.named_parameters()]
    return build_units(model, spec, names)
