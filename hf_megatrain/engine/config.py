"""EngineConfig: every knob of the engine, typed and checked once.

The trainer builds one from its arguments (`arguments.engine_config`), the planner
(`planner.estimate`) reads the same object to say what the engine will allocate, and the engine
takes it as it is: nothing below this point reads an arguments object or invents a default.
A config is frozen; a changed plan is a new config (`dataclasses.replace`).

`None` means "auto" for the placements (resident layers, offloaded layer inputs, lean residency):
the planner (`planner.resolve_placement`) settles them before an engine is built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..errors import MegaTrainError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def as_dtype(value) -> torch.dtype:
    """torch.bfloat16 / torch.float32, from a dtype or one of its names."""
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise MegaTrainError(f"compute dtype {value!r} is not supported; choose bfloat16 or float32.")


def parse_count(value, name: str) -> int | None:
    """'auto' (or None) -> None; a non-negative whole number (int or its digits) -> that int."""
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, str)
                                                                      and not value.strip().isdigit()):
        raise MegaTrainError(f"{name}={value!r}; use 'auto', 0 or a number of layers.")
    count = int(value)
    if count < 0:
        raise MegaTrainError(f"{name}={value!r}; use 'auto', 0 or a number of layers.")
    return count


def parse_switch(value, name: str) -> bool | None:
    """'auto' (or None) -> None; True/False or their spellings ('true', 'false', '1', '0') -> bool."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise MegaTrainError(f"{name}={value!r}; use auto, true or false.")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built with.

    device: where the math runs ("cpu" or "cuda[:n]").
    compute_dtype: dtype of the streamed weights and activations (bf16, or fp32).
    loss_chunk_tokens: rows of logits per loss chunk; None: from the vocabulary (layout.loss_chunk).
    mlp_tile_tokens: run each layer's MLP on sequence tiles of this many tokens; None: untiled.
    resident_layers: keep the embedding, the head and the first N decoder layers entirely on
        the compute device (weights, fp32 master, gradient, Adam moments; stepped there).
        None: auto, for the planner to fill in.
    offload_activations: keep the saved inputs of the first N decoder layers in pinned host
        memory between forward and backward (long context). None: auto.
    lean_resident: resident decoder layers keep no compute-dtype copy of their weights: each use
        casts the fp32 master into a ring slot on the GPU (the same rounding the copy holds), so a
        resident parameter costs 16 bytes instead of 18, what stock Trainer's fp32 AdamW costs.
        None: auto (the planner takes it when it makes more layers resident). Ignored in fp32
        compute, where the master itself is what the GPU reads.
    lean_streamed: streamed decoder layers keep no compute-dtype copy in host RAM: their fp32
        master crosses PCIe (pinned) and the GPU casts it into the ring slot (the same rounding the
        copy would hold), so a streamed parameter costs 16 bytes of host RAM instead of 18, for
        twice the PCIe bytes of its weights. Ignored in fp32 compute (the master already streams);
        not combined with data parallel. None: auto (the planner takes it when the host RAM does
        not suffice without it and does with it).
    transient_grads: streamed units keep no persistent fp32 gradient accumulator: each unit's
        gradient lands in one of TRANSIENT_GRAD_BUFFERS pinned buffers (layout.py) and the host
        AdamW steps it from there as soon as it is final, 4 bytes per streamed parameter less of
        host RAM. Resident decoder layers likewise share one fp32 gradient buffer on the GPU, each
        stepped right after its backward: 4 bytes per resident layer parameter less of GPU memory.
        Exact only when every backward steps its units as they finish
        (HostAdamW.step_during_backward before each backward; with clipping, after
        StreamingEngine.gradient_norm has measured the global norm in a pass of its own), a step's
        micro-batches run together, background host jobs; anything else is refused. Not with data
        parallel. None: auto (the planner takes it when the host RAM does not suffice without it;
        only offered without clipping, where it costs no pass: planner/run.py's settle_autos).
    gpu_grad_layers: the last N streamed decoder layers keep their fp32 gradient accumulator on the
        GPU instead of in host RAM (4 bytes per parameter moved from host to GPU): contributions are
        added and norms taken there, and each gradient crosses PCIe once, clipped on the GPU, through
        two pinned landing tiles during its host step. For exact clipping with a host that is
        short, where the GPU has room left beside its resident layers. None: auto (the planner fills
        that room when the host needs it; 0 off a GPU, with transient_grads or with data parallel).
        Not with transient_grads (nothing persists to place) or data parallel.
    prefetch_depth: GPU weight slots of the ring that streams decoder layers (>= 2).
    grad_slots: GPU slots of fp32 layer gradients on their way to the host (>= 1).
    staging_slabs: pinned slabs for gradient contributions after a step's first (>= 1).
    activation_lookahead: offloaded layer inputs brought back this many layers ahead (>= 1).
    host_threads: the host AdamW's span threads; 0 steps tiles with OpenMP inside each op.
    background_host_jobs: gradient accumulation and the host AdamW on worker threads,
        overlapped with compute. None: on a GPU yes, on the CPU no (there it exists so that
        tests walk the same asynchronous ordering and failure paths; the numbers are equal).
    """

    device: torch.device | str = "cpu"
    compute_dtype: torch.dtype | str = torch.bfloat16
    loss_chunk_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    resident_layers: int | None = 0
    offload_activations: int | None = 0
    lean_resident: bool | None = False
    lean_streamed: bool | None = False
    transient_grads: bool | None = False
    gpu_grad_layers: int | None = 0
    prefetch_depth: int = 2
    grad_slots: int = 2
    staging_slabs: int = 2
    activation_lookahead: int = 2
    host_threads: int = 0
    background_host_jobs: bool | None = None

    def __post_init__(self):
        device = torch.device(self.device)
        set_ = object.__setattr__  # frozen: normalised once, here
        set_(self, "device", device)
        set_(self, "compute_dtype", as_dtype(self.compute_dtype))
        set_(self, "resident_layers", parse_count(self.resident_layers, "resident_layers"))
        set_(self, "offload_activations", parse_count(self.offload_activations, "offload_activations"))
        lean = parse_switch(self.lean_resident, "lean_resident")
        set_(self, "lean_resident", False if self.compute_dtype == torch.float32 else lean)
        streamed = parse_switch(self.lean_streamed, "lean_streamed")
        set_(self, "lean_streamed", False if self.compute_dtype == torch.float32 else streamed)
        set_(self, "transient_grads", parse_switch(self.transient_grads, "transient_grads"))
        grads = parse_count(self.gpu_grad_layers, "gpu_grad_layers")
        if grads and self.transient_grads:
            raise MegaTrainError("gpu_grad_layers and transient_grads exclude each other: with transient_grads no "
                                 "gradient persists to be placed; choose one.")
        # auto (None) is the planner's to settle. On the CPU a number is taken as residency is: the
        # gradient is kept apart and stepped through the landing tiles, the same numbers (CPU tests).
        set_(self, "gpu_grad_layers", grads)
        if self.background_host_jobs is None:
            set_(self, "background_host_jobs", device.type == "cuda")
        if self.transient_grads and not self.background_host_jobs:
            raise MegaTrainError("transient_grads steps each unit on the host optimizer's worker as its gradient "
                                 "lands: it needs background_host_jobs (on by default on a GPU).")
        for name, low in (("prefetch_depth", 2), ("grad_slots", 1), ("staging_slabs", 1),
                          ("activation_lookahead", 1), ("host_threads", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                why = " (double buffering needs two GPU slots)" if name == "prefetch_depth" else ""
                raise MegaTrainError(f"{name}={value!r}; it must be a whole number >= {low}{why}.")
        for name in ("loss_chunk_tokens", "mlp_tile_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise MegaTrainError(f"{name}={value!r}; give a positive number of tokens, or leave it unset.")

    @property
    def planned(self) -> bool:
        """Every placement is settled (nothing left for the planner to decide)."""
        return self.resident_layers is not None and self.offload_activations is not None \
            and self.lean_resident is not None and self.lean_streamed is not None and self.transient_grads is not None \
            and self.gpu_grad_layers is not None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
