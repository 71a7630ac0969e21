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
import math
import time

import torch

from ..constants import IGNORE_INDEX
from ..errors import MegaTrainError

logger = logging.getLogger(__name__)
_VERIFIED: set[str] = set()
_RUNNING: set[str] = set()
# model type -> the parameters a stock training step leaves without a gradient (DeepSeek-V3.2's indexer, which
# its forward runs detached), by their names inside a decoder layer (or whole, outside the layers): the engine's
# gradient for them is exactly zero, and it keeps them out of weight decay, so that no optimizer moves them,
# as torch's optimizers skip a parameter whose .grad is None.
_STOCK_NO_GRAD: dict[str, frozenset[str]] = {}


def stock_leaves_without_grad(model_type: str, name: str, layers: str) -> bool:
    """Whether the verified self-check saw stock leave parameter `name` (a full name) without a gradient."""
    return model_type in _STOCK_NO_GRAD and _in_layer(name, layers) in _STOCK_NO_GRAD[model_type]


def _in_layer(name: str, layers: str) -> str:
    """A parameter's name inside its decoder layer (`<layers>.<i>.` dropped), or whole outside the layers."""
    prefix = layers + "."
    return name[len(prefix):].partition(".")[2] if name.startswith(prefix) else name

# Widths of the small copy; only the attributes a config sets are changed. The head geometry (head_dim, the
# ratio of query to key/value heads, MLA's rotary and plain parts of a head) stays the config's own: the
# number of heads shrinks, and the width with it, so the copy computes what the family computes.
_SMALL = dict(intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
              expert_intermediate_size=64, expert_ffn_hidden_size=64, num_local_experts=4, num_experts=4,
              vocab_size=128,
              sliding_window=8, attention_chunk_size=8,
              zero_expert_num=4)  # LongCat-Flash's zero-compute experts: few, so that routed ones are picked
_RANKS = ("q_lora_rank", "kv_lora_rank")  # MLA's compressed widths: at most 64
_HEADS = 4  # query heads of the copy, or one group of query heads per key/value head when groups are larger
_DEPTH = 2


