"""A host thread that runs submitted jobs in order (gradient accumulation, optimizer steps).

torch's CPU kernels release the GIL and parallelise internally, so one ordered worker per job
kind keeps all cores busy without oversubscribing them, while the main thread goes on feeding
the GPU. An exception in a job is re-raised in the caller at the next `drain()`.
"""

from __future__ import annotations

import queue
import threading

import torch


class Worker:
    def __init__(self, name: str):
        # OpenMP's thread count is per thread, and torch sets a thread's count lazily, at its
        # first parallel op, from the count *last set anywhere in the process*. DataLoader's
        # pin-memory thread sets 1, so a worker that had not yet run a parallel op when that
        # happened would run the host AdamW on one core (measured: 0.3 instead of ~2 G params/s).
        # The worker takes its creator's count and runs its lazy init at once (see _run).
        self._threads = torch.get_num_threads()
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.get_num_threads()  # this thread's one-time lazy init happens here, not later
        torch.ones(1 << 17).add_(1)  # (and a parallel op, in case a build only inits there)
        torch.set_num_threads(self._threads)
        while True:
            job = self._jobs.get()
            try:
                if self._error is None:
                    job()
            except BaseException as e:  # surfaced to the main thread by drain()
                self._error = e
            finally:
                self._jobs.task_done()

    def submit(self, job) -> None:
        self.check()
        self._jobs.put(job)

    def drain(self) -> None:
        """Block until every submitted job has run; re-raise the first failure."""
        self._jobs.join()
        self.check()

    def check(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background job in {self._thread.name} failed: {err!r}") from err
