"""PEFT's prompt learning on the engine: prompt tuning, p-tuning and prefix tuning.

`PeftModelForCausalLM.forward` puts `num_virtual_tokens` learned vectors (its prompt encoder's output)
before each row's token embeddings, a row of ones before the attention mask and -100 before the labels,
and drops the batch's position ids (the model then counts 0 .. L+T-1). The engine does the same in two
places: `with_virtual_tokens` lengthens each batch by placeholder ids before anything reads it (so masks,
positions, documents and the loss see the row the model sees), and the embedding unit's template runs the
prompt encoder and puts its output where those ids stand (`schedule._Embed`). The prompt encoder's
parameters are trainable slots of the embedding unit: the host store keeps their fp32 masters and the
optimizer steps them with the rest, and the PeftModel's own parameter objects view them, so its
`save_pretrained` writes what trained.

Prefix tuning enters each layer's attention instead: `PeftModel.get_prompt` makes, from the same kind of
encoder, `num_virtual_tokens` keys and values per layer, hands them to the model as a key/value cache, puts
ones before the attention mask and adds `num_virtual_tokens` to the positions; the rows and labels keep their
length. The engine does the same: `with_prefix` lengthens the mask and moves the positions, the embedding unit
runs the encoder beside the token embeddings (`schedule._Embed`, its output viewed as `prefix_keys_values`
does), and each layer gets its own keys and values as a cache of the class stock uses (`PrefixCaches`), whose
`update` puts them before the layer's own, whatever layer index the template carries. In the backward every
layer's recompute hands back the gradients of its keys and values (per_layer.LayerSides), which seed the
embedding unit's recompute, as the per-layer inputs of Gemma 3n seed theirs. The masks are built with a cache
of the same length, so they are the ones stock builds for a cache (kv length n + T).

Multitask prompt tuning (task ids) and the other prompt methods enter elsewhere and are refused
(`check_prompt_learning`), as are prefix tuning on families whose layers do not take a plain key/value cache
(`check_prefix_family`).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from contextlib import contextmanager
from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..constants import IGNORE_INDEX
from ..errors import MegaTrainError
from ..patcher.adapters import peft_type as _peft_type

_TRAINED = ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING")
# the decoder layer's keyword for the cache, by transformers version (5.25 renamed past_key_values to cache)
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def check_prompt_learning(config) -> None:
    """Refuse, in one line, a prompt-learning method the engine does not train (multitask prompt tuning and the
    rest); prefix tuning's families are checked when the engine is built (check_prefix_family)."""
    if getattr(config, "is_prompt_learning", False) and _peft_type(config) not in _TRAINED:
        raise MegaTrainError(f"peft_config is {_peft_type(config)}, which hf_megatrain does not train: its virtual "
                             "tokens need task ids or a pass of their own, which the engine does not run. Prompt "
                             "tuning (PromptTuningConfig), p-tuning (PromptEncoderConfig), prefix tuning "
                             "(PrefixTuningConfig) and LoRA work.")


class Prefix(NamedTuple):
    """Prefix tuning's shape: what PeftModel.get_prompt views its encoder's output as."""

    tokens: int  # num_virtual_tokens
    layers: int  # num_layers
    heads: int  # num_attention_heads (the key/value heads: PEFT sets them so for grouped-query attention)
    head_dim: int  # token_dim // num_attention_heads


class Prompt(NamedTuple):
    """A prompt-learning PeftModel's active prompt encoder."""

    module: torch.nn.Module
    path: str  # in the PeftModel: prompt_encoder.<adapter>
    tokens: int  # num_virtual_tokens
    prefix: Prefix | None = None  # prefix tuning: the keys and values its output becomes


