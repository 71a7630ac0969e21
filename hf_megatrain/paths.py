"""Local paths versus hub names, and the refusal for a local path that is missing.

Data loading and checkpoint loading both ask it. It imports nothing of the package but the
exception type (errors.py, which imports nothing itself), so asking it pulls in no engine or
checkpoint code.
"""

from __future__ import annotations

import os

from .errors import MegaTrainError

# Endings of the files hf_megatrain reads (data, configs, weights): a name ending so is a path.
LOCAL_SUFFIXES = (".json", ".jsonl", ".txt", ".text", ".csv", ".parquet", ".arrow", ".yaml", ".yml",
                  ".safetensors", ".bin", ".pt")


def looks_local(name: str) -> bool:
    """Whether `name` can only mean a local path, never a hub id ('org/name') or a dataset name.

    Absolute, ~ or ./../-relative, more than one '/', a backslash, or a file ending: when such a
    path does not exist, the lookup must stop there (datasets would spend ~25 s retrying the hub).
    """
    name = os.fspath(name)
    return (os.path.isabs(name) or name.startswith(("~", "./", "../")) or name in (".", "..")
            or name.count("/") > 1 or "\\" in name or name.lower().endswith(LOCAL_SUFFIXES))


def missing_path(kind: str, path: str, alternative: str = "") -> MegaTrainError:
    """The refusal for a local path that does not exist: one line, with where a relative one was looked for."""
    where = "" if os.path.isabs(path) else f" (relative paths start from {os.getcwd()})"
    return MegaTrainError(f"{kind} path {path!r} does not exist; check the path{where}{alternative}.")
