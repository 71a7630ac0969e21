"""TRL's KTOTrainer on the streaming engine: one change of class.

    from hf_megatrain.kto import MegaTrainKTOTrainer

    trainer = MegaTrainKTOTrainer(model="path/or/hub-id", args=KTOConfig(...),
                                  train_dataset=unpaired, peft_config=lora)     # was KTOTrainer
    trainer.train()

TRL prepares the data as it always does (prompt extraction, unpairing of paired data, EOS,
tokenization, the mismatched KL completions: each batch's completions rotated by one within
batches of per_device_train_batch_size); the engine runs the forwards, the loss and the step.

KTO's loss is a function of per-row sums: each row's summed completion log-probability, against
the reference's, and (for loss_type='kto') a KL estimate that TRL detaches: the mean over the
micro-batch of the policy's minus the reference's summed log-probabilities of the mismatched
(prompt, completion) rows, clamped at 0. The engine computes the policy's KL sums in a
forward-only pass of each micro-batch's KL rows before its training pass, with the step's
weights, as stock's no-grad forward does; the loss then goes through engine/loss.py RowLoss as
DPO's does. The reference (of the rows and of the KL rows) is the starting policy, computed in a
forward-only pass before the first step, or under LoRA the adapter-disabled model (a PeftModel's own
adapter: TRL's copy of it), or a ref_model
streamed through a second, forward-only engine (see hf_megatrain.preference). The metrics are TRL's (kl, rewards/*, logps/*, logits/*, entropy,
num_tokens, a MoE's aux_loss), each appended only where stock appends it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from trl import KTOConfig, KTOTrainer
except ImportError as e:  # an optional extra
    raise ImportError("hf_megatrain.kto needs TRL: pip install 'hf_megatrain[trl]'") from e

from .arguments import MegaTrainArguments, check_arguments
from .engine.loss import RowLoss
from .errors import MegaTrainError
from .preference import EnginePreference, check_preference, completion_labels
from .sft import TrlEngineFields, trl_arguments
from .trainer import MegaTrainTrainer

LOSS_TYPES = ("kto", "apo_zero_unpaired")  # KTOConfig.loss_type's choices; both functions of per-row sums


@dataclass
class MegaTrainKTOConfig(TrlEngineFields, KTOConfig, MegaTrainArguments):
    """`KTOConfig` with the engine's fields (those of `MegaTrainArguments`) besides.

    Where the two overlap, TRL's meaning holds: `max_length` is the row length (the engine plans
    its memory for it), `bf16` defaults to True as in every TRL config (pass `bf16=False` for fp32
    compute on a CPU)."""


def kto_arguments(args, model) -> MegaTrainKTOConfig:
    """The trainer's own MegaTrainKTOConfig for what the user passed: None (TRL's default, an output
    folder named after the model), a KTOConfig, a MegaTrainKTOConfig or TrainingArguments."""
    own = trl_arguments(args, model, MegaTrainKTOConfig, KTOConfig, "MegaTrainKTOTrainer", "KTO")
    check_arguments(own)
    return own


def check_kto(args, model, ref_model, train_dataset, peft_config, quantization_config) -> None:
    """What KTOTrainer offers that the engine cannot honour, refused before any data is tokenized."""
    check_preference(args, model, ref_model, train_dataset, peft_config, quantization_config, "KTO")
    if args.loss_type not in LOSS_TYPES:
        raise MegaTrainError(f"loss_type={args.loss_type!r} is not supported: the engine computes {', '.join(LOSS_TYPES)}.")


class MegaTrainKTOTrainer(EnginePreference, KTOTrainer, MegaTrainTrainer):
    """`trl.KTOTrainer` whose forwards, loss, backward and optimizer step run on the streaming engine.

    Takes what KTOTrainer takes; `args` may be a KTOConfig (the engine's options at their defaults)
    or a MegaTrainKTOConfig. `model` is a hub id, a folder (its weights are streamed into host RAM,
    never loaded whole) or a CPU model; `peft_config` trains LoRA adapters; `ref_model` (a CPU
    model, or a hub id or folder) streams through a forward-only engine (see the module docstring)."""

    trl_name = "KTO"
    ref_columns = ("ref_logps", "ref_KL_logps")

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):
        args = kto_arguments(args, model)
        skeleton, processing_class = self._engine_init(model, ref_model, args, train_dataset, eval_dataset,
                                                       processing_class, peft_config, quantization_config, check_kto)
        self._kl: dict[int, torch.Tensor] = {}
        with self._fingerprint_in_trl_init():
            super().__init__(model=skeleton, ref_model=None, args=args, data_collator=data_collator,
                             train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                             compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        self._reference_ready()

    def _head_loss(self, group, num_items_in_batch):
        return RowLoss(lambda k, per_row: self._kto_loss(group[k], per_row, k))

    def compute_ref_log_probs(self, model, inputs):
        """The reference's summed completion log-probabilities of a batch's rows and (when the loss has a KL
        term) of its mismatched KL rows: the engine's forward-only passes, with the reference's LoRA adapters
        (preference.reference_adapters)."""
        logps = self._engine_logps(inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"],
                                   reference=True)
        kl = None
        if self.calculate_KL:
            kl = self._engine_logps(inputs["KL_input_ids"], inputs["KL_attention_mask"],
                                    inputs["KL_completion_mask"], reference=True)
        return logps, kl

    def _kl_term(self, batch) -> torch.Tensor:
        """KTO's KL estimate of one micro-batch, detached as TRL's is: the policy's (its weights as they are now,
        a forward-only pass of the KL rows) minus the reference's summed log-probabilities, averaged, at least 0."""
        if not self.calculate_KL:
            return torch.zeros(1, device=self.accelerator.device)
        policy = self._engine_logps(batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"],
                                    reference=False)
        ref = torch.as_tensor(batch["ref_KL_logps"]).to(policy)
        kl = (policy - ref).mean().detach()
        return self.accelerator.gather_for_metrics(kl).mean().clamp(min=0)

    # -- one micro-batch ---------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if "labels" not in inputs:  # called outside train()'s loop
            inputs["labels"] = completion_labels(inputs)
        k, group = self._micro_batch(inputs)
        if k == 0:  # before the engine runs the group's micro-batches (all of them at once, layer-major)
            self.engine.train()
            self._kl = {i: self._kl_term(b) for i, b in enumerate(group)}
        loss = MegaTrainTrainer.training_step(self, model, inputs, num_items_in_batch)
        self._record_metrics(inputs, self._rows[k], self._kl[k], self._micro_aux(k), "train")
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        want_logits = not prediction_loss_only and self.compute_metrics is not None
        self._batch_reference(inputs)
        self.engine.eval()  # the KL rows' policy pass in eval mode, as stock's evaluation runs it
        self._kl = {0: self._kl_term(inputs)}
        out, aux = self._engine_eval(inputs, lambda per_row: self._kto_loss(inputs, per_row, 0), want_logits)
        self._record_metrics(inputs, self._rows[0], self._kl[0], aux, "eval")
        loss = out.loss.detach().to(self.args.device)
        if not want_logits:
            return loss, None, None
        return loss, out.logits, inputs["input_ids"].to(out.logits.device)

    # -- the loss ---------------------------------------------------------------------------------------
    def _kto_loss(self, batch, per_row, k):
        """KTOTrainer's loss of one micro-batch from the engine's per-row sums; keeps what the metrics need in
        self._rows[k]."""
        logps = per_row["logps"]
        desirable = torch.as_tensor(batch["label"]).to(device=logps.device, dtype=torch.bool)
        ref = torch.as_tensor(batch["ref_logps"]).to(logps)
        ratio = logps - ref
        beta, kl = self.args.beta, self._kl[k].to(logps)
        if self.loss_type == "kto":  # the KTO paper's value function, against the KL reference point
            per_row_loss = torch.where(desirable, 1 - torch.sigmoid(beta * (ratio - kl)),
                                       1 - torch.sigmoid(beta * (kl - ratio)))
        else:  # apo_zero_unpaired
            per_row_loss = torch.where(desirable, 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio))
        weights = torch.where(desirable, self.desirable_weight, self.undesirable_weight).to(logps)
        loss = (weights * per_row_loss).nanmean()
        self._rows[k] = {**{n: v.detach() for n, v in per_row.items()}, "ref": ref, "desirable": desirable}
        return loss

    def _record_metrics(self, inputs, rows, kl, aux, mode: str) -> None:
        """The metrics KTOTrainer._compute_loss logs for one micro-batch, as device tensors until the next log; a
        metric stock appends only when the micro-batch has such rows or tokens is a (value, present) pair."""
        metrics = self._metrics[mode]
        gather = self.accelerator.gather_for_metrics
        metrics["kl"].append(kl.reshape(()))
        tokens = rows["tokens"]
        total = gather(tokens.sum()).sum()
        metrics["entropy"].append(torch.where(total > 0, gather(rows["entropy"].sum()).sum() / total.clamp(min=1), 0.0))
        if mode == "train":
            self._total_train_tokens += int(gather(torch.as_tensor(inputs["attention_mask"]).sum()).sum()) // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        desirable = rows["desirable"]
        sides = {"chosen": desirable, "rejected": ~desirable}
        for side, is_side in sides.items():
            n = gather(tokens[is_side].sum()).sum()
            metrics[f"logits/{side}"].append((gather(rows["mean_logits"][is_side].sum()).sum() / n.clamp(min=1), n > 0))
        rewards = self.args.beta * (rows["logps"] - rows["ref"])
        means = {}
        for side, is_side in sides.items():
            count = gather(is_side.sum()).sum()
            means[side] = (gather(rewards[is_side].nansum()).nansum() / count.clamp(min=1), count > 0)
            metrics[f"rewards/{side}"].append(means[side])
            metrics[f"logps/{side}"].append((gather(rows["logps"][is_side].nansum()).nansum() / count.clamp(min=1),
                                             count > 0))
        metrics["rewards/margins"].append((means["chosen"][0] - means["rejected"][0],
                                           means["chosen"][1] & means["rejected"][1]))
        if self.aux_loss_enabled and aux is not None:
            metrics["aux_loss"].append(gather(aux).mean())
