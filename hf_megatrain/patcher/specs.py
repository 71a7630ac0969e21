"""Architecture specs: where each part of a causal LM lives and how its masks are made.

One spec per HF model type. The engine never hard-codes a model family: it asks the spec
for module paths, for the attention kind of each layer (which mask it takes) and for the
extra loss some families add (Mixtral's router load-balancing loss). Supporting a new
decoder family that follows the Llama layout is one `register(ArchSpec(...))` call, which
returns its undo.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import math
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from ..errors import MegaTrainError

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"  # Llama 4: attention within chunks of config.attention_chunk_size tokens

# The mask builders' cache argument: transformers 5.25 renamed `past_key_values` to `cache` (the old name
# warns and goes in 5.40); 5.17 knows only `past_key_values`. Read once from the signature, so neither
# version sees a deprecated keyword.
_CACHE_KW = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _uniform_window(config, index: int) -> str:
    # Llama-layout models with one `sliding_window` for every layer (Mistral, Mixtral).
    return SLIDING if getattr(config, "sliding_window", None) else FULL


def _per_layer_types(config, index: int) -> str:
    # Qwen2/Qwen3 name each layer's attention kind in `config.layer_types`.
    types = getattr(config, "layer_types", None)
    return types[index] if types else FULL


def _always_full(config, index: int) -> str:
    return FULL


def _kind_by_attr(attr: str, config, index: int) -> str:
    # Hybrid stacks: the config list the model forward picks each layer's mask by (layer_types, or Bamba's and
    # Granite-4's layers_block_type).
    if isinstance(attr, tuple):  # ("choice", list, value, kind if equal, kind otherwise): Inkling's attention_type
        _, attr, value, equal, otherwise = attr
        return equal if getattr(config, attr)[index] == value else otherwise
    return getattr(config, attr)[index]


@dataclass(frozen=True)
class ArchSpec:
    """What the engine needs to know about one model family."""

    model_type: str
    layer_kind: Callable  # (config, layer_index) -> FULL | SLIDING
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str = "model.norm"
    lm_head: str = "lm_head"
    rotary: str | None = "model.rotary_emb"  # None: the model has none (Jamba, Mamba, Kimi-Linear)
    # Inside a decoder layer: the per-token block that sequence tiling splits; a hybrid stack's layers without
    # one (a Mamba or conv mixer alone) are not tiled, and None: no layer has one.
    mlp: str | None = "mlp"
    # Module attribute of the router inside a layer whose output[0] is the router logits (a tuple: several
    # routers in one layer, JetMoE's attention and MLP ones), the name of the aux-loss function in the modeling
    # module, the config attribute that holds the number of experts it is given, and the one that holds the
    # coefficient the causal LM adds it with (MoE families only).
    router: str | tuple[str, ...] | None = None
    # Where in the router's outputs its logits are; None: the output its forward returns as `router_logits`,
    # read from the installed transformers (GraniteMoe's router returned them last, later first).
    router_index: int | None = 0
    aux_loss_fn: str | None = None
    experts: str = "num_local_experts"
    aux_coef: str = "router_aux_loss_coef"
    # Whether the decoder layers pass extra keyword arguments on to attention (StableLM's do not):
    # document-by-document attention needs them.
    attention_kwargs: bool = True
    # What the family's model forward does outside its layers, done exactly as it does it:
    # the config attribute the embeddings are multiplied by (Granite's embedding_multiplier),
    # and (config, logits) -> logits after lm_head (soft-capping, scaling).
    embed_multiplier: str | None = None
    logits: Callable | None = None
    # Made for a type outside the registry from its standard layout; verified before training.
    generic: bool = False
    # A generic MoE family whose causal LM adds a router loss the engine could not take from the installed
    # transformers: why, in a few words (the self-check's refusal says it).
    router_unmatched: str | None = None
    # Hybrid stacks (linear attention, Mamba/SSM, short conv beside or instead of attention), read from the base
    # model's forward (_layer_plan): how it makes each kind of mask, ((kind, maker), ...), a maker being the name
    # of a masking_utils function or ("if_none", config attribute, maker if None, maker otherwise); and what it
    # hands each decoder layer, ((keyword, source), ...), a source being ("mask", kind or None: the layer's own),
    # ("rotary", None or (config list, kind): the rotary cos/sin, for every layer or where the list names that
    # kind, else None), ("position_ids",) or ("raw_mask",) (the 2D attention mask as given). None for both: the
    # standard call (the mask of the layer's attention kind, position_ids, position_embeddings).
    mask_makers: tuple | None = None
    layer_inputs: tuple | None = None
    # Multimodal rotary embeddings of a text stack (Qwen3.5's mRoPE): the rotary module takes its positions as
    # [rows, batch, seq], which a text-only forward makes by repeating the 2D position ids this many times.
    rotary_rows: int | None = None
    # Absolute positions, added to the token embeddings before the first layer as the base model adds them: the
    # path of the module that makes them (GPT-2's wpe, OPT's and BioGPT's learned tables with their offset of 2,
    # XGLM's sinusoid), called with the position ids, or with the 2D mask and the ids where its forward takes the
    # mask; or of a buffer the ids index (CTRL's pos_encoding, positions_buffer). They are part of the embedding
    # unit (its `positions`), as OPT's project_in (applied to the token embeddings first) is, and project_out
    # (after the final norm) is part of the head.
    positions: str | None = None
    positions_buffer: bool = False
    positions_learned: bool = False  # the module holds parameters (a learned table), which the unit lays out
    # OPT: without position ids in the batch, its forward counts them from the 2D mask (cumsum(mask) * mask - 1),
    # for the positions and for its layers.
    positions_from_mask: bool = False
    project_in: str | None = None
    project_out: str | None = None
    # A norm the base model applies to the token embeddings before its first layer (BLOOM's
    # word_embeddings_layernorm), part of the embedding unit.
    embed_norm: str | None = None
    # ALiBi (BLOOM): its model forward hands each layer `build_alibi_tensor(mask, heads, dtype)` of its modeling
    # module, made from the 2D mask (all ones without one): (that module's name, the config attribute of heads).
    alibi: tuple | None = None
    # (config) -> what the token embeddings are multiplied by before the positions are added (CTRL's
    # sqrt(n_embd)); and where the base model keeps the embedding dropout it applies to their sum: the name of a
    # Dropout child, or of a float attribute it hands nn.functional.dropout (BioGPT's, XGLM's `dropout`).
    embed_scale: Callable | None = None
    embed_dropout: str | None = None
    # LayerDrop (OPT, BioGPT, XGLM): in training the base model skips a layer where a random number falls below
    # config.layerdrop, which the engine refuses (`layerdrop`: the forward reads it). Up to transformers 5.17 it
    # draws that number before each layer even at layerdrop 0 (later ones only where layerdrop > 0):
    # `layer_draws`, and the engine draws it too, so that the layers' dropout sees the numbers stock's does.
    layerdrop: bool = False
    layer_draws: bool = False
    # The config attribute below which the causal LM cuts its logits (Inkling's unpadded_vocab_size), where the
    # forward does: a config that sets it under the vocabulary is refused (_config_refusal).
    vocab_cut: str | None = None
    # Per-layer embeddings (Gemma 3n, Gemma 4): the base model's modules that give every decoder layer an input of
    # its own, made once from the token ids and the token embeddings by the base model's get_per_layer_inputs and
    # project_per_layer_inputs (a unit of their own, "per_layer", streamed like the embedding); each layer takes its
    # slice [:, :, i] by the keyword `per_layer_input`. A config that builds none of them (Gemma 4's larger
    # models, hidden_size_per_layer_input = 0) trains without that unit.
    per_layer: tuple[str, ...] | None = None
    # KV sharing (Gemma 3n, Gemma 4): the last num_kv_shared_layers layers attend with the keys and values an
    # earlier layer hands them in `shared_kv_states`, a dict the base model passes every layer. The engine passes
    # one per batch, and the gradients those layers send back reach the layer that made them (schedule.py).
    shared_kv: bool = False
    # AltUp (Gemma 3n): the hidden states between layers are [altup_num_inputs, batch, seq, hidden], made from the
    # token embeddings by the base model's altup_projections (part of the embedding unit) and collapsed back by its
    # altup_unembed_projections before the final norm (part of the head).
    altup: tuple[str, str] | None = None  # (path of altup_projections, path of altup_unembed_projections)
    # The config attribute that holds the length of the list of decoder layers, one unit each: LongCat-Flash's
    # num_layers, whose layers hold two attention sublayers each (its num_hidden_layers counts those, twice as many).
    depth: str = "num_hidden_layers"
    # Rotary modules per base (GraniteMoE-SWA's rotary_embs): the path of a ModuleList of them, one per distinct
    # non-zero base its config's per-layer list names (layer_inputs' ("rotary_by", list): each layer gets the cos/sin
    # of its own base, or None where the list says 0, NoPE).
    rotary_list: str | None = None
    # A state the model forward carries from each layer's call to the next (GLM-5's DSA indexer top-k): (the keyword
    # a layer takes it by, the index of the layer's output it is); the first layer gets None. Read by _layer_plan; the
    # engine keeps what each layer was handed for its recompute, and refuses one that would need a gradient.
    carried: tuple[str, int] | None = None
    # A PEFT prompt encoder (prompt tuning, p-tuning) held in the embedding unit while the engine is built: its
    # path in the base model then (engine/prompts.py); never a family's own
    prompt: str | None = None

    @property
    def embed_parts(self) -> tuple[tuple[str, str], ...]:
        """(name in the embedding unit, module path) of what the embedding unit holds beside the token embedding:
        how the host store lays their parameters out (engine/store.py)."""
        return tuple((part, path) for part, path in (("positions", self.positions if self.positions_learned else None),
                                                     ("project_in", self.project_in),
                                                     ("embed_norm", self.embed_norm),
                                                     ("altup", self.altup[0] if self.altup else None),
                                                     ("prompt", self.prompt)) if path)

    @property
    def head_parts(self) -> tuple[tuple[str, str], ...]:
        """The same for the head beside the final norm and lm_head (OPT's project_out)."""
        return tuple((part, path) for part, path in (("project_out", self.project_out),
                                                     ("altup_out", self.altup[1] if self.altup else None)) if path)

    @property
    def has_router_loss(self) -> bool:
        return self.router is not None

    @property
    def router_paths(self) -> tuple[str, ...]:
        return () if self.router is None else (self.router,) if isinstance(self.router, str) else tuple(self.router)

    def n_layers(self, config) -> int:
        """How many decoder layers (units) the family's causal LM holds for `config`."""
        return getattr(config, self.depth)

    def kinds(self, config) -> list[str]:
        return [self.layer_kind(config, i) for i in range(self.n_layers(config))]

    def build_masks(self, config, embeds, attention_mask, position_ids, cache=None) -> dict:
        """Masks for every attention kind the model uses, built exactly as HF's model forward does (with `cache`,
        as it does for a cache of that length: PEFT's prefix tuning)."""
        kw = dict(
            config=config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{_CACHE_KW: cache},
        )
        masks = {}
        if self.mask_makers is not None:  # a hybrid stack: every mask its model forward makes, made as it does
            for kind, maker in self.mask_makers:
                masks[kind] = _mask_function(maker, config)(**kw)
            return masks
        makers = {SLIDING: create_sliding_window_causal_mask, CHUNKED: create_chunked_causal_mask}
        for kind in set(self.kinds(config)):
            masks[kind] = makers.get(kind, create_causal_mask)(**kw)
        return masks

    def aux_loss(self, model_class):
        """The family's own load-balancing loss function (so numerics are HF's). With several routers in a layer,
        a layer's logits come stacked ([routers, tokens, experts], templates.Template.capture) and the function
        gets them one by one, layer after layer, in the order the model's own recorder keeps them."""
        fn = getattr(sys.modules[model_class.__module__], self.aux_loss_fn)
        if len(self.router_paths) < 2:
            return fn

        def per_router(layers, *args):
            return fn(tuple(r for stacked in layers for r in stacked.unbind(0)), *args)

        return per_router


def _softcap_logits(config, logits):
    cap = config.final_logit_softcapping
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap  # Gemma2ForCausalLM: logits / cap, tanh, * cap


def _divided_logits(config, logits):
    return logits / config.logits_scaling  # GraniteForCausalLM


def _multiplied_logits(config, logits):
    return logits * config.lm_head_multiplier  # FalconH1ForCausalLM


def _mup_divided_logits(config, logits):
    # InklingForCausalLM divides the last hidden state by logits_mup_width_multiplier before lm_head (no bias: the
    # same as dividing the logits)
    return logits / config.logits_mup_width_multiplier


def _scaled_logits(config, logits):
    return logits * config.logit_scale  # CohereForCausalLM


_REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec, *, replace: bool = False) -> Callable[[], None]:
    """Make `spec` the one for its model type; returns the undo (which restores what was there).

    A type that already has a spec is refused unless `replace=True`: two specs for one family
    would otherwise depend silently on import order."""
    previous = _REGISTRY.get(spec.model_type)
    if previous is not None and not replace:
        raise MegaTrainError(f"model type {spec.model_type!r} already has a spec; pass replace=True to replace it "
                             "(register returns the undo).")
    _REGISTRY[spec.model_type] = spec

    def undo() -> None:
        if _REGISTRY.get(spec.model_type) is spec:
            if previous is None:
                del _REGISTRY[spec.model_type]
            else:
                _REGISTRY[spec.model_type] = previous

    return undo


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def spec_for(config) -> ArchSpec:
    """The spec for a config, or a clear error naming what is supported."""
    model_type = getattr(config, "model_type", None)
    spec = _REGISTRY.get(model_type)
    why = None
    if spec is None:
        why = _why_not(config)
        if why == _UNKNOWN:
            spec = _generic(config)
            why = spec if isinstance(spec, str) else None
    if why is None:
        why = _config_refusal(spec, config)
    if why is not None:
        if not model_type:  # a PreTrainedModel of the user's own, no transformers family at all
            raise MegaTrainError(
                f"hf_megatrain trains transformers' decoder-only causal LMs; this model's config "
                f"({type(config).__name__}) names no model type. Supported decoder-only families: "
                f"{', '.join(supported_model_types())}.")
        raise MegaTrainError(
            f"hf_megatrain does not support model type {model_type!r} "
            f"(architectures: {getattr(config, 'architectures', None)}): {why}. "
            f"Supported decoder-only families: {', '.join(supported_model_types())}."
        )
    return spec


