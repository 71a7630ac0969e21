"""Host threads: an ordered job worker (gradient accumulation, optimizer steps) and a span pool.

torch's CPU kernels release the GIL and parallelise internally, so one ordered worker per job
kind keeps all cores busy without oversubscribing them, while the main thread goes on feeding
the GPU.

Failures are part of the contract. A job that raises makes its worker *failed* for good: every
later job is skipped (the state it would work on is torn), yet each job's `Signal` is still set,
carrying the failure, so whoever waits on it wakes and raises instead of hanging. The caller
sees a `HostJobError` naming the job and the unit at its next `submit`, `drain` or `Signal.wait`.

The thread holds only the queue and the failure, never the Worker, a finished job or a
traceback (the error keeps its traceback as text): when the owner (an optimizer, a pipeline)
is dropped, its host store is freed and the thread is told to end. A thread that kept its last
job alive would keep a whole host store alive after its trainer is gone.
"""

from __future__ import annotations

import queue
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from ..errors import HostJobError

_STOP = object()


class Signal:
    """A 'this is done' flag that can also carry a failure: `wait()` returns once it is set and
    raises the failure if the job that set it failed (or was skipped after another one failed)."""

    def __init__(self, done: bool = True):
        self._event = threading.Event()
        self._error: HostJobError | None = None
        if done:
            self._event.set()

    def clear(self) -> None:
        self._error = None
        self._event.clear()

    def set(self, error: HostJobError | None = None) -> None:
        self._error = error
        self._event.set()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error.fresh()


class Worker:
    def __init__(self, name: str):
        # OpenMP's thread count is per thread, and torch sets a thread's count lazily, at its
        # first parallel op, from the count *last set anywhere in the process*. DataLoader's
        # pin-memory thread sets 1, so a worker that had not yet run a parallel op when that
        # happened would run the host AdamW on one core (BENCHMARKS.md, "Measurements the code's
        # defaults rest on").
        # The worker takes its creator's count and runs its lazy init at once (see _serve).
        self._jobs: queue.Queue = queue.Queue()
        self._failed: list[HostJobError] = []  # the first failure, shared with the thread
        self.name = name
        thread = threading.Thread(target=_serve, args=(self._jobs, self._failed, name, torch.get_num_threads()),
                                  name=name, daemon=True)
        thread.start()

    def submit(self, run, job: str, done: Signal | None = None) -> None:
        """Run `run()` on the thread, in submission order. `job` names it in errors ("AdamW step of
        layer 3"); `done` is set when it has run, with the failure if it (or an earlier job) failed;
        at once, failed, when the worker has failed already and refuses the job."""
        if self._failed and done is not None:
            done.set(self._failed[0])
        self.check()
        self._jobs.put((run, job, done))

    def later(self, run, job: str):
        """submit(), and return a function that blocks until `run` has run (raising its failure)."""
        done = Signal(done=False)
        self.submit(run, job, done)
        return done.wait

    def drain(self) -> None:
        """Block until every submitted job has run; raise the worker's failure if it has one."""
        self._jobs.join()
        self.check()

    def check(self) -> None:
        if self._failed:
            raise self._failed[0].fresh()

    def __del__(self):
        try:
            self._jobs.put(_STOP)
        except Exception:
            pass


def set_thread_count(threads: int) -> None:
    """OpenMP threads for the calling thread's torch ops, from now on. torch initialises a thread's
    count lazily, at its first parallel op, from the count last set anywhere in the process, and
    that would override a count set before it: run the lazy init first."""
    torch.get_num_threads()  # this thread's one-time lazy init happens here, not later
    torch.ones(1 << 17).add_(1)  # (and a parallel op, in case a build only inits there)
    torch.set_num_threads(threads)


def _serve(jobs: queue.Queue, failed: list, worker: str, threads: int) -> None:
    set_thread_count(threads)
    while True:
        item = jobs.get()
        if item is _STOP:
            jobs.task_done()
            return
        run, job, done = item
        error = failed[0] if failed else None
        try:
            if error is None:
                run()
        except BaseException as e:  # everything must reach the owner's thread
            # A job that waited on another worker's failed job re-raises that failure as it is.
            error = e if isinstance(e, HostJobError) else \
                HostJobError(job, worker, e, "".join(traceback.format_exception(e)))
            e.__traceback__ = None  # its frames hold the job's engine: keep the text, not them
            failed.append(error)
        finally:
            if done is not None:
                done.set(error)
            run = item = done = error = None  # a finished job's closure must not keep its engine alive
            jobs.task_done()


class SpanPool:
    """Host threads that each run torch ops on ONE core, for memory-bound work split into spans.

    The host AdamW is bound by DRAM bandwidth. Run as one op after another, each op spread over
    all cores by OpenMP, it pays a fork-join per op and every op streams its whole tile from DRAM
    again (the clip, the update and the bf16 refresh: ~42 bytes per parameter instead of ~30).
    Spans handed to threads run the three ops back to back on data still in cache, with no
    barrier between them. Each thread runs on one core. In training it helped only when the step
    ran during the backward (no clipping) and was slower than OpenMP after the backward (clipping),
    so HostAdamW uses it only when asked (host_threads=n); the measurements are in BENCHMARKS.md,
    "Measurements the code's defaults rest on".

    OpenMP's thread count is per thread: each pool thread sets 1 for itself. torch also records
    the last count set as the default for threads not yet started, so the creator restores its
    own count once every pool thread has set its own (the same thing the Worker guards against).
    """

    def __init__(self, threads: int, name: str = "megatrain-span"):
        self.threads = max(1, int(threads))
        own = torch.get_num_threads()
        started = threading.Barrier(self.threads + 1)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=name,
                                        initializer=set_thread_count, initargs=(1,))
        # ThreadPoolExecutor starts a thread per submit while none is idle: K blocked jobs start K
        # threads, each running the initializer first.
        for _ in range(self.threads):
            self._pool.submit(started.wait)
        started.wait(timeout=120)  # a thread that failed to start breaks the barrier instead of hanging
        torch.set_num_threads(own)

    def run(self, fn, items) -> None:
        """fn(item) for every item, spread over the threads; returns when all are done (re-raises
        the first failure)."""
        items = list(items)
        if len(items) == 1:
            fn(items[0])
            return
        futures = [self._pool.submit(fn, item) for item in items]
        wait(futures)  # all of them: none may still be writing when the caller moves on
        for future in futures:
            future.result()

    def __del__(self):
        try:
            self._pool.shutdown(wait=False)
        except Exception:
            pass
