"""Stateless templates: HF modules with no storage, run on views of a flat weight buffer.

A template is the HF module itself (a decoder layer, the embedding, the final norm + lm_head)
built on the meta device, so it owns no memory. Each call binds its parameters to views of
whichever flat buffer holds the unit now (a GPU ring slot, or the host store on CPU) through
`torch.func.functional_call`, and HF's own forward does the math: attention backends, rotary
embeddings, masks and MoE routing stay exactly HF's.

Backward recomputes the unit from its saved input with the weight views as fresh leaves and
takes `autograd.grad`; the weight gradients are concatenated into ONE flat tensor in the
unit's layout, ready for a single device-to-host copy. No autograd graph outlives a unit.
"""

from __future__ import annotations

import copy
import itertools
from contextlib import contextmanager

import torch
from torch import nn
from torch.func import functional_call


def meta_copy(module: nn.Module, substitute: dict | None = None) -> nn.Module:
    """A copy of `module` whose parameters and buffers live on meta: same classes, same
    attributes and wrappers (e.g. PEFT's LoRA layers), no storage. `substitute` maps objects
    the module refers to (the model's config) to what the copy refers to instead (the engine's
    own config, shared by every template), keyed by the original object's id."""
    memo = dict(substitute or {})
    for t in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def persistent_buffers(model) -> dict:
    """The model's buffers that are saved with its weights (state_dict keys that are not parameters),
    by full name; those of a rotary module (older checkpoints' inv_freq) and HF v5's constants (a
    `scalar_<name>` beside the buffer: Gemma's embed_scale) aside, whose values the model rebuilds."""
    out = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "inv_freq") or type(module).__name__.endswith("RotaryEmbedding"):
            continue
        for k, b in module._buffers.items():
            if b is not None and k not in module._non_persistent_buffers_set and not hasattr(module, f"scalar_{k}"):
                out[f"{prefix}.{k}" if prefix else k] = b
    return out


class Template:
    """One HF module on meta plus the local parameter names of the units it serves."""

    def __init__(self, module: nn.Module, buffers: dict[str, torch.Tensor] | None = None):
        self.module = module
        self.buffers = buffers or {}
        self._captures: list | None = None
        # Arguments the module's forward requires that the engine does not pass: given None, as a model
        # forward passes them when it has nothing there (Falcon's alibi, without ALiBi). For a type outside
        # the registry the self-check shows that this is what stock computes.
        import inspect

        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
        self._required = [p.name for p in params if p.default is p.empty
                          and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    # -- binding ---------------------------------------------------------------------------
    @staticmethod
    def views(flat: torch.Tensor, slots) -> list[torch.Tensor]:
        return [aligned(flat[s.offset : s.offset + s.numel].view(s.shape)) for s in slots]

    def call(self, named: dict[str, torch.Tensor], *args, **kwargs):
        """The module's forward on `named` tensors: its parameters, and any buffer that is one unit's own
        (a persistent buffer of one decoder layer: GLM-4-MoE's router bias), which takes the place of the
        template's (those of the layer it was copied from)."""
        out = self.call_whole(named, *args, **kwargs)
        # A layer that returns (hidden_states, attention weights) as Falcon's does: its model forward goes on
        # with the first.
        return out[0] if isinstance(out, tuple) else out

    def call_whole(self, named: dict[str, torch.Tensor], *args, **kwargs):
        """`call`, its output as the module returns it (GLM-5's layers: the hidden states and their top-k)."""
        for name in self._required[len(args):]:
            kwargs.setdefault(name, None)
        return functional_call(self.module, {**self.buffers, **named}, args, kwargs, tie_weights=False)

    def train(self, mode: bool) -> None:
        self.module.train(mode)

    # -- router capture (MoE) -------------------------------------------------------------
    def capture(self, submodule_path, index: int | None = 0) -> None:
        """Record output[index] of a submodule (the router logits) on every call; index None: the output
        its forward returns as `router_logits` (router_logits_index). Several paths (JetMoE's attention and
        MLP routers in one layer): each call of the layer records one tensor, [routers, tokens, experts],
        the routers in the order the layer called them (what the model's own recorder keeps, one after
        the other), a router called tile by tile (MLP tiling) with its tiles put back in sequence order."""
        paths = [submodule_path] if isinstance(submodule_path, str) else list(submodule_path)
        for slot, path in enumerate(paths):
            sub = self.module.get_submodule(path)
            at = router_logits_index(sub) if index is None else index

            def hook(_mod, _inp, out, at=at, slot=slot):
                if self._captures is not None:
                    logits = out[at] if isinstance(out, tuple) else out
                    self._captures.append(logits if len(paths) == 1 else (slot, logits))

            sub.register_forward_hook(hook)
        if len(paths) > 1:
            self.module.register_forward_hook(self._stack_routers, with_kwargs=True)

    def _stack_routers(self, _mod, args, kwargs, _out) -> None:
        if not self._captures:
            return
        x = args[0] if args else kwargs["hidden_states"]
        order, parts = [], {}
        for slot, logits in self._captures:
            if slot not in parts:
                order.append(slot)
            parts.setdefault(slot, []).append(logits)
        per_router = []
        for slot in order:
            tiles = parts[slot]
            experts = tiles[0].shape[-1]
            per_router.append(tiles[0].reshape(-1, experts) if len(tiles) == 1 else
                              torch.cat([t.reshape(x.shape[0], -1, experts) for t in tiles], dim=1).reshape(-1, experts))
        self._captures[:] = [torch.stack(per_router)]

    @contextmanager
    def capturing(self):
        self._captures = []
        try:
            yield self._captures
        finally:
            self._captures = None


def router_logits_index(router: nn.Module) -> int:
    """Where among a router's outputs its logits are, as the installed transformers has it: the index the
    model's own output recorder takes for `router_logits` (`_can_record_outputs`), else the position of
    `router_logits` in the tuple its forward returns. GraniteMoe's router returned (index, weights, logits)
    up to transformers 5.17 and (logits, weights, index) later."""
    import inspect
    import re
    import sys

    module = sys.modules.get(type(router).__module__)
    for obj in vars(module).values() if module is not None else ():
        recorder = (getattr(obj, "_can_record_outputs", None) or {}).get("router_logits") \
            if isinstance(obj, type) else None
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type) and isinstance(router, target):
            return int(getattr(recorder, "index", 0) or 0)
    try:
        source = inspect.getsource(type(router).forward)
    except (OSError, TypeError):
        return 0
    returned = re.findall(r"^\s*return\s+\(?([^\n]+?)\)?\s*$", source, re.M)
    names = [n.strip() for n in returned[-1].split(",")] if returned else []
    return names.index("router_logits") if "router_logits" in names else 0


