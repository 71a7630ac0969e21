"""The engine without Trainer: one call, then your own loop.

    engine, optimizer = hf_megatrain.prepare(model, lr=1e-5, weight_decay=0.1, batch=8, seq=2048, grad_accum=4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    for batches in steps:                            # each a list of grad_accum micro-batches
        out = hf_megatrain.train_step(engine, optimizer, batches, max_grad_norm=1.0)  # out.loss, out.grad_norm
        scheduler.step(); engine.zero_grad()
    engine.save_pretrained("out", tokenizer=tokenizer)   # from_pretrained("out") loads it

train_step runs a step as the trainer does (engine/step.py: the host AdamW during the backward where
it can be, the plan's micro-batches together or one at a time). The parts stay yours to call:
engine.forward_backward(batch, scale=...) accumulates, optimizer.clip_grad_norm_(1.0) and
optimizer.step() step, exactly.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import Trainer

from .checkpoint.loading import load_model_and_tokenizer
from .checkpoint.peft_export import model_writer
from .checkpoint.stream_load import engine_from_checkpoint
from .engine.config import EngineConfig, parse_count
from .engine.optimizer import HostAdamW
from .engine.schedule import StreamingEngine


AUTO = dict(resident_layers=None, offload_activations=None, lean_resident=None, lean_streamed=None,
            transient_grads=None, gpu_grad_layers=None)  # what the planner settles unless given


def prepare(model, *, device=None, compute_dtype=None, lr: float = 1e-5, betas=(0.9, 0.999), eps: float = 1e-8,
            weight_decay: float = 0.0, batch: int = 1, seq: int = 1024, grad_accum: int = 1,
            max_grad_norm: float = 1.0, layer_major_accumulation: bool | None = False, memory_check: bool = True,
            max_gpu_memory: float | None = None, max_host_memory: float | None = None,
            gpu_resident_layers: int | str | None = None, **engine_options):
    """(StreamingEngine, HostAdamW) for a hub id, a folder or a loaded CPU model.

    device defaults to the first GPU when there is one; compute_dtype to bf16 on a GPU and
    fp32 on the CPU. Weight decay follows Trainer's grouping (no decay on norms and biases).
    gpu_resident_layers: the decoder layers kept and stepped on the GPU, a number or "auto" (default),
    as MegaTrainArguments.gpu_resident_layers and `--gpu_resident_layers` spell it (EngineConfig's own
    field, `resident_layers=`, is taken too).
    engine_options: the other EngineConfig fields (offload_activations=, mlp_tile_tokens=, ...); what they
    leave out of the placement and the host memory modes is planned as the trainer plans it
    (planner.plan_run, for this machine; off on the CPU).

    The plan is for the step the loop runs: micro-batches of `batch` rows of `seq` tokens, `grad_accum`
    of them per step, clipped at `max_grad_norm` (0: none), one at a time (layer_major_accumulation=
    False; True, or None for auto: engine.run_plan.per_pass of them through each layer at once, with
    StreamingEngine.forward_backward_many). A plan that does not fit this machine (free GPU memory and
    available host RAM, each capped at max_gpu_memory / max_host_memory GiB where given) is refused
    before any weight is read, unless memory_check=False. The plan is `engine.run_plan`.
    """
    from .errors import MegaTrainError
    from .planner.estimator import mlp_tile
    from .patcher.adapters import base_model, decay_names
    from .planner import LONG_CONTEXT_TOKENS, Machine, Request, plan_run

    if gpu_resident_layers is not None:
        if "resident_layers" in engine_options:
            raise MegaTrainError("prepare() got gpu_resident_layers= and resident_layers=, two names of one "
                                 "setting: give gpu_resident_layers= alone.")
        engine_options["resident_layers"] = parse_count(gpu_resident_layers, "gpu_resident_layers")
    model, _, weights_from = load_model_and_tokenizer(model)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    asked = EngineConfig(**{**AUTO, "mlp_tile_tokens": mlp_tile(seq, engine_options.get("mlp_tile_tokens")),
                            **engine_options, "device": device, "compute_dtype": compute_dtype})
    request = Request(asked, batch, seq, grad_accum=grad_accum, layer_major=layer_major_accumulation,
                      max_grad_norm=max_grad_norm or 0.0, peft_config=getattr(model, "peft_config", None),
                      admit=memory_check,
                      suggest_row=batch * seq >= LONG_CONTEXT_TOKENS,
                      mlp_tile_tokens=engine_options.get("mlp_tile_tokens"))
    machine = Machine.measured(device, max_gpu_memory=max_gpu_memory, max_host_memory=max_host_memory)
    run = plan_run(base_model(model).config, request, machine)
    if run.refusal is not None:
        raise MegaTrainError(run.refusal)  # before a single weight is read or a large allocation made
    config = run.engine
    decay = decay_names(partial(Trainer.get_decay_parameter_names, None), model)
    if weights_from is None:
        engine = StreamingEngine(model, config, decay_names=decay)
    else:
        engine = engine_from_checkpoint(model, weights_from, config=config, decay_names=decay)
    engine.writer = model_writer(model)  # engine.save_pretrained(dir, tokenizer=...) writes loadable files
    engine.run_plan = run  # the placement, the step split and the memory plan it was built with
    optimizer = HostAdamW(engine, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return engine.train(), optimizer