def prompt_encoder(peft_model) -> Prompt | None:
    """The active adapter's prompt encoder of a prompt-learning PeftModel; None for any other model."""
    if peft_model is None:
        return None
    config = peft_model.active_peft_config
    if not getattr(config, "is_prompt_learning", False):
        return None
    check_prompt_learning(config)
    if getattr(config, "num_transformer_submodules", 1) not in (None, 1):
        raise MegaTrainError("the prompt-learning config has num_transformer_submodules > 1 (an encoder-decoder's); "
                             "a causal LM has one.")
    adapter = peft_model.active_adapter
    n = int(config.num_virtual_tokens)
    prefix = None
    if _peft_type(config) == "PREFIX_TUNING":
        prefix = Prefix(n, int(config.num_layers), int(config.num_attention_heads),
                        int(config.token_dim) // int(config.num_attention_heads))
    return Prompt(peft_model.prompt_encoder[adapter], f"prompt_encoder.{adapter}", n, prefix)


_ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention"}
# families whose prefix cache PEFT makes from the config (each layer's cache of its kind: Gemma 2 and 3's sliding
# layers keep the prefix's last window - 1 tokens), and those it makes otherwise still (Gemma 4: keys and values
# of two widths, cut per layer; and the layers that share keys and values)
_CACHE_FROM_CONFIG = ("gemma2", "gemma3_text")
_PREFIX_ELSEWHERE = ("gemma4",)


class PrefixCaches:
    """The caches prefix tuning hands a batch's masks and each decoder layer, of the classes PEFT makes: a
    DynamicCache of plain layers, or (`from_config`: Gemma 2 and 3) one made from the model config, whose
    sliding layers keep the prefix's last window - 1 tokens and size the sliding masks by it. `kwarg`: the
    decoder layers' keyword for the cache."""

    def __init__(self, kwarg: str, config, from_config: bool):
        self.kwarg = kwarg
        self.config = config
        self.from_config = from_config
        # one empty layer cache of each layer's kind, copied for each call (not a whole cache made per layer call)
        self._empty = DynamicCache(config=config).layers if from_config else None

    def for_masks(self, prefix: torch.Tensor) -> DynamicCache:
        """A cache as long as the prefix in every layer: what the model forward builds its masks with."""
        cache = DynamicCache(config=self.config) if self.from_config else DynamicCache()
        if not self.from_config:  # one plain layer: the masks read index 0
            cache.layers = [DynamicLayer()]
        for i, layer in enumerate(cache.layers):
            layer.update(prefix[2 * i], prefix[2 * i + 1])
        return cache

    def for_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> dict:
        """The keyword argument for decoder layer `layer`: a cache whose update puts `keys` and `values` before the
        layer's own, at every index, because a template's attention carries the index of the layer it was copied
        from."""
        one = copy.copy(self._empty[layer]) if self.from_config else DynamicLayer()
        one.update(keys, values)
        cache = DynamicCache()
        cache.layers = [one] * int(self.config.num_hidden_layers)
        return {self.kwarg: cache}


def _projection_widths(layers) -> set[int]:
    """The output widths of the layers' own key and value projections (k_proj, v_proj), where they have them."""
    return {m.out_features for layer in layers for name, m in layer.named_modules()
            if name.rpartition(".")[2] in ("k_proj", "v_proj") and isinstance(m, torch.nn.Linear)}


def check_prefix_family(spec, config, layers, prefix: Prefix) -> PrefixCaches:
    """The caches for prefix tuning on this family, where it is what the engine runs; otherwise a refusal in one
    line. Stock hands every layer the cache; the engine hands it to layers that all attend with keys and values
    of their own, of the prefix's shape (no hybrid stack, no shared or compressed keys), through a keyword their
    forward takes."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_PREFIX_TUNING_POSTPROCESS_MAPPING as post

    model_type = spec.model_type
    why = None
    if model_type.startswith(_PREFIX_ELSEWHERE) or model_type in post:
        why = "PEFT builds its prefix cache another way for this family"
    elif spec.carried or not set(spec.kinds(config)) <= _ATTENTION_KINDS:
        why = "not all its layers are attention layers"
    elif spec.shared_kv or spec.per_layer or spec.altup:
        why = "some of its layers read keys and values or inputs that other units make"
    elif prefix.layers != config.num_hidden_layers:
        why = f"the prefix has {prefix.layers} layers and the model {config.num_hidden_layers}"
    else:
        heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) \
            or config.num_attention_heads
        if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
            heads = 1  # GPT-BigCode's and Falcon's one key/value head
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if (prefix.heads, prefix.head_dim) != (heads, dim) or getattr(config, "kv_lora_rank", None) \
                or getattr(config, "v_head_dim", dim) != dim \
                or not _projection_widths(layers) <= {prefix.heads * prefix.head_dim}:
            why = (f"its keys and values are not {prefix.heads} heads of {prefix.head_dim} in every layer (the "
                   "prefix's num_attention_heads and token_dim)")
    params = inspect.signature(type(layers[0]).forward).parameters
    name = next((k for k in _CACHE_KWARGS if k in params), None)
    if why is None and name is None:
        why = "its decoder layers take no cache"
    if why:
        raise MegaTrainError(f"prefix tuning on {model_type}: {why}; the engine does not train it there. Prompt "
                             "tuning (PromptTuningConfig), p-tuning (PromptEncoderConfig) and LoRA work for this family.")
    return PrefixCaches(name, config, model_type in _CACHE_FROM_CONFIG)


def check_prefix_early(model, peft_config=None) -> None:
    """check_prefix_family before any data is read (SFTTrainer tokenizes in its constructor, before the engine is
    built): for a PeftModel under prefix tuning, or a base model (a meta skeleton) that `peft_config` will wrap,
    wrapped here as PEFT wraps it on a meta copy (PEFT fills the prefix's shape from the model's config)."""
    from peft import get_peft_model

    from ..patcher.adapters import is_peft_model
    from ..patcher.specs import spec_for

    if not is_peft_model(model):
        if peft_config is None or _peft_type(peft_config) != "PREFIX_TUNING":
            return
        with torch.device("meta"):
            model = get_peft_model(copy.deepcopy(model).to("meta"), copy.deepcopy(peft_config))
    prompt = prompt_encoder(model)
    if prompt is None or prompt.prefix is None:
        return
    base = model.get_base_model()
    spec = spec_for(base.config)
    check_prefix_family(spec, base.config, base.get_submodule(spec.layers), prompt.prefix)


def prefix_keys_values(out: torch.Tensor, prefix: Prefix, dtype: torch.dtype) -> torch.Tensor:
    """The prefix encoder's output [rows, n, layers * 2 * token_dim] as PeftModel.get_prompt views it, cast to
    the model's dtype: [layers * 2, rows, heads, n, head_dim], layer i's keys at 2i and values at 2i + 1."""
    rows = out.shape[0]
    out = out.to(dtype).view(rows, prefix.tokens, prefix.layers * 2, prefix.heads, prefix.head_dim)
    return out.permute([2, 0, 3, 1, 4])


@contextmanager
def attached(base, module, path: str):
    """`module` registered in the base model at `path` (prompt_encoder.<adapter>, its path in the PeftModel) while
    the engine is built (its units, store and templates read the base model, and so name its parameters as the
    PeftModel does), and taken off again."""
    holder, _, name = path.rpartition(".")
    if holder in base._modules:
        raise MegaTrainError(f"the base model already has a submodule {holder!r}, where the engine puts the prompt "
                             "encoder while it is built.")
    base.add_module(holder, torch.nn.ModuleDict({name: module}))
    try:
        yield
    finally:
        del base._modules[holder]


def with_virtual_tokens(batch: dict, n: int) -> dict:
    """The batch as the base model sees it under prompt learning: n placeholder ids (0: the embedding unit puts
    the prompt there) before each row, ones before the mask, IGNORE_INDEX before the labels, no position ids
    (PeftModel drops them, with its warning) and no token type ids (likewise)."""
    if not n:
        return batch
    ids = batch.get("input_ids")
    if ids is None:
        return batch
    rows = ids.shape[0]
    out = dict(batch)
    out["input_ids"] = torch.cat([ids.new_zeros(rows, n), ids], dim=1)
    mask = batch.get("attention_mask")
    if mask is not None:
        out["attention_mask"] = torch.cat([mask.new_ones(rows, n), mask], dim=1)
    labels = batch.get("labels")
    if labels is not None:
        out["labels"] = torch.cat([labels.new_full((rows, n), IGNORE_INDEX), labels], dim=1)
    if batch.get("position_ids") is not None:
        warnings.warn("Position ids are not supported for parameter efficient tuning. Ignoring position ids.")
        out["position_ids"] = None
    return _without_token_type_ids(out)


def with_prefix(batch: dict, n: int, count_from_mask: bool = False) -> dict:
    """The batch as the base model sees it under prefix tuning (PeftModel.forward): n ones before the attention
    mask, the positions moved by n (the model counts them from the cache's length when none are given; with
    `count_from_mask`, OPT's, it counts them from the lengthened mask, which the engine does after this), no token
    type ids (with PEFT's warning); ids and labels as they are."""
    ids = batch.get("input_ids")
    if not n or ids is None:
        return batch
    rows, seq = ids.shape
    out = dict(batch)
    mask = batch.get("attention_mask")
    if mask is not None:
        out["attention_mask"] = torch.cat([mask.new_ones(rows, n), mask], dim=1)
    pos = batch.get("position_ids")
    if pos is not None:
        out["position_ids"] = pos + n
    elif not count_from_mask:
        out["position_ids"] = torch.arange(n, n + seq, device=ids.device).unsqueeze(0)
    return _without_token_type_ids(out)


def _without_token_type_ids(batch: dict) -> dict:
    """PEFT's prompt learning drops token type ids, with its warning."""
    if batch.get("token_type_ids") is not None:
        warnings.warn("Token type ids are not supported for parameter efficient tuning. Ignoring token type ids")
        batch["token_type_ids"] = None
    return batch
