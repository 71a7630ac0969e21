"""StreamingEngine: forward, loss and backward of an HF causal LM, one unit at a time.

    forward   embed -> for each layer: weights[i] -> run template -> keep its input x_i
    loss      final norm + lm_head + cross-entropy in token chunks, backward per chunk
    backward  for each layer, last first: weights[i] -> recompute from x_i with grad
              -> (dx, one flat dW) -> dW to the host accumulator
              then the embedding (plus the lm_head gradient when the two are tied)

The autograd graph never spans more than one unit or one loss chunk. Where weights come
from and where gradients go is the pipeline's business (pipeline.py / cuda_pipeline.py);
this file only says in which order units are needed.
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Callable, Protocol

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from ..errors import MegaTrainError
from ..patcher.adapters import check_peft_model, is_peft_model
from ..patcher.documents import attention_by_document
from ..patcher.specs import spec_for
from ..patcher.templates import Template, meta_copy, persistent_buffers, recompute_grads
from ..patcher.tiling import tile_mlp, untile_mlp
from .activations import Activations
from .carried import Carried
from .config import EngineConfig
from .inputs import BatchInputs, require_labels
from .layout import loss_chunk, mark_resident, slab_numel
from .loss import RowLoss, chunked_head_loss, full_logits, loss_denominator, row_head_loss
from .per_layer import LayerSides, PerLayerInputs, altup_collapse, altup_stack, base_buffers
from .pipeline import HostPipeline, Pipeline
from .prompts import (Prefix, attached, check_prefix_family, prefix_keys_values, prompt_encoder, with_prefix,
                      with_virtual_tokens)
from .selfcheck import stock_leaves_without_grad, verify
from .store import HostStore, build_units

logger = logging.getLogger(__name__)


class _Embed(nn.Module):
    """What the family's base model does before its first layer: the token embedding, a multiplier or scale,
    a projection (OPT's project_in), absolute positions added (a module called as the base model calls it, or a
    buffer the ids index), the embedding dropout (ArchSpec.positions and the fields beside it)."""

    def __init__(self, embed: nn.Module, multiplier: float | None = None, positions: nn.Module | None = None,
                 project_in: nn.Module | None = None, dropout: float = 0.0, embed_norm: nn.Module | None = None,
                 altup: nn.Module | None = None, prompt: nn.Module | None = None, virtual_tokens: int = 0,
                 prefix: Prefix | None = None):
        super().__init__()
        self.embed = embed
        # PEFT's prompt encoder (prompt tuning, p-tuning: engine/prompts.py): its output takes the place of the
        # first `virtual_tokens` ids of each row, which with_virtual_tokens put there
        self.prompt = prompt
        self.virtual_tokens = virtual_tokens
        # prefix tuning: the encoder's output is every layer's prefix keys and values, returned beside the hidden
        # states (engine/prompts.py)
        self.prefix = prefix
        self.altup = altup  # Gemma 3n's altup_projections: the embeddings become [inputs, batch, seq, hidden]
        self.embed_norm = embed_norm
        self.multiplier = multiplier
        self.positions = positions
        self.project_in = project_in
        self.dropout = dropout
        # NEFTune (Trainer's neftune_noise_alpha): noise on the token embedding's output while training, drawn as
        # transformers' neftune_post_forward_hook draws it on get_input_embeddings(); set by the trainer
        self.noise_alpha: float | None = None
        # OPT's and BioGPT's learned tables take the 2D mask (to count positions from it when given none)
        self._with_mask = positions is not None and not isinstance(positions, _Table) \
            and "attention_mask" in inspect.signature(positions.forward).parameters

    @property
    def stochastic(self) -> bool:
        """Whether a training forward draws random numbers (which its recompute must draw again)."""
        prompt = self.prompt is not None and any(
            isinstance(m, (nn.Dropout, nn.LSTM)) and getattr(m, "p", getattr(m, "dropout", 0))
            for m in self.prompt.modules())
        return self.training and bool(self.dropout or self.noise_alpha or prompt)

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        x = self._hidden(input_ids, position_ids, attention_mask)
        if self.prefix is None:
            return x
        p = self.prefix  # as PeftModel.get_prompt: the encoder on [rows, n] indices 0..n-1
        tokens = torch.arange(p.tokens, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)
        # cast to the compute dtype, where PEFT casts it to the base model's
        return x, prefix_keys_values(self.prompt(tokens), p, x.dtype)

    def _hidden(self, input_ids, position_ids=None, attention_mask=None):
        n = self.virtual_tokens
        x = self.embed(input_ids[:, n:] if n else input_ids)
        if self.training and self.noise_alpha:  # the hook's own expressions, so the same numbers come out
            mag_norm = self.noise_alpha / torch.sqrt(torch.tensor(x.size(1) * x.size(2)))
            x = x + torch.zeros_like(x).uniform_(-mag_norm, mag_norm)
        if n:  # as PeftModel.get_prompt: the encoder on [rows, n] indices 0..n-1, after the token embeddings
            tokens = torch.arange(n, device=x.device).unsqueeze(0).expand(x.shape[0], -1)
            x = torch.cat([self.prompt(tokens).to(x.dtype), x], dim=1)
        if self.multiplier is not None:
            x = x * self.multiplier
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if self.altup is not None:
            return altup_stack(x, self.altup)
        if self.positions is None:
            return x
        if self.project_in is not None:
            x = self.project_in(x)
        if isinstance(self.positions, _Table):
            pos = self.positions.weight.to(dtype=x.dtype)[position_ids, :]
        elif self._with_mask:
            mask = attention_mask if attention_mask is not None else torch.ones(input_ids.shape, device=x.device)
            pos = self.positions(mask, 0, position_ids=position_ids)
        else:
            pos = self.positions(position_ids)
        x = x + pos
        return nn.functional.dropout(x, self.dropout, self.training) if self.dropout else x


class _Table(nn.Module):
    """A base model's buffer of positions that the ids index (CTRL's pos_encoding), as a module of the embedding
    template so that it reaches each call like any template buffer."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", table, persistent=False)


class _Head(nn.Module):
    """Final norm, a projection (OPT's project_out), lm_head, and what the family's causal LM does to the
    logits (spec.logits)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, logits=None, config=None,
                 project_out: nn.Module | None = None, altup: nn.Module | None = None):
        super().__init__()
        self.norm = norm
        self.altup_out = altup  # Gemma 3n's altup_unembed_projections: [inputs, ..., hidden] back to [..., hidden]
        self.project_out = project_out
        self.lm_head = lm_head
        self.logits, self.config = logits, config

    def forward(self, hidden):
        if self.altup_out is not None:  # rows of the AltUp inputs side by side (StreamingEngine._head_rows)
            h = hidden.unflatten(-1, (len(self.altup_out) + 1, -1)).movedim(-2, 0)
            hidden = altup_collapse(h, self.altup_out, self.lm_head.weight.dtype)
        # the norm may hand back fp32 (Mamba's residual stream is kept in fp32): its causal LM casts to the head's
        # dtype first, as this does (a no-op where they agree)
        hidden = self.norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        weight = getattr(self.lm_head, "weight", None)
        out = self.lm_head(hidden if weight is None else hidden.to(weight.dtype))
        return out if self.logits is None else self.logits(self.config, out)


class GradListener(Protocol):
    """Told about one backward's gradients (a host optimizer's step_during_backward registers itself)."""

    def final_grad(self, index: int, landed: Callable[[], None]) -> None:
        """Unit `index` got its last gradient of the step; `landed()` blocks until it is in the
        host accumulator (and raises if adding it failed). Called on the training thread."""

    def backward_failed(self) -> None:
        """The backward it listened to raised; the engine has already stopped telling it."""


def _check_model(model: nn.Module, spec, skeleton: bool) -> None:
    for path in (spec.embed, spec.layers, spec.norm, spec.lm_head) + ((spec.rotary,) if spec.rotary else ()):
        try:
            model.get_submodule(path)
        except AttributeError:
            raise MegaTrainError(
                f"{type(model).__name__} has no submodule {path!r}; hf_megatrain needs the causal-LM class "
                f"(e.g. AutoModelForCausalLM), not a base model or another task's head."
            ) from None
    if not skeleton and any(p.device.type == "meta" for p in model.parameters()):
        raise MegaTrainError("the model has parameters on the meta device; load real weights first.")


def _say_what_the_model_shows(store: HostStore, sharding) -> None:
    """One line where the model object's parameters cannot be the fp32 weights that stock's would
    show (HostStore.bind), saying where those are; nothing where they are."""
    if sharding is not None and sharding.rank != 0:
        return
    lower = store.compute_dtype != torch.float32
    dtype = str(store.compute_dtype).replace("torch.", "")
    if store.views_compute and lower and any(u.n_train for u in store.units):
        logger.warning(
            "data parallel: each rank holds only a slice of the fp32 master weights, so the model object "
            "(trainer.model) shows the %s compute copy, not the trained fp32 weights; save_model() (or "
            "engine.save_pretrained) writes those, gathered from every rank.", dtype)
    elif lower and any(s.numel and not s.trainable for u in store.units for s in u.slots):
        logger.info("the frozen weights (a LoRA base) exist only as the %s copy that streams, so the model "
                    "object's frozen parameters are %s; its trained ones are the fp32 masters.", dtype, dtype)


def tied_embed_slot(model: nn.Module, spec, units):
    """The embedding unit's slot that a tied head reads: the token embedding's weight, or where a PEFT adapter wraps
    the embedding (LoRA on it, modules_to_save), the wrapped layer's weight that lm_head still shares."""
    weight = getattr(model.get_submodule(spec.lm_head), "weight", None)
    name = next((n for n, p in model.named_parameters() if p is weight), None)
    slot = next((s for s in units[0].slots if s.name == name or (name is None and s.local == "embed.weight")), None)
    if slot is None:
        raise MegaTrainError(f"the head is tied to the token embedding, but the embedding holds no weight it reads "
                             f"({name or spec.embed + '.weight'}); was the model changed after it was tied?")
    return slot


