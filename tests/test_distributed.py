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


HERE = os.path.dirname(os.path.abspath(__file__))


def launch(world, out, batch, *opts, port):
    """Start `world` processes the way torchrun does (environment variables) and wait for them."""
    import subprocess
    import sys

    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "dp_trainer.py"), str(out), str(batch),
                                       *opts], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    import json

    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_run(a, b, from_step=0):
    la = [x for x in a["logs"] if x["step"] > from_step]
    lb = [x for x in b["logs"] if x["step"] > from_step]
    assert [x["step"] for x in la] == [x["step"] for x in lb]
    for x, y in zip(la, lb):
        for k in ("loss", "grad_norm", "learning_rate"):
            assert abs(x[k] - y[k]) <= 1e-5 * max(1.0, abs(x[k])), (k, x, y)
    for name, t in a["masters"].items():
        torch.testing.assert_close(torch.tensor(b["masters"][name]), torch.tensor(t), atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return launch(1, out, 4, port=_free_port())


def test_trainer_two_ranks_match_one_process(tmp_path, single):
    two = launch(2, tmp_path, 2, port=_free_port())
    assert two["world"] == 2
    assert_same_run(single, two)


def test_save_with_two_ranks_resume_with_one(tmp_path, single):
    launch(2, tmp_path / "run", 2, "--save", "3", port=_free_port())
    ckpt = tmp_path / "run" / "checkpoint-3"
    files = sorted(os.listdir(ckpt))
    assert any("-r00001-" in f for f in files), files  # rank 1 wrote its own optimizer slice
    resumed = launch(1, tmp_path / "run", 4, "--resume", str(ckpt), port=_free_port())
    assert_same_run(single, resumed, from_step=3)
