"""What Gemma 3n and Gemma 4 (and PEFT's prefix tuning) hand decoder layers beside the hidden states, for the
schedule.

Three things their base model's forward does outside the layers (patcher/specs.py, ArchSpec.per_layer,
.shared_kv and .altup), and one of PEFT's, each a tensor that one unit makes and others read:

- Per-layer embeddings: `get_per_layer_inputs` and `project_per_layer_inputs` of the base model make, once per
  batch, [batch, seq, layers, width] from the token ids and the token embeddings; layer i reads [:, :, i]. The
  per-layer unit (`PerLayerInputs`, a template like any other) makes them after the embedding; in the backward
  every layer's recompute hands back the gradient of its slice, and the per-layer unit's own recompute turns their
  sum into its weight gradient and a gradient of the token embeddings, before the embedding's backward.
- KV sharing: the last layers attend with keys and values an earlier layer stored in a dict (`shared_kv_states`)
  the forward passes every layer. The engine's dict (`SharedKV`) notes what each layer read and wrote during the
  forward; a reading layer's recompute gets leaves of what it read and hands back their gradients, and the layer
  that wrote them, whose backward comes later, adds those as seeds of what it writes (`SideInputs`).
- AltUp (Gemma 3n): the hidden states between layers are [inputs, batch, seq, hidden], stacked from the token
  embeddings by the embedding unit and collapsed by the head unit (`altup_stack`, `altup_collapse`).
- Prefix tuning (engine/prompts.py): every layer's keys and values before its own, made by the embedding unit;
  a layer's recompute gets leaves of its pair and hands back their gradients, which seed the embedding unit's.

Each graph still spans one unit: the tensors crossing units are leaves, and their gradients are handed on.
"""

from __future__ import annotations

import inspect
from collections import UserDict

import torch
from torch import nn


class PerLayerInputs(nn.Module):
    """The per-layer unit's template: every decoder layer's input of its own, [batch, seq, layers, width], made by
    the base model's own `get_per_layer_inputs` and `project_per_layer_inputs`, run with this module as their
    `self`: it holds copies of the modules those read (the table, the projection, its norm), the base model's own
    buffers (Gemma 3n's scales, which the template's buffers fill on each call) and plain numbers (Gemma 4's
    scales), and the engine's config."""

    def __init__(self, base: nn.Module, parts: dict[str, nn.Module], config):
        super().__init__()
        for name, module in parts.items():
            setattr(self, name, module)
        for name, buf in base.named_buffers(recurse=False):
            self.register_buffer(name, torch.empty_like(buf, device="meta"), persistent=False)
        for name, value in vars(base).items():
            if not name.startswith("_") and name not in ("training", "config") \
                    and isinstance(value, (bool, int, float, type(None))):
                setattr(self, name, value)
        self.config = config
        self._get = type(base).get_per_layer_inputs
        self._project = type(base).project_per_layer_inputs
        # Gemma 4's takes the embeddings too (to find the ids when it has none), Gemma 3n's the ids alone
        self._with_embeds = "inputs_embeds" in inspect.signature(self._get).parameters

    def forward(self, input_ids, inputs_embeds):
        raw = self._get(self, input_ids, inputs_embeds) if self._with_embeds else self._get(self, input_ids)
        return self._project(self, inputs_embeds, raw)