def tied_head(model: nn.Module, spec, units) -> str | None:
    """The head's name for lm_head's weight where it is the token embedding's (tied): what the store's layout
    says (a head with no lm_head parameter of its own), or, beside an lm_head bias of its own (CTRL's), the two
    modules sharing one weight. A PEFT wrapper around a tied lm_head (LoRA on it, trainable tokens) is refused:
    it would share more than that one weight with the embedding."""
    lm_head, embed = model.get_submodule(spec.lm_head), model.get_submodule(spec.embed)
    weight = getattr(lm_head, "weight", None)
    tied = units[-1].tied_local or (isinstance(weight, nn.Parameter) and weight is getattr(embed, "weight", None))
    if tied and (hasattr(lm_head, "base_layer") or hasattr(lm_head, "token_adapter")):
        raise MegaTrainError("PEFT wraps lm_head, which is tied to the token embedding (LoRA on lm_head, or "
                             "trainable_token_indices, which PEFT ties to the head as well): the engine ties the "
                             "head to one plain embedding weight and does not train adapters shared by the two. "
                             "Leave lm_head out of target_modules and trainable_token_indices out, or untie the "
                             "model (tie_word_embeddings=False).")
    return (units[-1].tied_local or "lm_head.weight") if tied else None


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t` that nothing else writes (.cpu() of a host tensor is the tensor itself)."""
    return t.clone() if t.device.type == "cpu" else t.cpu()


class StreamingEngine(nn.Module):
    """Owns the host store and the templates; runs forward/backward unit by unit.

    Parameters
    ----------
    model: a loaded HF causal LM on the CPU (or a PEFT model around one). Its parameters are
        moved into the host store and keep their identity as views of it (HostStore.bind): what
        trains views its fp32 master, so the model object is the model that trains, as usable
        and savable as stock's. With `load_weights`, `model` is a meta skeleton instead.
    config: an EngineConfig (engine/config.py); or its fields as keywords (`device=`,
        `compute_dtype=`, `resident_layers=`, ...), not both.
    decay_names: parameter names that get weight decay (Trainer.get_decay_parameter_names).
    sharding: data parallel (engine/distributed.py): this rank keeps a slice of the fp32 state.
    load_weights: fills the freshly allocated store of a meta skeleton, e.g. straight from
        safetensors files (checkpoint.stream_load.engine_from_checkpoint builds one so).

    The engine keeps a copy of the model's config for its templates and masks: what it changes
    for a batch (document-wise attention) never reaches the user's model.
    """

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None = None,
        *,
        decay_names=None,
        sharding=None,
        load_weights: Callable[[HostStore], None] | None = None,
        **options,
    ):
        super().__init__()
        if config is not None and options:
            raise TypeError(f"pass an EngineConfig or its fields, not both (got {sorted(options)})")
        config = config if config is not None else EngineConfig(**options)
        if not config.planned:
            raise MegaTrainError("resident_layers, offload_activations and lean_resident must be settled here; 'auto' is "
                                 "settled by hf_megatrain.planner.plan_run before the engine is built (prepare() "
                                 "and the trainer call it).")
        # A PEFT model trains through its underlying causal LM: the adapter layers are part of
        # the decoder layers (so of the templates), and only they are trainable.
        self.peft_model = model if is_peft_model(model) else None
        if self.peft_model is not None:
            model = model.get_base_model()
        self.spec = spec_for(model.config)
        _check_model(model, self.spec, skeleton=load_weights is not None)
        if self.spec.generic:  # outside the registry: trained only once a small copy equals stock
            verify(self.spec, model.config)
        check_peft_model(self.peft_model)  # a PEFT method the engine does not run exactly: refused in one line
        # prompt tuning / p-tuning: the PeftModel's prompt encoder is part of the embedding unit (engine/prompts.py)
        prompt = prompt_encoder(self.peft_model)
        # prefix tuning: its tokens enter each layer's attention, not the rows (engine/prompts.py)
        self.prefix = prompt.prefix if prompt else None
        self.virtual_tokens = prompt.tokens if prompt and not self.prefix else 0
        self._prefix_caches = None  # the caches each layer gets the prefix in
        if self.prefix:
            self._prefix_caches = check_prefix_family(self.spec, model.config, model.get_submodule(self.spec.layers),
                                                    self.prefix)
        if prompt and not self.prefix:
            if self.spec.per_layer or self.spec.altup:  # made from the token ids, which PEFT does not pass
                raise MegaTrainError(f"prompt tuning and p-tuning on {self.spec.model_type}: its per-layer embeddings "
                                     "are made from the token ids, which PeftModel.forward replaces by embeddings; "
                                     "use LoRA for this family.")
        if prompt:
            self.spec = replace(self.spec, prompt=prompt.path)
        with attached(model, prompt.module, prompt.path) if prompt else nullcontext():  # the engine reads it from the base model
            self._lay_out(model, config, decay_names, sharding, load_weights)
        self.set_mlp_tiling(config.mlp_tile_tokens)
        cfg = self.config
        self.stochastic = any(
            float(getattr(cfg, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "router_jitter_noise", "hidden_dropout")
        ) or any(isinstance(m, nn.Dropout) and m.p > 0 for t in self._templates.values() for m in t.module.modules()) \
            or any(float(getattr(cfg, k, 0.0) or 0.0) > 0 for k in ("residual_dropout", "input_jitter_noise"))
        if float(getattr(cfg, "embedding_dropout", 0.0) or 0.0) > 0:  # StarCoder2 drops out the embeddings
            raise MegaTrainError(f"embedding_dropout={cfg.embedding_dropout} is applied outside the decoder layers, "
                                 "which the engine does not do yet; set config.embedding_dropout = 0.")
        self.rotary = self._build_rotary(model)
        self.rotary_list = self._build_rotary_list(model)
        self.rotary_per_kind = self.rotary is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.loss_chunk_tokens = loss_chunk(cfg.vocab_size, self.device.type, config.loss_chunk_tokens)
        self.pipeline: Pipeline = self._make_pipeline(config)
        self.activations = Activations(self.device, config.offload_activations, config.activation_lookahead)
        self._embed_rng: list[tuple] = []  # per micro-batch: the RNG state its embedding dropout drew from
        self._extra_activations: list[Activations] = []  # micro-batches after the first (forward_backward_many)
        self._grad_scratch: torch.Tensor | None = None  # their weight gradients, before they are summed
        self._listener: GradListener | None = None
        self.writer = None  # (engine, output_dir, dtype) -> files; see save_pretrained
        # Set to a list to have each training call (and each evaluation forward) leave there, per
        # micro-batch, a dict of its head statistics (token count, summed entropy, top-1 hits:
        # loss.chunked_head_loss) and, for a MoE with its router loss on, the load-balancing loss
        # before its coefficient ('aux_loss', the model's `outputs.aux_loss`); TRL's SFT metrics read them.
        self.head_stats: list[dict] | None = None
        # The token loss of the chunked head (loss.chunked_head_loss): 'nll', or TRL's 'dft' (SFTConfig.loss_type).
        self.loss_type = "nll"
        # The further per-row sums a RowLoss reads (loss.row_head_loss's extra; DPO's WPO: 'log_sum_sq_probs').
        self.row_stats: tuple[str, ...] = ()
        self._inputs = BatchInputs(self.config, self.spec, self.device)  # checks and moves each batch (inputs.py)

    def _lay_out(self, model, config: EngineConfig, decay_names, sharding, load_weights) -> None:
        """The units, the host store (filled and bound to the model's parameters) and the templates."""
        self.device = config.device
        self.model_class = type(model)
        self.compute_dtype = config.compute_dtype
        self.config = copy.deepcopy(model.config)  # the engine's own: see the class docstring
        if decay_names is None:
            decay_names = [n for n, _ in model.named_parameters()]
        # a parameter stock's step leaves without a gradient is never moved by its optimizer; here its gradient
        # is zero, and out of weight decay no optimizer moves it either (selfcheck.stock_leaves_without_grad)
        decay_names = [n for n in decay_names
                       if not stock_leaves_without_grad(self.spec.model_type, n, self.spec.layers)]
        self.units = build_units(model, self.spec, decay_names)
        self._tied = tied_head(model, self.spec, self.units)
        self._tied_slot = tied_embed_slot(model, self.spec, self.units) if self._tied else None
        if sharding is not None and config.transient_grads:
            raise MegaTrainError("transient_grads is not combined with data parallel yet: the ranks' gradients are "
                                 "summed before each step; leave it off.")
        if sharding is not None and config.lean_streamed:
            raise MegaTrainError("lean_streamed is not combined with data parallel yet: each rank holds only a "
                                 "slice of the fp32 master, so the master cannot be what streams; leave it off.")
        if sharding is not None and config.gpu_grad_layers:
            raise MegaTrainError("gpu_grad_layers is not combined with data parallel yet: each rank keeps a slice "
                                 "of every gradient in host RAM; leave it at 0.")
        self.resident_layers = mark_resident(self.units, config.resident_layers, config.lean_resident,
                                             config.lean_streamed, config.gpu_grad_layers)
        self.engine_config = replace(config, resident_layers=self.resident_layers,
                                     lean_resident=any(u.no_compute_copy and u.resident for u in self.units),
                                     lean_streamed=any(u.no_compute_copy and not u.resident for u in self.units),
                                     gpu_grad_layers=sum(u.grad_on_gpu for u in self.units))
        pin = self.device.type == "cuda"
        if load_weights is None:
            self.store = HostStore.from_model(model, self.units, self.compute_dtype, pin=pin, device=self.device,
                                              sharding=sharding, transient_grads=config.transient_grads)
        else:  # a meta skeleton: its weights come from the loader
            self.store = HostStore(self.units, self.compute_dtype, pin=pin, device=self.device, sharding=sharding,
                                   transient_grads=config.transient_grads)
            load_weights(self.store)
            self.store.bind(model)
        _say_what_the_model_shows(self.store, sharding)
        # The model's own Parameter objects (views of the store), in a plain list: not registered as the
        # engine's, but what parameters() yields, so that what counts the wrapped model's parameters
        # (Trainer's "Number of trainable parameters") counts the model's.
        self._model_params = list(model.parameters())
        self._templates = self._build_templates(model)

    @property
    def background_host_jobs(self) -> bool:
        return self.engine_config.background_host_jobs

    @property
    def aux_coef(self) -> str:
        """The config field of the family's MoE load-balancing coefficient (router_aux_loss_coef; JetMoE's
        aux_loss_coef), for what reads the coefficient outside the engine."""
        return self.spec.aux_coef

    @property
    def mlp_tile_tokens(self) -> int | None:
        return self.engine_config.mlp_tile_tokens

    # -- construction -----------------------------------------------------------------------
    def _build_templates(self, model) -> dict[str, Template]:
        """One template per distinct unit structure: a meta copy of the model's own module."""
        cfg = {id(model.config): self.config}  # templates read the engine's config copy, never the user's
        layers = model.get_submodule(self.spec.layers)
        spec = self.spec
        multiplier = getattr(self.config, spec.embed_multiplier) if spec.embed_multiplier else None
        if spec.embed_scale is not None:
            multiplier = spec.embed_scale(self.config)
        embed, norm, head = (model.get_submodule(p) for p in (spec.embed, spec.norm, spec.lm_head))
        # where NEFTune's hook would sit: the embedding template's first module must be it (set_neftune)
        self._embed_is_input = _input_embeddings(model) is embed
        # the embedding unit's other parts (absolute positions, OPT's project_in) and the head's (project_out)
        parts = {part: _submodule_or_none(model, path) for part, path in spec.embed_parts + spec.head_parts}
        parts = {k: m for k, m in parts.items() if m is not None}  # OPT's projections exist for some widths only
        if spec.positions:
            parts["positions"] = _Table(model.get_buffer(spec.positions)) if spec.positions_buffer \
                else model.get_submodule(spec.positions)
        copies = {k: meta_copy(m, cfg) for k, m in parts.items()}
        embed_sources = {"embed": embed, **{k: parts[k] for k in ("positions", "project_in", "embed_norm", "altup",
                                                                  "prompt") if k in parts}}
        templates = {
            "embed": Template(_Embed(meta_copy(embed, cfg), multiplier, copies.get("positions"),
                                     copies.get("project_in"), self._embed_dropout(model), copies.get("embed_norm"),
                                     copies.get("altup"), copies.get("prompt"), self.virtual_tokens, self.prefix),
                              self._template_buffers(embed_sources)),
            "head": Template(_Head(meta_copy(norm, cfg), meta_copy(head, cfg), spec.logits, self.config,
                                   copies.get("project_out"), copies.get("altup_out")),
                             self._template_buffers({"norm": norm, "lm_head": head,
                                                     **{k: parts[k] for k in ("project_out", "altup_out")
                                                        if k in parts}})),
        }
        if self._per_layer_unit is not None:
            templates["per_layer"] = self._per_layer_template(model, cfg)
        self._template_source = {}  # template key: the layer it copies
        for unit in self.units:
            if unit.kind == "layer" and unit.template_key not in templates:
                self._template_source[unit.template_key] = unit.layer
                source = layers[unit.layer]
                tmpl = Template(meta_copy(source, cfg), self._template_buffers({"": source}))
                routers = [p for p in spec.router_paths if _has_submodule(source, p)]  # dense layers of an MoE have none
                if routers:  # several: one layer's logits come stacked (JetMoE's attention and MLP routers)
                    tmpl.capture(routers[0] if len(routers) == 1 else routers, spec.router_index)
                templates[unit.template_key] = tmpl
        # A decoder layer's persistent buffers (saved with the weights, so one layer's own values: GLM-4-MoE's
        # router e_score_correction_bias) reach its template call beside its weights, on the compute device; so do
        # its other buffers where they differ from those of the layer its template copies (PSOFT's factors
        # of that layer's own weight), which the template would otherwise give every layer.
        self._layer_buffers = {}
        for unit in self.units:
            if unit.kind == "layer":
                own = persistent_buffers(layers[unit.layer])
                if any(b.device.type == "meta" for b in own.values()):
                    raise MegaTrainError(f"decoder layer {unit.layer} has a persistent buffer without a value (a "
                                         "meta skeleton not filled from its checkpoint).")
                source = dict(layers[self._template_source[unit.template_key]].named_buffers())
                for name, b in layers[unit.layer].named_buffers():
                    if name not in own and b.device.type != "meta" and not _same(b, source.get(name)):
                        own[name] = b
                if own:
                    self._layer_buffers[unit.index] = {k: self._buffer_on_device(k, b) for k, b in own.items()}
        return templates

    def _per_layer_template(self, model, cfg: dict) -> Template:
        """The per-layer unit's template (Gemma 3n/4): copies of the modules that make the per-layer inputs, run by
        the base model's own methods (per_layer.PerLayerInputs); its buffers are those modules' and the base
        model's own."""
        parts = {path.rpartition(".")[2]: model.get_submodule(path) for path in self.spec.per_layer}
        base = model.get_submodule(self.spec.per_layer[0].rpartition(".")[0])
        module = PerLayerInputs(base, {k: meta_copy(m, cfg) for k, m in parts.items()}, self.config)
        buffers = self._template_buffers(parts)
        buffers.update({k: self._buffer_on_device(k, b) for k, b in base_buffers(base).items()})
        return Template(module, buffers)

    @property
    def _layer_units(self) -> list:
        """The decoder layers' units, in forward order."""
        return [u for u in self.units if u.kind == "layer"]

    @property
    def _per_layer_unit(self):
        """The per-layer embeddings' unit (Gemma 3n/4 with hidden_size_per_layer_input), or None."""
        return next((u for u in self.units if u.kind == "per_layer"), None)

    def _token_embeds(self, x: torch.Tensor) -> torch.Tensor:
        """The token embeddings in the embedding unit's output: what masks, rotary embeddings and the per-layer
        unit are made from (AltUp's first input: Gemma 3n's stack begins with them)."""
        return x[0] if self.spec.altup else x

    def _head_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output as the head takes it, [batch, seq, width]: AltUp's [inputs, batch, seq, hidden]
        with each token's inputs side by side, so the loss's token rows stay rows (the head unstacks them)."""
        return x.permute(1, 2, 0, 3).flatten(2) if self.spec.altup else x

    def _from_head_rows(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The head's input gradient in the layers' layout (the inverse of _head_rows)."""
        if not self.spec.altup or grad is None:
            return grad
        return grad.unflatten(-1, (-1, self.config.hidden_size)).permute(2, 0, 1, 3).contiguous()

    def _per_layer_forward(self, preps: list, ctxs: list) -> None:
        """The per-layer unit's forward (no grad): each micro-batch's per-layer inputs, from its ids and token
        embeddings, kept in its batch context for the layers."""
        unit = self._per_layer_unit
        if unit is None:
            return
        pipe = self.pipeline
        w = pipe.weights(unit.index)
        named = dict(zip((s.local for s in unit.slots), Template.views(w, unit.slots)))
        with pipe.span("compute"):
            for prep, ctx in zip(preps, ctxs):
                ctx.sides.per_layer = self._templates["per_layer"].call(named, prep.ids, ctx.sides.embeds)
        pipe.release(unit.index)

    def _per_layer_backward(self, preps: list, ctxs: list, grad_xs: list) -> None:
        """The per-layer unit's backward, after every layer's: recomputed from the ids and the token embeddings
        with the gradients the layers sent back for their slices as its seed; its weight gradient leaves as any
        unit's, and its token embeddings' gradient joins the first layer's (grad_xs) for the embedding."""
        unit = self._per_layer_unit
        if unit is None:
            return
        pipe = self.pipeline
        w = pipe.weights(unit.index)
        acc = None
        with pipe.span("compute"):
            for k, (prep, ctx) in enumerate(zip(preps, ctxs)):
                sides = ctx.sides
                gbuf = self._grad_target(unit, k, len(preps))

                def run(named, ids=prep.ids, embeds=sides.embeds):
                    e = embeds.detach().requires_grad_()
                    return [self._templates["per_layer"].call(named, ids, e)], [e]

                seed = sides.per_layer_grad if sides.per_layer_grad is not None else torch.zeros_like(sides.per_layer)
                (grad_e,) = recompute_grads(unit.slots, w, gbuf, run, [seed])
                self._token_embeds(grad_xs[k]).add_(grad_e)
                sides.per_layer = sides.per_layer_grad = sides.embeds = None
                acc = self._accumulate(acc, gbuf, len(preps))
        if acc is not None:
            pipe.emit_grad(unit.index, acc)
        pipe.release(unit.index)

    def _embed_dropout(self, model) -> float:
        """The probability of the dropout the base model applies to the embeddings' sum (spec.embed_dropout: a
        Dropout module or a float attribute of the base model)."""
        if not self.spec.embed_dropout:
            return 0.0
        base = model.get_submodule(self.spec.embed.rpartition(".")[0])
        drop = getattr(base, self.spec.embed_dropout)
        return float(drop.p if isinstance(drop, nn.Dropout) else drop)

    def _template_buffers(self, sources: dict) -> dict:
        """The real buffers of the modules a template copies (a template lives on meta), on the compute
        device, by their names in the template: e.g. Gemma's embedding scale. Floating ones take the compute
        dtype (_buffer_on_device says which)."""
        out = {}
        for prefix, module in sources.items():
            for name, buf in module.named_buffers():
                if buf.device.type == "meta":
                    raise MegaTrainError(f"{type(module).__name__}.{name} is a buffer without a value (a meta "
                                         "skeleton); hf_megatrain cannot rebuild it.")
                out[f"{prefix}.{name}" if prefix else name] = self._buffer_on_device(name, buf)
        return out

    def _buffer_on_device(self, name: str, buf: torch.Tensor) -> torch.Tensor:
        """A buffer on the compute device. A floating one takes the compute dtype, as a stock model's buffers
        do when its parameters are cast (`model.to(torch.bfloat16)` casts them too): a forward that mixes one
        into a matmul with the activations (MiniMax's lightning-attention decays) runs, and a scale (Gemma 4's
        layer_scalar, Falcon-H1's mup_vector) keeps the hidden states in the compute dtype. Except those of a
        layer's MoE block (the module that holds its router: DeepSeek's e_score_correction_bias, LFM2-MoE's
        expert_bias), which HF's routers add to scores they compute in fp32: they stay fp32, as under stock's
        autocast. In fp32 nothing changes."""
        blocks = tuple(p.rpartition(".")[0] + "." for p in self.spec.router_paths)
        keep = not buf.is_floating_point() or any(name.startswith(b) for b in blocks if b != ".")
        return buf.to(self.device, dtype=None if keep else self.compute_dtype)

    def set_mlp_tiling(self, tokens: int | None) -> None:
        """Run every layer's MLP on sequence tiles of at most `tokens` tokens; None (or 0) restores
        the MLPs' own forward. Only the engine's templates are patched, never the user's model."""
        self.engine_config = replace(self.engine_config, mlp_tile_tokens=tokens or None)
        for key, tmpl in self._templates.items():
            # a hybrid stack's mixer-only layers (Mamba, short conv) have no per-token block: they run untiled
            if key.startswith("layer") and self.spec.mlp and _has_submodule(tmpl.module, self.spec.mlp):
                mlp = tmpl.module.get_submodule(self.spec.mlp)
                tile_mlp(mlp, tokens) if tokens else untile_mlp(mlp)

    def set_neftune(self, alpha: float | None) -> None:
        """Add NEFTune's noise (Trainer's neftune_noise_alpha) to the token embeddings of every training
        forward, as transformers' hook on get_input_embeddings() adds it; None turns it off. Evaluation (the
        engine in eval mode) draws none, as the hook draws none with the model in eval mode."""
        if alpha and not self._embed_is_input:
            raise MegaTrainError(f"neftune_noise_alpha: {self.spec.model_type}'s input embeddings are not the "
                                 f"module the engine embeds with ({self.spec.embed}); leave neftune_noise_alpha unset.")
        self._templates["embed"].module.noise_alpha = alpha or None

    def _build_rotary_list(self, model) -> nn.ModuleList | None:
        """GraniteMoE-SWA's rotary modules, one per base (ArchSpec.rotary_list), rebuilt from their own configs
        (each the model's with its base) as _build_rotary rebuilds one: inv_freq is a non-persistent buffer."""
        if self.spec.rotary_list is None:
            return None
        return nn.ModuleList(type(m)(config=m.config) for m in model.get_submodule(self.spec.rotary_list)).to(self.device)

    def _build_rotary(self, model) -> nn.Module | None:
        if self.spec.rotary is None:  # no rotary embeddings (Jamba, Mamba, Kimi-Linear): layers get none
            return None
        src = model.get_submodule(self.spec.rotary)
        rotary = type(src)(config=self.config)  # inv_freq is a non-persistent buffer: rebuild it
        return rotary.to(self.device)

    def _make_pipeline(self, config: EngineConfig) -> Pipeline:
        if self.device.type == "cuda":
            from .cuda_pipeline import CudaPipeline

            return CudaPipeline(self.store, self.device, depth=config.prefetch_depth, grad_slots=config.grad_slots,
                                staging_slabs=config.staging_slabs)
        return HostPipeline(self.store, self.device, asynchronous=config.background_host_jobs)

    # -- nn.Module behaviour that Trainer relies on ------------------------------------------
    def parameters(self, recurse: bool = True):
        """The model's parameters (views of the store), as the model it stands for would give them."""
        return iter(self._model_params)

    def train(self, mode: bool = True):
        super().train(mode)
        for t in self._templates.values():
            t.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.pipeline.finish()
        self.store.zero_grad()

    @contextmanager
    def prompt_disabled(self):
        """The engine as the base model, without its prompt-learning adapter (prompt tuning's virtual tokens, prefix
        tuning's keys and values): what PeftModel.disable_adapter gives a prompt-learning model, whose forward is
        then the base model's. For forward-only passes (a preference trainer's reference); nothing without one."""
        embed = self._templates["embed"].module
        saved = self.prefix, self.virtual_tokens, embed.prefix, embed.virtual_tokens
        self.prefix, self.virtual_tokens, embed.prefix, embed.virtual_tokens = None, 0, None, 0
        try:
            yield
        finally:
            self.prefix, self.virtual_tokens, embed.prefix, embed.virtual_tokens = saved

    def synchronize(self) -> None:
        """Every gradient on the host and every optimizer step applied (before saving, reading).

        Every step, on whichever thread, clears its unit's `store.ready` before it is queued and
        sets it when it has run (or failed), so waiting on those waits for every step."""
        self.pipeline.finish()
        self.store.wait_ready()

    def save_pretrained(self, output_dir: str, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """Write what the model has learnt so that `from_pretrained` loads it: the full model, or
        for a LoRA run the adapters (PeftModel.from_pretrained), plus the tokenizer when given.
        The engine's builder says how (`writer`: hf_megatrain.prepare and MegaTrainTrainer set it);
        the files are the checkpoint package's business, not the engine's."""
        if self.writer is None:
            raise MegaTrainError("this engine was built without a writer; build it with hf_megatrain.prepare() "
                                 "or MegaTrainTrainer, or save with hf_megatrain.checkpoint.hf_format.save_hf_model.")
        self.synchronize()
        self.writer(self, output_dir, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)

    def wait_for_gradients(self) -> None:
        """Every gradient emitted so far is in the host accumulators (raises a failed accumulation)."""
        self.pipeline.finish()

    # -- what the optimizer, the trainer and the benchmarks use ------------------------------
    def listen(self, listener: GradListener | None) -> None:
        """Tell `listener` when each unit's gradient is final, from the next backward on, until
        `listen(None)`; a backward that fails stops telling it and calls its backward_failed()."""
        self._listener = listener
        self.pipeline.on_final_grad = listener.final_grad if listener is not None else None

    def attach_timeline(self, timeline) -> None:
        """Record busy spans of H2D, compute, D2H and the host jobs into `timeline` (None: stop)."""
        self.pipeline.timeline = timeline

    @property
    def timeline(self):
        return self.pipeline.timeline

    def host_span(self, lane: str):
        """A busy span of host work on `lane` for the attached timeline (nothing without one)."""
        timeline = self.pipeline.timeline
        return timeline.host_span(lane) if timeline is not None else nullcontext()

    @property
    def sharding(self):
        """The data-parallel Sharding, or None in one process."""
        return self.store.sharding

    def barrier(self) -> None:
        """Every data-parallel rank reaches this point (nothing in one process)."""
        if self.store.sharding is not None:
            self.store.sharding.barrier()

    # -- inspection API (tests rely on it) -------------------------------------------------
    def named_grads(self):
        """(name, fp32 CPU gradient) for every parameter of the original model: a copy, as it is
        now. The host accumulators are reused by every step (the next first contribution is
        copied in, the clipped step scales them in place), so views of them would change under
        whoever keeps them, and views of host gradients beside copies of GPU-kept ones would
        change unevenly.

        Waits for every pending host job that writes gradients: accumulation, and a step that
        is still clipping them in place."""
        self.synchronize()
        grads = [_snapshot(self.store.grad_or_zeros(u.index)) for u in self.units]
        yield from self.store.named([self.store.full(grads, u.index) for u in self.units])

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the accumulated gradients, computed as torch.nn.utils.clip_grad_norm_ does.

        On a GPU the per-parameter norms were taken on the device as each gradient left it; on
        the CPU they are taken from the accumulators (bit-identical to stock).
        """
        self.synchronize()  # every contribution landed, and no step still clipping in place
        if self.store.sharding is not None:  # each rank holds a slice: sum the squares over ranks
            local = torch.zeros((), dtype=torch.float64)
            for u in self.units:
                if self.store.grad_count[u.index]:
                    local += self.store.grad[u.index].double().square().sum().cpu()
            return self.store.sharding.all_reduce(local).sqrt().float()
        return self._global_norm(self.pipeline.grad_norms())

    def _global_norm(self, per_unit: list[torch.Tensor]) -> torch.Tensor:
        """The norm of every parameter's norm, in the model's parameter order (clip_grad_norm_'s),
        from each unit's per-parameter norms in slot order."""
        by_name = {s.name: per_unit[u.index][j] for u in self.units for j, s in enumerate(u.train_slots)}
        return torch.linalg.vector_norm(torch.stack([by_name[n] for n in self.store.order]), 2)

    def named_master_params(self):
        """(name, fp32 CPU master weight) for every parameter of the original model: a copy, as it
        is now (named_grads says why)."""
        self.synchronize()
        masters = [_snapshot(m) for m in self.store.master]
        yield from self.store.named([self.store.full(masters, u.index) for u in self.units])

    @property
    def num_parameters(self) -> int:
        return self.store.num_parameters

    # -- the schedule ---------------------------------------------------------------------------
    def _unit_plan(self, backward: bool) -> list[int]:
        n = len(self.units)
        fwd = list(range(n))  # embed, layers, head
        return fwd + list(range(n - 2, -1, -1)) if backward else fwd

    def _layer_call(self, unit, weights, x, ctx):
        tmpl = self._templates[unit.template_key]
        named = dict(zip((s.local for s in unit.slots), Template.views(weights, unit.slots)))
        named.update(self._layer_buffers.get(unit.index, {}))
        carried = ctx.carried.forward_kwargs(unit.layer) if ctx.carried else {}
        with ctx.attention():
            if carried:  # GLM-5: the layer's top-k goes on to the next layer (engine/carried.py)
                out = ctx.carried.took(unit.layer, tmpl.call_whole(named, x, **ctx.layer_kwargs(unit),
                                                                   **ctx.sides.forward_kwargs(unit.layer), **carried))
            else:
                out = tmpl.call(named, x, **ctx.layer_kwargs(unit), **ctx.sides.forward_kwargs(unit.layer))
        ctx.sides.noted(unit.layer)
        return out

    def _head_weights(self, head_flat, embed_flat):
        """Names, tensors and trainable flags of what the head reads (a tied lm_head is the embedding)."""
        head = self.units[-1]
        names = [s.local for s in head.slots]
        weights = Template.views(head_flat, head.slots)
        trainable = [s.trainable for s in head.slots]
        if self._tied:
            embed_slot = self._tied_slot
            names.append(self._tied)
            weights.append(Template.views(embed_flat, [embed_slot])[0])
            trainable.append(embed_slot.trainable)
        return names, weights, trainable

    def _run_head(self, names):
        tmpl = self._templates["head"]
        return lambda ws, h: tmpl.call(dict(zip(names, ws)), h)

    def _as_peft_passes(self, batch: dict) -> dict:
        """The batch as a prompt-learning PeftModel hands it to its base model (engine/prompts.py)."""
        if not self.prefix:
            return with_virtual_tokens(batch, self.virtual_tokens)
        if batch.get("attention_mask") is not None and self.spec.has_router_loss \
                and getattr(self.config, "output_router_logits", False):
            raise MegaTrainError(f"prefix tuning on {self.spec.model_type} with output_router_logits and an "
                                 "attention mask: the load-balancing loss weighs each token's router output by the "
                                 "mask, which PEFT lengthens by the prefix, so stock fails there too (tensor sizes "
                                 "do not match). Set config.output_router_logits = False, or pass no attention "
                                 "mask (padding-free rows).")
        return with_prefix(batch, self.prefix.tokens, count_from_mask=self.spec.positions_from_mask)

    def _embed_call(self, named: dict, prep):
        """The embedding unit on one micro-batch; its positions as the base model computes them. Under prefix
        tuning: (hidden states, every layer's prefix keys and values)."""
        tmpl = self._templates["embed"]
        call = tmpl.call_whole if self.prefix else tmpl.call
        if not self.spec.positions:
            return call(named, prep.ids)
        return call(named, prep.ids, prep.pos, prep.mask)

    @contextmanager
    def _embed_rng_for(self, k: int, save: bool):
        """The embedding dropout's random numbers (GPT-2's embd_pdrop) and NEFTune's noise: those of micro-batch
        k's forward drawn again by its recompute, as a layer's are (_BatchContext.rng_for)."""
        tmpl = self._templates["embed"]
        if not (self.training and tmpl.module.stochastic):
            yield
            return
        dev = self.device
        cuda = dev.type == "cuda"
        if save:
            self._embed_rng.append((torch.get_rng_state(), torch.cuda.get_rng_state(dev) if cuda else None))
            yield
            return
        cpu_state, cuda_state = self._embed_rng[k]
        with torch.random.fork_rng(devices=[dev] if cuda else [], device_type=dev.type if cuda else "cuda"):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, dev)
            yield

    def _positions(self, prep, batch: dict):
        """OPT's positions: without position ids in the batch, its forward counts them from the 2D mask
        (cumsum(mask) * mask - 1: a left-padded row starts at 0 where its tokens start), for its positions and
        its layers; every other family's are the engine's (0, 1, ... or the batch's own). Token type ids, which
        GPT-2's and CTRL's forwards embed and add, are refused rather than left out."""
        if self.spec.positions and batch.get("token_type_ids") is not None:
            raise MegaTrainError(f"the batch has token_type_ids, whose embeddings {self.spec.model_type}'s model "
                                 "forward adds to the hidden states, which the engine does not; leave them out.")
        if not self.spec.positions_from_mask or batch.get("position_ids") is not None:
            return prep
        n = self.prefix.tokens if self.prefix else 0  # prefix tuning: counted over the prefix's ones, then cut
        mask = prep.mask
        if mask is None:  # all ones: 0, 1, ... (what the engine gave) or, after a prefix, n, n + 1, ...
            if not n:
                return prep
            mask = torch.ones(prep.ids.shape[0], n + prep.ids.shape[1], dtype=torch.long, device=prep.ids.device)
        pos = torch.cumsum(mask, dim=1)
        return prep._replace(pos=(pos * mask - 1).long()[:, n:])

    def _activation_sets(self, n: int) -> list[Activations]:
        """One store of layer inputs per micro-batch of a step (the first is `self.activations`)."""
        while len(self._extra_activations) < n - 1:
            base = self.activations
            self._extra_activations.append(Activations(self.device, base.offload, base.lookahead))
        return [self.activations] + self._extra_activations[: n - 1]

    def _forward_layers(self, preps: list, keep: bool):
        """Embedding and decoder layers without grad, for each micro-batch in `preps` (what
        BatchInputs.prepare returns) while a unit's weights are in; keeps each layer's inputs when asked."""
        pipe = self.pipeline
        embed = self.units[0]
        e_w = pipe.weights(embed.index)
        xs, ctxs = [], []
        self._embed_rng = []
        with torch.no_grad():
            with pipe.span("compute"):
                for prep in preps:
                    with self._embed_rng_for(len(self._embed_rng), save=True):
                        out = self._embed_call(dict(zip((s.local for s in embed.slots),
                                                        Template.views(e_w, embed.slots))), prep)
                    x, prefix = out if self.prefix else (out, None)
                    xs.append(x)
                    ctxs.append(_BatchContext(self, self._token_embeds(x), prep.mask, prep.pos, prep.docs, prefix))
            self._per_layer_forward(preps, ctxs)
            acts = self._activation_sets(len(preps)) if keep else None
            for a in acts or ():
                a.reset()
            routers = [{} for _ in preps]  # per micro-batch: layer -> its router logits
            draws = self.training and self.spec.layer_draws
            for unit in self._layer_units:
                w = pipe.weights(unit.index)
                for k, ctx in enumerate(ctxs):
                    if keep:
                        acts[k].put(unit.layer, xs[k])
                    if draws:  # LayerDrop's number, drawn (on the CPU) before each layer as its base model draws it
                        torch.rand([])
                    with pipe.span("compute"), ctx.rng_for(unit, save=True), ctx.router_capture(unit) as cap:
                        xs[k] = self._layer_call(unit, w, xs[k], ctx)
                    if cap:  # an MoE layer's router ran (a dense layer of an MoE model has none)
                        routers[k][unit.layer] = _router_logits(cap, preps[k][0].shape[0])
                pipe.release(unit.index)
        return [self._head_rows(x) for x in xs], ctxs, acts, routers, e_w

    def forward_backward(self, batch: dict, num_items_in_batch=None, scale: float = 1.0,
                         aux_scale: float = 1.0) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch; weight gradients accumulate.

        The gradient is that of `scale * loss`; the returned loss (detached, on the compute
        device) is not scaled, exactly what `model(**batch).loss` would be. `aux_scale` weighs
        the MoE load-balancing term within the loss (TRL averages it over accumulation steps).
        """
        return self.forward_backward_many([batch], num_items_in_batch, scale, aux_scale)[0]

    def forward_backward_many(self, batches: list[dict], num_items_in_batch=None, scale: float = 1.0,
                              aux_scale: float = 1.0, head_loss=None) -> list[torch.Tensor]:
        """`forward_backward` of each micro-batch of one optimizer step, run layer by layer.

        Every micro-batch goes through a unit while its weights are in, so each streamed unit
        crosses PCIe once for the forward and once for the backward however many micro-batches
        the step has, and its gradient, summed over them on the device in their order, leaves
        once. The numbers are those of calling forward_backward on each in turn (the sums are
        the same fp32 additions in the same order); the price is that every layer's inputs of
        every micro-batch are kept at once. Returns each micro-batch's loss.

        num_items_in_batch: one count for all (Trainer's, for the whole step), or one per batch.
        head_loss: a loss of the caller's in place of the causal-LM loss (see _custom_head_loss).
        """
        try:
            return self._forward_backward(batches, num_items_in_batch, scale, aux_scale, head_loss)
        except BaseException:
            listener = self._listener
            if listener is not None:  # an early step armed for this backward must not outlive it
                self.listen(None)
                listener.backward_failed()
            raise

    def gradient_norm(self, batches: list[dict], num_items_in_batch=None, scale: float = 1.0,
                      aux_scale: float = 1.0, head_loss=None) -> torch.Tensor:
        """The global gradient norm that `forward_backward_many` of these micro-batches would leave
        for clipping, computed as grad_norm() computes it, by a forward and backward that keeps no
        gradient and steps nothing: each unit's per-parameter norms are taken as its gradient is
        emitted, and the gradient is dropped. The RNG is put back as it was, so the pass that follows
        draws the same numbers (dropout).

        For exact clipping with transient_grads: the norm is known before the backward that steps
        each unit as it finishes (the host optimizer's step_during_backward(clip_norm=...)). The gradients of
        that backward are this pass's only as far as the kernels are deterministic: bit for bit on
        the CPU. It costs one more forward and backward per step, with no gradient crossing PCIe."""
        if self.store.sharding is not None:
            raise MegaTrainError("gradient_norm is not combined with data parallel: each rank holds a slice.")
        pipe, listener = self.pipeline, self._listener
        cuda = self.device.type == "cuda"
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
        self._listener, pipe.on_final_grad = None, None  # nothing is stepped by this pass
        pipe.measured, pipe.measure_only = {}, True
        try:
            self._forward_backward(batches, num_items_in_batch, scale, aux_scale, head_loss)
        finally:
            pipe.measure_only = False
            self.listen(listener)
            torch.set_rng_state(rng[0])
            if cuda:
                torch.cuda.set_rng_state(rng[1], self.device)
        measured, pipe.measured = pipe.measured, {}
        return self._global_norm([measured[u.index].cpu() if u.index in measured else torch.zeros(len(u.train_slots))
                                  for u in self.units])

    def _forward_backward(self, batches: list[dict], num_items_in_batch, scale: float,
                          aux_scale: float, head_loss=None) -> list[torch.Tensor]:
        if self.store.transient and self.training and self._listener is None and not self.pipeline.measure_only:
            raise MegaTrainError("transient_grads keeps each gradient only until its step, so every backward must "
                                 "step its units as they finish: call the host optimizer's step_during_backward() before it "
                                 "(to clip, with clip_norm=(gradient_norm(...), max_norm)), with the step's "
                                 "micro-batches together in one call.")
        batches = [self._as_peft_passes(b) for b in batches]
        preps = [self._positions(self._inputs.prepare(b), b) for b in batches]
        require_labels(preps)
        pipe = self.pipeline
        pipe.start(self._unit_plan(backward=True))
        xs, ctxs, acts, routers, e_w = self._forward_layers(preps, keep=True)

        head = self.units[-1]
        h_w = pipe.weights(head.index)
        names, weights, trainable = self._head_weights(h_w, e_w)
        seed = torch.full((), scale, dtype=torch.float32, device=self.device)
        n_own = len(head.slots)
        losses, grad_xs, tied_grads, router_seeds = [], [], [], []
        head_grad = None
        if self.head_stats is not None:
            self.head_stats[:] = [{} for _ in preps]
        for k, (ids, mask, labels, pos, rows, docs) in enumerate(preps):
            items = num_items_in_batch[k] if isinstance(num_items_in_batch, (list, tuple)) else num_items_in_batch
            denom = loss_denominator(labels, items)
            stats = self.head_stats[k] if self.head_stats is not None else None
            with pipe.span("compute"):
                if isinstance(head_loss, RowLoss):  # a loss of per-row sums (TRL's preference losses)
                    loss, grad_x, grad_w = row_head_loss(
                        self._run_head(names), weights, xs[k], labels, lambda r, k=k: head_loss(k, r), seed,
                        self.loss_chunk_tokens, rows, trainable, extra=self.row_stats)
                elif head_loss is None:
                    loss, grad_x, grad_w = chunked_head_loss(
                        self._run_head(names), weights, xs[k], labels, denom, seed, self.loss_chunk_tokens, rows,
                        trainable, stats=stats, loss_type=self.loss_type,
                    )
                else:
                    loss, grad_x, grad_w, custom_seeds = self._custom_head_loss(
                        head_loss, k, names, weights, xs[k], trainable, seed, routers[k], mask)
                xs[k] = None
                own = [g.reshape(-1) for g in grad_w[:n_own] if g is not None]
                if own:  # summed over micro-batches in their order, as the host accumulator would
                    head_grad = torch.cat(own) if head_grad is None else head_grad.add_(torch.cat(own))
            tied_grads.append(grad_w[n_own].reshape(-1) if self._tied and grad_w[n_own] is not None else None)
            grad_xs.append(self._from_head_rows(grad_x))
            r_seeds = {}
            if head_loss is not None and not isinstance(head_loss, RowLoss):
                r_seeds = custom_seeds  # the caller's loss holds the router loss as far as it took it
            elif routers[k]:
                aux, r_seeds = self._router_loss(routers[k], mask, seed * aux_scale, stats)  # times 1.0 is exact
                loss = loss + aux * aux_scale
            router_seeds.append(r_seeds)
            losses.append(loss.detach())
        if head_grad is not None:
            pipe.emit_grad(head.index, head_grad)
        pipe.release(head.index)

        for unit in reversed(self._layer_units):
            w = pipe.weights(unit.index)
            acc = None
            for k, ctx in enumerate(ctxs):
                x_in = acts[k].get(unit.layer)  # also starts bringing back the next offloaded inputs
                gbuf = self._grad_target(unit, k, len(preps))
                with pipe.span("compute"):
                    grad_xs[k] = self._layer_backward(unit, w, gbuf, x_in, grad_xs[k], router_seeds[k].get(unit.layer),
                                                      ctx)
                    acc = self._accumulate(acc, gbuf, len(preps))
                del x_in  # free the activation as soon as its layer is done
            if acc is not None:
                pipe.emit_grad(unit.index, acc)
            pipe.release(unit.index)

        self._per_layer_backward(preps, ctxs, grad_xs)
        self._embed_backward(e_w, preps, grad_xs, tied_grads, [ctx.sides.prefix_grad for ctx in ctxs])
        return losses

    def _custom_head_loss(self, head_loss, k, names, weights, hidden, trainable, seed, routers, mask):
        """The head under a loss of the caller's (Trainer's compute_loss, a compute_loss_func, label
        smoothing) instead of the chunked causal-LM loss: the whole [B, T, vocab] logits are built with
        autograd, as the model's own forward builds them, and `head_loss(k, logits, aux)` returns micro-batch
        k's loss over them. `aux` (an MoE's load-balancing term times its coefficient, what the model adds to
        its loss; None without routers) is a leaf: its gradient says how much of it the loss took, and each
        layer's router gets that share of its own gradient, exactly. Returns (loss, grad_hidden, fp32 grads
        of `weights` (None where frozen), router seeds per layer)."""
        h = hidden.detach().requires_grad_()
        bound = [w.detach().requires_grad_() if t else w for w, t in zip(weights, trainable)]
        leaves = [b for b, t in zip(bound, trainable) if t]
        aux = unit_seeds = None
        if routers:
            aux, unit_seeds = self._router_loss(routers, mask, torch.ones((), device=self.device))
            aux = aux.detach().requires_grad_()
        with torch.enable_grad():
            loss = head_loss(k, self._run_head(names)(bound, h), aux)
            wrt = [h] + leaves + ([aux] if aux is not None else [])
            grads = torch.autograd.grad(loss, wrt, grad_outputs=seed.to(loss.dtype), materialize_grads=True,
                                        allow_unused=True)
        of_weights = iter(grads[1:1 + len(leaves)])
        grad_w = [next(of_weights).float() if t else None for t in trainable]
        seeds = {layer: g * grads[-1] for layer, g in unit_seeds.items()} if aux is not None else {}
        return loss.detach().float(), grads[0], grad_w, seeds

    def _grad_target(self, unit, k: int, n: int) -> torch.Tensor | None:
        """Where micro-batch k writes unit's weight gradient: the pipeline's buffer for the first
        (it is what leaves), an fp32 buffer for the later ones, which are added to it (fp32: a
        LoRA adapter's gradient is fp32 under a bf16 base). A streamed unit's comes from one
        scratch buffer on the device sized for the largest; a resident one's is made per use, as
        the pipeline makes one for a second contribution."""
        if not unit.n_train:
            return None
        if k == 0:
            return self.pipeline.grad_buffer(unit.index)
        if unit.resident or self.device.type != "cuda":
            return torch.empty(unit.n_train, dtype=torch.float32, device=self.device)
        if self._grad_scratch is None:  # as large as any unit that is not resident (the planner counts it)
            self._grad_scratch = torch.empty(slab_numel(self.units), dtype=torch.float32, device=self.device)
        return self._grad_scratch[: unit.n_train]

    @staticmethod
    def _accumulate(acc, grad, n: int):
        """acc + grad in fp32, the sum the host accumulator makes (its first contribution copied in)."""
        if grad is None:
            return acc
        if acc is None:
            return grad.float() if n > 1 else grad  # float() of an fp32 buffer is the buffer itself
        return acc.add_(grad)

    def _layer_backward(self, unit, w, gbuf, x_in, grad_out, router_seed, ctx):
        tmpl = self._templates[unit.template_key]

        side = ctx.sides.leaves(unit.layer)  # what it reads that other units made (per-layer input, shared KV)
        carried = ctx.carried.recompute_kwargs(unit.layer) if ctx.carried else {}  # what its forward was handed

        def run(named):
            x = x_in.detach().requires_grad_()
            with ctx.rng_for(unit, save=False), ctx.router_capture(unit) as cap, ctx.attention():
                out = tmpl.call({**named, **self._layer_buffers.get(unit.index, {})}, x,
                                **{**ctx.layer_kwargs(unit), **side.kwargs, **carried})
            outs = [out] + ([_router_logits(cap, x.shape[0])] if router_seed is not None else [])
            return outs + side.made_outputs(), [x] + side.leaves

        seeds = [grad_out] + ([router_seed] if router_seed is not None else []) + side.made_seeds
        grad_x, *grad_side = recompute_grads(unit.slots, w, gbuf, run, seeds)
        ctx.sides.take_grads(unit.layer, side, grad_side)
        return grad_x

    def _embed_backward(self, e_w, preps, grad_xs, tied_grads, prefix_grads):
        """The embedding unit's recompute and backward, seeded by the first layer's input gradient (and under
        prefix tuning by the gradients of the prefix keys and values the layers sent back)."""
        embed = self.units[0]
        if not embed.n_train:  # frozen embedding (LoRA): nothing to compute
            self.pipeline.release(embed.index)
            return
        acc = None
        # whether the hidden states carry a gradient: under prefix tuning only the prompt encoder may train
        tokens = any(s.trainable for s in embed.slots if not s.local.startswith("prompt."))
        with self.pipeline.span("compute"):
            for k, prep in enumerate(preps):
                gbuf = self._grad_target(embed, k, len(preps))

                def run(named, prep=prep, k=k):
                    with self._embed_rng_for(k, save=False):
                        out = self._embed_call(named, prep)
                    if not self.prefix:
                        return [out], []
                    return ([out[0]] if tokens else []) + [out[1]], []

                seeds = [grad_xs[k]] if tokens or not self.prefix else []
                seeds += [prefix_grads[k]] if self.prefix else []
                recompute_grads(embed.slots, e_w, gbuf, run, seeds)
                grad_xs[k] = prefix_grads[k] = None
                if tied_grads[k] is not None and len(embed.slots) > 1:
                    # the token embedding's part of the unit (absolute positions beside it): the two uses of the
                    # tied weight meet there in fp32 (the same sum: fp32 addition commutes)
                    slot = self._tied_slot
                    gbuf[slot.offset:slot.offset + slot.numel].add_(tied_grads[k])
                elif tied_grads[k] is not None:
                    # Both uses of a tied weight meet in fp32, as they would in an fp32 .grad.
                    tied_grads[k].add_(gbuf)
                    gbuf = tied_grads[k]
                acc = self._accumulate(acc, gbuf, len(preps))
        self.pipeline.emit_grad(embed.index, acc)
        self.pipeline.release(embed.index)

    def _router_loss(self, routers, mask, seed, stats: dict | None = None):
        """Mixtral-style load-balancing loss and d(loss)/d(router logits) for each layer.

        HF adds `coef * aux` to the loss when labels are given. The aux loss couples all
        layers (expert counts are summed over layers), so it is evaluated once on detached
        logit leaves and each layer's share of its gradient is fed in during that layer's
        recompute: exact, with no graph spanning layers.
        """
        leaves = {layer: r.detach().requires_grad_() for layer, r in routers.items()}
        with torch.enable_grad():
            aux = self._aux_loss(leaves, mask, stats)
            seeds = torch.autograd.grad(aux, list(leaves.values()), grad_outputs=seed, materialize_grads=True,
                                        allow_unused=True)
        return aux.detach(), dict(zip(leaves, seeds))

    def _aux_loss(self, routers: dict, mask, stats: dict | None = None) -> torch.Tensor:
        """coef * the family's own load-balancing loss over every MoE layer's router logits, as the
        causal LM adds it to the loss (number of experts from the config attribute the spec names).
        `stats` (a head_stats dict) receives the loss before the coefficient, as `outputs.aux_loss`."""
        cfg = self.config
        fn = self.spec.aux_loss(self.model_class)
        aux = fn(tuple(routers.values()), getattr(cfg, self.spec.experts), cfg.num_experts_per_tok, mask)
        if stats is not None:
            stats["aux_loss"] = aux.detach()
        return getattr(cfg, self.spec.aux_coef) * aux  # router_aux_loss_coef but for JetMoE's aux_loss_coef

    # -- evaluation -------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, labels=None, position_ids=None, return_logits=True, **kw):
        """Eval-mode forward: loss (when labels are given) and, optionally, the logits."""
        if self.training and torch.is_grad_enabled():
            # A training step that calls the model for a loss to backpropagate (stock Trainer's training_step
            # body, copied into an override) would get a loss that carries no gradient: say so instead.
            raise MegaTrainError("the engine was called as a model for a loss to backpropagate: its forward "
                                 "computes no gradients. Training runs through MegaTrainTrainer.training_step (an "
                                 "override must call super().training_step) or engine.forward_backward.")
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "position_ids": position_ids}
        batch = self._as_peft_passes(batch)
        prep = self._positions(self._inputs.prepare(batch), batch)
        mask, labels, rows = prep.mask, prep.labels, prep.rows
        pipe = self.pipeline
        pipe.start(self._unit_plan(backward=False))
        (x,), _, _, (routers,), e_w = self._forward_layers([prep], keep=False)
        head = self.units[-1]
        names, weights, _ = self._head_weights(pipe.weights(head.index), e_w)
        run_head = self._run_head(names)
        loss = logits = None
        stats = None
        if self.head_stats is not None:  # what TRL's evaluation logs (entropy, token accuracy, aux loss)
            self.head_stats[:] = [{}] if labels is not None else []
            stats = self.head_stats[0] if labels is not None else None
        router = {}
        if routers:  # the model's outputs.aux_loss (before its coefficient), with or without labels
            weighted = self._aux_loss(routers, mask, router)
            if stats is not None:
                stats["aux_loss"] = router["aux_loss"]
        if labels is not None and kw.get("row_loss") is not None:  # a RowLoss's fn of one micro-batch
            loss, _, _ = row_head_loss(run_head, weights, x, labels, kw["row_loss"], None, self.loss_chunk_tokens, rows,
                                       extra=self.row_stats)
            if routers:
                loss = loss + weighted
        elif labels is not None:
            denom = loss_denominator(labels, kw.get("num_items_in_batch"))
            loss, _, _ = chunked_head_loss(run_head, weights, x, labels, denom, None, self.loss_chunk_tokens, rows,
                                           stats=stats, loss_type=self.loss_type)
            if routers:
                loss = loss + weighted
        if return_logits:
            logits = full_logits(run_head, weights, x, self.loss_chunk_tokens)
        pipe.release(head.index)
        pipe.release(self.units[0].index)
        if routers:
            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=router["aux_loss"], logits=logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class _BatchContext:
    """What every layer call of one batch shares: masks (or document spans), rotary cos/sin, RNG states."""

    def __init__(self, engine: StreamingEngine, embeds, mask, pos, docs=None, prefix=None):
        self.engine = engine
        cfg = engine.config
        self.docs = docs  # long packed / padded rows: attention runs document by document, no mask
        if docs and prefix is not None:
            raise MegaTrainError("rows this long with padding or packed documents run attention document by "
                                 "document, which prefix tuning's keys and values (before every row) do not fit; "
                                 "use attn_implementation='flash_attention_2' or shorter rows.")
        if docs:
            self.masks = dict.fromkeys(engine.spec.kinds(cfg))
        else:  # under prefix tuning, for a cache as long as the prefix, as stock builds them
            cache = engine._prefix_caches.for_masks(prefix) if prefix is not None else None
            self.masks = engine.spec.build_masks(cfg, embeds, mask, pos, cache)
        self.pos = pos
        self.raw_mask = mask  # the 2D mask as given: what Mamba's model forward hands its layers
        self.alibi = None
        if engine.spec.alibi:  # BLOOM's ALiBi, from the 2D mask (all ones without one), as its model forward makes it
            module, heads = engine.spec.alibi
            ones = mask if mask is not None else torch.ones(embeds.shape[:2], device=embeds.device, dtype=torch.long)
            self.alibi = sys.modules[module].build_alibi_tensor(ones, getattr(cfg, heads), dtype=embeds.dtype)
        if engine.rotary is None:
            self.pos_emb = None
        elif engine.rotary_per_kind:  # Gemma 3: one rotary base per attention kind, as its model forward does
            self.pos_emb = {kind: engine.rotary(embeds, pos, kind) for kind in set(engine.spec.kinds(cfg))}
        elif engine.spec.rotary_rows:  # Qwen3.5's mRoPE: a text-only forward gives every row the same positions
            self.pos_emb = engine.rotary(embeds, pos[None].expand(engine.spec.rotary_rows, pos.shape[0], -1))
        else:
            self.pos_emb = engine.rotary(embeds, position_ids=pos)
        self.carried = Carried(*engine.spec.carried) if engine.spec.carried else None  # GLM-5's top-k, layer to layer
        # cos/sin per rotary base, as GraniteMoE-SWA's forward makes them once a batch (ArchSpec.rotary_list)
        self.pos_by_base = {r.config.rope_parameters["rope_theta"]: r(embeds, pos) for r in engine.rotary_list or ()}
        self.router = engine.spec.has_router_loss and bool(getattr(cfg, "output_router_logits", False))
        # Gemma 3n/4: the per-layer inputs and the shared keys and values (engine/per_layer.py)
        self.sides = LayerSides(engine.spec.shared_kv)
        if prefix is not None:  # prefix tuning: every layer's keys and values, before its own
            self.sides.take_prefix(prefix, engine._prefix_caches)
        if engine._per_layer_unit is not None:
            self.sides.embeds = embeds
        # Dropout / router jitter draw random numbers: the recompute must draw the same ones.
        self.stochastic = engine.training and engine.stochastic
        self.rng: dict[int, tuple] = {}

    def layer_kwargs(self, unit) -> dict:
        if self.engine.spec.layer_inputs is not None:
            return self._planned_kwargs(unit)
        pos_emb = self.pos_emb[unit.attn_kind] if isinstance(self.pos_emb, dict) else self.pos_emb
        kw = dict(attention_mask=self.masks[unit.attn_kind], position_ids=self.pos, position_embeddings=pos_emb)
        if self.docs:
            kw["megatrain_documents"] = self.docs
        return kw

    def _planned_kwargs(self, unit) -> dict:
        """A hybrid stack's layer call, as its model forward makes it (ArchSpec.layer_inputs)."""
        kw = {}
        for name, source in self.engine.spec.layer_inputs:
            what = source[0]
            if what == "mask":
                kw[name] = self.masks.get(unit.attn_kind if source[1] is None else source[1])
            elif what == "rotary":  # for every layer, or for those of one kind (OLMo-hybrid's attention layers)
                every = source[1] is None or getattr(self.engine.config, source[1][0])[unit.layer] == source[1][1]
                kw[name] = self.pos_emb if every else None
            elif what == "rotary_by":  # the cos/sin of the layer's own base; None where it is 0 (NoPE)
                base = getattr(self.engine.config, source[1])[unit.layer]
                kw[name] = self.pos_by_base[base] if base else None
            elif what == "position_ids":
                kw[name] = self.pos
            elif what == "raw_mask":
                kw[name] = self.raw_mask
            elif what == "alibi":
                kw[name] = self.alibi
        return kw

    def attention(self):
        return attention_by_document(self.engine.config) if self.docs else nullcontext()

    @contextmanager
    def rng_for(self, unit, save: bool):
        if not self.stochastic:
            yield
            return
        dev = self.engine.device
        devices = [dev] if dev.type == "cuda" else []
        if save:
            self.rng[unit.index] = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if devices else None)
            yield
            return
        cpu_state, cuda_state = self.rng[unit.index]
        with torch.random.fork_rng(devices=devices, device_type=dev.type if devices else "cuda"):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, dev)
            yield

    def router_capture(self, unit):
        if not self.router:
            return nullcontext(None)
        return self.engine._templates[unit.template_key].capturing()


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    """model.get_input_embeddings(), or None where the model has none to give."""
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def _submodule_or_none(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:  # not built for this config (None)
        return None


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _router_logits(captured: list, batch: int) -> torch.Tensor:
    """One layer's router logits as [batch * seq, experts] in (row, position) order, also when a
    tiled MLP routed the sequence tile by tile (each tile gives [batch * tile, experts])."""
    if len(captured) == 1:
        return captured[0]
    experts = captured[0].shape[-1]
    return torch.cat([c.view(batch, -1, experts) for c in captured], dim=1).view(-1, experts)

