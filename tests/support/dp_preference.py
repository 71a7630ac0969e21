"""One process of a data-parallel preference run (launched as torchrun does: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment), stock TRL's trainer or ours, for tests/integration/test_dp_preference.py, and
`launch`, which starts the processes of one run.

    python -m tests.support.dp_preference OUT FOLDER KIND IMPL BATCH [GA]

KIND: dpo, kto, orpo or cpo (dpo-sync: dpo with sync_ref_model, mixed every step, whose all-gathered masters the
engine mixes into its reference); IMPL: stock or ours; BATCH: per_device_train_batch_size; GA: gradient accumulation
steps (1). Trains the tiny model in FOLDER on preference data made here, in order (sequential sampler: N ranks x
BATCH rows see the same global batches as 1 rank x N*BATCH rows), evaluates, and writes OUT/result.json on
rank 0: the log history without timings, and the trained weights.
"""

import json
import os
import sys
import warnings

import datasets

from tests.support import end_process_group, trained_weights


def trainers(kind):
    """(TRL config, stock trainer, our trainer, data) of `kind`."""
    from tests.support.preference import pairs, unpaired

    with warnings.catch_warnings():  # trl.experimental's warning that its APIs may change
        warnings.simplefilter("ignore")
        if kind == "dpo":
            from trl import DPOConfig, DPOTrainer

            from hf_megatrain.dpo import MegaTrainDPOTrainer
            return DPOConfig, DPOTrainer, MegaTrainDPOTrainer, pairs
        if kind == "kto":
            from trl import KTOConfig, KTOTrainer

            from hf_megatrain.kto import MegaTrainKTOTrainer
            return KTOConfig, KTOTrainer, MegaTrainKTOTrainer, unpaired
        if kind == "orpo":
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            from hf_megatrain.orpo import MegaTrainORPOTrainer
            return ORPOConfig, ORPOTrainer, MegaTrainORPOTrainer, pairs
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        from hf_megatrain.cpo import MegaTrainCPOTrainer
        return CPOConfig, CPOTrainer, MegaTrainCPOTrainer, pairs


def main():
    out, folder, kind, impl, batch = sys.argv[1:6]
    ga = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    datasets.disable_caching()  # each run computes its own reference (TRL caches it under the data's fingerprint)
    from tests.support.preference import KW, TIMINGS, WORDS

    kind, _, variant = kind.partition("-")
    config, stock, ours, data = trainers(kind)
    extra = dict(sync_ref_model=True, ref_model_sync_steps=1) if variant == "sync" else {}
    args = config(output_dir=out, **dict(KW, per_device_train_batch_size=int(batch), gradient_accumulation_steps=ga,
                                         per_device_eval_batch_size=int(batch),
                                         train_sampling_strategy="sequential", **extra))
    trainer = (stock if impl == "stock" else ours)(model=folder, args=args, train_dataset=data(),
                                                  eval_dataset=data(WORDS[:8]))
    trainer.train()
    trainer.evaluate()
    weights = trained_weights(trainer, impl)  # collective: every rank
    if trainer.args.process_index == 0:
        logs = [{k: v for k, v in h.items() if not k.endswith(TIMINGS)} for h in trainer.state.log_history]
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"logs": logs, "weights": {n: t.tolist() for n, t in weights.items()},
                       "world": trainer.args.world_size}, f)
    del trainer  # stock's DDP model, before the group ends (end_process_group says why)
    end_process_group()


def launch(world: int, out, folder: str, kind: str, impl: str, batch: int, ga: int = 1) -> dict:
    """Start `world` processes of one run as torchrun does and return the run's result.json."""
    from tests.support import launch_ranks

    return launch_ranks(world, "tests.support.dp_preference", [out, folder, kind, impl, batch, ga], out)


if __name__ == "__main__":
    main()
