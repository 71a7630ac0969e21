"""Data parallel against stock DDP (2 gloo ranks on the CPU, fp32, GA 2, clipped at every step): MegaTrainTrainer
equals stock Trainer and MegaTrainSFTTrainer equals TRL's SFTTrainer, both with 2 ranks, in the losses they log,
grad_norm and the final weights, for every way stock scales a rank's loss:

- average_tokens_across_devices=True (the default): num_items_in_batch counts every rank's tokens and stock
  multiplies the loss by the world size to undo DDP's average; the engine's sum over ranks is already that;
- average_tokens_across_devices=False: each rank's loss is over its own tokens and DDP averages the ranks;
- no num_items_in_batch (a model that takes no loss kwargs): each micro-batch's mean, divided by the GA steps;
- an MoE's load-balancing loss, which stock Trainer's model adds inside the loss it multiplies, and which TRL adds
  after multiplying (averaged over the accumulation steps).

The engine sums the ranks' gradients where DDP averages them: without taking stock's factor over the world size
(MegaTrainTrainer._rank_loss_factor), the gradient and grad_norm of the second and third cases were twice stock's.
Clipping and Adam hide most of that in the weights (both rescale), so grad_norm is what shows it."""

import pytest
import torch

from tests.support.dp_stock import IA3_CLIP, PREFIX_CLIP, launch

TRAINER_CASES = {
    "average_tokens": ("llama", ()),
    "own_tokens": ("llama", ("--no_average_tokens",)),
    "no_loss_kwargs": ("llama", ("--no_loss_kwargs",)),
    "moe_average_tokens": ("mixtral", ()),
    "moe_own_tokens": ("mixtral", ("--no_average_tokens",)),
    "prefix_tuning": ("llama", ("--prefix_tuning",)),  # the embedding unit's prompt encoder alone trains
    "ia3": ("llama", ("--ia3",)),  # another PEFT method: the layers' scaling vectors alone train
}
SFT_CASES = {
    "defaults": ("llama", ()),
    "own_tokens": ("llama", ("--no_average_tokens",)),
    "moe_defaults": ("mixtral", ()),
    "moe_own_tokens": ("mixtral", ("--no_average_tokens",)),
}


def assert_same(stock, ours, flags, weights_tol):
    assert stock["world"] == ours["world"] == 2
    # what the case is meant to exercise, as each run's trainer saw it (the default is True)
    assert stock["average_tokens"] == ours["average_tokens"] == ("--no_average_tokens" not in flags)
    assert stock["accepts_loss_kwargs"] == ours["accepts_loss_kwargs"] == ("--no_loss_kwargs" not in flags)
    clip = PREFIX_CLIP if "--prefix_tuning" in flags else IA3_CLIP if "--ia3" in flags else 0.5
    assert min(h["grad_norm"] for h in stock["logs"]) > clip  # max_grad_norm clips at every step
    assert len(ours["logs"]) == len(stock["logs"]) > 0
    for x, y in zip(stock["logs"], ours["logs"]):
        assert x.keys() == y.keys(), (x, y)
        for k in x:  # the logged loss: the mean over the ranks of each rank's loss after stock's scaling
            assert y[k] == pytest.approx(x[k], rel=1e-6, abs=1e-6), (k, x, y)
    assert ours["weights"].keys() == stock["weights"].keys()
    for name, t in stock["weights"].items():
        torch.testing.assert_close(torch.tensor(ours["weights"][name]), torch.tensor(t), atol=weights_tol,
                                   rtol=weights_tol, msg=name)


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_trainer_two_ranks_equal_stock_ddp(case, tmp_path):
    kind, flags = TRAINER_CASES[case]
    stock = launch(2, tmp_path / "stock", "stock", "trainer", kind, *flags)
    ours = launch(2, tmp_path / "ours", "ours", "trainer", kind, *flags)
    assert_same(stock, ours, flags, 1e-6)


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_two_ranks_equal_stock_ddp(case, tmp_path):
    pytest.importorskip("trl")
    kind, flags = SFT_CASES[case]
    stock = launch(2, tmp_path / "stock", "stock", "sft", kind, *flags)
    ours = launch(2, tmp_path / "ours", "ours", "sft", kind, *flags)
    # weights to 1e-5, as test_trl compares one process: the last bits of TRL's fused head and of the engine's
    # chunked loss differ, and Adam's division by tiny second moments grows them (to 4e-6 here on Mixtral)
    assert_same(stock, ours, flags, 1e-5)