def _config_refusal(spec: ArchSpec, config) -> str | None:
    """What this config sets that its family's spec does not repeat, in a few words; None where nothing."""
    if spec.layerdrop and float(getattr(config, "layerdrop", 0.0) or 0.0) > 0:
        return (f"layerdrop={config.layerdrop} skips random decoder layers in training, which the engine's "
                "one-unit-per-layer schedule does not repeat; set config.layerdrop = 0")
    cut = getattr(config, spec.vocab_cut, None) if spec.vocab_cut else None
    if cut is not None and cut < config.vocab_size:
        return (f"{spec.vocab_cut}={cut} cuts the logits below the vocabulary ({config.vocab_size}), which the "
                f"engine's loss does not; train with {spec.vocab_cut} = None")
    return None


_ATTENTION_KINDS = {FULL, SLIDING, CHUNKED}
_GENERIC: dict[str, ArchSpec] = {}
# Where a decoder layer keeps its per-token block (what sequence tiling splits), by family.
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn")


def _generic(config) -> ArchSpec | str:
    """A spec for a type outside the registry whose causal LM has the standard layout: the embedding,
    a ModuleList of decoder layers taking (hidden_states, attention_mask, position_embeddings, and
    position_ids by name or through **kwargs), a final norm, lm_head, a rotary module. The engine
    verifies it before training (engine/selfcheck.py). Otherwise the reason it is not that layout,
    in a few words."""
    model_type = getattr(config, "model_type", None)
    if model_type in _GENERIC:
        return _GENERIC[model_type]
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception as e:
        return f"its causal LM cannot be built from this config ({type(e).__name__}: {_first_line(e)})"
    paths = _layout(model)
    if isinstance(paths, str):
        return paths
    kind = _per_layer_types if getattr(config, "layer_types", None) else _uniform_window
    layers = model.get_submodule(paths["layers"])
    depth = _depth_attr(model, paths, config)
    if depth not in _DEPTH_ATTRS:
        return depth
    shared = _shared_across_layers(layers)
    if shared:
        return shared
    params = inspect.signature(type(layers[0]).forward).parameters
    plan = {}
    # A hybrid stack (layers that are not all attention), or one without rotary embeddings: what each layer gets is
    # read from the base model's forward.
    # (or rotary modules per base, GraniteMoE-SWA's, each layer handed the cos/sin of its own)
    hybrid = bool(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_KINDS) or paths["rotary"] is None \
        or "rotary_list" in paths
    if hybrid:
        plan = _layer_plan(model, paths, layers)
        if isinstance(plan, str):
            return plan
        attr = plan.pop("kind_attr")
        kind = functools.partial(_kind_by_attr, attr) if attr else kind
    else:
        wanted = {"hidden_states", "attention_mask", "position_embeddings"}
        # position_ids is passed by keyword too: named, or taken by **kwargs (the self-check decides the rest)
        takes_position_ids = "position_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        if not wanted <= set(params) or not takes_position_ids:
            absent = sorted(wanted - set(params)) + ([] if takes_position_ids else ["position_ids"])
            return (f"its decoder layer ({type(layers[0]).__name__}) does not take {', '.join(absent)}, which the "
                    "engine passes each layer")
    mlp = next((n for n in _MLP_NAMES if all(_has(layer, n) for layer in layers)), None)
    if mlp is None and hybrid:  # a hybrid's mixer-only layers (Nemotron-H's Mamba ones) are not tiled
        mlp = next((n for n in _MLP_NAMES if any(_has(layer, n) for layer in layers)), None)
    elif mlp is None:
        return (f"its decoder layers ({type(layers[0]).__name__}) have no per-token block under a name the engine "
                f"knows ({', '.join(_MLP_NAMES)}) in every layer")
    outside = _outside_the_layers(model, paths, planned=hybrid)
    if isinstance(outside, str):
        return outside
    router = _router_loss(model, layers)
    fields = router if isinstance(router, dict) else {"router_unmatched": router}
    if plan:  # recurrent layers do not see document boundaries: rows are never split into documents for them
        fields["attention_kwargs"] = False
    spec = ArchSpec(model_type, kind, mlp=mlp, generic=True, depth=depth, **paths, **outside, **fields, **plan)
    _GENERIC[model_type] = spec
    return spec


