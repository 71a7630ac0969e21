"""The units a config lays out, cached on disk across processes.

Laying a config out means building the model on the meta device, which imports the family's
modeling code (about a second of a 70B `hf-megatrain estimate`, more than the planning itself).
The result depends only on the config's contents, the adapters, the code that lays it out (this
package's patcher and engine layout) and the versions of transformers, torch and peft, so it is
kept as JSON under the cache directory (HF_MEGATRAIN_CACHE, else ~/.cache/hf_megatrain, beside the
probe's rates), keyed by a hash of all of them. A file that cannot be read is rebuilt; a cache
that cannot be written is skipped: the cache only ever costs its own speed-up.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata

SCHEMA = 1  # bump when the encoding below changes
# what lays a config out: a change to any of these files is a new layout
_LAYOUT_CODE = ("engine/layout.py", "engine/store.py", "patcher")


def cache_root() -> str:
    return os.environ.get("HF_MEGATRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hf_megatrain")


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """A hash of the layout code's sources and of the libraries it builds with."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for entry in _LAYOUT_CODE:
        path = os.path.join(package, entry)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(root, name) for root, _, names in os.walk(path) for name in names if name.endswith(".py"))
        for name in files:
            digest.update(os.path.relpath(name, package).encode())
            with open(name, "rb") as f:
                digest.update(f.read())
    for dist in ("transformers", "torch", "peft"):
        try:
            digest.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist}=none".encode())
    return digest.hexdigest()


def cached_units(key, build) -> list:
    """build() (a list of engine Units), read from the disk cache where an earlier process laid out
    the same `key` with the same code, else built and written there. key None: not cached."""
    if key is None:
        return build()
    name = hashlib.sha256(json.dumps([SCHEMA, code_version(), key]).encode()).hexdigest()[:40]
    path = os.path.join(cache_root(), "layouts", name + ".json")
    try:
        with open(path) as f:
            return decode(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not there yet, or unreadable: built again below
    units = build()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
            json.dump(encode(units), f)
        os.replace(f.name, path)  # whole or not at all: a reader never sees half a file
    except OSError:
        pass
    return units


def encode(units) -> list:
    out = []
    for unit in units:
        fields = {f.name: getattr(unit, f.name) for f in dataclasses.fields(unit)}
        fields["slots"] = [{**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)}, "shape": list(s.shape)}
                           for s in unit.slots]
        out.append(fields)
    return out


def decode(data: list) -> list:
    import torch

    from ..engine.store import Slot, Unit

    return [Unit(**{**u, "slots": [Slot(**{**s, "shape": torch.Size(s["shape"])}) for s in u["slots"]]})
            for u in data]
