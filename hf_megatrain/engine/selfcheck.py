"""The self-check of a generic spec: a model type outside the registry, with the standard layout, is
trained only once the engine has shown on a small random copy that it computes what stock computes.

`verify(config)` builds the same config class with 2 layers and small widths on the CPU, runs one
forward/backward through the engine (fp32) and through stock autograd, and compares the loss and
every parameter's gradient (1e-5). Equal: the type is marked verified for this process (a few
seconds, once). Not equal: MegaTrainError naming the first parameter that differs.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from ..errors import MegaTrainError

logger = logging.getLogger(__name__)
_VERIFIED: set[str] = set()
_RUNNING: set[str] = set()

# Widths of the small copy; only the attributes a config has are set.
_SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts=4, vocab_size=128,
              num_hidden_layers=2, sliding_window=8)


def small_copy(config):
    small = copy.deepcopy(config)
    for key, value in _SMALL.items():
        if getattr(small, key, None) is not None:
            setattr(small, key, value)
    if getattr(small, "num_experts_per_tok", None):
        small.num_experts_per_tok = min(small.num_experts_per_tok, 2)
    if getattr(small, "layer_types", None):
        small.layer_types = list(small.layer_types)[:2]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(small, key, None), int) and getattr(small, key) >= small.vocab_size:
            setattr(small, key, 0)
    return small


def verify(spec, config) -> None:
    """Refuse a generic spec whose engine run differs from stock on a small copy of `config`."""
    key = spec.model_type
    if key in _VERIFIED or key in _RUNNING:  # the check's own engine is built under the same spec
        return
    from transformers import AutoModelForCausalLM

    from .schedule import StreamingEngine

    _RUNNING.add(key)
    start = time.perf_counter()
    try:
        small = small_copy(config)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(small, dtype=torch.float32).train()
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, small.vocab_size, (2, 24), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
        torch.manual_seed(1)
        out = ref(**batch)
        out.loss.backward()
        engine = StreamingEngine(model, compute_dtype=torch.float32).train()
        torch.manual_seed(1)
        loss = engine.forward_backward(batch)
        grads = dict(engine.named_grads())
    except MegaTrainError:
        raise
    except Exception as e:
        raise MegaTrainError(f"model type {key!r} is outside the registry and its self-check could not run "
                             f"({type(e).__name__}: {e}); it is not trained.") from e
    finally:
        _RUNNING.discard(key)
    stock_loss = float(out.loss.detach())
    differs = [] if abs(float(loss) - stock_loss) <= 1e-5 * max(1.0, abs(stock_loss)) else ["the loss"]
    differs += [f"the gradient of {n}" for n, p in ref.named_parameters()
                if p.grad is not None and not torch.allclose(grads[n], p.grad, atol=1e-6, rtol=1e-5)]
    if differs:
        raise MegaTrainError(
            f"model type {key!r} is outside the registry; the engine tried it through the standard layout, but on "
            f"a 2-layer random copy {differs[0]} differs from stock autograd, so it is not trained (the family "
            "does something outside its layers that the engine does not know)."
        )
    _VERIFIED.add(key)
    logger.info("model type %r: not in the registry; the engine equals stock on a 2-layer copy (%.1f s)",
                key, time.perf_counter() - start)