# What a generic family's forwards may do outside the layers that the engine does as they do (spec.logits and
# spec.embed_multiplier), recognised in their source: the causal LM's soft-capping (Gemma 2's, VaultGemma's,
# NanoChat's), Cohere's logit scale, Granite's logits scaling; the base model's embedding multiplier.
_LOGITS = (
    (re.compile(r"logits\s*=\s*logits\s*/\s*self\.config\.final_logit_softcapping\s*\n\s*logits\s*=\s*torch\.tanh"
                r"\(logits\)\s*\n\s*logits\s*=\s*logits\s*\*\s*self\.config\.final_logit_softcapping\b"), "_softcap_logits"),
    (re.compile(r"logits\s*=\s*logits\s*\*\s*self\.logit_scale\b"), "_scaled_logits"),
    (re.compile(r"logits\s*=\s*logits\s*/\s*self\.config\.logits_scaling\b"), "_divided_logits"),
    (re.compile(r"logits\s*=\s*self\.lm_head\([^\n]*\)\s*\*\s*self\.model\.lm_head_multiplier\s*$", re.M),
     "_multiplied_logits"),  # Falcon-H1's µP head multiplier
    (re.compile(r"hidden_states\s*=\s*outputs\.last_hidden_state\s*/\s*self\.config\.logits_mup_width_multiplier\s*$",
                re.M), "_mup_divided_logits"),  # Inkling's
)
# Inkling's causal LM cuts the logits to config.unpadded_vocab_size where it is set below the vocabulary, which the
# engine's loss does not: such a config is refused (ArchSpec.vocab_cut).
_VOCAB_CUT = re.compile(r"unpadded_vocab_size\s*=\s*self\.config\.(\w+)\s*$", re.M)
_EMBED_MULTIPLIER = re.compile(r"inputs_embeds\s*=\s*(inputs_embeds|self\.embed_tokens\(input_ids\))\s*\*\s*"
                               r"self\.embedding_multiplier\b")


# What the engine hands a decoder layer, or what a training forward leaves at its default (a cache; Falcon's alibi,
# None without ALiBi: with it, the self-check finds the difference).
_LAYER_KWARGS = {"hidden_states", "attention_mask", "position_ids", "position_embeddings", "past_key_values", "cache",
                 "past_key_value", "layer_past", "use_cache", "cache_position", "output_attentions",
                 "output_router_logits", "alibi"}


# Config attributes a base model may build its list of decoder layers from (`range(config.X)`).
_DEPTH_ATTRS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")


def _depth_attr(model, paths: dict, config) -> str:
    """The config attribute that holds the length of the decoder-layer list (ArchSpec.depth): num_hidden_layers
    where it says the list's length; otherwise the one the base model's __init__ builds the list from, read from
    its source (LongCat-Flash's `range(config.num_layers)`: each of its layers holds two attention sublayers, and
    num_hidden_layers counts those), provided its forward runs the whole list. The reason otherwise."""
    base = model.get_submodule(paths["layers"].rpartition(".")[0])
    attr = paths["layers"].rpartition(".")[2]
    n = len(model.get_submodule(paths["layers"]))
    said = {config.num_hidden_layers, model.config.num_hidden_layers}  # building may rewrite it (LongCat-Flash)
    if said == {n}:
        return "num_hidden_layers"
    why = (f"its causal LM has {n} decoder layers where its config's num_hidden_layers says {max(said - {n})}, and "
           "the engine finds no config attribute it builds them from")
    try:
        init, forward = inspect.getsource(type(base).__init__), inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return why
    built = re.search(rf"self\.{re.escape(attr)}\s*=\s*nn\.ModuleList\([^=]*?range\(config\.(\w+)\)", init, re.S)
    depth = built.group(1) if built else None
    if depth not in _DEPTH_ATTRS or {getattr(config, depth, None), getattr(model.config, depth, None)} != {n}:
        return why
    # the loop may slice the list, by that attribute only (LongCat's self.layers[: self.config.num_layers]): a
    # slice by another (num_hidden_layers) would run other layers than the list holds
    loop = _layers_loop(forward, attr)
    sliced = re.search(rf"self\.{re.escape(attr)}\[([^\]]*)\]", loop.group(0)) if loop else None
    if loop is None or (sliced and re.sub(r"\s", "", sliced.group(1)) != f":self.config.{depth}"):
        return (f"its causal LM has {n} decoder layers (config.{depth}) and its model forward runs "
                f"{sliced.group(1).strip() if sliced else 'them in a way the engine cannot read'}")
    return depth


def _shared_across_layers(layers) -> str | None:
    """The reason where two decoder layers hold one weight (Zamba's and Zamba2's shared attention blocks, tied
    across layers): it would belong to several units, and the engine keeps each weight in one."""
    owner = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (i, name))
            if first[0] != i:
                return (f"its decoder layers {first[0]} and {i} share weights ({name.rpartition('.')[0]}: a block "
                        "shared across layers), where the engine streams every weight with one layer")
    return None


def _layers_loop(base_forward: str, layers: str):
    return re.search(rf"^\s*for\b[^\n]*\bself\.{re.escape(layers)}\b[^\n]*:\s*$", base_forward, re.M)


def _layer_call_keywords(base_forward: str, layers: str) -> list[str]:
    """The keyword arguments of the call inside the base model's loop over `self.<layers>` (Beam's
    attention_scaling), read from its source; [] where no such loop is found."""
    loop = _layers_loop(base_forward, layers)
    if loop is None:
        return []
    call = re.search(r"\w+\((.*?)\n\s*\)", base_forward[loop.end():], re.S)
    return re.findall(r"^\s*(\w+)\s*=", call.group(1), re.M) if call else []


