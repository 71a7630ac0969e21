"""Helpers shared by the tests. The scripts among them (train_subprocess, dp_trainer) run in processes of
their own as modules, `python -m tests.support.NAME`, with the repository root as the working folder or
on PYTHONPATH."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def launch_ranks(world: int, module: str, args: list, out) -> dict:
    """Start `world` processes of `python -m module *args` as torchrun starts its ranks (its environment variables,
    a free port on this host), wait for every one, and return the run's result.json under `out`."""
    import json
    import socket
    import subprocess
    import sys

    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", module, *map(str, args)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=900)[1] for p in procs]  # every rank's, so none is left blocked on a pipe
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-3000:]
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def trained_weights(trainer, impl: str) -> dict:
    """The trained weights of a rank's run: stock's from its (DDP-wrapped) model, ours gathered from the engine's
    fp32 masters (a collective: every rank calls it)."""
    if impl == "stock":
        model = trainer.accelerator.unwrap_model(trainer.model)
        # what ours has masters of, named as ours names them (a PEFT model's adapters under its base model's names)
        return {n.removeprefix("base_model.model."): p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return dict(trainer.engine.named_master_params())


def end_process_group() -> None:
    """Take the process group down in order, every rank together, as `hf-megatrain train` does: left to
    interpreter exit, gloo's threads end in no set order, and under load a rank can abort after training has
    finished ("terminate called without an active exception").

    A stock run's caller drops its trainer first (`del trainer`): collected here while the group is still
    registered, DDP's Reducer lets go of it without ending it. Collected after destroy_process_group, the Reducer
    held the group's last reference and ended it holding the GIL, joining gloo's run loop while that thread waited
    for the GIL to free a finished all-gather's tensors: a rank hung for good (torch 2.13, seen once on 2 CPU
    ranks of stock ORPO)."""
    import gc

    import torch.distributed as dist

    gc.collect()  # a trainer is kept alive by its own cycles (callbacks, accelerator) until collected
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
