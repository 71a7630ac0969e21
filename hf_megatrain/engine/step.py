"""The step policy: when the host optimizer runs relative to the backward, written once for the
trainer, `prepare()` users and their own loops.

A streamed unit's step (HostAdamW's, or a stock optimizer's in HostParamOptimizer: the same policy for
both) can run on the host while the backward is still computing the units below it, but only where its
gradient is final and its clip coefficient known:

- without clipping, on the step's last backward: each unit is stepped as soon as its gradient has
  landed (HostOptimizer.step_during_backward), overlapping the CPU optimizer with the GPU;
- with clipping and transient_grads (no gradient outlives its step, so the norm cannot be taken
  after the backward): a first pass measures the global norm and keeps nothing
  (StreamingEngine.gradient_norm), then each unit is stepped, clipped by it, as its gradient lands;
- otherwise (clipping with kept gradients, or an earlier micro-batch of the step): the gradients
  accumulate, and the caller clips (HostOptimizer.clip_grad_norm_) and steps after the backward.

Either way the caller's `optimizer.step()` ends the step: it finishes an armed step or runs one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .loss import loss_denominator

# what a batch carries into the engine; anything else a collator adds stays behind
ENGINE_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


class Backward(NamedTuple):
    losses: list  # each batch's loss (detached), as forward_backward_many returns them
    norm: torch.Tensor | None  # the global gradient norm measured before the backward (a norm pass), else None


class Step(NamedTuple):
    loss: torch.Tensor  # the step's loss: the mean over its real label tokens, as Trainer logs it
    grad_norm: torch.Tensor | None  # the pre-clip global norm where clipping ran, else None


def backward(engine, optimizer, batches: list[dict], *, num_items_in_batch=None, scale: float = 1.0,
             max_grad_norm: float = 0.0, last: bool = True, aux_scale: float = 1.0, head_loss=None) -> Backward:
    """Forward and backward of `batches` (run through each layer together), with the host optimizer's
    step placed by the policy above. last: these are the step's last micro-batches (every one when
    they run together), so that the step may run during this backward. The other arguments are
    StreamingEngine.forward_backward_many's."""
    clip = max_grad_norm or 0.0
    kw = dict(aux_scale=aux_scale, head_loss=head_loss)
    norm = None
    if clip > 0 and engine.store.transient:
        norm = engine.gradient_norm(batches, num_items_in_batch, scale, **kw)
        optimizer.step_during_backward(clip_norm=(norm, clip))
    elif clip <= 0 and last:
        optimizer.step_during_backward()
    return Backward(engine.forward_backward_many(batches, num_items_in_batch, scale, **kw), norm)


def train_step(engine, optimizer, batches: list[dict], *, max_grad_norm: float = 0.0, plan=None) -> Step:
    """One optimizer step over a step's micro-batches (each a dict of input_ids, labels and optionally
    attention_mask / position_ids), as MegaTrainTrainer runs one: the loss is the mean over the
    step's real label tokens (Trainer's num_items_in_batch), the micro-batches run as `plan` says
    (prepare()'s `engine.run_plan` by default: cut into chunks of rows, and through each layer
    together or one at a time), clipped at max_grad_norm (0: none), then `optimizer.step()`.
    The caller then steps its scheduler and calls `engine.zero_grad()`."""
    plan = plan if plan is not None else getattr(engine, "run_plan", None)
    split, together = (plan.split, plan.per_pass > 1) if plan is not None else (1, False)
    chunks = [c for b in batches for c in split_rows(b, split)]
    items = sum(int(loss_denominator(b["labels"], None)) for b in batches)
    if together or len(chunks) == 1:
        runs = [chunks]
    else:
        runs = [[c] for c in chunks]
    losses, norm = [], None
    for i, run in enumerate(runs):
        out = backward(engine, optimizer, run, num_items_in_batch=items, max_grad_norm=max_grad_norm,
                       last=i == len(runs) - 1)
        losses += out.losses
        norm = out.norm if out.norm is not None else norm
    if max_grad_norm and max_grad_norm > 0 and norm is None:
        norm = optimizer.clip_grad_norm_(max_grad_norm)
    optimizer.step()
    return Step(torch.stack([x.float().cpu() for x in losses]).sum(), norm)


def split_rows(batch: dict, parts: int) -> list[dict]:
    """`batch` cut into `parts` batches of consecutive rows, or as many as it has rows (a [1, T]
    position_ids row is shared by all); `[batch]` itself when it stays whole."""
    rows = batch["input_ids"].shape[0]
    parts = min(parts, rows)
    if parts <= 1:
        return [batch]
    out = [dict() for _ in range(parts)]
    for key, value in batch.items():
        if key not in ENGINE_KEYS or value is None:
            continue
        if value.shape[0] == 1 and rows > 1:  # broadcast over the rows
            pieces = [value] * parts
        else:
            pieces = value.chunk(parts, dim=0)
        for piece, part in zip(pieces, out):
            part[key] = piece
    return out
