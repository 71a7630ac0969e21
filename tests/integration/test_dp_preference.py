"""TRL's preference trainers through the engine under data parallel (gloo on the CPU, fp32): MegaTrainDPOTrainer
with 2 ranks of 2 pairs equals one process of 4 pairs (the losses, every metric, the evaluation and the weights),
and each of MegaTrainDPOTrainer, MegaTrainKTOTrainer, MegaTrainORPOTrainer and MegaTrainCPOTrainer with 2 ranks
equals stock TRL's trainer with 2 ranks (DDP), DPO with sync_ref_model too. KTO, ORPO and CPO are compared with stock at the same ranks, not
with one process: their losses are not the same across that change in stock either (KTO's KL rows pair completions
within each rank's batch; ORPO's and CPO's NLL is a mean over each rank's tokens, which DDP then averages)."""

import pytest
import torch

pytest.importorskip("trl")
from tests.support.dp_preference import launch  # noqa: E402
from tests.support.preference import fresh_datasets, model_folder  # noqa: E402,F401  (an autouse fixture)


def assert_same(a, b, skip=()):
    assert len(a["logs"]) == len(b["logs"]) and sum("loss" in h for h in a["logs"]) == 3
    assert any(k.startswith("eval_") and k != "eval_loss" for k in a["logs"][-1]), a["logs"][-1]
    for x, y in zip(a["logs"], b["logs"]):
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            # KTO's kl is the mean difference of two summed log-probabilities of about -30, whose fp32 ulp is 1.9e-6
            # (test_kto compares it so too)
            tol = 1e-5 if k.endswith("kl") else 1e-6
            if k not in skip:
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=tol), (k, x, y)
    assert a["weights"].keys() == b["weights"].keys()
    for name, t in a["weights"].items():
        torch.testing.assert_close(torch.tensor(b["weights"][name]), torch.tensor(t), atol=1e-5, rtol=1e-5, msg=name)


def test_dpo_two_ranks_equal_one_process(tmp_path):
    """The DPO loss is a mean over a micro-batch's pairs: DDP's average of two ranks' means of 2 pairs is the mean of
    4. The reference's log-probabilities are computed by each rank for its share and shared through TRL's cache file
    (the dataset is made in memory: no cache folder of its own)."""
    folder = model_folder(tmp_path, "llama")
    one = launch(1, tmp_path / "one", folder, "dpo", "ours", 4)
    two = launch(2, tmp_path / "two", folder, "dpo", "ours", 2)
    assert (one["world"], two["world"]) == (1, 2)
    # total_flos counts the padded rows: each rank pads its 2 pairs to their own longest row
    assert_same(one, two, skip=("total_flos",))


@pytest.mark.parametrize("kind", ["dpo", "kto", "orpo", "cpo", "dpo-sync"])
def test_two_ranks_equal_stock_two_ranks(kind, tmp_path):
    folder = model_folder(tmp_path, "mixtral" if kind == "orpo" else "llama")
    stock = launch(2, tmp_path / "stock", folder, kind, "stock", 2)
    ours = launch(2, tmp_path / "ours", folder, kind, "ours", 2)
    assert_same(stock, ours)
