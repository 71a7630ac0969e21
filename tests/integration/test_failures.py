"""Failures in background host jobs surface, and shared buffers are read only when whole.

Every host job kind gets a failure injected (optimizer step, gradient accumulation, activation
copy, checkpoint write). Each test asserts that the caller of train() gets an exception naming
the job and the unit within a timeout, that the failed trainer leaves no thread (and, on a GPU,
no page-locked memory) behind once dropped, and that a new trainer in the same process then
trains exactly like a clean one. On the CPU the asynchronous host optimizer runs when asked
(background_host_jobs=True), so these orderings are tested without a GPU; the `cuda` cases run
the same tests on the device.
"""

import gc
import os
import threading
import time

import pytest
import torch
from transformers import default_data_collator

from hf_megatrain import HostAdamW, HostJobError, MegaTrainArguments, MegaTrainTrainer, StreamingEngine
from hf_megatrain.engine.pinned import pinned_bytes
from hf_megatrain.engine.store import HostStore
from hf_megatrain.engine.worker import Signal, Worker
from tests.support import ROOT
from tests.support.tiny import make_batch, make_model, make_rows as rows

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TIMEOUT = 60  # seconds; a hang is what these tests exist to catch


def within(seconds, fn):
    """Run fn() on a thread; return its exception (None if it returned). Fails if it hangs."""
    out = {}

    def target():
        try:
            fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    return out.get("error")


def megatrain_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("megatrain")]


def assert_let_go(baseline_threads, baseline_pinned):
    """Once the failed trainer is dropped, its threads end and its pinned memory is returned."""
    gc.collect()
    for _ in range(200):
        if len(megatrain_threads()) <= baseline_threads:
            break
        time.sleep(0.05)
        gc.collect()
    assert len(megatrain_threads()) <= baseline_threads, megatrain_threads()
    assert pinned_bytes() <= baseline_pinned



def trainer(tmp_path, device, name="run", **overrides):
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2,
              max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
              dataloader_num_workers=0, use_cpu=device == "cpu", background_host_jobs=True,
              gpu_resident_layers="0", compute_dtype="float32", log_pipeline=False)
    kw.update(overrides)
    args = MegaTrainArguments(output_dir=str(tmp_path / name), **kw)
    return MegaTrainTrainer(make_model("llama", num_hidden_layers=4), args, train_dataset=rows(24),
                            data_collator=default_data_collator)


def losses(t):
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def on_thread(name):
    return threading.current_thread().name == name


def fail_and_recover(tmp_path, device, monkeypatch, inject, expect, error=HostJobError, **overrides):
    """A clean run; the same run with `inject` applied must raise `error` matching `expect` in
    time and let go of everything; then, without it, a new trainer trains exactly as the clean one."""
    threads, pinned = len(megatrain_threads()), pinned_bytes()
    clean = trainer(tmp_path, device, "clean", **overrides)
    clean.train()
    want = losses(clean)
    del clean
    with monkeypatch.context() as m:
        inject(m)
        failing = trainer(tmp_path, device, "failing", **overrides)
        err = within(TIMEOUT, failing.train)
        assert isinstance(err, error), repr(err)
        assert expect in str(err), str(err)
        if error is HostJobError:  # the same trainer again: refuses, never hangs
            again = within(TIMEOUT, failing.train)
            assert isinstance(again, HostJobError) and expect in str(again), repr(again)
            del again
        del failing, err
    assert_let_go(threads, pinned)
    again = trainer(tmp_path, device, "again", **overrides)
    again.train()
    assert losses(again) == want


