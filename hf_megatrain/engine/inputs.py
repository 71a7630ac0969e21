"""A micro-batch on its way into the engine: checked, moved to the compute device, and told
whether its attention must run document by document.

The schedule (schedule.py) hands each batch dict to `BatchInputs.prepare` and runs on what comes
back; nothing here allocates more than the batch itself, so every refusal comes before the
forward has touched a weight.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from ..constants import IGNORE_INDEX
from ..errors import MegaTrainError
from ..patcher.documents import document_spans, restarts
from ..patcher.specs import SLIDING
from .loss import counted_rows

_DENSE_MASK_LIMIT = 2 << 30  # bytes of a boolean [batch, 1, T, T] mask we let HF build


class Prepared(NamedTuple):
    """One micro-batch on the compute device, as the schedule reads it."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    labels: torch.Tensor | None
    pos: torch.Tensor
    rows: torch.Tensor | None  # flat indices of the tokens with a target, taken on the host (loss.counted_rows)
    docs: list | None  # document spans per row where attention runs document by document


class BatchInputs:
    """Prepares one engine's micro-batches: `config` is the engine's own copy of the model config
    (its attention choice and lengths), `spec` the family's ArchSpec, `device` the compute device.

    It keeps one piece of state: whether the too-long warning was given (once per engine)."""

    def __init__(self, config, spec, device: torch.device):
        self.config = config
        self.spec = spec
        self.device = device
        self._warned_length = False

    def prepare(self, batch: dict) -> Prepared:
        ids = batch.get("input_ids")
        if ids is None:
            raise MegaTrainError("the batch has no 'input_ids'; hf_megatrain trains on token ids.")
        labels = batch.get("labels")
        if ids.device.type == "cpu":
            validate_tokens(ids, labels, self.config.vocab_size)
        pos = batch.get("position_ids")
        # packed (and TRL's padding-free) rows restart their positions: what counts is the largest
        self.check_length(int(pos.max()) + 1 if pos is not None and pos.device.type == "cpu" else ids.shape[1])
        docs = self.documents(ids, batch.get("attention_mask"), batch.get("position_ids"))
        rows = counted_rows(labels) if labels is not None and labels.device.type == "cpu" else None
        if rows is not None and self.device.type == "cuda":
            rows = rows.pin_memory()
        dev = self.device
        ids = ids.to(dev, non_blocking=True)
        mask = batch.get("attention_mask")
        mask = mask.to(dev, non_blocking=True) if mask is not None else None
        labels = labels.to(dev, non_blocking=True) if labels is not None else None
        if pos is None:
            pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        else:
            pos = pos.to(dev, non_blocking=True)
        return Prepared(ids, mask, labels, pos, rows, docs)

    def documents(self, ids, mask, pos) -> list | None:
        """Document spans per row when long rows must run attention document by document, else None.

        SDPA and eager attention stay O(T) in memory only for plain causal rows (the mask is then
        None and the kernel applies causality itself). Padding or packed documents (position ids
        restarting) make HF build a dense boolean mask: 256 GiB at 512K tokens. Under SDPA such
        rows run one document at a time instead (patcher/documents.py); what that cannot express
        is refused here, before anything is allocated.
        """
        impl = getattr(self.config, "_attn_implementation", None) or "sdpa"
        rows, seq = ids.shape
        if impl not in ("sdpa", "eager") or rows * seq * seq < _DENSE_MASK_LIMIT:
            return None
        padded = mask is not None and not bool(mask.all())
        packed = pos is not None and bool(restarts(pos).any())
        if not (padded or packed):
            return None
        docs = document_spans(rows, mask, pos if pos is not None else torch.arange(seq).unsqueeze(0))
        window = getattr(self.config, "sliding_window", None)
        longest = max((b - a for row in docs or [] for a, b in row), default=0)
        sliding = SLIDING in self.spec.kinds(self.config) and window is not None and longest > window
        if impl == "sdpa" and docs is not None and not sliding and self.spec.attention_kwargs:
            return docs
        why = ("left or inner padding" if docs is None else
               f"documents of up to {longest} tokens under a {window}-token sliding window" if sliding else
               "attn_implementation='eager'" if impl == "eager" else
               f"{self.spec.model_type}'s decoder layers, which do not pass extra arguments to attention")
        raise MegaTrainError(
            f"rows of {seq} tokens with {'packed documents' if packed else 'padding'} need a dense "
            f"{rows}x{seq}x{seq} attention mask under attn_implementation={impl!r} "
            f"({rows * seq * seq / 2**30:.0f} GiB), and with {why} they cannot run document by document. "
            "Use attn_implementation='sdpa' with right padding, 'flash_attention_2' (flash-attn installed) or "
            "'flex_attention', or give one document per row without padding (packing=False)."
        )

    def check_length(self, seq: int) -> None:
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit and seq > limit and not self._warned_length:
            self._warned_length = True
            warnings.warn(
                f"sequences of {seq} tokens are longer than config.max_position_embeddings={limit}: the model was "
                "not trained at this length. Extend it deliberately: set config.rope_parameters (rope_scaling: "
                "'yarn', 'linear', 'dynamic' or 'llama3') and config.max_position_embeddings before training.",
                stacklevel=3,  # the engine's call that prepared the batch (check_length <- prepare <- it)
            )


def require_labels(prepared: list[Prepared]) -> None:
    """Training needs labels in every micro-batch (evaluation does not)."""
    if any(p.labels is None for p in prepared):
        raise MegaTrainError(f"the batch has no 'labels'; training needs them (use {IGNORE_INDEX} to ignore a token).")


def validate_tokens(ids: torch.Tensor, labels: torch.Tensor | None, vocab: int) -> None:
    """Clear errors for ids/labels outside the vocabulary (instead of a device-side assert)."""
    if ids.numel() == 0:
        raise MegaTrainError("the batch is empty (0 tokens).")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise MegaTrainError(
            f"input_ids contain token id {hi if hi >= vocab else lo}, outside the model's vocabulary "
            f"[0, {vocab}). Is the tokenizer the model's own? (config.vocab_size={vocab})"
        )
    if labels is not None:
        valid = labels[labels != IGNORE_INDEX]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
            raise MegaTrainError(
                f"labels contain ids outside [0, {vocab}) other than {IGNORE_INDEX} (the ignore index)."
            )
