"""MegaTrainArguments: TrainingArguments plus what the streaming engine needs."""

from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, field, fields

import torch
from transformers import TrainingArguments

from .engine.config import DTYPES, EngineConfig, parse_count, parse_switch
from .errors import MegaTrainError

SUPPORTED_OPTIM = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor")
SAVE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class MegaTrainArguments(TrainingArguments):
    """Every `TrainingArguments` field works as in Trainer, plus these.

    Precision: `compute_dtype="auto"` streams bf16 weights on a GPU (fp32 master weights,
    fp32 gradient accumulation and fp32 Adam states on the host: what `bf16=True` does in
    stock Trainer) and computes in fp32 on a CPU. `bf16=True` forces bf16 compute.
    `fp16` is refused: there is no GradScaler, the fp32 master makes it unnecessary.
    """

    compute_dtype: str = field(
        default="auto",
        metadata={"help": "Dtype of the weights streamed to the compute device: auto | bfloat16 | float32. "
                  "auto = bfloat16 on a GPU (or when --bf16 is set), float32 on the CPU."},
    )
    data_path: str | None = field(
        default=None,
        metadata={"help": "Training data when no train_dataset is passed: a .txt/.jsonl/.json/.parquet file, "
                  "a folder of them, or a dataset name already in the local HF cache."},
    )
    eval_data_path: str | None = field(default=None, metadata={"help": "Evaluation data, same forms as data_path."})
    text_field: str = field(default="text", metadata={"help": "Column that holds the raw text in data_path."})
    max_seq_length: int = field(default=1024, metadata={"help": "Tokens per training row (packed or truncated)."})
    packing: bool = field(
        default=True,
        metadata={"help": "Pack short documents into full rows (position ids restart at every document)."},
    )
    # Annotated as a string for the command line (inline JSON or a JSON file); Python callers may
    # also give a peft config or a dict of its fields.
    peft_config: str | None = field(
        default=None,
        metadata={"help": "Train PEFT adapters instead of all weights: inline JSON such as '{\"r\": 8}' (LoraConfig "
                  "fields; another method's with its peft_type, e.g. '{\"peft_type\": \"IA3\"}'), a JSON file, a "
                  "dict or a peft config. The frozen base streams as compute weights only (~2 bytes/param of "
                  "host RAM)."},
    )
    loss_chunk_tokens: int | None = field(
        default=None,
        metadata={"help": "Rows of [tokens, vocab] logits computed at once by the chunked loss (auto when unset)."},
    )
    mlp_tile_tokens: int | None = field(
        default=None,
        metadata={"help": "Run each layer's MLP on sequence tiles of this many tokens, bounding its memory by the "
                  "tile (exact). Unset: tiles of 16384 tokens once a micro-batch holds more than 32768 tokens."},
    )
    gpu_resident_layers: str = field(
        default="auto",
        metadata={"help": "auto | N | 0. Keep the embedding, the head and the first N decoder layers entirely on "
                  "the GPU (weights, fp32 master, gradients, Adam states; stepped there by the GPU); stream the "
                  "rest. auto: as many as the memory plan allows. 0: stream everything."},
    )
    offload_activations: str = field(
        default="auto",
        metadata={"help": "auto | N | 0. Keep the saved inputs of the first N decoder layers in pinned host memory "
                  "between forward and backward (long context). auto: only what does not fit on the GPU."},
    )
    lean_resident: str = field(
        default="auto",
        metadata={"help": "auto | true | false. Resident decoder layers keep no bf16 copy of their weights: the GPU "
                  "casts the fp32 master for each use (the same rounding), so a resident parameter costs 16 bytes "
                  "of GPU memory instead of 18. auto: when that keeps more layers on the GPU."},
    )
    lean_streamed: str = field(
        default="auto",
        metadata={"help": "auto | true | false. Streamed decoder layers keep no bf16 copy in host RAM: their fp32 "
                  "master crosses PCIe and the GPU casts it (the same rounding), so a streamed parameter costs 16 "
                  "bytes of host RAM instead of 18, for twice the PCIe bytes of its weights. auto: when the host "
                  "RAM does not suffice without it and does with it. Not with data parallel."},
    )
    transient_grads: str = field(
        default="auto",
        metadata={"help": "auto | true | false. Decoder layers keep no persistent fp32 gradient: a streamed one's "
                  "lands in one of a few shared host buffers, a resident one's in one shared GPU buffer, and each "
                  "is stepped as soon as it is final (4 bytes per parameter less; the same numbers). With "
                  "clipping (max_grad_norm > 0) each step first measures the global norm with a forward and "
                  "backward of its own (exact, one more pass per step). With gradient accumulation it needs the "
                  "micro-batches through each layer together. Not with data parallel. auto: on a GPU without "
                  "clipping, when the host RAM does not suffice without it."},
    )
    gpu_grad_layers: str = field(
        default="auto",
        metadata={"help": "auto | N. The last N streamed decoder layers keep their fp32 gradient on the GPU instead "
                  "of in host RAM (4 bytes per parameter moved; each crosses PCIe once, clipped, during its host "
                  "step; the same numbers). auto: when the host RAM is short and the GPU has room beside its "
                  "resident layers. Not with transient_grads or data parallel."},
    )
    layer_major_accumulation: str = field(
        default="auto",
        metadata={"help": "auto | true | false. With gradient accumulation, run a step's micro-batches through each "
                  "layer together: a streamed layer crosses PCIe once per step, not once per micro-batch, and its "
                  "gradient is summed on the GPU and leaves once (the same numbers). Every micro-batch's layer "
                  "inputs are kept at once. auto: when some layer streams, in one process."},
    )
    prefetch_depth: int = field(
        default=2, metadata={"help": "GPU weight slots in the ring that streams decoder layers (>= 2)."}
    )
    save_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of saved model weights: auto (the model's own config dtype) | float32 | bfloat16."},
    )
    checkpoint_hashes: bool = field(
        default=True,
        metadata={"help": "Hash every checkpoint file into its manifest (checked on resume); sizes are always checked."},
    )
    log_pipeline: bool = field(
        default=False,
        metadata={"help": "Add to every training log: real tokens/s, model TFLOPS (MFU with gpu_peak_tflops), the "
                  "step-time model's prediction and, on a GPU, the busy fraction of H2D, compute, D2H and the host "
                  "optimizer (a GPU sync per log). Off by default, so logs carry stock Trainer's keys."},
    )
    gpu_peak_tflops: float | None = field(
        default=None, metadata={"help": "The GPU's bf16 matmul peak; when set, logs include MFU."}
    )
    memory_check: bool = field(
        default=True,
        metadata={"help": "Refuse, before loading, a run whose estimated host RAM or GPU memory exceeds the machine."},
    )
    max_gpu_memory: float | None = field(
        default=None,
        metadata={"help": "GiB of GPU memory the planner counts as free at most (unset: what the GPU has free at "
                  "start): a cap for a card shared with another job, or to plan (placement, admission) as for a "
                  "smaller one."},
    )
    max_host_memory: float | None = field(
        default=None,
        metadata={"help": "GiB of host RAM the planner counts as available at most (unset: MemAvailable at start; "
                  "with several ranks on a host, that host's): a cap for a shared machine, or to plan as for a "
                  "smaller one."},
    )
    host_threads: int = field(
        default=0,
        metadata={"help": "Threads of the host AdamW: 0 steps large tiles with OpenMP inside each op (faster with "
                  "clipping); N > 0 spreads one-core spans over N threads (faster without clipping)."},
    )
    background_host_jobs: bool | None = field(
        default=None,
        metadata={"help": "Run the host AdamW and gradient accumulation on background threads, overlapped with "
                  "compute. Default: on a GPU yes, on the CPU no (there it gives the same numbers, for testing)."},
    )
    hub_dir: str | None = field(
        default=None,
        metadata={"help": "Local hub directory (HF cache layout) that push_to_hub publishes into; "
                  "defaults to $HF_HUB_CACHE when set."},
    )

    def __post_init__(self):
        if self.deepspeed:  # refused before TrainingArguments builds DeepSpeed's config, a process-wide setting
            refuse_deepspeed()
        super().__post_init__()
        check_own_fields(self)


