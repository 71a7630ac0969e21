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
run forward and backward once, as for SFT.

The reference is the starting policy, as in stock DPOTrainer without a ref_model. The engine
computes its log-probabilities in a forward-only pass over the data before the first step (TRL's
precompute_ref_log_probs path, taken whether or not the config asks for it): no second model and
no second copy of the weights. Under LoRA the reference is the model with its adapters disabled,
as in TRL. The metrics are TRL's (rewards/*, logps/*, logits/*, entropy, mean_token_accuracy,
num_tokens, a MoE's aux_loss), in training and, as eval_*, in evaluation.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.nn.functional as F
from transformers import TrainingArguments

try:
    from trl import DPOConfig, DPOTrainer
except ImportError as e:  # an optional extra
    raise ImportError("hf_megatrain.dpo needs TRL: pip install 'hf_megatrain[trl]'") from e

from .arguments import MegaTrainArguments, check_arguments
from .constants import IGNORE_INDEX
from .engine.loss import RowLoss
from .engine.step import ENGINE_KEYS
from .errors import MegaTrainError
from .patcher.adapters import check_adapter_config, is_peft_model
from .preflight import check_outputs, check_resume
from .sft import load_for_trl, trl_arguments
from .trainer import MegaTrainTrainer

# DPOConfig.loss_type values: every one is a function of the per-row sums (see pair_losses)
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass
class MegaTrainDPOConfig(DPOConfig, MegaTrainArguments):
    """`DPOConfig` with the engine's fields (those of `MegaTrainArguments`) besides.

    Where the two overlap, TRL's meaning holds: `max_length` is the row length (the engine plans
    its memory for it), `bf16` defaults to True as in every TRL config (pass `bf16=False` for fp32
    compute on a CPU)."""

    gradient_checkpointing: bool | None = field(
        default=next(f.default for f in fields(TrainingArguments) if f.name == "gradient_checkpointing"),
        metadata={"help": "Ignored: the engine always recomputes each layer in the backward."},
    )

    def __post_init__(self):
        super().__post_init__()
        self.follow_max_length()

    def follow_max_length(self) -> None:
        if self.max_length is not None:
            self.max_seq_length = self.max_length


def dpo_arguments(args, model) -> MegaTrainDPOConfig:
    """The trainer's own MegaTrainDPOConfig for what the user passed: None (TRL's default, an output
    folder named after the model), a DPOConfig, a MegaTrainDPOConfig or TrainingArguments."""
    own = trl_arguments(args, model, MegaTrainDPOConfig, DPOConfig, "MegaTrainDPOTrainer", "DPO")
    own.loss_type = list(own.loss_type)  # the caller's list stays theirs
    check_arguments(own)
    return own


