"""HostAdamW equals torch.optim.AdamW (Trainer's grouping, clipping, schedulers)."""

import copy

import pytest
import torch
from transformers import Trainer, get_cosine_schedule_with_warmup

from hf_megatrain import HostAdamW, StreamingEngine
from tests.support.tiny import make_batch, make_model


@pytest.mark.parametrize("span,threads", [(None, 0), (256, 0), (256, 3), (None, 2)])
def test_adamw_clipping_and_scheduler_match_torch(span, threads, monkeypatch):
    """(None, 0), the default: no pool, OpenMP inside each op; (256, 0): the same on tiles of 256
    elements, hundreds per unit; (256, 3): every unit cut into
    hundreds of spans stepped by three threads at once; (None, 2): the pool at its own span."""
    if span is not None:
        monkeypatch.setattr("hf_megatrain.engine.optimizer.SPAN", span)
        monkeypatch.setattr("hf_megatrain.engine.optimizer.OPENMP_TILE", span)
    model = make_model("llama_tied")
    ref = copy.deepcopy(model)
    decay = Trainer.get_decay_parameter_names(None, ref)
    groups = [
        {"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": 0.1},
        {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    ref_opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ref_sched = get_cosine_schedule_with_warmup(ref_opt, 2, 5)

    engine = StreamingEngine(model, compute_dtype=torch.float32, decay_names=decay).train()
    opt = HostAdamW(engine, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, host_threads=threads)
    sched = get_cosine_schedule_with_warmup(opt, 2, 5)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]

    for step in range(5):
        batch = make_batch(seed=step)
        ref(**batch).loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()

        engine.forward_backward(batch)
        norm = opt.clip_grad_norm_(0.05)
        opt.step(), sched.step(), engine.zero_grad()
        assert torch.equal(norm, ref_norm), (step, norm, ref_norm)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]

    masters = dict(engine.named_master_params())
    for name, p in ref.named_parameters():
        assert torch.equal(masters[name], p.detach()), name  # same fused kernel: bit for bit



def test_state_dict_is_small_and_round_trips():
    engine = StreamingEngine(make_model("llama"), compute_dtype=torch.float32).train()
    opt = HostAdamW(engine, lr=1e-3)
    engine.forward_backward(make_batch())
    opt.step()
    sd = opt.state_dict()
    assert sd["state"] == {} and sd["megatrain_step"] == 1
    opt2 = HostAdamW(engine, lr=5.0)
    opt2.load_state_dict(sd)
    assert opt2.step_count == 1 and opt2.param_groups[0]["lr"] == 1e-3


def test_bf16_compute_copy_is_refreshed_after_step():
    model = make_model("mistral")
    engine = StreamingEngine(model, compute_dtype=torch.bfloat16).train()
    opt = HostAdamW(engine, lr=1e-2)
    engine.forward_backward(make_batch())
    opt.step()
    for unit in engine.units:
        assert torch.equal(engine.store.compute[unit.index], engine.store.master[unit.index].to(torch.bfloat16))


def test_worker_keeps_its_thread_count_when_another_thread_sets_one():
    """DataLoader's pin-memory thread calls torch.set_num_threads(1); torch applies the last count
    set anywhere to a thread's first parallel op, which once left the host AdamW on one core."""
    import threading

    from hf_megatrain.engine.worker import Worker

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        worker = Worker("test-threads")
        worker.submit(lambda: None, "start")
        worker.drain()  # the worker thread is up
        other = threading.Thread(target=lambda: torch.set_num_threads(1))
        other.start()
        other.join()
        seen = []
        worker.submit(lambda: seen.append(torch.get_num_threads()), "count")
        worker.drain()
        assert seen == [2]
    finally:
        torch.set_num_threads(before)


def test_worker_lets_go_of_finished_jobs_and_ends_with_its_owner():
    """A finished job's closure (an optimizer step holds the whole host store) is not kept alive
    by the worker thread, and the thread ends once its Worker is dropped."""
    import gc
    import threading
    import time
    import weakref

    from hf_megatrain.engine.worker import Worker

    class Store:  # stands in for a host store
        pass

    store = Store()
    ref = weakref.ref(store)
    worker = Worker("test-release")
    worker.submit(lambda s=store: s, "hold the store")
    worker.drain()
    del store
    gc.collect()
    assert ref() is None
    del worker
    gc.collect()
    for _ in range(100):
        if not any(t.name == "test-release" for t in threading.enumerate()):
            break
        time.sleep(0.01)
    assert not any(t.name == "test-release" for t in threading.enumerate())


def test_span_threads_run_on_one_core_and_leave_other_threads_alone():
    """The host step's threads set OpenMP's count to 1 for themselves only: the creator keeps its
    count, and so does a thread started afterwards (torch gives new threads the last count set)."""
    import threading

    from hf_megatrain.engine.worker import SpanPool

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pool = SpanPool(3)
        seen = []
        pool.run(lambda _: seen.append(torch.get_num_threads()), range(12))
        assert seen == [1] * 12
        assert torch.get_num_threads() == 2
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2]
        with pytest.raises(ZeroDivisionError):
            pool.run(lambda i: 1 / i, [3, 2, 0, 1])
    finally:
        torch.set_num_threads(before)


def test_named_grads_and_masters_are_snapshots():
    """What named_grads() and named_master_params() return keeps its values through later steps: the
    host accumulators and masters are reused in place (the next step's first contribution is copied
    in, clipping scales in place, AdamW writes the masters), so views of them would change under
    the caller (they were views of host buffers and copies of device ones). Gradients kept apart
    (gpu_grad_layers) and a resident layer beside streamed ones: each kind of buffer."""
    engine = StreamingEngine(make_model("llama", num_hidden_layers=3, seed=2), compute_dtype=torch.float32,
                             resident_layers=1, gpu_grad_layers=1).train()
    opt = HostAdamW(engine, lr=1e-2)
    engine.forward_backward(make_batch(seed=0), None, 1.0)
    grads, masters = dict(engine.named_grads()), dict(engine.named_master_params())
    kept = {n: t.clone() for n, t in {**grads, **{"m." + k: v for k, v in masters.items()}}.items()}
    opt.clip_grad_norm_(1e-3)
    opt.step()
    engine.zero_grad()
    engine.forward_backward(make_batch(seed=1), None, 1.0)
    later = dict(engine.named_grads())
    assert any(not torch.equal(later[n], g) for n, g in grads.items())  # the accumulators did change
    for name, g in grads.items():
        assert torch.equal(g, kept[name]), name
    for name, m in masters.items():
        assert torch.equal(m, kept["m." + name]), name