def recompute_grads(slots, flat: torch.Tensor, grad_flat: torch.Tensor | None, run, grad_seeds) -> tuple:
    """Re-run `run(named_params)` with grad, backprop `grad_seeds`, write dW into grad_flat.

    Trainable slots become fresh leaves; frozen ones (a LoRA base) stay plain views and get
    no gradient. `run` returns (outputs, inputs_needing_grad): outputs pair one-to-one with
    grad_seeds. Returns the gradients of those extra inputs (e.g. the layer's input).
    """
    named, leaves = {}, []
    for s in slots:
        v = aligned(_own_view(flat, s))
        if s.trainable:
            v = v.detach().requires_grad_()
            leaves.append(v)
        named[s.local] = v
    with torch.enable_grad():
        outputs, extra_inputs = run(named)
        grads = torch.autograd.grad(
            outputs,
            list(extra_inputs) + leaves,
            grad_outputs=grad_seeds,
            allow_unused=True,
            materialize_grads=True,
        )
    n = len(extra_inputs)
    if leaves:
        # One kernel writes every weight gradient into its place in the flat layout.
        torch.cat([g.reshape(-1) for g in grads[n:]], out=grad_flat)
    return grads[:n]


# CUDA kernels that load 16-byte vectors refuse a tensor whose memory starts elsewhere (torch._grouped_mm, which
# transformers' MoE experts call on a GPU). A unit's flat buffer packs its parameters without padding, so a
# parameter after one whose size is not a multiple of 8 elements (a tiny test config's, or a short conv's) can
# start off the boundary; such a one is handed to the layer as an aligned copy (its gradient is the same).
_ALIGN = 16


def aligned(v: torch.Tensor) -> torch.Tensor:
    return v.clone() if v.is_cuda and v.data_ptr() % _ALIGN else v


def _own_view(flat: torch.Tensor, slot) -> torch.Tensor:
    """Slot `slot` of `flat`, as a tensor over the same memory with an autograd version counter of its
    own. Views of one buffer share the buffer's counter, so an in-place op on one weight would mark
    every weight of the unit that the recompute saved as modified. PEFT's LoRA on parameters
    (`target_parameters`, e.g. MoE experts) does one: `nn.utils.parametrize` `set_`s the parameter
    it wraps to itself, which then fails the backward of the router before it."""
    return flat.new_empty(0).set_(flat.untyped_storage(), flat.storage_offset() + slot.offset, slot.shape)