# -- the worker itself --------------------------------------------------------------------------
def test_a_failed_job_wakes_every_waiter_and_stays_failed():
    worker = Worker("megatrain-test")
    go = threading.Event()
    first, queued, refused = Signal(done=False), Signal(done=False), Signal(done=False)
    ran = []

    def fail():
        go.wait(5)
        raise ZeroDivisionError("injected")

    worker.submit(fail, "dividing", first)
    worker.submit(lambda: ran.append(1), "after it", queued)  # queued before the failure happens
    go.set()
    for signal in (first, queued):
        err = within(5, signal.wait)
        assert isinstance(err, HostJobError) and "dividing failed" in str(err) and "ZeroDivisionError" in str(err)
    assert ran == []  # skipped: the state it would work on is torn
    for call in (worker.drain, lambda: worker.submit(lambda: ran.append(2), "more", refused), refused.wait):
        err = within(5, call)
        assert isinstance(err, HostJobError) and "dividing failed" in str(err)
    assert ran == []


def test_a_failed_worker_lets_go_of_its_owner():
    """The failure's traceback holds the job's frames; the thread keeps only its text, so a
    failed owner (with its host store) is still freed and its thread ends."""
    import weakref

    class Owner:  # stands in for an optimizer that owns a worker and a store
        def __init__(self):
            self.worker = Worker("megatrain-owner")

        def step(self):
            raise MemoryError("injected")

    owner = Owner()
    ref = weakref.ref(owner)
    owner.worker.submit(owner.step, "a step")
    assert isinstance(within(5, owner.worker.drain), HostJobError)
    del owner
    gc.collect()
    assert ref() is None
    for _ in range(100):
        if "megatrain-owner" not in megatrain_threads():
            break
        time.sleep(0.02)
    assert "megatrain-owner" not in megatrain_threads()


# -- each kind of host job, through train() -------------------------------------------------------
def _fail_step_of(index):
    original = HostAdamW._adamw

    def adamw(self, i, *args):
        if i == index and on_thread("megatrain-adamw"):
            raise MemoryError("injected: host allocation failed")
        return original(self, i, *args)

    return lambda m: m.setattr(HostAdamW, "_adamw", adamw)


@pytest.mark.parametrize("device", DEVICES)
def test_failed_optimizer_step_surfaces(device, tmp_path, monkeypatch):
    # the third unit (decoder layer 1), as measured hanging on the H200
    fail_and_recover(tmp_path, device, monkeypatch, _fail_step_of(2), "AdamW step 1 of decoder layer 1 failed")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("together", ["false", "true"])
def test_failed_step_during_the_backward_surfaces(device, together, tmp_path, monkeypatch):
    """Also with the micro-batches through each layer together, where the step fails while the backward
    still runs (no accumulation thread in between): the step's own error, then again on the next call."""
    fail_and_recover(tmp_path, device, monkeypatch, _fail_step_of(2), "AdamW step 1 of decoder layer 1",
                     max_grad_norm=0.0, layer_major_accumulation=together)


