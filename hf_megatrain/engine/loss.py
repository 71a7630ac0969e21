"""Final norm + lm_head + cross-entropy in token chunks, with the backward done per chunk.

Exactly `ForCausalLMLoss` (transformers.loss.loss_utils): labels are shifted left with
-100 padding, logits are upcast to fp32, cross-entropy ignores -100, and the loss is
sum / num_items_in_batch when that is given, otherwise the mean over counted tokens.
With loss_type='dft' (TRL's SFTConfig, Dynamic Fine-Tuning) each token's negative log-likelihood
is weighted by its probability, detached (exp(log_p).detach(), as SFTTrainer.compute_loss does),
with the same normalisation; the gradient is that of the weighted sum with the weight constant.

Only rows whose shifted label is not -100 contribute, so only those rows are pushed through
lm_head: padding and prompt tokens cost no vocabulary matmul. At most `chunk` rows of
[rows, vocab] logits exist at once; the full [B, T, vocab] tensor never does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX

LOSS_TYPES = ("nll", "dft")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def counted_rows(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the tokens that have a target. Taken on the host copy of the labels when
    there is one: `nonzero` on the GPU would stall the host until the whole forward is done."""
    return (shift_labels(labels).reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def loss_denominator(labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """sum/num_items_in_batch when given (Trainer's GA-correct count), else the mean over counted tokens."""
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            return num_items_in_batch.to(labels.device)
        return torch.tensor(num_items_in_batch, device=labels.device)
    return (shift_labels(labels) != IGNORE_INDEX).sum()


def chunked_head_loss(
    run_head,
    weights: list[torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    denom: torch.Tensor,
    seed: torch.Tensor | None,
    chunk: int,
    rows: torch.Tensor | None = None,
    trainable: list[bool] | None = None,
    stats: dict | None = None,
    loss_type: str = "nll",
):
    """Loss of the head over `hidden`, and (when `seed` is given) its gradients.

    run_head(weights, rows[N, H]) -> logits[N, V]
    seed: d(total loss)/d(loss), e.g. 1/GA, as an fp32 scalar tensor on the device.

    trainable: which weights get a gradient (frozen ones, e.g. under LoRA, get None).
    stats: when a dict, it receives device tensors over the counted tokens: 'tokens', the
    summed 'entropy' of the predicted distributions and 'correct' top-1 predictions (TRL's
    SFT metrics), at the cost of a softmax over each chunk's logits.
    loss_type: 'nll' (the causal LM's loss) or 'dft' (TRL's: each token's NLL times its detached
    probability).

    Returns (loss, grad_hidden or None, fp32 grads of `weights` or None).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")
    trainable = trainable if trainable is not None else [True] * len(weights)
    hidden_size = hidden.shape[-1]
    flat_h = hidden.reshape(-1, hidden_size)
    flat_l = shift_labels(labels).reshape(-1)
    if rows is None:
        rows = counted_rows(labels)
    rows = rows.to(hidden.device, non_blocking=True)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.zeros_like(flat_h) if seed is not None else None
    grad_w = None
    if seed is not None:
        grad_w = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) if t else None
                  for w, t in zip(weights, trainable)]
    chunk_seed = seed / denom if seed is not None else None
    if stats is not None:
        stats.update(tokens=torch.tensor(rows.numel(), device=hidden.device),
                     entropy=torch.zeros((), dtype=torch.float32, device=hidden.device),
                     correct=torch.zeros((), dtype=torch.int64, device=hidden.device))

    for idx in rows.split(chunk):
        h = flat_h.index_select(0, idx)
        target = flat_l.index_select(0, idx)
        if seed is None:
            with torch.no_grad():
                logits = run_head(weights, h).float()
                total += _summed_loss(logits, target, loss_type)
                _add_stats(stats, logits, target)
            continue
        bound = [w.detach().requires_grad_() if t else w for w, t in zip(weights, trainable)]
        leaves = [b for b, t in zip(bound, trainable) if t]
        h.requires_grad_()
        with torch.enable_grad():
            logits = run_head(bound, h).float()
            ce = _summed_loss(logits, target, loss_type)
            _add_stats(stats, logits, target)
            grads = torch.autograd.grad(ce, [h] + leaves, grad_outputs=chunk_seed, materialize_grads=True, allow_unused=True)
        total += ce.detach()
        grad_h.index_copy_(0, idx, grads[0])
        for acc, g in zip([a for a in grad_w if a is not None], grads[1:]):
            acc.add_(g)

    loss = total / denom
    if grad_h is not None:
        grad_h = grad_h.view_as(hidden)
    return loss, grad_h, grad_w


def _summed_loss(logits: torch.Tensor, target: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The chunk's summed token loss over fp32 logits."""
    if loss_type == "dft":  # -log_p * exp(log_p).detach()
        nll = F.cross_entropy(logits, target, reduction="none")
        return (nll * torch.exp(-nll).detach()).sum()
    return F.cross_entropy(logits, target, reduction="sum")


def _add_stats(stats: dict | None, logits: torch.Tensor, target: torch.Tensor) -> None:
    if stats is None:
        return
    with torch.no_grad():
        logp = logits.detach().log_softmax(-1)
        stats["entropy"] += -(logp.exp() * logp).sum()
        stats["correct"] += (logp.argmax(-1) == target).sum()


def full_logits(run_head, weights, hidden: torch.Tensor, chunk: int) -> torch.Tensor:
    """All logits (for evaluation with metrics); built chunk by chunk in the compute dtype."""
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    with torch.no_grad():
        parts = [run_head(weights, h) for h in flat_h.split(chunk)]
    return torch.cat(parts).view(*hidden.shape[:-1], -1)


# -- losses of per-row sums (TRL's preference losses) --------------------------------------------
ROW_FIELDS = ("logps", "tokens", "entropy", "mean_logits", "top1")


class RowLoss:
    """A loss that is a function of per-row sums over each row's counted tokens (TRL's DPO family:
    sums of token log-probabilities of the chosen and rejected rows), for `row_head_loss`.

    fn(k, per_row) -> scalar loss of micro-batch k, differentiable in per_row['logps'];
    per_row holds [rows] fp32 tensors: 'logps' (summed token log-probabilities), 'tokens' (counted
    tokens), 'entropy' (summed entropies of the predicted distributions), 'mean_logits' (summed
    per-token means of the logits over the vocabulary) and 'top1' (tokens whose target is the
    first argmax); and, per counted token, 'token_logps' (its log-probability: the leaf 'logps' is
    summed from, for a loss of sums over other sets of tokens, e.g. ORPO's prompt-and-completion NLL
    beside its completion log-probabilities) and 'token_index' (its flat position, row * seq + t,
    the order of loss.counted_rows). The other entries are constants: only the log-probabilities
    carry a gradient. Sums row_head_loss computes only when asked (its `extra`, the engine's
    `row_stats`): 'log_sum_sq_probs', the summed log sum_v p_v^2 of the predicted distributions
    (TRL's WPO weights).

    fn may set per_row['live']: a bool tensor over the counted tokens, False where a token's
    coefficient is known to be 0 (counted only for a statistic, as ORPO's and CPO's logits metrics
    count padding); the second pass then skips those tokens. On the host it costs no device sync."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, k: int, per_row: dict) -> torch.Tensor:
        return self.fn(k, per_row)


def row_head_loss(
    run_head,
    weights: list[torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    row_loss,
    seed: torch.Tensor | None,
    chunk: int,
    rows: torch.Tensor | None = None,
    trainable: list[bool] | None = None,
    extra: tuple[str, ...] = (),
):
    """A loss of per-row sums of token log-probabilities (`row_loss(per_row)`, RowLoss's fn for one
    micro-batch), and (when `seed` is given) the gradients of seed * loss. `extra`: further per-row
    sums of the first pass (RowLoss names them).

    Two passes of the head over the counted tokens, `chunk` rows of logits at a time: the first,
    without autograd, takes each token's log-probability (and the statistics RowLoss names); the
    loss is evaluated on them with autograd, which gives each token's coefficient
    c_t = seed * d loss / d log p_t (for a loss of per-row sums, its row's d loss / d sum); the
    second recomputes each chunk's logits with autograd and backpropagates sum_t c_t * log p_t,
    which is exactly the loss's gradient (the loss depends on the weights only through the token
    log-probabilities). Returns (loss, grad_hidden or None, fp32 grads of `weights` or None)."""
    trainable = trainable if trainable is not None else [True] * len(weights)
    seq = hidden.shape[1]
    n_rows = hidden.shape[0]
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_l = shift_labels(labels).reshape(-1)
    if rows is None:
        rows = counted_rows(labels)
    rows = rows.to(hidden.device, non_blocking=True)
    per_row = {k: torch.zeros(n_rows, dtype=torch.float32, device=hidden.device) for k in ROW_FIELDS + tuple(extra)}
    token_logps = torch.zeros(rows.numel(), dtype=torch.float32, device=hidden.device)

    with torch.no_grad():  # pass 1: each token's log-probability, the statistics' sums
        start = 0
        for idx in rows.split(chunk):
            target = flat_l.index_select(0, idx)
            logits = run_head(weights, flat_h.index_select(0, idx)).float()
            logp = logits.log_softmax(-1)
            row = idx // seq
            token_logps[start:start + idx.numel()] = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            start += idx.numel()
            per_row["tokens"].index_add_(0, row, torch.ones_like(row, dtype=torch.float32))
            per_row["entropy"].index_add_(0, row, -(logp.exp() * logp).sum(-1))
            per_row["mean_logits"].index_add_(0, row, logits.mean(-1))
            per_row["top1"].index_add_(0, row, (logits.argmax(-1) == target).float())
            if "log_sum_sq_probs" in extra:
                per_row["log_sum_sq_probs"].index_add_(0, row, torch.logsumexp(2 * logp, -1))

    token_logps.requires_grad_(seed is not None)
    with torch.enable_grad():
        # the rows' sums in token order, as pass 1 would have added them up chunk by chunk
        per_row["logps"] = per_row["logps"].index_add(0, rows // seq, token_logps)
        per_row["token_logps"], per_row["token_index"] = token_logps, rows
        loss = row_loss(per_row)
        if seed is None:
            return loss.detach().float(), None, None
        (coef,) = torch.autograd.grad(loss, [token_logps], grad_outputs=seed.to(loss.dtype), materialize_grads=True)
    token_logps.requires_grad_(False)
    coef = coef.float()
    live = per_row.get("live")
    if live is not None:  # tokens counted for a statistic only: no second pass for them
        keep = live.nonzero().squeeze(1).to(hidden.device, non_blocking=True)
        rows, coef = rows.index_select(0, keep), coef.index_select(0, keep)

    grad_h = torch.zeros_like(flat_h)
    grad_w = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) if t else None
              for w, t in zip(weights, trainable)]
    for idx, c in zip(rows.split(chunk), coef.split(chunk)):  # pass 2: d(sum_t c_t * log p_t)
        h = flat_h.index_select(0, idx).requires_grad_()
        target = flat_l.index_select(0, idx)
        bound = [w.detach().requires_grad_() if t else w for w, t in zip(weights, trainable)]
        leaves = [b for b, t in zip(bound, trainable) if t]
        with torch.enable_grad():
            logits = run_head(bound, h).float()
            token_logp = -F.cross_entropy(logits, target, reduction="none")
            weighted = (token_logp * c).sum()
            grads = torch.autograd.grad(weighted, [h] + leaves, materialize_grads=True, allow_unused=True)
        grad_h.index_copy_(0, idx, grads[0])
        for acc, g in zip([a for a in grad_w if a is not None], grads[1:]):
            acc.add_(g)
    return loss.detach().float(), grad_h.view_as(hidden), grad_w