def _int(config, name):
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# State-space mixers (Mamba, Mamba-2 and the hybrids built on them): the state and the scan's chunk shrink, and the
# number of SSM heads with the width (their size stays: heads x head size is the mixer's width, tied to the model's).
_SSM_STATE = ("mamba_d_state", "state_size", "ssm_state_size")
_SSM_CHUNK = ("mamba_chunk_size", "chunk_size")
_SSM_HEADS = (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"))
_SSM_WIDTH = 256  # the width of a stack without attention heads (Mamba): nothing else shrinks it


def _shrink_ssm(small, hidden: int | None) -> None:
    heads = list(_SSM_HEADS)
    if _int(small, "num_attention_heads") is None and _int(small, "expand") is not None:
        heads.append(("num_heads", "head_dim"))  # Mamba-2's SSM heads
        if hidden and hidden > _SSM_WIDTH:
            small.hidden_size = _SSM_WIDTH
    new = _int(small, "hidden_size")
    for key, dim in heads:
        n = _int(small, key)
        if n is None or not hidden or not new:
            continue
        n = max(1, n * new // hidden)
        setattr(small, key, n)
        for groups in ("mamba_n_groups", "n_groups"):
            if _int(small, groups):
                setattr(small, groups, math.gcd(getattr(small, groups), n))
        if _int(small, "mamba_d_ssm") and _int(small, dim):
            small.mamba_d_ssm = n * getattr(small, dim)  # Falcon-H1's mixer width
    for key in _SSM_STATE:
        if _int(small, key):
            setattr(small, key, min(getattr(small, key), 16))
    for key in _SSM_CHUNK:
        if _int(small, key):
            setattr(small, key, min(getattr(small, key), 16))


def _settable(config, name: str) -> bool:
    prop = getattr(type(config), name, None)
    return not isinstance(prop, property) or prop.fset is not None


def small_copy(config, depth_attr: str = "num_hidden_layers"):
    """`config` with 2 layers (or one per layer kind, up to 4) and small widths, its head geometry kept.
    depth_attr: the config attribute the family builds its list of decoder layers from (ArchSpec.depth)."""
    small = copy.deepcopy(config)
    heads, kv, hidden = _int(small, "num_attention_heads"), _int(small, "num_key_value_heads"), _int(small, "hidden_size")
    if heads and hidden:
        group = heads // kv if kv and heads % kv == 0 else 1
        new_kv = max(1, min(kv or heads, 2, _HEADS // group or 1))
        new_heads = new_kv * group if kv else min(heads, _HEADS)
        if new_heads < heads:
            if _int(small, "head_dim") is None and getattr(small, "head_dim", None) is None:
                small.head_dim = hidden // heads  # the width shrinks below; the size of a head stays
            small.hidden_size = hidden * new_heads // heads if hidden * new_heads % heads == 0 \
                else new_heads * (hidden // heads)
            small.num_attention_heads = new_heads
            if kv:
                small.num_key_value_heads = new_kv
    _shrink_ssm(small, hidden)
    for key, value in _SMALL.items():
        if _int(small, key) is not None:
            setattr(small, key, min(getattr(small, key), value) if key == "vocab_size" else value)
    for key in _RANKS:
        if _int(small, key) is not None:
            setattr(small, key, min(getattr(small, key), 64))
    if _int(small, "n_routed_experts"):  # DeepSeek-style grouped routing: 8 experts in 2 groups, 1 group picked
        small.n_routed_experts = 8
        if _int(small, "n_group"):
            small.n_group, small.topk_group = 2, 1
    if _int(small, "num_experts_per_tok"):
        small.num_experts_per_tok = min(small.num_experts_per_tok, 2)
    if _int(small, "first_k_dense_replace"):
        small.first_k_dense_replace = 1  # a dense layer, then a sparse one
    depth = _DEPTH
    types = list(getattr(small, "layer_types", None) or ())
    picked = types[:_DEPTH]
    for kind in dict.fromkeys(types):  # every kind of layer the family has, once at least
        if kind not in picked and len(picked) < 4:
            picked.append(kind)
    if types and _settable(small, "layer_types"):
        try:
            small.layer_types = picked
            depth = len(picked)
            types = []
        except AttributeError:  # Bamba's sets a list it derives from, which has no setter
            pass
    if types:
        # Kinds derived from the depth (Jamba's attention every 8th layer from the 4th, Bamba's attention indices):
        # the first layers up to one of every kind, as many as that takes (the width is small).
        types = list(small.layer_types)
        depth = max(_DEPTH, max(types.index(kind) for kind in set(types)) + 1)
    small.num_hidden_layers = depth
    if depth_attr != "num_hidden_layers":  # LongCat-Flash: num_layers layers of two sublayers each (after the above:
        setattr(small, depth_attr, depth)  # on 5.25 num_hidden_layers is a property that sets num_layers to half)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(small, key, None), int) and getattr(small, key) >= small.vocab_size:
            setattr(small, key, 0)
    return small


def _differences(small, key: str) -> tuple[list[str], set[str]]:
    """Stock autograd and the engine on the small copy: what differs (the loss, then each gradient), on a batch
    without padding, then on one with a right-padded row (what a layer does with padding: an attention mask, a
    recurrent layer's 2D one); MegaTrainError where either side cannot run. With them, the parameters stock's step
    on the unpadded batch leaves without a gradient."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, small.vocab_size, (2, 24), generator=g)
    plain = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    mask = torch.ones_like(ids)
    mask[1, -6:] = 0
    padded = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX), "attention_mask": mask}
    differs, without_grad = _compare(small, key, plain)
    if not differs:
        differs = [f"{d} (with a padded row)" for d in _compare(small, key, padded)[0]]
    return differs, without_grad


def _compare(small, key: str, batch: dict) -> tuple[list[str], set[str]]:
    from transformers import AutoModelForCausalLM

    from .schedule import StreamingEngine

    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(small), dtype=torch.float32).train()
        ref = copy.deepcopy(model)
        torch.manual_seed(1)
        out = ref(**batch)
        out.loss.backward()
    except Exception as e:
        raise MegaTrainError(f"model type {key!r} is outside the registry, and stock transformers itself fails a "
                             f"training step on a small copy of this config ({type(e).__name__}: {_line(e)}); it is "
                             "not trained.") from e
    try:
        engine = StreamingEngine(model, compute_dtype=torch.float32).train()
        torch.manual_seed(1)
        loss = engine.forward_backward(batch)
        grads = dict(engine.named_grads())
    except MegaTrainError:
        raise
    except Exception as e:
        raise MegaTrainError(f"model type {key!r} is outside the registry and its self-check could not run "
                             f"({type(e).__name__}: {_line(e)}); it is not trained.") from e
    stock_loss = float(out.loss.detach())
    differs = [] if abs(float(loss) - stock_loss) <= 1e-5 * max(1.0, abs(stock_loss)) else ["the loss"]
    differs += [f"the gradient of {n}" for n, p in ref.named_parameters() if p.requires_grad
                and not (torch.allclose(grads[n], p.grad, atol=1e-6, rtol=1e-5) if p.grad is not None
                        else torch.count_nonzero(grads[n]) == 0)]  # stock's None: the engine's must be zero
    return differs, {n for n, p in ref.named_parameters() if p.requires_grad and p.grad is None}


def _line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def verify(spec, config) -> None:
    """Refuse a generic spec whose engine run differs from stock on a small copy of `config`."""
    key = spec.model_type
    if key in _VERIFIED or key in _RUNNING:  # the check's own engine is built under the same spec
        return
    _RUNNING.add(key)
    start = time.perf_counter()
    try:
        small = small_copy(config, spec.depth)
        differs, without_grad = _differences(small, key)
        router_loss = bool(differs) and bool(getattr(small, "output_router_logits", False))
        if router_loss:  # equal without the router's loss: that loss is what the engine leaves out
            small.output_router_logits = False
            router_loss = not _differences(small, key)[0]
    finally:
        _RUNNING.discard(key)
    depth = f"{spec.n_layers(small)}-layer"
    if router_loss:
        why = (f"which it cannot take as stock does ({spec.router_unmatched})" if spec.router_unmatched else
               "which it takes from the routers the installed transformers records, and that differs")
        raise MegaTrainError(
            f"model type {key!r} is outside the registry; the engine equals stock on a {depth} random copy except "
            f"for the router's load-balancing loss (output_router_logits=True), {why}, so it is not trained; with "
            "config.output_router_logits = False it is.")
    if differs:
        raise MegaTrainError(
            f"model type {key!r} is outside the registry; the engine tried it through the standard layout, but on "
            f"a {depth} random copy {differs[0]} differs from stock autograd, so it is not trained (the family "
            "does something outside its layers that the engine does not know)."
        )
    if without_grad:
        _STOCK_NO_GRAD[key] = frozenset(_in_layer(n, spec.layers) for n in without_grad)
    _VERIFIED.add(key)
    logger.info("model type %r: not in the registry; the engine equals stock on a %s copy (%.1f s)",
                key, depth, time.perf_counter() - start)