def check_dpo(args, model, ref_model, train_dataset, peft_config, quantization_config) -> None:
    """What DPOTrainer offers that the engine cannot honour, refused before any data is tokenized."""
    if is_peft_model(model):
        raise MegaTrainError("a PeftModel as model is not supported: DPOTrainer would keep a copy of its adapter as "
                             "the reference. Pass the base model with peft_config for new adapters, or merge the "
                             "adapter into the base first (merge_and_unload, save_pretrained) and train that.")
    if ref_model is not None:
        raise MegaTrainError("ref_model is not supported: the reference is the starting policy, whose log-probabilities "
                             "the engine computes in a forward-only pass before the first step (the adapter-disabled "
                             "model under LoRA). Omit ref_model, or start from the reference's weights.")
    unknown = [t for t in args.loss_type if t not in LOSS_TYPES]
    if unknown:
        raise MegaTrainError(f"loss_type {unknown} is not supported: the engine computes {', '.join(LOSS_TYPES)}.")
    if args.f_divergence_type not in F_DIVERGENCES:
        raise MegaTrainError(f"f_divergence_type={args.f_divergence_type!r} is not one of {F_DIVERGENCES}.")
    if args.ld_alpha is not None:
        raise MegaTrainError("ld_alpha is not supported: it weighs each token by its place beyond the pair's shared "
                             "length, not a plain per-row sum the engine computes; leave it None.")
    if args.use_weighting:
        raise MegaTrainError("use_weighting (WPO) is not supported yet: it needs each token's log sum of squared "
                             "probabilities; leave it False.")
    if args.sync_ref_model:
        raise MegaTrainError("sync_ref_model is not supported: it keeps a second model that follows the policy, while "
                             "the engine's reference is computed once, before the first step; leave it False.")
    if args.activation_offloading:
        raise MegaTrainError("activation_offloading=True is TRL's offload for a model on the GPU; the engine keeps "
                             "activations itself (offload_activations). Leave it False.")
    if args.use_liger_kernel:
        raise MegaTrainError("use_liger_kernel is not supported; the engine's head is already chunked.")
    if quantization_config is not None or (args.model_init_kwargs or {}).get("quantization_config"):
        raise MegaTrainError("quantization_config is not supported: hf_megatrain trains at full precision (fp32 "
                             "master weights); a frozen LoRA base streams in bf16. Remove it.")
    check_adapter_config(peft_config)  # prompt learning: refused in one line
    targets = getattr(peft_config, "target_modules", None) or ()
    if "lm_head" in (targets if not isinstance(targets, str) else [targets]):
        raise MegaTrainError("a LoRA adapter on lm_head is not supported by DPO (TRL refuses it too: the "
                             "log-probabilities come from lm_head's weight); remove 'lm_head' from target_modules.")
    if train_dataset is None:
        raise MegaTrainError("train_dataset is required (preference pairs: prompt, chosen, rejected).")
    import datasets

    if isinstance(train_dataset, datasets.IterableDataset):
        raise MegaTrainError("train_dataset is an IterableDataset: the engine computes the reference's log-probabilities "
                             "over the whole dataset before the first step, which needs a map-style datasets.Dataset.")
    sample = next(iter(train_dataset))
    if "image" in sample or "images" in sample:
        raise MegaTrainError("vision preference data (an 'image' or 'images' column) is not supported: the engine "
                             "trains text decoders.")


