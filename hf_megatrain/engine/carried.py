"""A state a family's model forward carries from one decoder layer's call to the next (ArchSpec.carried).

GLM-5's DSA layers return their indexer's top-k beside the hidden states, and its forward hands the next layer the
previous one's (`prev_topk_indices`; a "shared" layer attends over them instead of running an indexer of its own).
They are token indices: no gradient flows through them, so a unit needs only what it was handed, never a gradient
back. The forward notes, per layer, what it handed the layer; the layer's recompute in the backward gets the same.
"""

from __future__ import annotations

import torch

from ..errors import MegaTrainError


class Carried:
    """One batch's carried state: `keyword` is what a layer takes it by, `index` where it is among the layer's
    outputs."""

    def __init__(self, keyword: str, index: int):
        self.keyword, self.index = keyword, index
        self.last = None  # what the next layer's forward gets: the first layer, None
        self.given: dict[int, object] = {}

    def forward_kwargs(self, layer: int) -> dict:
        self.given[layer] = self.last
        return {self.keyword: self.last}

    def took(self, layer: int, out):
        """The hidden states of a layer's forward output, keeping what it carries on for the next layer."""
        value = out[self.index]
        if isinstance(value, torch.Tensor) and (value.requires_grad or value.is_floating_point()):
            # a gradient would have to flow to the layer that made it, across units: not what this carries
            raise MegaTrainError(f"decoder layer {layer} hands the next layer {self.keyword} that could carry a gradient "
                                 f"({value.dtype}), which the engine carries only as indices without one")
        self.last = value
        return out[0]

    def recompute_kwargs(self, layer: int) -> dict:
        return {self.keyword: self.given[layer]}