def _outside_the_layers(model, paths: dict, planned: bool = False) -> dict | str:
    """What the causal LM and its base model do outside the layers that the engine repeats (the spec's logits and
    embed_multiplier fields), read from their forwards' source; the reason, where they do what it does not.
    `planned`: what the layers get was read by _layer_plan, which refuses what it does not know."""
    base = model.get_submodule(paths["embed"].rpartition(".")[0])
    try:
        forward, base_forward = inspect.getsource(type(model).forward), inspect.getsource(type(base).forward)
        init, base_init = inspect.getsource(type(model).__init__), inspect.getsource(type(base).__init__)
    except (OSError, TypeError):
        return {}
    out = {}
    found = [fn for pattern, fn in _LOGITS if pattern.search(forward)]
    if len(found) > 1:
        return f"its causal LM transforms the logits in several ways ({', '.join(found)})"
    if found == ["_scaled_logits"] and not re.search(r"self\.logit_scale\s*=\s*config\.logit_scale\s*$", init, re.M):
        return "its causal LM scales the logits by something other than config.logit_scale"
    if found == ["_multiplied_logits"] and not re.search(r"self\.lm_head_multiplier\s*=\s*config\.lm_head_multiplier\s*$",
                                                        base_init, re.M):
        return "its causal LM multiplies the logits by something other than config.lm_head_multiplier"
    if found == ["_mup_divided_logits"] and getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "its causal LM divides the last hidden state before an lm_head with a bias"
    if found:
        out["logits"] = globals()[found[0]]
    cut = _VOCAB_CUT.search(forward)
    if cut:
        out["vocab_cut"] = cut.group(1)
    if _EMBED_MULTIPLIER.search(base_forward):
        if not re.search(r"self\.embedding_multiplier\s*=\s*config\.embedding_multiplier\s*$", base_init, re.M):
            return "its model multiplies the embeddings by something other than config.embedding_multiplier"
        out["embed_multiplier"] = "embedding_multiplier"
    extra = sorted(set(_layer_call_keywords(base_forward, paths["layers"].rpartition(".")[2])) - _LAYER_KWARGS)
    if extra and not planned:
        return (f"its model forward hands each decoder layer {', '.join(extra)}, computed outside the layers, which "
                "the engine does not pass")
    norm = re.search(rf"self\.{re.escape(paths['norm'].rpartition('.')[2])}\(", base_forward)
    loop = _layers_loop(base_forward, paths["layers"].rpartition(".")[2])
    if norm and loop and norm.start() < loop.start():  # NanoChat
        module = model.get_submodule(paths["norm"])
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            return (f"its model forward applies its final norm ({paths['norm']}) before the first decoder layer too, "
                    "a weight the engine's embedding and head units cannot share")
        if not re.search(rf"hidden_states\s*=\s*self\.{re.escape(paths['norm'].rpartition('.')[2])}\(hidden_states\)",
                         base_forward[norm.start() - 40:loop.start()]):
            return (f"its model forward applies its final norm ({paths['norm']}) before the first decoder layer to "
                    "something other than the hidden states")
        # NanoChat's norm holds nothing (x * rsqrt(mean(x^2) + eps)): the embedding unit applies a copy of it to the
        # token embeddings (spec.embed_norm), as the forward does before the first layer
        out["embed_norm"] = paths["norm"]
    return out


# -- hybrid stacks: what the base model hands each decoder layer, read from its forward ------------------------------
_MASK_FUNCTIONS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask",
                   "create_recurrent_attention_mask")
# What the engine hands a mask maker (ArchSpec.build_masks), by the names a model forward's mask_kwargs use.
_MASK_KWARGS = {"config", "inputs_embeds", "attention_mask", "past_key_values", "cache", "position_ids"}
# Keywords of a layer call that a training forward leaves at their defaults (no cache) or that say nothing the
# layer computes with.
_DEFAULTED = {"past_key_values", "cache", "past_key_value", "layer_past", "cache_params", "use_cache",
              "cache_position", "output_attentions", "output_router_logits",
              # cross-attention inputs, None in a decoder-only causal LM's forward (GPT-2, XGLM, GPT-BigCode)
              "encoder_hidden_states", "encoder_attention_mask"}


def _mask_function(maker, config):
    """The masking_utils function a maker (ArchSpec.mask_makers) names for this config."""
    import transformers.masking_utils as masking

    if isinstance(maker, tuple) and maker[0] == "with":  # ("with", maker, ((keyword, constant), ...))
        _, inner, extra = maker
        return functools.partial(_mask_function(inner, config), **dict(extra))
    if isinstance(maker, tuple):  # ("if_none", attribute, if None, otherwise): MiniMax's sliding or full mask
        _, attr, if_none, otherwise = maker
        maker = if_none if getattr(config, attr, None) is None else otherwise
    return getattr(masking, maker)


def _mask_extras(items, function_names) -> tuple | str:
    """The arguments a model forward hands its mask makers beyond those the engine passes (_MASK_KWARGS), as
    ((keyword, constant), ...): DeepSeek-V3.2's `allow_is_causal_skip: False` (its indexer needs the mask made
    even where sdpa could skip it). Only constants that every named masking_utils function takes are repeated;
    the reason otherwise."""
    import transformers.masking_utils as masking

    extra = []
    for key, value in items:
        if key in _MASK_KWARGS:
            continue
        # a function that takes it by name, or through **kwargs (create_recurrent_attention_mask drops it): stock
        # hands it the same
        takes = all(key in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
                    for params in (inspect.signature(getattr(masking, f)).parameters for f in function_names))
        if not isinstance(value, ast.Constant) or not takes:
            return key
        extra.append((key, value.value))
    return tuple(sorted(extra))


class _Why(str):
    """A refusal's reason where a maker (itself a str) could have been answered (_layer_plan's made_by)."""


def _with_extras(maker, extra: tuple):
    """A maker with the constant arguments its call adds (_mask_function reads ("with", maker, extra))."""
    return ("with", maker, extra) if extra else maker


def _maker_functions(maker) -> tuple:
    """The masking_utils functions a maker may call."""
    if isinstance(maker, tuple) and maker[0] == "if_none":
        return maker[2], maker[3]
    return (maker,)


def _maker(node, aliases: dict):
    """The mask maker an expression names: a masking_utils function, a name bound to one, or a choice between
    two by whether a config attribute is None; None otherwise."""
    if isinstance(node, ast.Name):
        return node.id if node.id in _MASK_FUNCTIONS else aliases.get(node.id)
    if isinstance(node, ast.IfExp) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1 \
            and isinstance(node.test.ops[0], (ast.Is, ast.IsNot)) \
            and isinstance(node.test.comparators[0], ast.Constant) and node.test.comparators[0].value is None:
        attr = _config_attr(node.test.left)
        body, orelse = _maker(node.body, aliases), _maker(node.orelse, aliases)
        if attr and isinstance(body, str) and isinstance(orelse, str):
            if isinstance(node.test.ops[0], ast.IsNot):
                body, orelse = orelse, body
            return ("if_none", attr, body, orelse)
    return None


def _config_attr(node) -> str | None:
    """X of `self.config.X`."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "config" \
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "self":
        return node.attr
    return None


def _per_layer_attr(node, index: str | None) -> str | None:
    """X of `self.config.X[i]`, i the loop's layer index."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name) and node.slice.id == index:
        return _config_attr(node.value)
    return None


def _as_keywords(call: ast.Call, layers) -> list | None:
    """The layer call's arguments after the hidden states as keywords, a positional one named by the layer
    forward's parameter in its place (GPT-2's `block(hidden_states, past_key_values, causal_mask, ...)`); None
    where the first is not the hidden states or the others cannot be named (starred, too many, or layer classes
    that name them differently)."""
    args = call.args
    if not args or not isinstance(args[0], ast.Name) or args[0].id != "hidden_states":
        return None
    if len(args) == 1:
        return list(call.keywords)
    named = set()
    for cls in dict.fromkeys(type(m) for m in layers):
        params = list(inspect.signature(cls.forward).parameters.values())[2:]  # after self and the hidden states
        named.add(tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD))
    if len(named) != 1 or any(isinstance(a, ast.Starred) for a in args):
        return None
    (names,) = named
    if len(args) - 1 > len(names):
        return None
    return [ast.keyword(arg=n, value=a) for n, a in zip(names, args[1:])] + list(call.keywords)


