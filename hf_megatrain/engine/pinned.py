"""Exact-size page-locked host memory.

Everything that crosses PCIe must be pinned: a pageable copy is staged by the driver through a
bounce buffer and runs several times slower. torch's pinned allocator rounds every request up to a power of two, which would
waste up to half of a 100 GB host store, so we allocate ordinary memory of exactly the size
needed and page-lock it with cudaHostRegister. One arena per buffer kind, carved into the
per-unit flat tensors.

Arenas are private anonymous mappings marked MADV_DONTFORK (Linux): a forked process
(DataLoader workers) does not get them. Without it, fork() copies every page-locked page into
each child at once and shares the rest copy-on-write, so every worker costs another store of
host RAM and the OOM killer takes the trainer (BENCHMARKS.md, run 5). Children never touch the store.
"""

from __future__ import annotations

import mmap

import torch

_ALIGN = 4096  # page-aligned slices: clean DMA, no false sharing between units
_registered = [0]  # bytes page-locked by live arenas (tests check that a failed run returns them)


def pinned_bytes() -> int:
    """Bytes of host memory currently page-locked by hf_megatrain's arenas."""
    return _registered[0]


class HostArena:
    def __init__(self, sizes_bytes: list[int], pin: bool):
        offsets, total = [], 0
        for n in sizes_bytes:
            offsets.append(total)
            total += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        self._offsets = offsets
        self.nbytes = total
        self._map = _anonymous(max(total, 1))  # page-aligned, zero-filled
        if hasattr(mmap, "MADV_DONTFORK"):
            self._map.madvise(mmap.MADV_DONTFORK)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if pin and total:
            err = int(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), total, 0))
            if err != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {total / 2**30:.1f} GiB failed (cudaError {err}); "
                    "the host may not allow that much page-locked memory (check `ulimit -l`)."
                )
            self.pinned = True
            _registered[0] += total

    def tensor(self, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = self._offsets[i]
        return self.buffer[start : start + nbytes].view(dtype)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
            _registered[0] -= self.nbytes

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _anonymous(nbytes: int) -> mmap.mmap:
    """Private anonymous memory, what malloc gives (Python's default is a shared mapping: shmem)."""
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


def arena_tensors(numels: list[int], dtype: torch.dtype, pin: bool) -> tuple[HostArena, list[torch.Tensor]]:
    """One arena holding a flat tensor of `dtype` for each entry of `numels`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    arena = HostArena([n * itemsize for n in numels], pin)
    return arena, [arena.tensor(i, n, dtype) for i, n in enumerate(numels)]
