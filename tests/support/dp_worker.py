"""One rank of the data-parallel tests (tests/integration/test_distributed.py); run through torch.multiprocessing."""

import torch
import torch.distributed as dist

from tests.support.tiny import make_batch, make_model


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


def rank_main(rank, world, init_file, cases, out):
    """One of `world` gloo ranks: trains the engine on its share of the global batches (rank 0
    saves the masters and norms to OUT.pt), then builds each store case (store_cases); every rank
    saves its buffers to OUT.RANK."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from hf_megatrain.engine.distributed import Sharding

    masters, norms = train_engine("llama_tied", global_batches(3, 4), Sharding(), rank, world)
    if rank == 0:
        torch.save({"masters": masters, "norms": norms}, f"{out}.pt")
    torch.save(store_cases(cases), f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def store_cases(cases):
    """Build each case's store twice on this rank: from the checkpoint folder the way the trainer
    does (a meta skeleton filled by load_into_store) and with HostStore.from_model from the model
    transformers loads; and what this rank allocates for it (the store's and HostAdamW's arenas)."""
    from transformers import AutoModelForCausalLM

    from hf_megatrain import HostAdamW, StreamingEngine
    from hf_megatrain.checkpoint.loading import load_model_and_tokenizer
    from hf_megatrain.checkpoint.stream_load import engine_from_checkpoint
    from hf_megatrain.engine.distributed import Sharding

    got = {}
    for name, folder, dtype in cases:
        skeleton, _, weights_from = load_model_and_tokenizer(folder)
        engine = engine_from_checkpoint(skeleton, weights_from, compute_dtype=dtype, sharding=Sharding(),
                                        progress=False)
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ref = StreamingEngine(loaded, compute_dtype=dtype, sharding=Sharding()).store
        got[name] = {which: {"bounds": s.bounds, "master": [t.clone() for t in s.master],
                             "compute": [t.clone() for t in s.compute]}
                     for which, s in (("folder", engine.store), ("from_model", ref))}
        arenas = engine.store._arenas + HostAdamW(engine)._arenas
        got[name]["allocated"] = {"bytes": sum(a.nbytes for a in arenas), "slots": len(engine.units) * len(arenas)}
    return got
