"""The engine without Trainer: one call, then your own loop.

    engine, optimizer = hf_megatrain.prepare(model, lr=1e-5, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    for batch in loader:
        loss = engine.forward_backward(batch)        # accumulates gradients (scale= for GA)
        optimizer.clip_grad_norm_(1.0)               # optional, exact
        optimizer.step(); scheduler.step(); engine.zero_grad()
    engine.save_pretrained("out", tokenizer=tokenizer)   # from_pretrained("out") loads it
"""

from __future__ import annotations

import torch
from transformers import Trainer

from .checkpoint.loading import load_model_and_tokenizer
from .checkpoint.peft_export import model_writer
from .checkpoint.stream_load import engine_from_checkpoint
from .engine.config import EngineConfig
from .engine.optimizer import HostAdamW
from .engine.schedule import StreamingEngine


def prepare(model, *, device=None, compute_dtype=None, lr: float = 1e-5, betas=(0.9, 0.999), eps: float = 1e-8,
            weight_decay: float = 0.0, **engine_options):
    """(StreamingEngine, HostAdamW) for a hub id, a folder or a loaded CPU model.

    device defaults to the first GPU when there is one; compute_dtype to bf16 on a GPU and
    fp32 on the CPU. Weight decay follows Trainer's grouping (no decay on norms and biases).
    engine_options: the other EngineConfig fields (resident_layers=, mlp_tile_tokens=, ...).
    """
    model, _, weights_from = load_model_and_tokenizer(model)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = EngineConfig(device=device, compute_dtype=compute_dtype, **engine_options)
    decay = Trainer.get_decay_parameter_names(None, model)
    if weights_from is None:
        engine = StreamingEngine(model, config, decay_names=decay)
    else:
        engine = engine_from_checkpoint(model, weights_from, config=config, decay_names=decay)
    engine.writer = model_writer(model)  # engine.save_pretrained(dir, tokenizer=...) writes loadable files
    optimizer = HostAdamW(engine, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return engine.train(), optimizer