def _layer_plan(model, paths: dict, layers) -> dict | str:
    """What a hybrid stack's base model hands each decoder layer (ArchSpec.mask_makers, .layer_inputs, and the
    config list that names each layer's kind: `kind_attr`), read from its forward's source; the reason, in a few
    words, where it does something the engine does not repeat. Every layer must be called on the hidden states
    alone, with keywords that are masks the forward makes with masking_utils, the rotary embeddings (for every
    layer, or for the layers of one kind), the position ids, the 2D attention mask as given, or a cache."""
    base = model.get_submodule(paths["layers"].rpartition(".")[0])
    layers_attr = paths["layers"].rpartition(".")[2]
    name = type(base).__name__
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(type(base).forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return f"the source of its model forward ({name}), which says what each of its hybrid layers gets, cannot be read"
    aliases, bound, mapping, mapping_name, kwargs_dicts = {}, {}, {}, None, {}

    def made_by(call: ast.Call):
        """The maker of a call to a mask function, with the constant arguments it adds to the engine's, from its
        own keywords and the dicts it unpacks; the reason where one is not a constant the function takes."""
        maker = _maker(call.func, aliases)
        items = []
        for kw in call.keywords:
            if kw.arg is not None:
                items.append((kw.arg, kw.value))
            elif isinstance(kw.value, ast.Name) and kw.value.id in kwargs_dicts:
                items += kwargs_dicts[kw.value.id]
            else:
                return _Why(f"its model forward ({name}) makes its masks with arguments the engine cannot read")
        extra = _mask_extras(items, _maker_functions(maker))
        if isinstance(extra, str):
            return _Why(f"its model forward ({name}) makes its masks with an argument the engine does not pass "
                        f"({extra})")
        return _with_extras(maker, extra)
    alibi = None  # (the name its forward binds BLOOM's ALiBi tensor to, the plan's alibi field)
    assigns = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
                      and isinstance(n.targets[0], ast.Name)), key=lambda n: n.lineno)
    for node in assigns:
        target, value = node.targets[0].id, node.value
        if isinstance(value, ast.Call) and ast.unparse(value.func) in ("build_alibi_tensor", "self.build_alibi_tensor"):
            alibi = _alibi(base, value, target)
            if isinstance(alibi, str):
                return alibi
        elif _maker(value, aliases) is not None:
            aliases[target] = _maker(value, aliases)  # MiniMax's mask_function
        elif isinstance(value, ast.Call) and _maker(value.func, aliases) is not None:
            made = made_by(value)  # Mamba-2's attention_mask = create_recurrent_attention_mask(..)
            if isinstance(made, _Why):
                return str(made)
            bound[target] = made
        elif isinstance(value, ast.Dict) and value.keys and all(
                isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys) \
                and {"config", "inputs_embeds"} <= {k.value for k in value.keys}:
            # the mask_kwargs the makers get with **: what it holds beyond the engine's arguments is checked
            # against the makers that use it (made_by)
            kwargs_dicts[target] = [(k.value, v) for k, v in zip(value.keys, value.values)]
        elif isinstance(value, ast.Dict) and value.keys and all(
                isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys):
            made = [made_by(v) if isinstance(v, ast.Call) and _maker(v.func, aliases) is not None else None
                    for v in value.values]
            if any(isinstance(m, _Why) for m in made):
                return str(next(m for m in made if isinstance(m, _Why)))
            if all(m is not None for m in made):
                mapping_name, mapping = target, dict(zip((k.value for k in value.keys), made))
    loops = [n for n in ast.walk(fn) if isinstance(n, ast.For) and f"self.{layers_attr}" in ast.unparse(n.iter)]
    if len(loops) != 1:
        return f"its model forward ({name}) does not run its layers in one loop the engine can read"
    loop = loops[0]
    index = layer = None
    if isinstance(loop.target, ast.Tuple) and len(loop.target.elts) == 2:
        index, layer = (e.id if isinstance(e, ast.Name) else None for e in loop.target.elts)
    elif isinstance(loop.target, ast.Name):
        layer = loop.target.id
    calls = [n for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == layer]
    if layer is None or len(calls) != 1:
        return f"its model forward ({name}) calls its layers in a way the engine cannot read"
    call = calls[0]
    keywords = _as_keywords(call, layers)
    if keywords is None:
        return (f"its model forward ({name}) hands each decoder layer positional arguments beyond the hidden states "
                f"({', '.join(ast.unparse(a) for a in call.args[1:]) or ast.unparse(call.args[0])}), which the engine "
                "does not pass")
    # GLM-5's DSA layers return their indexer's top-k beside the hidden states, and the forward hands them to the next
    # layer (prev_topk_indices): a state carried from layer to layer (ArchSpec.carried).
    carried = _carried(fn, loop, call, keywords)
    if isinstance(carried, str):
        return f"its decoder layers {carried} and its model forward ({name}) hands each the previous one's"
    keywords = [kw for kw in keywords if not carried or kw.arg != carried[0]]
    choices = {}  # the name bound to a per-layer choice of mask kind (_kind_by_attr's "choice")
    local = {}  # OLMo-hybrid: layer_position_embeddings = position_embeddings if self.config.layer_types[i] == K else None
    local.update(_rotary_by_base(fn, loop, index, paths))  # GraniteMoE-SWA: the cos/sin of each layer's own base
    for node in ast.walk(loop):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.IfExp) and isinstance(node.value.body, ast.Name) \
                and node.value.body.id == "position_embeddings" and isinstance(node.value.orelse, ast.Constant) \
                and node.value.orelse.value is None and isinstance(node.value.test, ast.Compare) \
                and isinstance(node.value.test.ops[0], ast.Eq) and isinstance(node.value.test.comparators[0], ast.Constant):
            attr = _per_layer_attr(node.value.test.left, index)
            if attr:
                local[node.targets[0].id] = ("rotary", (attr, node.value.test.comparators[0].value))
        # Inkling: attention_type = "full_attention" if self.config.layer_types[i] == "hybrid" else "sliding_attention",
        # then causal_mask_mapping[attention_type]: the layer's kind is the mapping's key this picks
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.IfExp) and isinstance(node.value.test, ast.Compare) \
                and len(node.value.test.ops) == 1 and isinstance(node.value.test.ops[0], (ast.Eq, ast.NotEq)) \
                and all(isinstance(n, ast.Constant) and isinstance(n.value, str)
                        for n in (node.value.test.comparators[0], node.value.body, node.value.orelse)):
            attr = _per_layer_attr(node.value.test.left, index)
            equal, otherwise = node.value.body.value, node.value.orelse.value
            if isinstance(node.value.test.ops[0], ast.NotEq):
                equal, otherwise = otherwise, equal
            if attr:
                choices[node.targets[0].id] = ("choice", attr, node.value.test.comparators[0].value, equal, otherwise)
    kind_attr, inputs, makers, strict = None, [], dict(mapping), False
    rows = _mrope_rows(ast.unparse(fn))
    layer_init = inspect.getsource(type(layers[0]).__init__) if layers else ""
    for kw in keywords:
        v, src = kw.value, None
        if kw.arg is None or kw.arg in _DEFAULTED:
            continue
        if isinstance(v, ast.Name):
            if v.id == "position_ids":
                src = ("position_ids",)
            elif v.id == "position_embeddings":
                src = ("rotary", None)
            elif v.id in local:
                src = local[v.id]
            elif v.id == "text_position_ids" and rows:
                src = ("position_ids",)  # row 0 of the positions repeated for mRoPE: the 2D ids themselves
            elif v.id in bound:
                makers[f"@{v.id}"] = bound[v.id]
                src = ("mask", f"@{v.id}")
            elif v.id == "attention_mask":
                src = ("raw_mask",)
            elif alibi and v.id == alibi[0]:
                src = ("alibi",)
        elif isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and v.value.id == mapping_name:
            if isinstance(v.slice, ast.Constant) and v.slice.value in mapping:
                src = ("mask", v.slice.value)
            elif _per_layer_attr(v.slice, index):
                src, attr, strict = ("mask", None), _per_layer_attr(v.slice, index), True
                if kind_attr not in (None, attr):
                    return f"its model forward ({name}) picks its layers' masks by two config lists"
                kind_attr = attr
            elif isinstance(v.slice, ast.Name) and v.slice.id in choices:
                src, strict = ("mask", None), True
                if kind_attr not in (None, choices[v.slice.id]):
                    return f"its model forward ({name}) picks its layers' masks in two ways"
                kind_attr = choices[v.slice.id]
        elif isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "get" \
                and isinstance(v.func.value, ast.Name) and v.func.value.id == mapping_name and len(v.args) == 1 \
                and isinstance(v.args[0], ast.Attribute) and isinstance(v.args[0].value, ast.Name) \
                and v.args[0].value.id == layer:
            # Nemotron-H: causal_mask_mapping.get(block.block_type), block_type = config.layers_block_type[layer_idx]
            m = re.search(rf"self\.{re.escape(v.args[0].attr)}\s*=\s*config\.(\w+)\[layer_idx\]\s*$", layer_init, re.M)
            if m:
                src, kind_attr = ("mask", None), m.group(1)
        if src is None:
            return (f"its model forward ({name}) hands each decoder layer {kw.arg}={ast.unparse(v)}, computed outside "
                    "the layers, which the engine does not pass")
        if src[0] == "rotary" and paths["rotary"] is None:
            src = None  # NoPE: the forward hands None (Granite-4 without rotary embeddings)
        if src is not None:
            inputs.append((kw.arg, src))
    for cls in dict.fromkeys(type(m) for m in layers):  # Jamba: one class for attention layers, one for Mamba
        params = inspect.signature(cls.forward).parameters
        absent = [k for k, _ in inputs if k not in params]
        if absent and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return f"its decoder layer ({cls.__name__}) does not take {', '.join(absent)}, which its model forward passes"
    if isinstance(kind_attr, tuple):  # the kinds the choice picks for this config's layers
        kinds = {_kind_by_attr(kind_attr, model.config, i) for i in range(len(getattr(model.config, kind_attr[1])))}
    else:
        kinds = set(getattr(model.config, kind_attr, None) or ()) if strict else set()
    if kinds - set(makers):
        return (f"its model forward makes no mask the engine can read for its "
                f"{', '.join(sorted(kinds - set(makers)))} layers")
    plan = dict(kind_attr=kind_attr, mask_makers=tuple(makers.items()), layer_inputs=tuple(inputs))
    if carried:
        plan["carried"] = carried
    if alibi and any(src == ("alibi",) for _, src in inputs):
        plan["alibi"] = alibi[1]
    return dict(plan, rotary_rows=rows) if rows else plan