def refuse_deepspeed() -> None:
    raise MegaTrainError(
        "a DeepSpeed config was given, but hf_megatrain replaces DeepSpeed's offload with its own engine. "
        "Remove `deepspeed=` from the arguments."
    )


def check_own_fields(args) -> None:
    """Malformed values of this library's own fields, refused when the arguments are built (a parser
    setup shared with stock Trainer never sets them). What the engine cannot honour among Trainer's
    own options is refused later, when a trainer is built (check_arguments): code that only parses
    arguments keeps working."""
    if args.compute_dtype != "auto" and args.compute_dtype not in DTYPES:
        raise MegaTrainError(f"compute_dtype={args.compute_dtype!r}; choose auto, bfloat16 or float32.")
    if args.save_dtype not in SAVE_DTYPES:
        raise MegaTrainError(f"save_dtype={args.save_dtype!r}; choose {', '.join(SAVE_DTYPES)}.")
    parse_switch(args.layer_major_accumulation, "layer_major_accumulation")
    if args.max_seq_length < 1:
        raise MegaTrainError("max_seq_length must be a positive number of tokens.")
    # The engine's own checks of its knobs, on any machine. Background host jobs left on auto count as on
    # (a GPU's default): transient_grads=true needs them, and a CPU run, where they are off by default, is
    # refused, saying so, once the trainer knows its device.
    engine_config(args, torch.device("cpu"), host_jobs=True)


