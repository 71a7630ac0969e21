"""trl.experimental's CPOTrainer on the streaming engine: one change of class, every loss_type
(sigmoid, hinge, ipo, and simpo: SimPO), AlphaPO's reward shaping (alpha) and the NLL term (cpo_alpha).

    from hf_megatrain.cpo import MegaTrainCPOTrainer

    trainer = MegaTrainCPOTrainer(model="path/or/hub-id", args=CPOConfig(loss_type="simpo", ...),
                                  train_dataset=pairs, peft_config=lora)       # was CPOTrainer
    trainer.train()

TRL prepares the data as it always does (the tokenization and collator ORPOTrainer shares); the
engine runs the forward, the loss and the step. CPO has no reference model: its loss is a function
of each pair's summed completion log-probabilities (their per-token means for ipo and simpo),
computed by TRL's own cpo_loss on the sums the engine's head computes, plus cpo_alpha times the
chosen completions' NLL (see hf_megatrain.preference.ReferenceFreePairs). The metrics are TRL's
(rewards/*, logps/*, logits/*, nll_loss), in training and, as eval_*, in evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from trl.experimental.cpo import CPOConfig, CPOTrainer
except ImportError as e:  # an optional extra
    raise ImportError("hf_megatrain.cpo needs TRL: pip install 'hf_megatrain[trl]'") from e

from .arguments import MegaTrainArguments
from .errors import MegaTrainError
from .preference import ReferenceFreePairs, check_pairs
from .sft import TrlEngineFields
from .trainer import MegaTrainTrainer

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")  # CPOTrainer.cpo_loss's; each a function of per-row sums
AVERAGED = ("ipo", "simpo")  # the loss types TRL gives each row's mean token log-probability, not the sum


@dataclass
class MegaTrainCPOConfig(TrlEngineFields, CPOConfig, MegaTrainArguments):
    """`CPOConfig` with the engine's fields (those of `MegaTrainArguments`) besides.

    Where the two overlap, TRL's meaning holds: `max_length` is the row length (the engine plans
    its memory for it), `bf16` defaults to True as in every TRL config (pass `bf16=False` for fp32
    compute on a CPU)."""


class MegaTrainCPOTrainer(ReferenceFreePairs, CPOTrainer, MegaTrainTrainer):
    """`trl.experimental.cpo.CPOTrainer` whose forward, loss, backward and optimizer step run on the
    streaming engine.

    Takes what CPOTrainer takes; `args` may be a CPOConfig (the engine's options at their defaults)
    or a MegaTrainCPOConfig. `model` is a hub id, a folder (its weights are streamed into host RAM,
    never loaded whole) or a CPU model; `peft_config` trains LoRA adapters."""

    trl_name = "CPO"
    trl_config, own_config = CPOConfig, MegaTrainCPOConfig
    last_position = True  # CPO's logits metrics average every position of the chosen (rejected) rows

    def _check(self, args, model, train_dataset, peft_config) -> None:
        check_pairs(args, model, train_dataset, peft_config, None, self.trl_name)
        if args.loss_type not in LOSS_TYPES:  # stock fails only at the first loss (kto_pair: in __init__)
            raise MegaTrainError(f"loss_type={args.loss_type!r} is not one of CPOTrainer's loss types "
                                 f"{', '.join(LOSS_TYPES)}.")

    def _nll_tokens(self, attended, completion):
        # TRL counts the chosen completions' tokens, and none (an NLL of 0) when cpo_alpha is 0
        return completion if self.cpo_alpha != 0 else completion & False

    def _objective(self, sums, counts, nll):
        logps = sums / counts if self.loss_type in AVERAGED else sums
        chosen, rejected = logps.chunk(2)
        losses, chosen_rewards, rejected_rewards = self.cpo_loss(chosen, rejected)
        return losses.mean() + self.cpo_alpha * nll, chosen, rejected, (chosen_rewards, rejected_rewards), {}