def base_buffers(base: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's own buffers (not its children's) by name, the ones PerLayerInputs registers."""
    return dict(base.named_buffers(recurse=False))


def altup_stack(x: torch.Tensor, projections: nn.ModuleList) -> torch.Tensor:
    """Gemma 3n's model forward before its first layer, written out: the token embeddings and one projection of
    them per further AltUp input, each scaled to the embeddings' root mean square (its magnitude held at least
    at sqrt(1e-5)), stacked into [inputs, batch, seq, hidden]. The same operations in the same order as its
    forward, so the numbers are its own."""
    target = torch.mean(x**2, dim=-1, keepdim=True) ** 0.5
    floor = torch.tensor(1e-5).to(target.device)
    out = [x]
    for proj in projections:
        y = proj(x).to(dtype=x.dtype, device=target.device)
        magnitude = torch.sqrt(torch.maximum(torch.mean(y**2, dim=-1, keepdim=True), floor))
        out.append(y * target / magnitude)
    return torch.stack(out, dim=0)


def altup_collapse(h: torch.Tensor, projections: nn.ModuleList, dtype: torch.dtype) -> torch.Tensor:
    """Its model forward after its last layer: the first AltUp input and the unembedding projection of each other,
    scaled to the first's root mean square, averaged. `dtype`: the token embeddings' (what the forward casts the
    projections to), the compute dtype."""
    target = torch.mean(h[0] ** 2, dim=-1, keepdim=True) ** 0.5
    floor = torch.tensor(1e-5).to(target.device)
    out = [h[0]]
    for i, proj in enumerate(projections, start=1):
        y = proj(h[i]).to(dtype=dtype, device=target.device)
        magnitude = torch.sqrt(torch.maximum(torch.mean(y**2, dim=-1, keepdim=True), floor))
        out.append(y * target / magnitude)
    return torch.mean(torch.stack(out), dim=0)


class SharedKV(UserDict):
    """The dict KV sharing hands from layer to layer (the base model passes a UserDict too), noting which entries
    the layer being called reads and writes: `begin()` before each call, `read` and `written` after it."""

    def __init__(self):
        self.read: list = []
        self.written: list = []
        super().__init__()

    def begin(self) -> None:
        self.read, self.written = [], []

    def __getitem__(self, key):
        if key not in self.read:
            self.read.append(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        if key not in self.written:
            self.written.append(key)
        super().__setitem__(key, value)


class SideInputs:
    """One decoder layer's recompute: the leaves of what it reads that other units made (`kwargs`, passed beside the
    engine's usual keywords; `leaves`, whose gradients recompute_grads hands back after the hidden states' own),
    and what it writes for later layers (`made_outputs()`, seeded with `made_seeds`)."""

    def __init__(self):
        self.kwargs: dict = {}
        self.leaves: list[torch.Tensor] = []
        self.per_layer: torch.Tensor | None = None
        self.read: list = []  # the shared keys/values read, in the order of their leaves (after per_layer)
        self.made: list = []  # the shared keys/values written whose gradients later layers sent back
        self.made_seeds: list[torch.Tensor] = []
        self.kv: SharedKV | None = None
        self.prefix: list[torch.Tensor] | None = None  # prefix tuning: its keys and values (after the rest)

    def made_outputs(self) -> list[torch.Tensor]:
        """The keys and values the call just wrote (with their graph), paired with made_seeds."""
        return [t for key in self.made for t in self.kv.data[key]]


class LayerSides:
    """What one batch's layers hand one another beside the hidden states (part of the schedule's batch context):
    the per-layer inputs and their gradients, the shared keys and values of the forward, who read and wrote which,
    and the gradients the readers sent back."""

    def __init__(self, shared_kv: bool):
        self.per_layer: torch.Tensor | None = None  # [batch, seq, layers, width], made by the per-layer unit
        self.per_layer_grad: torch.Tensor | None = None
        self.embeds: torch.Tensor | None = None  # what the per-layer unit read (its recompute reads it again)
        self.kv = SharedKV() if shared_kv else None
        self.reads: dict[int, list] = {}
        self.writes: dict[int, list] = {}
        self.kv_grads: dict = {}  # key -> [grad of keys, grad of values], summed over the layers that read them
        # prefix tuning (engine/prompts.py): [layers * 2, batch, heads, n, head_dim], made by the embedding unit
        self.prefix: torch.Tensor | None = None
        self.prefix_grad: torch.Tensor | None = None
        self.caches = None  # prompts.PrefixCaches: the cache each layer gets it in

    def take_prefix(self, prefix: torch.Tensor, caches) -> None:
        self.prefix, self.caches = prefix, caches
        self.prefix_grad = torch.zeros_like(prefix)

    def forward_kwargs(self, layer: int) -> dict:
        kw = {}
        if self.per_layer is not None:
            kw["per_layer_input"] = self.per_layer[:, :, layer, :]
        if self.kv is not None:
            self.kv.begin()
            kw["shared_kv_states"] = self.kv
        if self.prefix is not None:
            kw.update(self.caches.for_layer(layer, self.prefix[2 * layer], self.prefix[2 * layer + 1]))
        return kw

    def noted(self, layer: int) -> None:
        """After layer `layer`'s forward call: what it read and wrote."""
        if self.kv is not None:
            self.reads[layer], self.writes[layer] = list(self.kv.read), list(self.kv.written)

    def leaves(self, layer: int) -> SideInputs:
        side = SideInputs()
        if self.per_layer is not None:
            side.per_layer = self.per_layer[:, :, layer, :].detach().requires_grad_()
            side.kwargs["per_layer_input"] = side.per_layer
            side.leaves.append(side.per_layer)
        if self.kv is not None:
            side.kv = SharedKV()
            for key in self.reads.get(layer, ()):
                pair = tuple(t.detach().requires_grad_() for t in self.kv.data[key])
                side.kv.data[key] = pair
                side.leaves += pair
                side.read.append(key)
            # its backward comes after every later layer's: all the gradients of what it wrote are in
            side.made = [key for key in self.writes.get(layer, ()) if key in self.kv_grads]
            side.made_seeds = [g for key in side.made for g in self.kv_grads.pop(key)]
            side.kwargs["shared_kv_states"] = side.kv
        if self.prefix is not None:
            side.prefix = [self.prefix[2 * layer + i].detach().requires_grad_() for i in (0, 1)]
            side.kwargs.update(self.caches.for_layer(layer, *side.prefix))
            side.leaves += side.prefix
        return side

    def take_grads(self, layer: int, side: SideInputs, grads: list[torch.Tensor]) -> None:
        """The gradients of a recompute's side leaves (in SideInputs.leaves order), kept for their makers."""
        it = iter(grads)
        if side.per_layer is not None:
            if self.per_layer_grad is None:
                self.per_layer_grad = torch.zeros_like(self.per_layer)
            self.per_layer_grad[:, :, layer, :] = next(it)
        for key in side.read:
            pair = [next(it), next(it)]
            if key in self.kv_grads:
                for acc, g in zip(self.kv_grads[key], pair):
                    acc.add_(g)
            else:
                self.kv_grads[key] = pair
        if side.prefix is not None:
            self.prefix_grad[2 * layer] = next(it)
            self.prefix_grad[2 * layer + 1] = next(it)
