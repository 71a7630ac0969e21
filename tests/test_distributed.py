"""Data parallel on the CPU with gloo: N ranks equal one process on the same global batch."""

import os

import pytest
import torch
import torch.multiprocessing as mp

import dp_worker


@pytest.mark.parametrize("world", [2, 4])
def test_engine_data_parallel_matches_one_process(world, tmp_path):
    out = str(tmp_path / "result.pt")
    mp.start_processes(dp_worker.engine_rank, args=(world, str(tmp_path / "init"), "llama_tied", out),
                       nprocs=world, start_method="spawn")
    got = torch.load(out)
    ref_masters, ref_norms = dp_worker.train_engine("llama_tied", dp_worker.global_batches(3, 4))
    for a, b in zip(got["norms"], ref_norms):
        assert abs(a - b) <= 1e-5 * max(1, b), (got["norms"], ref_norms)
    for name, t in ref_masters.items():
        torch.testing.assert_close(got["masters"][name], t, atol=1e-5, rtol=1e-5, msg=name)
