"""Layer-boundary activations of one forward, kept for the backward's recomputation.

The backward recomputes each layer from its input, so the forward keeps one [batch, seq,
hidden] tensor per decoder layer. At long context these dominate GPU memory (28 layers of
512K x 3072 bf16 tokens are 84 GiB), so the first `offload` layers' inputs go to pinned host
memory instead:

    forward   after layer i's input is final: D2H on a stream of its own (async), GPU copy freed
    backward  `lookahead` layers before it is needed: H2D on another stream, waited on by event

The earliest layers are the ones offloaded: they are needed last in the backward, which leaves
the whole backward of the later layers to bring them back. Copies are bit-exact, so gradients
do not change. The host buffers are page-locked once (exact size, engine/pinned.py) and reused
every step while the activation shape stays the same.

On the CPU "offload" copies into a separate host buffer and drops the original, which keeps the
bookkeeping (which layer is where, when it comes back) under test without a GPU.

Who may touch a host buffer when: layer i's buffer is written by the D2H stream (forward) and
read by the H2D stream (backward). Its D2H waits for the forward's compute (`produced`) and for
the last H2D that read the buffer (`_read[i]`: a backward that failed halfway leaves such reads
queued); its H2D waits for its D2H (`_stored[i]`). The buffers are unpinned and freed only when a
larger activation needs new ones, after both copy streams have drained.
"""

from __future__ import annotations

import torch

from .pinned import arena_tensors


class Activations:
    def __init__(self, device: torch.device, offload: int = 0, lookahead: int = 2):
        self.device = device
        self.offload = max(0, int(offload))
        self.lookahead = max(1, int(lookahead))
        self.cuda = device.type == "cuda"
        if self.cuda and self.offload:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
        self._arena = None
        self._host: list[torch.Tensor] = []
        self._capacity = (0, None)  # (numel, dtype) the host buffers can hold
        self._read: dict[int, torch.cuda.Event] = {}  # layer -> its host buffer's last H2D
        self.reset()

    def reset(self) -> None:
        self._gpu: dict[int, torch.Tensor] = {}
        self._shape = None
        self._stored: dict[int, torch.cuda.Event | None] = {}  # offloaded layer -> its D2H event
        self._back: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}  # prefetched

    def __len__(self) -> int:
        return len(self._gpu) + len(self._stored)

    def _host_buffers(self, x: torch.Tensor) -> list[torch.Tensor]:
        numel, dtype = self._capacity
        if x.numel() > numel or x.dtype != dtype:  # page-lock once for the largest size seen
            if self.cuda and self._arena is not None:  # no copy may still be queued on the old buffers
                self.d2h.synchronize()
                self.h2d.synchronize()
            self._read.clear()
            self._host, self._arena = [], None  # let the old arena go first
            self._arena, self._host = arena_tensors([x.numel()] * self.offload, x.dtype, pin=self.cuda)
            self._capacity = (x.numel(), x.dtype)
        return self._host

    def put(self, layer: int, x: torch.Tensor) -> None:
        """Keep decoder layer `layer`'s input (called in the forward, in layer order)."""
        self._shape = x.shape
        if layer >= self.offload:
            self._gpu[layer] = x
            return
        try:
            self._offload(layer, x)
        except Exception as e:  # e.g. page-locking a larger buffer failed: say which copy it was
            raise RuntimeError(f"offloading the input of decoder layer {layer} to host memory failed: {e!r}") from e

    def _offload(self, layer: int, x: torch.Tensor) -> None:
        host = self._host_buffers(x)[layer][: x.numel()]
        if not self.cuda:
            host.copy_(x.reshape(-1))
            self._stored[layer] = None
            return
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(produced)
            if layer in self._read:
                self.d2h.wait_event(self._read.pop(layer))
            host.copy_(x.reshape(-1), non_blocking=True)
            x.record_stream(self.d2h)  # the GPU copy may be freed before the D2H ran
            done = torch.cuda.Event()
            done.record(self.d2h)
        self._stored[layer] = done

    def _fetch(self, layer: int) -> None:
        if layer < 0 or layer not in self._stored or layer in self._back:
            return
        host = self._host[layer][: self._shape.numel()]
        if not self.cuda:
            self._back[layer] = (host.clone().view(self._shape), None)
            return
        compute = torch.cuda.current_stream(self.device)
        out = torch.empty(self._shape, dtype=host.dtype, device=self.device)  # allocated on compute
        allocated = torch.cuda.Event()
        allocated.record(compute)
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(allocated)  # the memory's previous user (on compute) is done
            self.h2d.wait_event(self._stored[layer])  # the D2H into the host buffer is done
            out.view(-1).copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        self._read[layer] = ready
        self._back[layer] = (out, ready)

    def get(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s input, on the device (called in the backward, in reverse order)."""
        for ahead in range(layer - 1, layer - 1 - self.lookahead, -1):
            self._fetch(ahead)  # start the next ones while this layer computes
        if layer in self._gpu:
            return self._gpu.pop(layer)
        self._fetch(layer)
        self._stored.pop(layer)
        x, ready = self._back.pop(layer)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return x