def _carried(fn, loop, call: ast.Call, keywords) -> tuple | str | None:
    """What a model forward carries from one layer's call to the next (ArchSpec.carried): GLM-5's
        topk_indices = None
        for ...: hidden_states, topk_indices = decoder_layer(hidden_states, ..., prev_topk_indices=topk_indices)
    as (the keyword, the index of the layer's output it takes): the first layer gets None, each next one what the
    previous returned there. None where nothing is carried; what the engine does not repeat, in a few words."""
    assigned = [n for n in ast.walk(loop) if isinstance(n, ast.Assign) and n.value is call]
    if not assigned or not isinstance(assigned[0].targets[0], ast.Tuple):
        return None
    names = [e.id if isinstance(e, ast.Name) else None for e in assigned[0].targets[0].elts]
    passed = [(kw.arg, names.index(kw.value.id)) for kw in keywords
              if isinstance(kw.value, ast.Name) and kw.value.id in names[1:]]
    if not passed:
        return None
    name = names[passed[0][1]]
    first = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
             and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name]
    if len(passed) > 1 or names[0] != "hidden_states" or len(first) != 1 \
            or not (isinstance(first[0].value, ast.Constant) and first[0].value.value is None) \
            or first[0].lineno > loop.lineno:
        return (f"return {', '.join(n or '?' for n in names[1:])} beside the hidden states in a way the engine does "
                "not repeat")
    return passed[0]


def _rotary_by_base(fn, loop, index: str | None, paths: dict) -> dict:
    """GraniteMoE-SWA's per-layer rotary bases, read from its forward: before the loop, cos/sin per base from the
    base model's rotary list (ArchSpec.rotary_list),
        by_base = {r.config.rope_parameters["rope_theta"]: r(hidden_states, position_ids) for r in self.<list>}
    and in the loop, each layer's from its config's per-layer list, None where it says 0 (NoPE):
        base = self.config.<bases>[i]; layer_position_embeddings = by_base[base] if base else None
    Returns {the name the loop binds: ("rotary_by", <bases>)}; {} where the forward does not do exactly this."""
    if "rotary_list" not in paths:
        return {}
    made = set()  # names bound to the cos/sin per base of the rotary list
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.DictComp) and len(node.value.generators) == 1:
            comp, gen = node.value, node.value.generators[0]
            var = ast.unparse(gen.target)
            if ast.unparse(gen.iter) == f"self.{paths['rotary_list'].rpartition('.')[2]}" and not gen.ifs \
                    and ast.unparse(comp.key) == f"{var}.config.rope_parameters['rope_theta']" \
                    and ast.unparse(comp.value) in (f"{var}(hidden_states, position_ids)",
                                                    f"{var}(hidden_states, position_ids=position_ids)"):
                made.add(node.targets[0].id)
    statements = [n for n in ast.walk(loop) if isinstance(n, ast.Assign) and len(n.targets) == 1
                  and isinstance(n.targets[0], ast.Name)]
    bases = {n.targets[0].id: _per_layer_attr(n.value, index) for n in statements if _per_layer_attr(n.value, index)}
    out = {}
    for n in statements:
        v = n.value
        if isinstance(v, ast.IfExp) and isinstance(v.test, ast.Name) and v.test.id in bases \
                and isinstance(v.body, ast.Subscript) and isinstance(v.body.value, ast.Name) and v.body.value.id in made \
                and isinstance(v.body.slice, ast.Name) and v.body.slice.id == v.test.id \
                and isinstance(v.orelse, ast.Constant) and v.orelse.value is None:
            out[n.targets[0].id] = ("rotary_by", bases[v.test.id])
    return out


def _alibi(base, call: ast.Call, target: str) -> tuple | str:
    """BLOOM's `alibi = self.build_alibi_tensor(attention_mask, self.num_heads, dtype=...)`: (target, (the modeling
    module, the config attribute of the head count)) where it is made from the 2D mask by the modeling module's own
    function (the method hands its arguments on to it); the reason otherwise."""
    module = sys.modules[type(base).__module__]
    why = f"its model forward makes ALiBi ({ast.unparse(call)}) in a way the engine does not repeat"
    args = [ast.unparse(a) for a in call.args]
    if not callable(getattr(module, "build_alibi_tensor", None)) or args[:2] != ["attention_mask", "self.num_heads"]:
        return why
    try:
        init = inspect.getsource(type(base).__init__)
        method = inspect.getsource(type(base).build_alibi_tensor) if call.func.__class__ is ast.Attribute else ""
    except (OSError, TypeError, AttributeError):
        return why
    heads = re.search(r"self\.num_heads\s*=\s*config\.(\w+)\s*$", init, re.M)
    if heads is None or (method and not re.search(r"return\s+build_alibi_tensor\(attention_mask,\s*num_heads,\s*dtype\)",
                                                  method)):
        return why
    return target, (module.__name__, heads.group(1))


def _mrope_rows(forward: str) -> int | None:
    """Qwen3.5's text model: 2D position ids are repeated into [n, batch, seq], row 0 is what the layers and the
    masks get (the ids themselves) and rows 1.. what the rotary module gets: n - 1 rows of the same ids."""
    n = re.search(r"position_ids\s*=\s*position_ids\[None, \.\.\.\]\.expand\((\d+), position_ids\.shape\[0\], -1\)", forward)
    if n and re.search(r"text_position_ids\s*=\s*position_ids\[0\]", forward) \
            and re.search(r"position_ids\s*=\s*position_ids\[1:\]", forward):
        return int(n.group(1)) - 1
    return None


# What a generic causal LM's forward must do with its routers for the engine's router loss to be its own: read
# the switch from the config, call the modeling file's load_balancing_loss_func on every recorded router's logits
# with the model's expert count, top-k and the attention mask, and add it times a coefficient when there are labels.
_LBL_CALL = re.compile(r"load_balancing_loss_func\(\s*outputs\.router_logits\s*,\s*self\.num_experts\s*,"
                       r"\s*self\.num_experts_per_tok\s*,\s*attention_mask\s*,?\s*\)")
_LBL_ADD = re.compile(r"loss\s*\+=\s*self\.(\w+)\s*\*\s*aux_loss\b")


