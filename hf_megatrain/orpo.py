"""trl.experimental's ORPOTrainer on the streaming engine: one change of class.

    from hf_megatrain.orpo import MegaTrainORPOTrainer

    trainer = MegaTrainORPOTrainer(model="path/or/hub-id", args=ORPOConfig(...),
                                   train_dataset=pairs, peft_config=lora)      # was ORPOTrainer
    trainer.train()

TRL prepares the data as it always does (prompt extraction, chat templates, its tokenize_row with
BOS/EOS and truncation, DPODataCollatorWithPadding); the engine runs the forward, the loss and the
step. ORPO has no reference model: its loss is the chosen rows' NLL over their prompt and completion
tokens minus beta times the mean log-sigmoid of the log odds ratio of each pair's mean completion
log-probabilities (TRL's own odds_ratio_loss, called on the sums the engine's head computes; see
hf_megatrain.preference.ReferenceFreePairs). The metrics are TRL's (rewards/*, logps/*, logits/*,
nll_loss, log_odds_ratio, log_odds_chosen), in training and, as eval_*, in evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
except ImportError as e:  # an optional extra
    raise ImportError("hf_megatrain.orpo needs TRL: pip install 'hf_megatrain[trl]'") from e

from .arguments import MegaTrainArguments
from .preference import ReferenceFreePairs
from .sft import TrlEngineFields
from .trainer import MegaTrainTrainer


@dataclass
class MegaTrainORPOConfig(TrlEngineFields, ORPOConfig, MegaTrainArguments):
    """`ORPOConfig` with the engine's fields (those of `MegaTrainArguments`) besides.

    Where the two overlap, TRL's meaning holds: `max_length` is the row length (the engine plans
    its memory for it), `bf16` defaults to True as in every TRL config (pass `bf16=False` for fp32
    compute on a CPU)."""


class MegaTrainORPOTrainer(ReferenceFreePairs, ORPOTrainer, MegaTrainTrainer):
    """`trl.experimental.orpo.ORPOTrainer` whose forward, loss, backward and optimizer step run on the
    streaming engine.

    Takes what ORPOTrainer takes; `args` may be an ORPOConfig (the engine's options at their defaults)
    or a MegaTrainORPOConfig. `model` is a hub id, a folder (its weights are streamed into host RAM,
    never loaded whole) or a CPU model; `peft_config` trains LoRA adapters."""

    trl_name = "ORPO"
    trl_config, own_config = ORPOConfig, MegaTrainORPOConfig

    def _nll_tokens(self, attended, completion):
        return attended  # TRL: "orpo chosen nll loss is computed over the full prompt and response"

    def _objective(self, sums, counts, nll):
        chosen, rejected = (sums / counts).chunk(2)  # each completion's mean token log-probability
        losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = \
            self.odds_ratio_loss(chosen, rejected)
        return (nll - losses.mean(), chosen, rejected, (chosen_rewards, rejected_rewards),
                {"log_odds_ratio": log_odds_ratio, "log_odds_chosen": log_odds_chosen})
