"""A host thread that runs submitted jobs in order (gradient accumulation, optimizer steps).

torch's CPU kernels release the GIL and parallelise internally, so one ordered worker per job
kind keeps all cores busy without oversubscribing them, while the main thread goes on feeding
the GPU. An exception in a job is re-raised in the caller at the next `drain()`.

The thread holds only the queue, never the Worker or a finished job: when the owner (an
optimizer, a pipeline) is dropped, its host store is freed and the thread is told to end. A
thread that kept its last job alive once kept a whole 27 GB host store alive after its trainer
was gone.
"""

from __future__ import annotations

import queue
import threading

import torch

_STOP = object()


class Worker:
    def __init__(self, name: str):
        # OpenMP's thread count is per thread, and torch sets a thread's count lazily, at its
        # first parallel op, from the count *last set anywhere in the process*. DataLoader's
        # pin-memory thread sets 1, so a worker that had not yet run a parallel op when that
        # happened would run the host AdamW on one core (measured: 0.3 instead of ~2 G params/s).
        # The worker takes its creator's count and runs its lazy init at once (see _serve).
        self._jobs: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self.name = name
        thread = threading.Thread(target=_serve, args=(self._jobs, self._errors, torch.get_num_threads()),
                                  name=name, daemon=True)
        thread.start()

    def submit(self, job) -> None:
        self.check()
        self._jobs.put(job)

    def drain(self) -> None:
        """Block until every submitted job has run; re-raise the first failure."""
        self._jobs.join()
        self.check()

    def check(self) -> None:
        if self._errors:
            err = self._errors.pop(0)
            self._errors.clear()
            raise RuntimeError(f"background job in {self.name} failed: {err!r}") from err

    def __del__(self):
        try:
            self._jobs.put(_STOP)
        except Exception:
            pass


def _serve(jobs: queue.Queue, errors: list, threads: int) -> None:
    torch.get_num_threads()  # this thread's one-time lazy init happens here, not later
    torch.ones(1 << 17).add_(1)  # (and a parallel op, in case a build only inits there)
    torch.set_num_threads(threads)
    while True:
        job = jobs.get()
        try:
            if job is _STOP:
                return
            if not errors:
                job()
        except BaseException as e:  # surfaced to the owner's thread by drain()
            errors.append(e)
        finally:
            job = None  # a finished job's closure must not keep its engine alive
            jobs.task_done()