def check_arguments(args) -> None:
    """Refuse, with a reason and a way out, what the streaming engine cannot honour: called when a
    trainer is built, before any weight is read."""
    check_own_fields(args)
    if args.fp16 or args.fp16_full_eval:
        raise MegaTrainError(
            "fp16=True is not supported: hf_megatrain keeps fp32 master weights and needs no GradScaler. "
            "Use bf16=True (or leave compute_dtype='auto') for 16-bit compute."
        )
    if args.deepspeed:
        refuse_deepspeed()
    if args.fsdp:
        raise MegaTrainError("FSDP is not supported together with hf_megatrain; remove `fsdp=` from the arguments.")
    if args.torch_compile:
        raise MegaTrainError(
            "torch_compile=True is not supported: the engine runs HF's layer code one unit at a time. "
            "Set torch_compile=False."
        )
    if args.use_liger_kernel:
        raise MegaTrainError("use_liger_kernel is not supported; the loss is already chunked.")
    optim = str(getattr(args.optim, "value", args.optim))  # a string before __post_init__, an enum after
    if optim not in SUPPORTED_OPTIM:
        raise MegaTrainError(
            f"optim={optim!r} is not supported: hf_megatrain runs these on the host: {', '.join(SUPPORTED_OPTIM)}."
        )


def megatrain_arguments(args) -> MegaTrainArguments:
    """The trainer's own copy of the user's arguments, checked: it may adjust the copy (pinning,
    the recompute flag) and the user's object never changes. A plain TrainingArguments becomes a
    MegaTrainArguments with this library's fields at their defaults."""
    if args is None:
        return MegaTrainArguments(output_dir="megatrain_output")
    if not isinstance(args, TrainingArguments):
        raise MegaTrainError(f"args must be MegaTrainArguments (or TrainingArguments), not {type(args).__name__}.")
    own = copy.copy(args)
    if not isinstance(args, MegaTrainArguments):
        if type(args) is not TrainingArguments:
            if (type(args).__module__ or "").startswith("trl"):
                raise MegaTrainError(
                    f"args is TRL's {type(args).__name__}: for SFT use hf_megatrain.MegaTrainSFTTrainer (it takes "
                    "SFTConfig), for DPO hf_megatrain.MegaTrainDPOTrainer (DPOConfig), for KTO "
                    "hf_megatrain.MegaTrainKTOTrainer (KTOConfig). TRL's GRPO, RLOO, reward and distillation "
                    "trainers are not supported: their losses need forwards the engine does not run (generations, "
                    "a value head, a teacher)."
                )
            raise MegaTrainError(
                f"args is a {type(args).__name__}: a TrainingArguments subclass of another library, whose fields "
                "hf_megatrain cannot carry over. Pass MegaTrainArguments (every TrainingArguments field works there)."
            )
        own.__class__ = MegaTrainArguments  # it only adds fields, each with a default
        for f in fields(MegaTrainArguments):
            if f.name not in vars(own):
                setattr(own, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)
    check_arguments(own)
    return own


def compute_dtype(args, device: torch.device) -> torch.dtype:
    """auto: bf16 on a GPU or with --bf16, fp32 on the CPU."""
    if args.compute_dtype != "auto":
        return DTYPES[args.compute_dtype]
    return torch.bfloat16 if args.bf16 or device.type == "cuda" else torch.float32


def save_dtype(args) -> torch.dtype | None:
    """The dtype saved model files hold; None: the model's own (config.dtype)."""
    return None if args.save_dtype == "auto" else getattr(torch, args.save_dtype)


def engine_config(args, device: torch.device, host_jobs: bool | None = None) -> EngineConfig:
    """The EngineConfig these arguments ask for on `device`; the placements stay None where they
    say 'auto' (planner.resolve_placement decides them). host_jobs: background_host_jobs where the
    arguments leave it on auto (None: the device's default)."""
    from .planner.estimator import mlp_tile

    return EngineConfig(
        device=device,
        compute_dtype=compute_dtype(args, device),
        loss_chunk_tokens=args.loss_chunk_tokens,
        mlp_tile_tokens=mlp_tile(args.max_seq_length, args.mlp_tile_tokens),
        resident_layers=parse_count(args.gpu_resident_layers, "gpu_resident_layers"),
        offload_activations=parse_count(args.offload_activations, "offload_activations"),
        lean_resident=parse_switch(args.lean_resident, "lean_resident"),
        lean_streamed=parse_switch(args.lean_streamed, "lean_streamed"),
        transient_grads=parse_switch(args.transient_grads, "transient_grads"),
        gpu_grad_layers=parse_count(args.gpu_grad_layers, "gpu_grad_layers"),
        prefetch_depth=args.prefetch_depth,
        host_threads=args.host_threads,
        background_host_jobs=host_jobs if args.background_host_jobs is None else args.background_host_jobs,
    )