def _router_loss(model, layers) -> dict | str | None:
    """The router fields of a generic spec (router path inside a layer, the output index of its logits, the
    aux-loss function, the config attribute with the number of experts), read from the installed transformers:
    the causal LM's forward and __init__ say how it adds its load-balancing loss, and its
    `_can_record_outputs["router_logits"]` which module's output, at which index, is a layer's router logits.
    None: the causal LM adds no router loss from its config (nothing to capture); a string: it adds one in a way
    the engine does not match, in a few words."""
    cls = type(model)
    if not hasattr(model.config, "output_router_logits"):
        return None
    try:
        forward, init = inspect.getsource(cls.forward), inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return f"the source of its causal LM ({cls.__name__}), which says how it adds its router loss, cannot be read"
    if "load_balancing_loss_func(" not in forward or "self.config.output_router_logits" not in forward:
        return None  # no router loss, or only when a call asks for it (JetMoE up to transformers 5.17)
    if not _LBL_CALL.search(forward) or not hasattr(sys.modules[cls.__module__], "load_balancing_loss_func"):
        return (f"its causal LM ({cls.__name__}) computes its load-balancing loss from other arguments than "
                "(router logits, num_experts, num_experts_per_tok, attention_mask)")
    assigned = dict(re.findall(r"self\.(\w+)\s*=\s*config\.(\w+)\s*$", init, re.M))
    coef = _LBL_ADD.search(forward)
    coef = assigned.get(coef.group(1)) if coef else None
    if coef is None:
        return (f"its causal LM ({cls.__name__}) weighs its load-balancing loss by something other than a config "
                "attribute")
    if assigned.get("num_experts_per_tok") != "num_experts_per_tok" or "num_experts" not in assigned:
        return (f"its causal LM ({cls.__name__}) takes the number of experts or their top-k from other config "
                "attributes than the engine reads")
    recorded = getattr(cls, "_can_record_outputs", None) or {}
    recorded = recorded.get("router_logits")
    recorded = recorded if isinstance(recorded, (list, tuple)) else [recorded] if recorded is not None else []
    targets = []  # (router class, the index of its logits among its outputs, the name its path must hold or None)
    for r in recorded:
        target = r if isinstance(r, type) else getattr(r, "target_class", None)
        if not isinstance(target, type) or getattr(r, "class_name", None):
            return f"its model records router logits in a way the engine does not read ({r!r})"
        named = getattr(r, "layer_name", None)  # MiniMax's mlp.gate, Jamba's router: a Linear of that name
        targets.append((target, 0 if isinstance(r, type) else int(r.index or 0),
                        f".{named.strip('.')}." if named else None))
    found = {tuple((n, i) for n, m in layer.named_modules() for t, i, named in targets
                   if isinstance(m, t) and (named is None or named in f".{n}.")) for layer in layers}
    found.discard(())  # the dense layers of an MoE
    if len(found) != 1:
        return ("its decoder layers have no router the engine finds from the model's recorded router logits"
                if not found else "its routers sit under different paths in different layers")
    (routers,) = found
    if len({i for _, i in routers}) != 1:
        return "the routers of one layer give their logits at different output indices"
    paths = tuple(n for n, _ in routers)
    return dict(router=paths[0] if len(paths) == 1 else paths, router_index=routers[0][1],
                aux_loss_fn="load_balancing_loss_func", experts=assigned["num_experts"], aux_coef=coef)


