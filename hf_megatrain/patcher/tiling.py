"""Sequence tiling of a layer's MLP (and MoE experts): memory bounded by the tile, not the sequence.

At long context a decoder layer's MLP intermediates ([tokens, intermediate] several times, plus
their gradients) dwarf everything else the layer holds. The MLP is per token, so running it on
tiles of the sequence computes exactly the same outputs. In the recompute (grad enabled) each
tile is checkpointed: only its input is kept, and the tile is recomputed when its gradient is
needed, so at most one tile's intermediates exist at a time. Weight gradients are summed over
tiles (fp32-rounding-level differences from the untiled sum).

The MLP's own forward is replaced on the (meta) template instance only, so parameter names,
classes and HF's math stay as they are; `untile_mlp` removes the replacement again.
"""

from __future__ import annotations

import types

import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint


def tile_mlp(mlp: torch.nn.Module, tokens_per_tile: int) -> None:
    """Make `mlp(x)` (x: [batch, seq, hidden]) run on tiles of at most `tokens_per_tile` tokens."""
    if getattr(mlp, "_megatrain_tiled", None) is not None:
        mlp._megatrain_tiled = tokens_per_tile
        return
    original = type(mlp).forward
    mlp._megatrain_tiled = tokens_per_tile

    def forward(self, hidden_states, *args, **kwargs):
        batch, seq = hidden_states.shape[0], hidden_states.shape[1]
        rows = max(1, self._megatrain_tiled // max(batch, 1))
        if seq <= rows:
            return original(self, hidden_states, *args, **kwargs)
        tiles = [t.contiguous() for t in hidden_states.split(rows, dim=1)]  # MoE blocks .view() their input
        if not torch.is_grad_enabled():
            return _joined([original(self, t, *args, **kwargs) for t in tiles], batch)
        # The parameters bound right now (views of the streamed buffer, as grad leaves) are
        # captured so that the checkpoint's recompute, which runs after functional_call has
        # unbound them, uses the same tensors.
        bound = dict(self.named_parameters())

        def run(t):
            return functional_call(self, bound, (t, *args), kwargs, tie_weights=False)

        outs = [checkpoint(run, t, use_reentrant=False) for t in tiles]
        return _joined(outs, batch)

    mlp.forward = types.MethodType(forward, mlp)


def _joined(outs: list, batch: int):
    """The tiles' outputs as the untiled MLP returns them: [batch, tile, hidden] joined along the
    sequence; an MLP that also returns per-token values flattened to [batch * tile, ...] (gpt-oss's
    router scores) gets those joined in (row, position) order too."""
    if not isinstance(outs[0], tuple):
        return torch.cat(outs, dim=1)
    joined = [torch.cat([o[0] for o in outs], dim=1)]
    for k in range(1, len(outs[0])):
        parts = [o[k] for o in outs]
        if all(p.shape[0] == batch * o[0].shape[1] for p, o in zip(parts, outs)):
            rest = parts[0].shape[1:]
            parts = [p.view(batch, -1, *rest) for p in parts]
            joined.append(torch.cat(parts, dim=1).reshape(-1, *rest))
        else:
            joined.append(torch.cat(parts, dim=0))
    return tuple(joined)


def untile_mlp(mlp: torch.nn.Module) -> None:
    """Undo tile_mlp: the MLP runs its class's own forward again (nothing if it was not tiled)."""
    if getattr(mlp, "_megatrain_tiled", None) is None:
        return
    del mlp.forward  # the instance attribute tile_mlp set; the class's method shows through again
    del mlp._megatrain_tiled
