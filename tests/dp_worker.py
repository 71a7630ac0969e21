"""One rank of the data-parallel tests (tests/test_distributed.py); run through torch.multiprocessing."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from tiny import make_batch, make_model  # noqa: E402


def global_batches(steps, rows):
    return [make_batch(batch=rows, seq=12, seed=100 + s, pad_rows=1) for s in range(steps)]


def train_engine(kind, batches, sharding=None, rank=0, world=1):
    from hf_megatrain import HostAdamW, StreamingEngine

    model = make_model(kind, seed=4)
    engine = StreamingEngine(model, compute_dtype=torch.float32, sharding=sharding).train()
    opt = HostAdamW(engine, lr=3e-3, weight_decay=0.1)
    norms = []
    for batch in batches:
        nib = batch["labels"][..., 1:].ne(-100).sum()  # the global count, as Trainer gathers it
        rows = batch["input_ids"].shape[0] // world
        mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}
        engine.forward_backward(mine, num_items_in_batch=nib)
        norms.append(float(opt.clip_grad_norm_(0.3)))
        opt.step()
        engine.zero_grad()
    return dict(engine.named_master_params()), norms


def engine_rank(rank, world, init_file, kind, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from hf_megatrain.engine.distributed import Sharding

    masters, norms = train_engine(kind, global_batches(3, 4), Sharding(), rank, world)
    if rank == 0:
        torch.save({"masters": masters, "norms": norms}, out)
    dist.barrier()
    dist.destroy_process_group()
