"""Where hf_megatrain's own log lines go: the memory plan, the memory modes the planner took and why,
the step-time model's prediction. They are what a user needs to read at the start of a run, so they
are shown at INFO by default, as a line each on stderr, like transformers' own (a Trainer run's
`log_level` overrides the level; a logging set-up of the user's own receives them as usual)."""

from __future__ import annotations

import logging
import sys

NAME = "hf_megatrain"


def show_logs(level: int | None = None) -> None:
    """Show hf_megatrain's log records from `level` (None or -1, transformers' "passive": INFO) on.

    Records still propagate to the root logger; a stderr handler is added only while neither this
    logger nor the root has one, so a logging configuration of the user's own (or pytest's capture)
    gets them once and nothing prints them twice."""
    logger = logging.getLogger(NAME)
    logger.setLevel(logging.INFO if level is None or level < 0 else level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[hf_megatrain] %(message)s"))
        logger.addHandler(handler)
