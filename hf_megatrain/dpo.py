"""TRL's DPOTrainer on the streaming engine: one change of class.

    from hf_megatrain.dpo import MegaTrainDPOTrainer

    trainer = MegaTrainDPOTrainer(model="path/or/hub-id", args=DPOConfig(...),
                                  train_dataset=pairs, peft_config=lora)       # was DPOTrainer
    trainer.train()

TRL prepares the data as it always does (prompt extraction, chat templates, chosen/rejected
tokenization, truncation, its collator, which stacks each batch's chosen rows over its rejected
rows); the engine runs the forward, the loss and the step.

Every loss in DPOConfig's loss_type list is a function of per-row sums: the summed token
log-probabilities of each chosen and rejected completion (and their token counts). The engine's
head computes those sums in a first pass without autograd (engine/loss.py row_head_loss), the
loss and each row's coefficient d loss / d sum come from them, and a second pass backpropagates
the coefficient-weighted token log-probabilities: the gradient of the loss, exactly. The layers
run forward and backward once, as for SFT. ld_alpha (LD-DPO) sums a completion's tokens beyond its
pair's shared length with weight ld_alpha, from the token log-probabilities the first pass hands the
loss; use_weighting (WPO) scales each pair's terms by constants from a further sum of that pass
(each token's log sum_v p_v^2).

The reference is the starting policy, as in stock DPOTrainer without a ref_model. The engine
computes its log-probabilities in a forward-only pass over the data before the first step (TRL's
precompute_ref_log_probs path, taken whether or not the config asks for it): no second model and
no second copy of the weights. Under LoRA the reference is the model with its adapters disabled,
as in TRL; for a PeftModel with an adapter of its own, TRL's frozen copy of that adapter ('ref').
A ref_model that differs (a loaded CPU model, or a hub id or folder, which is streamed
from disk) runs through a second, forward-only engine (hf_megatrain.preference): its weights
frozen, its store holds one compute copy and nothing else. A streamed train_dataset and
sync_ref_model take the reference batch by batch, as stock does (full fine-tuning without a
ref_model: from a forward-only copy of the starting policy). The metrics are TRL's (rewards/*, logps/*, logits/*, entropy, mean_token_accuracy,
num_tokens, a MoE's aux_loss), in training and, as eval_*, in evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from trl import DPOConfig, DPOTrainer
except ImportError as e:  # an optional extra
    raise ImportError("hf_megatrain.dpo needs TRL: pip install 'hf_megatrain[trl]'") from e

from .arguments import MegaTrainArguments, check_arguments
from .engine.loss import RowLoss
from .errors import MegaTrainError
from .preference import EnginePreference, adapters_disabled, check_preference, completion_labels  # noqa: F401
from .sft import TrlEngineFields, trl_arguments
from .trainer import MegaTrainTrainer

# DPOConfig.loss_type values: every one is a function of the per-row sums (see pair_losses)
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass
class MegaTrainDPOConfig(TrlEngineFields, DPOConfig, MegaTrainArguments):
    """`DPOConfig` with the engine's fields (those of `MegaTrainArguments`) besides.

    Where the two overlap, TRL's meaning holds: `max_length` is the row length (the engine plans
    its memory for it), `bf16` defaults to True as in every TRL config (pass `bf16=False` for fp32
    compute on a CPU)."""


def dpo_arguments(args, model) -> MegaTrainDPOConfig:
    """The trainer's own MegaTrainDPOConfig for what the user passed: None (TRL's default, an output
    folder named after the model), a DPOConfig, a MegaTrainDPOConfig or TrainingArguments."""
    own = trl_arguments(args, model, MegaTrainDPOConfig, DPOConfig, "MegaTrainDPOTrainer", "DPO")
    own.loss_type = list(own.loss_type)  # the caller's list stays theirs
    check_arguments(own)
    return own


def check_dpo(args, model, ref_model, train_dataset, peft_config, quantization_config) -> None:
    """What DPOTrainer offers that the engine cannot honour, refused before any data is tokenized."""
    check_preference(args, model, ref_model, train_dataset, peft_config, quantization_config, "DPO")
    unknown = [t for t in args.loss_type if t not in LOSS_TYPES]
    if unknown:
        raise MegaTrainError(f"loss_type {unknown} is not supported: the engine computes {', '.join(LOSS_TYPES)}.")
    if args.f_divergence_type not in F_DIVERGENCES:
        raise MegaTrainError(f"f_divergence_type={args.f_divergence_type!r} is not one of {F_DIVERGENCES}.")


class MegaTrainDPOTrainer(EnginePreference, DPOTrainer, MegaTrainTrainer):
    """`trl.DPOTrainer` whose forward, loss, backward and optimizer step run on the streaming engine.

    Takes what DPOTrainer takes; `args` may be a DPOConfig (the engine's options at their defaults)
    or a MegaTrainDPOConfig. `model` is a hub id, a folder (its weights are streamed into host RAM,
    never loaded whole) or a CPU model; `peft_config` trains LoRA adapters. Without `ref_model` the
    reference is the starting policy; a `ref_model` (a CPU model, or a hub id or folder) streams
    through a forward-only engine (see the module docstring)."""

    rows_per_example = 2  # each micro-batch is its pairs' chosen rows over their rejected rows
    trl_name = "DPO"
    ref_columns = ("ref_chosen_logps", "ref_rejected_logps")

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):
        args = dpo_arguments(args, model)
        skeleton, processing_class = self._engine_init(model, ref_model, args, train_dataset, eval_dataset,
                                                       processing_class, peft_config, quantization_config, check_dpo)
        with self._fingerprint_in_trl_init():
            super().__init__(model=skeleton, ref_model=None, args=args, data_collator=data_collator,
                             train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                             compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        # WPO's weights need each token's log sum_v p_v^2: a further sum of the head's first pass (the reference's
        # passes, before this, do without it)
        self.engine.row_stats = ("log_sum_sq_probs",) if args.use_weighting else ()
        self._reference_ready()

    def _head_loss(self, group, num_items_in_batch):
        return RowLoss(lambda k, per_row: self._dpo_loss(group[k], per_row, k))

    def compute_ref_log_probs(self, model, inputs):
        """The reference's summed log-probabilities of a batch's chosen and rejected completions: the engine's
        forward-only pass, with the reference's LoRA adapters (preference.reference_adapters)."""
        logps = self._engine_logps(inputs["input_ids"], inputs.get("attention_mask"), inputs["completion_mask"],
                                   reference=True, reduce=self._sequence_logps)
        return logps.chunk(2, dim=0)

    # -- one micro-batch ---------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if "labels" not in inputs:  # called outside train()'s loop
            inputs["labels"] = completion_labels(inputs)
        loss = MegaTrainTrainer.training_step(self, model, inputs, num_items_in_batch)
        k = self._micro_index
        self._record_metrics(inputs, self._rows[k], self._micro_aux(k), "train")
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        want_logits = not prediction_loss_only and self.compute_metrics is not None
        self._batch_reference(inputs)
        out, aux = self._engine_eval(inputs, lambda per_row: self._dpo_loss(inputs, per_row, 0), want_logits)
        self._record_metrics(inputs, self._rows[0], aux, "eval")
        loss = out.loss.detach().to(self.args.device)
        if not want_logits:
            return loss, None, None
        return loss, out.logits, inputs["input_ids"].to(out.logits.device)

    # -- the loss ---------------------------------------------------------------------------------------
    def _dpo_loss(self, batch, per_row, k):
        """DPOTrainer's loss of one micro-batch from the engine's per-row sums (its rows: the chosen completions,
        then the rejected ones); keeps what the metrics need in self._rows[k]."""
        logps = self._sequence_logps(per_row)
        chosen, rejected = logps.chunk(2)
        ref_chosen = torch.as_tensor(batch["ref_chosen_logps"]).to(logps)
        ref_rejected = torch.as_tensor(batch["ref_rejected_logps"]).to(logps)
        lengths = torch.as_tensor(batch["completion_mask"]).sum(dim=1).to(logps)  # TRL's unshifted count (IPO)
        weights = None
        if self.args.use_weighting:  # WPO: each row's exp(mean log(p_t / sum_v p_v^2)), constants
            mean = (per_row["logps"].detach() - per_row["log_sum_sq_probs"]) / per_row["tokens"].clamp(min=1)
            weights = torch.mul(*mean.exp().chunk(2))
        loss = pair_losses(self.args, chosen, rejected, ref_chosen, ref_rejected, lengths, per_row["tokens"],
                           plain_chosen=per_row["logps"].chunk(2)[0], pair_weights=weights)
        self._rows[k] = {**{n: v.detach() for n, v in per_row.items()}, "logps": logps.detach(),
                         "ref_chosen": ref_chosen, "ref_rejected": ref_rejected}
        return loss

    def _sequence_logps(self, per_row) -> torch.Tensor:
        """Each row's summed completion log-probabilities as DPOTrainer weighs them: with ld_alpha (LD-DPO), the
        tokens of a completion beyond its pair's shared length (the shorter completion's) count ld_alpha times.
        The counted tokens come row by row, in order (loss.counted_rows)."""
        alpha = self.args.ld_alpha
        if alpha is None:
            return per_row["logps"]
        tok = per_row["token_logps"]
        counts = per_row["tokens"].long()
        row = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        place = torch.arange(row.numel(), device=counts.device) - (torch.cumsum(counts, 0) - counts)[row] + 1
        shared = (place <= torch.minimum(*counts.chunk(2)).repeat(2)[row]).to(tok)
        row = row.to(tok.device)
        zeros = torch.zeros_like(per_row["logps"])
        return zeros.index_add(0, row, tok * shared) + alpha * zeros.index_add(0, row, tok * (1 - shared))

    def _record_metrics(self, inputs, rows, aux, mode: str) -> None:
        """The metrics DPOTrainer._compute_loss logs for one micro-batch, as device tensors until the next log."""
        metrics = self._metrics[mode]
        gather = self.accelerator.gather_for_metrics
        tokens = rows["tokens"]
        chosen_tok, rejected_tok = tokens.chunk(2)
        if self.aux_loss_enabled and aux is not None:
            metrics["aux_loss"].append(gather(aux).mean())
        total = gather(tokens.sum()).sum()
        metrics["entropy"].append(torch.where(total > 0, gather(rows["entropy"].sum()).sum() / total.clamp(min=1), 0.0))
        if mode == "train":
            self._total_train_tokens += int(gather(torch.as_tensor(inputs["attention_mask"]).sum()).sum()) // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        logits_c, logits_r = rows["mean_logits"].chunk(2)
        for name, values, count in (("logits/chosen", logits_c, chosen_tok), ("logits/rejected", logits_r, rejected_tok)):
            n = gather(count.sum()).sum()
            metrics[name].append(torch.where(n > 0, gather(values.sum()).sum() / n.clamp(min=1), 0.0))
        n = gather(chosen_tok.sum()).sum()
        metrics["mean_token_accuracy"].append(torch.where(n > 0, gather(rows["top1"].chunk(2)[0].sum()).sum()
                                                          / n.clamp(min=1), 0.0))
        chosen, rejected = rows["logps"].chunk(2)
        beta = self.args.beta
        chosen_rewards = beta * (chosen - rows["ref_chosen"])
        rejected_rewards = beta * (rejected - rows["ref_rejected"])
        all_gather = self.accelerator.gather
        metrics["rewards/chosen"].append(all_gather(chosen_rewards).mean())
        metrics["rewards/rejected"].append(all_gather(rejected_rewards).mean())
        metrics["rewards/accuracies"].append(all_gather((chosen_rewards > rejected_rewards).float()).mean())
        metrics["rewards/margins"].append(all_gather(chosen_rewards - rejected_rewards).mean())
        metrics["logps/chosen"].append(all_gather(chosen).mean())
        metrics["logps/rejected"].append(all_gather(rejected).mean())


def pair_losses(args, chosen, rejected, ref_chosen, ref_rejected, lengths, tokens, plain_chosen=None,
                pair_weights=None) -> torch.Tensor:
    """DPOConfig's weighted sum of loss types over one micro-batch's pairs, each the mean over the pairs.

    chosen / rejected: the policy's summed completion log-probabilities (with ld_alpha, LD-DPO's weighted
    sums); ref_*: the reference's; lengths: each row's completion tokens (chosen rows, then rejected), as
    the collator's mask counts them; tokens: each row's scored tokens (the shifted mask); plain_chosen:
    the chosen rows' plain sums, which the sft term averages (default: chosen); pair_weights: each pair's
    factor on every term (WPO), or None. Written from the DPOConfig docs and the papers each loss
    cites, checked against DPOTrainer by tests/integration/test_dpo.py."""
    beta, eps = args.beta, args.label_smoothing
    log_ratio_c, log_ratio_r = chosen - ref_chosen, rejected - ref_rejected
    score_c, score_r = _f_scores(args, log_ratio_c), _f_scores(args, log_ratio_r)
    margin = score_c - score_r
    len_c, len_r = lengths.chunk(2)
    weights = args.loss_weights or [1.0] * len(args.loss_type)
    total = 0.0
    for kind, weight in zip(args.loss_type, weights):
        if kind == "sigmoid":
            per_pair = -F.logsigmoid(beta * margin)
        elif kind == "hinge":
            per_pair = torch.relu(1 - beta * margin)
        elif kind in ("ipo", "sigmoid_norm"):  # per-token averages of the scores
            avg = score_c / len_c.clamp(min=1.0) - score_r / len_r.clamp(min=1.0)
            per_pair = (avg - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * avg)
        elif kind == "exo_pair":
            e = torch.tensor(eps, device=margin.device)
            z = beta * margin
            per_pair = torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-e)) + \
                torch.sigmoid(-z) * (F.logsigmoid(-z) - torch.log(e))
        elif kind == "nca_pair":
            rc, rr = beta * log_ratio_c, beta * log_ratio_r
            per_pair = -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)
        elif kind == "robust":
            z = beta * margin
            per_pair = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
        elif kind == "bco_pair":
            per_pair = -F.logsigmoid(beta * log_ratio_c) - F.logsigmoid(-beta * log_ratio_r)
        elif kind == "sppo_hard":
            per_pair = (log_ratio_c - 0.5 / beta) ** 2 + (log_ratio_r + 0.5 / beta) ** 2
        elif kind in ("aot", "aot_unpaired"):  # sorted over the micro-batch's pairs
            if kind == "aot":
                d = torch.sort(chosen - rejected, dim=0)[0] - torch.sort(ref_chosen - ref_rejected, dim=0)[0]
            else:
                d = torch.sort(log_ratio_c, dim=0)[0] - torch.sort(log_ratio_r, dim=0)[0]
            per_pair = -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)
        elif kind == "apo_zero":
            per_pair = (1 - torch.sigmoid(beta * log_ratio_c)) + torch.sigmoid(beta * log_ratio_r)
        elif kind == "apo_down":
            per_pair = torch.sigmoid(beta * log_ratio_c) + (1 - torch.sigmoid(beta * (log_ratio_c - log_ratio_r)))
        elif kind == "discopop":
            z = beta * margin
            mix = torch.sigmoid(z / args.discopop_tau)
            per_pair = -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
        elif kind == "sft":  # the chosen completions' mean token NLL, the same for every pair
            plain = chosen if plain_chosen is None else plain_chosen
            per_pair = (-plain.sum() / tokens.chunk(2)[0].sum()).expand(chosen.shape[0])
        else:
            raise MegaTrainError(f"loss_type {kind!r} is not supported")
        if pair_weights is not None:
            per_pair = per_pair * pair_weights
        total = total + per_pair.mean() * weight
    return total


def _f_scores(args, log_ratio):
    """The f-divergence's score of a log-ratio (f-DPO): the log-ratio itself for the reverse KL."""
    kind = args.f_divergence_type
    if kind == "reverse_kl":
        return log_ratio
    if kind == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    alpha = args.f_alpha_divergence_coef  # alpha_divergence
    if abs(alpha - 1.0) < 1e-6:
        return log_ratio
    t = torch.clamp(((alpha - 1.0) * log_ratio).float(), max=80.0)
    return (torch.exp(t) - 1.0).to(log_ratio.dtype) * (1.0 / (alpha - 1.0))
