"""Long rows of packed documents under SDPA: attention run one document at a time.

HF's sdpa and eager paths express packed documents (position ids restarting) and padding as a
dense [rows, 1, T, T] mask: 256 GiB at 512K tokens. For such rows the engine names this module's
attention for the batch instead. Each document is an ordinary causal call of HF's own
`sdpa_attention_forward` on its slice of q, k and v, so it gets the numerics it would get run
alone, and memory stays O(T).

A document starts where the position ids do not continue (HF's own rule for packed rows, in
`masking_utils.find_packed_sequence_indices`). Right padding is one more span at the end of a
row: causal attention never lets a real token see it, and its outputs carry no loss.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "megatrain_sdpa_documents"
_registered = False


def restarts(pos: torch.Tensor) -> torch.Tensor:
    """[rows, T - 1]: True where a new document begins at position t + 1 (the ids do not continue)."""
    return pos[:, 1:] != pos[:, :-1] + 1


def document_spans(rows: int, mask: torch.Tensor | None, pos: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Per row, the [start, end) spans of its documents (and of its right padding), or None when
    a row's padding is not all at its end (left or inner padding: no causal split expresses it)."""
    pos = pos.cpu().expand(rows, -1)
    seq = pos.shape[1]
    starts = torch.ones(rows, seq, dtype=torch.bool)
    starts[:, 1:] = restarts(pos)
    valid = torch.full((rows,), seq)
    if mask is not None:
        real = mask.cpu().bool()
        valid = real.sum(1)
        if not torch.equal(real, torch.arange(seq) < valid[:, None]):
            return None
    spans = []
    for r in range(rows):
        n = int(valid[r])
        cuts = starts[r, :n].nonzero().flatten().tolist() + [n]
        spans.append(list(zip(cuts[:-1], cuts[1:])) + ([(n, seq)] if n < seq else []))
    return spans


def _by_document(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 megatrain_documents=None, **kwargs):
    # query [rows, heads, T, d], key / value [rows, kv_heads, T, d]; returns [rows, T, heads, d]
    if megatrain_documents is None:
        raise RuntimeError(f"attention {NAME!r} called without document spans: it is the engine's, for one batch")
    # split, not slicing: the backward of a split concatenates its pieces' gradients once, where
    # each slice's backward would write a zero-filled gradient the size of the whole tensor.
    out = []
    for spans, q, k, v in zip(megatrain_documents, *(t.split(1, dim=0) for t in (query, key, value))):
        sizes = [b - a for a, b in spans]
        parts = [
            sdpa_attention_forward(module, qd, kd, vd, None, dropout=dropout, scaling=scaling, **kwargs)[0]
            for qd, kd, vd in zip(*(t.split(sizes, dim=2) for t in (q, k, v)))
        ]
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return torch.cat(out, dim=0) if len(out) > 1 else out[0], None


@contextmanager
def attention_by_document(config):
    """Within: every attention module reading `config` runs document by document (the layer
    calls pass `megatrain_documents`). The config's own choice comes back on exit."""
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, _by_document)
        _registered = True
    old = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = old
