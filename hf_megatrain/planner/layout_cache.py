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
# (estimator.py lays out a PEFT run's units, engine/prompts.py the prompt encoder among them)
_LAYOUT_CODE = ("engine/layout.py", "engine/store.py", "engine/prompts.py", "planner/estimator.py", "patcher")


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


def _path(kind: str, key) -> str:
    name = hashlib.sha256(json.dumps([SCHEMA, code_version(), key]).encode()).hexdigest()[:40]
    return os.path.join(cache_root(), kind, name + ".json")


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # not there yet, or unreadable: built again


def _write(path, data) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
            json.dump(data, f)
        os.replace(f.name, path)  # whole or not at all: a reader never sees half a file
    except OSError:
        pass


def cached_units(key, build) -> list:
    """build() (a list of engine Units), read from the disk cache where an earlier process laid out
    the same `key` with the same code, else built and written there. key None: not cached."""
    if key is None:
        return build()
    path = _path("layouts", key)
    data = _read(path)
    if data is not None:
        try:
            return decode(data)
        except (KeyError, TypeError):
            pass  # an older or damaged file: built again below
    units = build()
    _write(path, encode(units))
    return units


def config_key(config):
    """What a config's units depend on, as a key: its class and every field (None: not serialisable,
    so not cached)."""
    if isinstance(config, ConfigRecord):
        return config.class_name, config.to_json_string(use_diff=False)
    try:
        return type(config).__qualname__, config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - an odd attribute costs the cache, never the plan
        return None


class ConfigRecord:
    """A flat model config as the planner reads it (its fields as attributes), kept on disk beside
    the units it lays out. Building the real config imports transformers and the family's config
    code, about 3-4 s of a 2-core box, more than planning a 70B run; `hf-megatrain estimate` plans
    from this record instead where an earlier process already laid the same config out (see
    cached_config). Only what the planner calls is here: a field access or to_json_string."""

    def __init__(self, class_name: str, text: str):
        self.__dict__.update(json.loads(text))
        self.class_name, self._text = class_name, text

    def to_json_string(self, use_diff: bool = True) -> str:
        if use_diff:
            raise ValueError("a ConfigRecord keeps the full config only: call to_json_string(use_diff=False)")
        return self._text

    def to_dict(self) -> dict:
        return json.loads(self._text)


def cached_config(key, build):
    """The config `build()` makes, as a ConfigRecord where it is on disk under `key` (what the config
    was made from: a shape's fields, a config.json's text) and its units are cached too, else the
    real config from build(), recorded for the next process. Nested configs (a composite model's
    text_config) are never recorded: the planner reads them as objects."""
    path = _path("configs", key)
    data = _read(path)
    if isinstance(data, dict) and {"class_name", "text"} <= data.keys():
        record = ConfigRecord(data["class_name"], data["text"])
        if os.path.exists(_path("layouts", config_key(record))):
            return record
    config = build()
    units_key = config_key(config)
    flat = units_key is not None and not any(
        isinstance(v, dict) and "model_type" in v for v in json.loads(units_key[1]).values())
    if flat:
        _write(path, {"class_name": units_key[0], "text": units_key[1]})
    return config


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
