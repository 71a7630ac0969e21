"""Reading safetensors files straight into the host store, without mmap and without a copy.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw bytes. We read each tensor with `readinto` directly into its
destination when the dtypes match (an fp32 checkpoint lands in the fp32 master with no
intermediate), or into one reusable staging buffer that is then converted: peak memory is the
host store plus one tensor, and truncated or corrupted files are caught with the file and
tensor named.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import MegaTrainError

# The file names of HF's safetensors checkpoints: one file, or shards listed by an index.
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    path: str
    name: str
    dtype: torch.dtype
    shape: tuple
    start: int  # absolute file offset
    nbytes: int


def read_header(path: str) -> list[TensorEntry]:
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header claims {n} bytes but the file has {size}")
            header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise MegaTrainError(f"{path} is not a readable safetensors file (corrupted or truncated): {e}") from e
    base = 8 + n
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta.get("dtype") not in DTYPES:
            raise MegaTrainError(f"{path}: tensor {name!r} has unsupported dtype {meta.get('dtype')!r}")
        a, b = meta["data_offsets"]
        entry = TensorEntry(path, name, DTYPES[meta["dtype"]], tuple(meta["shape"]), base + a, b - a)
        if base + b > size:
            raise MegaTrainError(
                f"{path} is truncated: tensor {name!r} ends at byte {base + b} but the file has {size} bytes. "
                "Re-download or re-save this shard."
            )
        entries.append(entry)
    return entries


def _buffer(t: torch.Tensor):
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


class TensorReader:
    """Reads tensors into given destinations; keeps one staging buffer for dtype conversion."""

    def __init__(self):
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._files: dict[str, object] = {}

    def _file(self, path: str):
        if path not in self._files:
            self._files[path] = open(path, "rb", buffering=0)
        return self._files[path]

    def read_into(self, entry: TensorEntry, dest: torch.Tensor, first: int | None = None) -> None:
        """Copy the tensor into `dest` (any float dtype, any device).

        first: copy only the flat elements [first, first + dest.numel()) (a data-parallel rank's
        slice of a tensor); by default `dest` must hold the whole tensor."""
        numel = 1
        for d in entry.shape:
            numel *= d
        whole = first is None
        first = first or 0
        if (whole and dest.numel() != numel) or first < 0 or first + dest.numel() > numel:
            raise MegaTrainError(
                f"{entry.path}: tensor {entry.name!r} has shape {list(entry.shape)}, "
                f"but the model expects {list(dest.shape)}"
            )
        size = entry.dtype.itemsize
        nbytes = dest.numel() * size
        f = self._file(entry.path)
        f.seek(entry.start + first * size)
        if dest.dtype == entry.dtype and dest.is_contiguous() and dest.device.type == "cpu":
            target = dest
        else:
            if self._staging.numel() < nbytes:
                self._staging = torch.empty(nbytes, dtype=torch.uint8)
            target = self._staging[:nbytes].view(entry.dtype)
        got = f.readinto(_buffer(target)) if nbytes else 0
        if got != nbytes:
            raise MegaTrainError(f"{entry.path}: tensor {entry.name!r} is truncated ({got} of {nbytes} bytes)")
        if target is not dest:
            dest.copy_(target.view(dest.shape))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._staging = torch.empty(0, dtype=torch.uint8)