def _fail_accumulation_of(index):
    original = HostStore.add_grad

    def add_grad(self, i, grad, first):
        if i == index and on_thread("megatrain-accumulate"):
            raise RuntimeError("injected: accumulation failed")
        return original(self, i, grad, first)

    return lambda m: m.setattr(HostStore, "add_grad", add_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_failed_gradient_accumulation_surfaces(device, clip, tmp_path, monkeypatch):
    """With clipping the step waits for every gradient; without it each unit's early step waits
    for its own gradient to land (and must see the failure instead of stepping). Micro-batches one
    at a time: together, their gradients are summed on the GPU and no accumulation job runs."""
    fail_and_recover(tmp_path, device, monkeypatch, _fail_accumulation_of(3),
                     "gradient accumulation of decoder layer 2 failed", max_grad_norm=clip,
                     layer_major_accumulation="false")


@pytest.mark.parametrize("device", DEVICES)
def test_failed_activation_offload_surfaces(device, tmp_path, monkeypatch):
    def inject(m):
        def refuse(*a, **k):
            raise MemoryError("injected: cannot page-lock")

        m.setattr("hf_megatrain.engine.activations.arena_tensors", refuse)

    fail_and_recover(tmp_path, device, monkeypatch, inject, "input of decoder layer 0 to host memory failed",
                     error=RuntimeError, offload_activations="2")


@pytest.mark.parametrize("device", DEVICES)
def test_failed_checkpoint_write_keeps_the_last_checkpoint(device, tmp_path, monkeypatch):
    from hf_megatrain.checkpoint.manifest import verify_manifest
    from hf_megatrain.trainer import save_optimizer_state as real_save

    def inject(m):
        def save(optimizer, folder):
            if "checkpoint-4" in folder:
                raise OSError(28, "No space left on device")
            return real_save(optimizer, folder)

        m.setattr("hf_megatrain.trainer.save_optimizer_state", save)

    fail_and_recover(tmp_path, device, monkeypatch, inject, "checkpoint-4 failed", error=RuntimeError,
                     max_steps=4, save_strategy="steps", save_steps=2)
    out = tmp_path / "failing"
    assert sorted(os.listdir(out)) == ["checkpoint-2"]  # no half-written or hidden folder left
    verify_manifest(str(out / "checkpoint-2"))
    resumed = trainer(tmp_path, device, "failing", max_steps=4, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert losses(resumed)[-2:] == losses(trainer_done(tmp_path, device))[-2:]


def trainer_done(tmp_path, device):
    t = trainer(tmp_path, device, "reference", max_steps=4)
    t.train()
    return t


def test_failed_step_through_the_cli(tmp_path):
    """`hf-megatrain train` with the host AdamW failing on its thread: the command ends within the
    timeout, exit status 1, its last words naming the job and the unit, the thread's traceback above."""
    import json
    import subprocess
    import sys

    from hf_megatrain.demo import build_tokenizer

    folder = tmp_path / "model"
    make_model("llama", num_hidden_layers=4).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": "abcdefghij"[i % 7:] * 3}) + "\n" for i in range(40)))
    script = (
        "import sys, threading\n"
        "from hf_megatrain import HostAdamW, cli\n"
        "real = HostAdamW._adamw\n"
        "def adamw(self, i, *a):\n"
        "    if i == 2 and threading.current_thread().name == 'megatrain-adamw':\n"
        "        raise MemoryError('injected: host allocation failed')\n"
        "    return real(self, i, *a)\n"
        "HostAdamW._adamw = adamw\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script, "train", "--model", str(folder), "--data", str(data),
                        "--output_dir", str(tmp_path / "out"), "--use_cpu", "--background_host_jobs", "true",
                        "--max_seq_length", "32", "--max_steps", "3", "--report_to", "none",
                        "--save_strategy", "no"],
                       capture_output=True, text=True, env=env, timeout=TIMEOUT * 5)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "hf-megatrain train: error: AdamW step 1 of decoder layer 1 failed on host thread megatrain-adamw: " \
           "MemoryError('injected: host allocation failed')" in r.stderr, r.stderr[-3000:]
    assert "--- traceback in megatrain-adamw ---" in r.stderr


# -- ordering: the asynchronous host jobs give the synchronous numbers ----------------------------
def _slow_steps(m, seconds=0.01):
    """Every host step sleeps first, so a reader that does not wait for it sees stale buffers."""
    original = HostAdamW._adamw
    finished = []

    def adamw(self, index, *args):
        if not on_thread("MainThread"):
            time.sleep(seconds)
        original(self, index, *args)
        finished.append(index)

    m.setattr(HostAdamW, "_adamw", adamw)
    return finished


def _train(background, clip, steps=4, ga=2, device="cpu"):
    model = make_model("llama_tied", num_hidden_layers=4, seed=3)
    engine = StreamingEngine(model, device=device, compute_dtype=torch.float32,
                             background_host_jobs=background).train()
    opt = HostAdamW(engine, lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        for micro in range(ga):
            if not clip and micro == ga - 1:
                opt.step_during_backward()
            engine.forward_backward(make_batch(seed=10 * step + micro, seq=10 + 4 * micro), scale=1.0 / ga)
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        engine.zero_grad()
    return dict(engine.named_master_params())


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_background_host_jobs_on_cpu_equal_the_synchronous_path(clip, monkeypatch):
    sync = _train(False, clip)
    _slow_steps(monkeypatch)
    background = _train(True, clip)
    for name in sync:
        assert torch.equal(sync[name], background[name]), name


# -- readers wait for the writers (the ownership rules in engine/store.py) -------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reader", ["named_grads", "grad_norm", "named_master_params"])
def test_readers_wait_for_a_pending_step(device, reader, monkeypatch):
    """A clipping step scales the gradients in place on the host thread: named_grads, grad_norm
    and named_master_params return only once it has finished with every unit."""
    finished = _slow_steps(monkeypatch, 0.05)
    engine = StreamingEngine(make_model("llama", num_hidden_layers=4), device=device,
                             compute_dtype=torch.float32, background_host_jobs=True).train()
    opt = HostAdamW(engine, lr=1e-2)
    engine.forward_backward(make_batch())
    before = {n: g.clone() for n, g in engine.named_grads()}
    coef = torch.clamp(1e-3 / (opt.clip_grad_norm_(1e-3) + 1e-6), max=1.0)
    opt.step()
    result = getattr(engine, reader)()
    if reader != "grad_norm":
        result = dict(result)
    assert len(finished) == len(engine.units), "returned before the step finished"
    if reader == "named_grads":
        for name, g in before.items():
            assert torch.equal(result[name], g.mul_(coef)), name  # clipped, as the step left them


def test_a_failed_backward_disarms_the_early_step(monkeypatch):
    engine = StreamingEngine(make_model("llama", num_hidden_layers=4), compute_dtype=torch.float32,
                             background_host_jobs=True).train()
    opt = HostAdamW(engine, lr=1e-2)
    assert opt.step_during_backward()
    bad = make_batch()
    bad["input_ids"][0, 0] = 10_000  # outside the vocabulary: refused before any unit ran
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.forward_backward(bad)
    assert engine.pipeline.on_final_grad is None
    engine.forward_backward(make_batch())  # not armed any more: nothing is stepped here
    engine.synchronize()
    assert opt.step_count == 0 and all(c == 1 for c in engine.store.grad_count)
    opt.step()  # the plain step still works
    engine.synchronize()
    assert opt.step_count == 1

    # A backward that fails after some units were stepped early leaves them stepped: the next
    # step must refuse instead of stepping them twice.
    engine.zero_grad()
    assert opt.step_during_backward()
    original = engine._layer_backward

    def fail_at_layer_0(unit, *args):
        if unit.layer == 0:
            raise RuntimeError("injected: backward failed")
        return original(unit, *args)

    monkeypatch.setattr(engine, "_layer_backward", fail_at_layer_0)
    with pytest.raises(RuntimeError, match="injected"):
        engine.forward_backward(make_batch())
    with pytest.raises(RuntimeError, match="partly updated"):
        opt.step()


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_activations_of_varying_length_are_exact(device):
    """Micro-batches that grow make the offload buffers grow (re-allocated and re-pinned after the
    copies queued on the old ones): gradients equal keeping every input on the device."""
    results = []
    for offload in (0, 3):
        engine = StreamingEngine(make_model("llama", num_hidden_layers=4, seed=3), device=device,
                                 compute_dtype=torch.float32, offload_activations=offload).train()
        grads = []
        for seq in (12, 40, 20, 64):
            engine.zero_grad()
            if device == "cuda":
                torch.cuda._sleep(2_000_000)  # the copies must wait for the compute, not race it
            engine.forward_backward(make_batch(batch=2, seq=seq, seed=seq))
            grads.append(dict(engine.named_grads()))
        results.append(grads)
    for a, b in zip(*results):
        for name in a:
            assert torch.equal(a[name], b[name]), name