class MegaTrainDPOTrainer(DPOTrainer, MegaTrainTrainer):
    """`trl.DPOTrainer` whose forward, loss, backward and optimizer step run on the streaming engine.

    Takes what DPOTrainer takes; `args` may be a DPOConfig (the engine's options at their defaults)
    or a MegaTrainDPOConfig. `model` is a hub id, a folder (its weights are streamed into host RAM,
    never loaded whole) or a CPU model; `peft_config` trains LoRA adapters. `ref_model` is refused:
    the reference is the starting policy (see the module docstring)."""

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):
        args = dpo_arguments(args, model)
        if peft_config is not None:  # the engine wraps the base itself (DPOTrainer would wrap a meta skeleton)
            if args.peft_config is not None and args.peft_config is not peft_config:
                raise MegaTrainError("peft_config was given twice (as an argument and in args); keep one.")
            args.peft_config = peft_config
        check_dpo(args, model, ref_model, train_dataset, args.peft_config, quantization_config)
        check_outputs(args)
        check_resume(args.resume_from_checkpoint, args.output_dir)
        self._loaded = load_for_trl(model, args)  # a folder or hub id: a meta skeleton the engine fills
        skeleton, tokenizer, _ = self._loaded
        if processing_class is None:
            processing_class = tokenizer
        if args.device.type == "cuda":
            args._n_gpu = 1  # one GPU per process: DPOTrainer would refuse nn.DataParallel on a multi-GPU host
        # The reference's log-probabilities are computed before the first step whatever the config says (the
        # only reference the engine has is the starting policy): TRL's precompute path, with no ref_model built.
        self._asked_precompute = args.precompute_ref_log_probs
        args.precompute_ref_log_probs = True
        self._rows: dict[int, dict] = {}
        super().__init__(model=skeleton, ref_model=None, args=args, data_collator=data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)

    # -- what MegaTrainTrainer.__init__ calls before the engine exists ---------------------------------
    def _datasets(self, raw_data, train_dataset, eval_dataset, data_collator, processing_class, args, config):
        return train_dataset, eval_dataset, data_collator  # prepared by DPOTrainer already

    def _plan(self, args, model):
        # each micro-batch is its pairs' chosen rows over their rejected rows: twice the rows the batch size says
        planned = copy.copy(args)
        planned.per_device_train_batch_size = 2 * args.per_device_train_batch_size
        run = super()._plan(planned, model)
        for name in ("dataloader_pin_memory", "_n_gpu", "gradient_checkpointing"):
            if hasattr(planned, name):
                setattr(args, name, getattr(planned, name))
        if self._split > 1:
            raise MegaTrainError(
                f"the memory plan splits each micro-batch of {planned.per_device_train_batch_size} rows (chosen and "
                f"rejected) into {self._split}, but DPO's loss couples each pair's rows; lower "
                "per_device_train_batch_size (raise gradient_accumulation_steps instead).")
        return run

    def _build_engine(self, model, weights_from, args, engine_config):
        model = super()._build_engine(model, weights_from, args, engine_config)
        self.engine.head_stats = []  # the MoE load-balancing loss of each micro-batch, for TRL's aux_loss metric
        if args.disable_dropout:  # what DPOTrainer does to the model, done to the engine's copies of its modules
            from trl.trainer.utils import disable_dropout_in_model

            for tmpl in self.engine._templates.values():
                disable_dropout_in_model(tmpl.module)
        return model

    def _head_loss(self, group, num_items_in_batch):
        return RowLoss(lambda k, per_row: self._dpo_loss(group[k], per_row, k))

    # -- the trainer after DPOTrainer.__init__ -------------------------------------------------------
    def _post_init_engine(self):
        """The MoE router loss as DPOTrainer settled it (coefficient and switch), on the engine's config copy."""
        own = self.engine.config.get_text_config()
        if hasattr(own, "output_router_logits"):
            own.output_router_logits = bool(self.aux_loss_enabled)
            setattr(own, self.engine.aux_coef, self.router_aux_loss_coef)

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self._post_init_engine()  # the first thing after DPOTrainer's settings; before any forward
        if self._asked_precompute:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        # Stock computes the reference batch by batch, from a second model; the engine computes it here, before
        # training. The pass leaves the random state as it found it, as stock's absence of it would.
        states = (torch.get_rng_state(), np.random.get_state(), random.getstate(),
                  torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        try:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            torch.set_rng_state(states[0])
            np.random.set_state(states[1])
            random.setstate(states[2])
            if states[3] is not None:
                torch.cuda.set_rng_state_all(states[3])

    def compute_ref_log_probs(self, model, inputs):
        """The reference's summed log-probabilities of a batch's chosen and rejected completions: the engine's
        forward-only pass, with LoRA adapters disabled."""
        logps = {}

        def keep(per_row):
            logps["rows"] = per_row["logps"].detach()
            return per_row["logps"].sum().detach()

        engine, training = self.engine, self.engine.training
        engine.eval()
        try:
            with torch.no_grad(), adapters_disabled(engine), self._no_head_stats():
                engine(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                       labels=completion_labels(inputs), return_logits=False, row_loss=keep)
        finally:
            engine.train(training)
        return logps["rows"].to(self.accelerator.device).chunk(2, dim=0)

    @contextlib.contextmanager
    def _no_head_stats(self):
        stats, self.engine.head_stats = self.engine.head_stats, None
        try:
            yield
        finally:
            self.engine.head_stats = stats

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        if (eval_dataset is not None and not isinstance(eval_dataset, str) and self.engine.peft_model is None
                and not self._asked_precompute and self.state.global_step > 0):
            raise MegaTrainError(
                "evaluate() was given a new dataset after training started: its reference log-probabilities are "
                "those of the starting policy, which the engine computes before the first step (no second model is "
                "kept). Pass it as eval_dataset when building the trainer.")
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # -- one micro-batch ---------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        for batch in batches:  # the engine trains on labels: the completion tokens, as TRL's loss counts them
            batch["labels"] = completion_labels(batch)
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        if "labels" not in inputs:  # called outside train()'s loop
            inputs["labels"] = completion_labels(inputs)
        loss = MegaTrainTrainer.training_step(self, model, inputs, num_items_in_batch)
        k = self._micro_index
        aux = [c.get("aux_loss") for c, o in zip(self.engine.head_stats, self._owner) if o == k]
        self._record_metrics(inputs, self._rows[k], aux[0] if aux else None, "train")
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.engine.eval()
        self.model.eval()  # as stock's evaluation leaves the model: TRL's log then reports the eval metrics
        labels = completion_labels(inputs)
        want_logits = not prediction_loss_only and self.compute_metrics is not None
        with torch.no_grad():
            out = self.engine(**{k: v for k, v in inputs.items() if k in ENGINE_KEYS and k != "labels"}, labels=labels,
                              return_logits=want_logits, row_loss=lambda per_row: self._dpo_loss(inputs, per_row, 0))
        aux = self.engine.head_stats[0].get("aux_loss") if self.engine.head_stats else None
        self._record_metrics(inputs, self._rows[0], aux, "eval")
        loss = out.loss.detach().to(self.args.device)
        if not want_logits:
            return loss, None, None
        return loss, out.logits, inputs["input_ids"].to(out.logits.device)

    # -- the loss ---------------------------------------------------------------------------------------
    def _dpo_loss(self, batch, per_row, k):
        """DPOTrainer's loss of one micro-batch from the engine's per-row sums (its rows: the chosen completions,
        then the rejected ones); keeps what the metrics need in self._rows[k]."""
        logps = per_row["logps"]
        chosen, rejected = logps.chunk(2)
        ref_chosen = torch.as_tensor(batch["ref_chosen_logps"]).to(logps)
        ref_rejected = torch.as_tensor(batch["ref_rejected_logps"]).to(logps)
        lengths = torch.as_tensor(batch["completion_mask"]).sum(dim=1).to(logps)  # TRL's unshifted count (IPO)
        loss = pair_losses(self.args, chosen, rejected, ref_chosen, ref_rejected, lengths, per_row["tokens"])
        self._rows[k] = {**{n: v.detach() for n, v in per_row.items()},
                         "ref_chosen": ref_chosen, "ref_rejected": ref_rejected}
        return loss

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

    def log(self, logs, start_time=None):
        for buffer in self._metrics.values():  # device tensors become numbers once per log
            for values in buffer.values():
                values[:] = [float(v) for v in values]
        super().log(logs, start_time)


def completion_labels(batch) -> torch.Tensor:
    """The batch's tokens where its completion_mask is set, IGNORE_INDEX elsewhere (TRL's DPO labels)."""
    ids = torch.as_tensor(batch["input_ids"])
    return ids.masked_fill(torch.as_tensor(batch["completion_mask"]).to(ids.device) == 0, IGNORE_INDEX)


@contextlib.contextmanager
def adapters_disabled(engine):
    """The engine's LoRA adapters off (their layers return the base layer's output), as PEFT's
    disable_adapter does to a model; nothing for a full fine-tune."""
    if engine.peft_model is None:
        yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for t in engine._templates.values() for m in t.module.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def pair_losses(args, chosen, rejected, ref_chosen, ref_rejected, lengths, tokens) -> torch.Tensor:
    """DPOConfig's weighted sum of loss types over one micro-batch's pairs, each the mean over the pairs.

    chosen / rejected: the policy's summed completion log-probabilities; ref_*: the reference's;
    lengths: each row's completion tokens (chosen rows, then rejected), as the collator's mask counts
    them; tokens: each row's scored tokens (the shifted mask). Written from the DPOConfig docs and the
    papers each loss cites, checked against DPOTrainer by tests/integration/test_dpo.py."""
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
            per_pair = (-chosen.sum() / tokens.chunk(2)[0].sum()).expand(chosen.shape[0])
        else:
            raise MegaTrainError(f"loss_type {kind!r} is not supported")
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
