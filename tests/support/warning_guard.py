"""Catches FutureWarning / DeprecationWarning that transformers, accelerate or peft raise inside hf_megatrain's calls.

Such a warning means hf_megatrain uses an API on its way out, which a later release removes (how the
`create_causal_mask(past_key_values=)` rename in transformers 5.25 was found). conftest.py wraps every
test phase in `deprecations_from_our_calls()` and fails the test on what it catches. A warning counts when
the code that raised it is in one of those libraries and an hf_megatrain frame is on the stack at that
moment (which includes the frame a `stacklevel=2` warning is attributed to), with no frame of another of
those libraries in between: peft reading a deprecated transformers property inside `get_peft_model` is
peft's use, not ours. What the libraries raise for a test's own direct calls (the stock baselines)
passes through to pytest as usual.

Warnings raised inside a test's own `pytest.warns` / `recwarn` block go to that block (it records them
itself), and subprocesses are not watched.
"""

from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager

LIBRARIES = ("transformers", "accelerate", "peft")
OURS = "hf_megatrain"


def _package(frame) -> str:
    return frame.f_globals.get("__name__", "").partition(".")[0]


def _from_our_call(category) -> bool:
    """Called from within showwarning: is this a library deprecation with hf_megatrain code on the stack?"""
    if not issubclass(category, (FutureWarning, DeprecationWarning)):
        return False
    frame = inspect.currentframe().f_back.f_back  # past _from_our_call and the showwarning hook
    while frame is not None and _package(frame) == "warnings":  # warnings' own Python-level helpers
        frame = frame.f_back
    raiser = _package(frame) if frame is not None else None
    if raiser not in LIBRARIES:
        return False  # raised by Python, torch or some other package: not what this guard is for
    while frame is not None:
        package = _package(frame)
        if package == OURS:
            return True
        if package in LIBRARIES and package != raiser:
            return False  # another of the libraries made the deprecated call (peft using transformers)
        frame = frame.f_back
    return False


@contextmanager
def deprecations_from_our_calls():
    """Yields the list of warnings.WarningMessage caught; the others go on to whoever showed them before."""
    caught = []
    with warnings.catch_warnings():  # restores showwarning (and the filters) on the way out
        passed_on = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if _from_our_call(category):
                caught.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
            else:
                passed_on(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        yield caught
