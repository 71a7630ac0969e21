"""The exception types users see."""


class MegaTrainError(ValueError):
    """Raised with a message that says what is wrong and what to do about it."""


class HostJobError(RuntimeError):
    """A background host job (an optimizer step, a gradient accumulation) failed.

    Raised in the training thread at its next wait on that job's worker; every later call into
    the same engine raises it again, since the state the failed job was updating is torn. The
    failed thread's traceback is in the message; the original exception is the `__cause__`.
    """

    def __init__(self, job: str, worker: str, error: BaseException, remote_traceback: str = ""):
        self.job, self.worker, self.error, self._remote = job, worker, error, remote_traceback
        super().__init__(
            f"{job} failed on host thread {worker}: {error!r}. The training state is now inconsistent: "
            f"restart from the last checkpoint (a new trainer in this process works).\n"
            f"--- traceback in {worker} ---\n{remote_traceback}"
        )
        self.__cause__ = error
        self.__suppress_context__ = True

    def fresh(self) -> "HostJobError":
        """A new instance to raise: a raised exception collects the raiser's frames in its
        traceback, and the stored one must not (they hold the engine the thread is to let go of)."""
        return HostJobError(self.job, self.worker, self.error, self._remote)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 layer', '3 layers', '0 layer inputs': numbers in messages read as a person writes them."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {plural or noun + 's'}"


def parameter_count(n: int) -> str:
    """'7.62 B', '135.0 M', '98.3 K' parameters: never '0.00 B' for a small model."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "B" else f"{n / scale:.1f} {unit}"
    return str(n)
