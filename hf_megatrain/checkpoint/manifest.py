"""Checkpoint folders that are either complete or absent.

A checkpoint is written into a hidden temporary folder next to its final place, a manifest of
every file's size and hash is written last, and only then is the folder renamed into place (a
rename is atomic on one filesystem). A process killed during a save leaves at most a hidden
`.partial-*` folder, which Trainer's `checkpoint-<step>` globbing never sees, so resume and
rotation only ever meet complete checkpoints. On resume the manifest is checked.
"""

from __future__ import annotations

import json
import os
import shutil

from ..errors import MegaTrainError

MANIFEST = "megatrain_manifest.json"
_CHUNK = 16 << 20
RESUME_ELSEWHERE = "resume from another checkpoint-N folder, or start without resume_from_checkpoint."


def _hash(path: str) -> str:
    try:
        import xxhash

        h = xxhash.xxh3_64()
        algo = "xxh3_64"
    except ImportError:  # pragma: no cover - xxhash comes with datasets
        import hashlib

        h = hashlib.blake2b(digest_size=8)
        algo = "blake2b64"
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return f"{algo}:{h.hexdigest()}"


def write_manifest(folder: str, hashes: bool = True) -> None:
    files = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, folder)
            if rel == MANIFEST:
                continue
            entry = {"size": os.path.getsize(full)}
            if hashes:
                entry["hash"] = _hash(full)
            files[rel] = entry
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def verify_manifest(folder: str, hashes: bool = True) -> None:
    """Raise naming the first file that is missing, truncated or altered.

    hashes=False checks presence and sizes only: seconds instead of reading every byte (preflight)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise MegaTrainError(
            f"{folder} has no {MANIFEST}: it was not written completely by hf_megatrain; {RESUME_ELSEWHERE}")
    with open(path) as f:
        files = json.load(f)["files"]
    for rel, entry in sorted(files.items()):
        full = os.path.join(folder, rel)
        if not os.path.isfile(full):
            raise MegaTrainError(f"checkpoint {folder} is missing {rel}; {RESUME_ELSEWHERE}")
        size = os.path.getsize(full)
        if size != entry["size"]:
            raise MegaTrainError(
                f"checkpoint file {full} has {size} bytes, the manifest says {entry['size']}; {RESUME_ELSEWHERE}")
        if hashes and "hash" in entry and _hash(full) != entry["hash"]:
            raise MegaTrainError(
                f"checkpoint file {full} does not match its hash in the manifest (corrupted); {RESUME_ELSEWHERE}")


def partial_dir(final: str) -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".partial-{name}")


def commit_dir(tmp: str, final: str) -> None:
    """Move a finished temporary checkpoint into place, replacing an older one of that name."""
    if os.path.exists(final):
        old = partial_dir(final) + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