def _layout(model) -> dict | str:
    """Where a causal LM keeps the parts the engine streams, found from the model itself: its input
    embedding and output head (get_input_embeddings / get_output_embeddings), and in its base model the
    list of decoder layers, a rotary module and the final norm (GPT-NeoX's gpt_neox.final_layer_norm, Phi's
    model.final_layernorm, Falcon's transformer.ln_f). The reason it is not that layout otherwise: every
    parameter must be in one of them."""
    names = {id(m): n for n, m in model.named_modules()}
    embed = names.get(id(model.get_input_embeddings()))
    head = names.get(id(model.get_output_embeddings()))
    prefix = embed.rpartition(".")[0] if embed else ""  # the base model holds the embedding
    if not embed or not head or not prefix:
        return f"its causal LM ({type(model).__name__}) has no input embedding and output head the engine can find"
    base = model.get_submodule(prefix)
    rotary_lists = [n for n, m in base.named_children() if _is_rotary_list(n, m)]
    layers = [n for n, m in base.named_children() if isinstance(m, torch.nn.ModuleList) and n not in rotary_lists]
    rotary = [n for n, m in base.named_children() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(rotary_lists) > 1:
        return (f"its base model ({type(base).__name__}) holds {len(rotary_lists)} lists of rotary modules "
                f"({', '.join(rotary_lists)}), where the engine reads at most one")
    if len(layers) != 1:
        return (f"its base model ({type(base).__name__}) holds {len(layers)} lists of layers itself, where the engine "
                "streams exactly one list of decoder layers")
    if len(rotary) > 1:
        return (f"its base model ({type(base).__name__}) has {len(rotary)} rotary modules, where the engine hands "
                "every layer the embeddings of one")
    rotary = f"{prefix}.{rotary[0]}" if rotary else None  # none: positions made otherwise, or none at all (Mamba)
    rotary_list = f"{prefix}.{rotary_lists[0]}" if rotary_lists else None
    taken = {f"{prefix}.{layers[0]}", embed, head} | ({rotary} if rotary else set()) \
        | ({rotary_list} if rotary_list else set())
    rest = [(f"{prefix}.{n}", m) for n, m in base.named_children()
            if f"{prefix}.{n}" not in taken and not isinstance(m, torch.nn.Dropout)]
    parts = _embedding_parts(base, prefix, layers[0], [n for n, _ in rest]) if rotary is None else {}
    if isinstance(parts, str):
        return parts
    taken |= {v for k, v in parts.items() if k in ("positions", "project_in", "project_out", "embed_norm")}
    rest = [(n, m) for n, m in rest if n not in taken]
    if len(rest) > 1:  # a final norm without parameters (OLMo's) beside modules with some is not the norm
        rest = [(n, m) for n, m in rest if any(True for _ in m.parameters())] or rest
    rest = [n for n, _ in rest]
    if not rest:
        return (f"its base model ({type(base).__name__}) has no final norm (OpenAI GPT's; OPT's with "
                "do_layer_norm_before=False), where the engine's head unit begins with one")
    if len(rest) != 1:
        extra = ", ".join(rest)
        if rotary is None and len(rest) > 1:
            return (f"its base model ({type(base).__name__}) has no rotary module, and modules outside the embedding, "
                    f"the decoder layers and one final norm ({extra}): positions made outside the layers, which the "
                    "engine does not run")
        return (f"its base model has parameters outside the embedding, the decoder layers and one final norm "
                f"({extra}), which the engine does not run")
    if any(not n.startswith(tuple(p + "." for p in taken | set(rest))) for n, _ in model.named_parameters()):
        return "its causal LM has parameters outside the embedding, the decoder layers, the final norm and the head"
    return dict(embed=embed, layers=f"{prefix}.{layers[0]}", norm=rest[0], lm_head=head, rotary=rotary, **parts,
                **({"rotary_list": rotary_list} if rotary_list else {}))


def _is_rotary_list(name: str, module) -> bool:
    """A ModuleList of rotary modules without parameters (GraniteMoE-SWA's rotary_embs, one per rotary base its
    layers use; empty where every layer is NoPE): not a list of layers, but cos/sin made once per batch."""
    if not isinstance(module, torch.nn.ModuleList) or any(True for _ in module.parameters()):
        return False
    if not len(module):
        return "rotary" in name
    return all(type(m).__name__.endswith("RotaryEmbedding") for m in module)


def _sqrt_of(attr: str, config) -> float:
    return math.sqrt(getattr(config, attr))  # CTRL: np.sqrt(n_embd), the same correctly rounded double


def _embedding_parts(base, prefix: str, layers: str, rest: list[str]) -> dict | str:
    """What a base model without rotary embeddings does between its token embedding and its first layer, and
    after its last layer besides the final norm, read from its forward's source (ArchSpec.positions and the
    fields beside it): a module called with the position ids whose output it adds to the embeddings (GPT-2's
    wpe, OPT's embed_positions), or a buffer the ids index (CTRL's pos_encoding); a projection of the token
    embeddings (OPT's project_in) and of the last hidden state (project_out); a scale of the token embeddings by
    the square root of a config attribute (CTRL); its embedding dropout; LayerDrop's draws. The self-check
    verifies what is read. {} where it does none of these; the reason where it does one the engine does not."""
    try:
        forward = inspect.getsource(type(base).forward)
        init = inspect.getsource(type(base).__init__)
    except (OSError, TypeError):
        return {}
    loop = _layers_loop(forward, layers)
    if loop is None:
        return {}
    before, after = forward[:loop.start()], forward[loop.end():]
    attrs = {n.rpartition(".")[2]: n for n in rest}
    out = {}
    for attr, path in attrs.items():
        call = re.search(rf"self\.{attr}\(([^()]*(?:\([^()]*\)[^()]*)*)\)", before)
        if call and "position_ids" in call.group(1):
            if "positions" in out:
                return f"its model forward makes absolute positions with two modules ({out['positions']}, {path})"
            out["positions"] = path
            out["positions_learned"] = any(True for _ in base.get_submodule(attr).parameters())
    norm = re.search(r"hidden_states\s*=\s*self\.(\w+)\(inputs_embeds\)", before)
    if norm and norm.group(1) in attrs:
        out["embed_norm"] = attrs[norm.group(1)]
    # Projections, read from the source whether this config builds them or not (OPT's are None where
    # word_embed_proj_dim equals the width): the spec of a family is one for all its configs.
    proj = re.search(r"inputs_embeds\s*=\s*self\.(\w+)\(inputs_embeds\)", before)
    module = getattr(base, proj.group(1), None) if proj else None
    if proj and module is not None and not isinstance(module, torch.nn.Linear) and proj.group(1) in attrs:
        # Inkling's embed_norm, applied to the token embeddings in place: a norm of the embeddings as BLOOM's
        # (the embedding unit applies it with or without positions)
        if "embed_norm" in out:
            return f"its model forward applies two norms to the embeddings ({out['embed_norm']}, {attrs[proj.group(1)]})"
        out["embed_norm"] = attrs[proj.group(1)]
    elif proj:
        out["project_in"] = f"{prefix}.{proj.group(1)}"
    for name, buf in base.named_buffers(recurse=False):
        if buf is not None and re.search(rf"self\.{name}\[position_ids\b", before):
            if "positions" in out:
                return f"its model forward makes absolute positions in two ways ({out['positions']}, {name})"
            out.update(positions=f"{prefix}.{name}", positions_buffer=True)
    # after the layers: the final norm, then a projection (OPT's project_out), applied last and declared in its
    # __init__ as a Linear (or None)
    applied = re.findall(r"hidden_states\s*=\s*self\.(\w+)\(hidden_states\)", after)
    if len(applied) > 1 and re.search(rf"self\.{applied[-1]}\s*=\s*nn\.Linear\(", init):
        out["project_out"] = f"{prefix}.{applied[-1]}"
    if not out:
        return {}
    scale = re.search(r"inputs_embeds\s*\*=\s*(?:np|math)\.sqrt\(self\.(\w+)\)", before)
    if scale:
        attr = re.search(rf"self\.{scale.group(1)}\s*=\s*config\.(\w+)\s*$", init, re.M)
        if attr is None:
            return "its model forward scales the embeddings by something other than the root of a config attribute"
        out["embed_scale"] = functools.partial(_sqrt_of, attr.group(1))
    for attr in re.findall(r"hidden_states\s*=\s*self\.(\w+)\(hidden_states\)", before):
        if isinstance(getattr(base, attr, None), torch.nn.Dropout):
            out["embed_dropout"] = attr
    drop = re.search(r"hidden_states\s*=\s*nn\.functional\.dropout\(hidden_states,\s*p=(?:float\()?self\.(\w+)\b",
                     before)
    if drop:
        out["embed_dropout"] = drop.group(1)
    if re.search(r"\bself\.layerdrop\b", forward[loop.start():]):
        out["layerdrop"] = True
        # a draw guarded by the rate (`if self.training and self.layerdrop > 0.0:`) never runs at the only
        # rate the engine takes
        out["layer_draws"] = not re.search(r"\bself\.layerdrop\s*>\s*0", forward[loop.start():])
    # the mask it counts from is the 2D attention mask (named position_attention_mask after 5.17)
    if re.search(r"position_ids\s*=\s*torch\.cumsum\((?:position_)?attention_mask\b", before):
        out["positions_from_mask"] = True
    return out


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _why_not(config) -> str:
    """The reason, in a few words, that a config is not one of the decoder stacks the engine trains
    (_UNKNOWN: none seen in the config; the generic spec looks at the model next)."""
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model, not a decoder-only stack"
    if getattr(config, "text_config", None) is not None or getattr(config, "vision_config", None) is not None:
        return "a wrapper around a text model (vision-language or multimodal); train its text model's type instead"
    if getattr(config, "hidden_size_per_layer_input", None):
        return ("per-layer embeddings (embed_tokens_per_layer gives every decoder layer an input of its own, "
                "computed outside the layers), which the engine does not stream yet")
    varying = getattr(config, "per_layer_attributes", None)
    if varying:
        return (f"a per-layer config ({', '.join(sorted(varying))} may differ from layer to layer), which the "
                "engine's layout does not take yet")
    return _UNKNOWN  # hybrid stacks (state-space, linear attention, conv layers) too: the generic spec reads them


_UNKNOWN = "a decoder stack the registry does not know, without the standard layout the engine can try"


register(ArchSpec("llama", _always_full))
register(ArchSpec("mistral", _uniform_window))
register(ArchSpec("qwen2", _per_layer_types))
register(ArchSpec("qwen3", _per_layer_types))
register(
    ArchSpec(
        "mixtral",
        _uniform_window,
        router="mlp.gate",
        aux_loss_fn="load_balancing_loss_func",
    )
)
# Dense families whose causal LM is the Llama layout end to end (tests/unit/test_families.py proves each).
for _type in ("olmo2", "glm4", "smollm3", "helium", "exaone4", "ministral"):
    register(ArchSpec(_type, _per_layer_types))
for _type in ("phi3", "starcoder2"):  # a sliding mask wherever config.sliding_window is set
    register(ArchSpec(_type, _uniform_window))
register(ArchSpec("stablelm", _always_full, attention_kwargs=False))
register(ArchSpec("gemma", _always_full))  # its embedding scales itself (a buffer of the module)
register(ArchSpec("gemma2", _per_layer_types, logits=_softcap_logits))
register(ArchSpec("gemma3_text", _per_layer_types, logits=_softcap_logits))  # a rotary base per attention kind
register(ArchSpec("granite", _always_full, embed_multiplier="embedding_multiplier", logits=_divided_logits))
register(ArchSpec("cohere", _always_full, logits=_scaled_logits))
# Gemma 4 text: per-layer embeddings (ArchSpec.per_layer) where hidden_size_per_layer_input is set, KV sharing
# across its last layers, a head_dim of their own for its full-attention layers (per_layer_config: other layer
# templates), a persistent layer_scalar buffer per layer; Gemma-4-unified text is the same without per-layer
# embeddings; Gemma 3n adds AltUp's stacked hidden states (ArchSpec.altup), laurel and activation sparsity (inside
# its layers).
_PER_LAYER = ("model.embed_tokens_per_layer", "model.per_layer_model_projection", "model.per_layer_projection_norm")
register(ArchSpec("gemma4_text", _per_layer_types, logits=_softcap_logits, per_layer=_PER_LAYER, shared_kv=True))
register(ArchSpec("gemma4_unified_text", _per_layer_types, logits=_softcap_logits, shared_kv=True))
register(ArchSpec("gemma3n_text", _per_layer_types, logits=_softcap_logits, per_layer=_PER_LAYER, shared_kv=True,
                  altup=("model.altup_projections", "model.altup_unembed_projections")))
# MiniCPM3: MLA attention in its layers; its embedding scales itself (scale_emb, a buffer of the module), and its
# causal LM divides the last hidden state by logits_scaling before lm_head (no bias: the same as the logits)
register(ArchSpec("minicpm3", _always_full, logits=_divided_logits))
# Cohere 2: sliding and full layers by config.layer_types (its layers take position_ids through **kwargs)
register(ArchSpec("cohere2", _per_layer_types, logits=_scaled_logits))
# Mixture-of-experts families: HF's load-balancing loss, experts fused in memory as HF v5 does.
_LBL = "load_balancing_loss_func"
for _type, _kind, _inter in (("qwen2_moe", _per_layer_types, "moe_intermediate_size"),
                             ("qwen3_moe", _uniform_window, "moe_intermediate_size"),
                             ("olmoe", _per_layer_types, "intermediate_size")):
    register(ArchSpec(_type, _kind, router="mlp.gate", aux_loss_fn=_LBL, experts="num_experts"))
register(ArchSpec("phimoe", _uniform_window, router="mlp.router", aux_loss_fn=_LBL))
# GLM-4-MoE: sigmoid router with grouped top-k over scores plus a per-layer persistent e_score_correction_bias
# (read from the checkpoint, handed to each layer's call), a shared expert, dense first layers; no
# load-balancing loss in its causal LM. Experts one by one on disk.
register(ArchSpec("glm4_moe", _per_layer_types))
# gpt-oss: attention sinks need attn_implementation="eager" (HF refuses sdpa for it); experts fused on disk too
register(ArchSpec("gpt_oss", _per_layer_types, router="mlp.router", aux_loss_fn=_LBL))
register(ArchSpec("granitemoe", _always_full, mlp="block_sparse_moe", router="block_sparse_moe.router",
                  router_index=None, aux_loss_fn=_LBL, embed_multiplier="embedding_multiplier", logits=_divided_logits))
