"""Turn what the user passed (hub id, local path or loaded model) into what the engine needs.

A loaded CPU model is used as it is. A hub id or folder becomes a *meta skeleton* (the real
model class, no storage) plus the folder its safetensors are streamed from, so a 70B model
never exists in RAM twice.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from ..errors import MegaTrainError
from ..patcher.adapters import check_adapter_config, check_peft_model, is_peft_model
from ..patcher.specs import spec_for
from .stream_load import read_names, resolve_folder, shard_files

logger = logging.getLogger(__name__)


def with_adapters(model, peft_config, folder: str | None, compute_dtype: torch.dtype):
    """A PEFT model for `peft_config` (a peft config object, a dict, or a JSON file path).

    The frozen base is loaded for real (it streams as compute weights only, 2 bytes/param in
    bf16), in the compute dtype; the adapters are created by PEFT and trained in fp32.
    """
    from peft import get_peft_model

    peft_config = peft_config_from(peft_config)
    if is_peft_model(model):
        raise MegaTrainError("the model already has adapters; pass either a PEFT model or peft_config, not both.")
    if folder is not None:  # a meta skeleton: LoRA needs the real base weights to wrap
        # with the skeleton's attention, and its own modeling code where the skeleton was built from it
        # (load_model_and_tokenizer with trust_remote_code)
        own_code = not type(model).__module__.startswith("transformers.")
        skeleton = model
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=compute_dtype, device_map="cpu",
                                                     attn_implementation=model.config._attn_implementation,
                                                     **({"trust_remote_code": True} if own_code else {}))
        _take_resized_embeddings(model, skeleton)
    return get_peft_model(model, peft_config)


def _take_resized_embeddings(model, skeleton) -> None:
    """The embeddings the skeleton holds for real (read, then resized for a cloned chat template: sft.py), in the
    loaded model in place of the checkpoint's, with the eos token the clone set; nothing where it holds none."""
    read = read_names(skeleton)
    if not read:
        return
    with torch.random.fork_rng():  # its new rows are overwritten below: their draws must not move the RNG
        model.resize_token_embeddings(skeleton.get_input_embeddings().weight.shape[0], mean_resizing=False)
    with torch.no_grad():
        for name in read:
            model.get_parameter(name).copy_(skeleton.get_parameter(name))
    text, theirs = model.config.get_text_config(), skeleton.config.get_text_config()
    text.eos_token_id = theirs.eos_token_id
    if model.generation_config is not None and skeleton.generation_config is not None:
        model.generation_config.eos_token_id = skeleton.generation_config.eos_token_id


def peft_config_from(peft_config):
    """A peft config from a peft config object, a dict of its fields, inline JSON of them or a JSON file (such as
    the adapter_config.json a PEFT save writes). A dict without `peft_type` holds LoraConfig fields; with one, the
    fields of that method's config (PeftConfig.from_peft_type)."""
    import json

    from peft import LoraConfig, PeftConfig, PeftType

    if isinstance(peft_config, str):
        inline = peft_config.lstrip().startswith("{")
        try:
            if inline:
                peft_config = json.loads(peft_config)
            else:
                with open(peft_config) as f:
                    peft_config = json.load(f)
        except (OSError, ValueError) as e:
            what = "as inline JSON" if inline else "as a JSON file"
            raise MegaTrainError(f"peft_config={peft_config!r} cannot be read {what} ({e}); pass inline JSON such "
                                 "as '{\"r\": 8}', a JSON file (LoRA fields, or an adapter_config.json), a dict or a "
                                 "peft config.") from e
    if isinstance(peft_config, dict):
        fields = {"task_type": "CAUSAL_LM", **peft_config}
        if fields.get("inference_mode"):
            raise MegaTrainError("peft_config has inference_mode=true (as the adapter_config.json of a saved adapter "
                                 "has): PEFT would freeze the adapters, so nothing would train. Set it to false.")
        try:
            if "peft_type" in fields:
                fields["peft_type"] = str(fields["peft_type"]).upper()
                if fields["peft_type"] not in {t.value for t in PeftType}:
                    raise MegaTrainError(f"peft_config's peft_type {fields['peft_type']!r} is not a PEFT method; the "
                                         "installed peft knows " + ", ".join(sorted(t.value for t in PeftType)) + ".")
                peft_config = PeftConfig.from_peft_type(**fields)
            else:
                peft_config = LoraConfig(**fields)
        except (KeyError, TypeError, ValueError) as e:
            what = fields.get("peft_type", "LORA")
            text = " ".join(str(e).split()) or repr(e)
            raise MegaTrainError(f"peft_config does not make a {what} config: {text}. Give the fields of that PEFT "
                                 "method's config (for LoRA, LoraConfig's: r, lora_alpha, target_modules, ...).") from e
    if not isinstance(peft_config, PeftConfig):
        raise MegaTrainError(f"peft_config must be a peft config, a dict or a JSON path, not {type(peft_config).__name__}")
    check_adapter_config(peft_config)
    return peft_config


def meta_skeleton(config, attn_implementation: str | None = None, trust_remote_code: bool | None = None
                  ) -> PreTrainedModel:
    """The model class built on meta; non-persistent buffers (rotary inv_freq) are rebuilt real, and
    persistent ones are allocated on the host, to be read from the checkpoint with the weights.
    `trust_remote_code` as from_pretrained takes it: a config with its own modeling code builds that."""
    kwargs = {"dtype": torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if trust_remote_code is not None:
        kwargs["trust_remote_code"] = trust_remote_code
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    computed = []  # non-persistent buffers the model computes when built, blank on the host until rebuilt
    for name, module in list(model.named_modules()):
        meta = [k for k, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        rotary = hasattr(module, "inv_freq") or type(module).__name__.endswith("RotaryEmbedding")
        if meta and not rotary:
            for k in meta:
                if hasattr(module, f"scalar_{k}"):
                    # HF v5 keeps a constant buffer's value beside it as `scalar_<name>` (Gemma's embed_scale)
                    module._buffers[k] = torch.tensor(getattr(module, f"scalar_{k}"))
                elif k not in module._non_persistent_buffers_set:
                    # a persistent buffer (GLM-4-MoE's router e_score_correction_bias): saved with the
                    # weights, so the loader reads it from the checkpoint (stream_load.load_into_store)
                    b = module._buffers[k]
                    module._buffers[k] = torch.zeros(b.shape, dtype=b.dtype)
                else:
                    computed.append((name, k, _blank(module, k)))
        elif meta:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            # from the module's own config where it keeps one: GraniteMoE-SWA's rotary_embs each hold the model's
            # with a base of their own
            setattr(parent, attr, type(module)(config=getattr(module, "config", None) or model.config))
    unrebuilt = [(name, key) for name, key, blank in computed if not _rebuilt(model, name, key, blank)]
    if unrebuilt:
        _build_buffers(model, unrebuilt, config, kwargs)
    return model


def _build_buffers(model, wanted: list[tuple[str, str]], config, kwargs: dict) -> None:
    """Non-persistent buffers that the model's __init__ computes and its _init_weights does not (Gemma 3n's
    per_layer_projection_scale and per_layer_input_scale, made from the config in its base model's __init__): the
    values of a second build with its parameters on meta and its buffers on the host (accelerate's
    init_empty_weights), which runs that __init__."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        built = dict(AutoModelForCausalLM.from_config(config, **kwargs).named_buffers())
    for name, key in wanted:
        full = f"{name}.{key}" if name else key
        value = built.get(full)
        if value is None or value.device.type == "meta" or (value.is_floating_point() and value.isnan().any()):
            raise MegaTrainError(f"{full} is a buffer that is neither saved with the weights nor a constant, and the "
                                 "model's _init_weights does not compute it, so it cannot be rebuilt on the host")
        model.get_submodule(name)._buffers[key] = value


def _blank(module, key: str) -> torch.Tensor:
    """A host tensor in place of a meta buffer, filled with what no initialisation writes (NaN, or zeros)."""
    meta = module._buffers[key]
    blank = torch.full(meta.shape, float("nan") if meta.is_floating_point() else 0, dtype=meta.dtype)
    module._buffers[key] = blank.clone()
    return blank


def _rebuilt(model, name: str, key: str, blank: torch.Tensor) -> bool:
    """Whether a non-persistent buffer the model computes when it is built (CTRL's pos_encoding, XGLM's sinusoid,
    GPT-Neo's causal masks, Falcon-H1's mup_vector) is now written by the model's own _init_weights, as
    from_pretrained writes it after loading: called on the buffer's module, then on each module above it (Falcon-H1
    computes its mixers' vector in its base model's), until one writes it. Parameters are on meta there, so
    nothing else is initialised."""
    path = name.split(".") if name else []
    module = model.get_submodule(name)
    for depth in range(len(path), -1, -1):
        owner = model.get_submodule(".".join(path[:depth]))
        try:
            model._init_weights(owner)
        except Exception:
            continue
        got = module._buffers[key]
        if got.device.type == "cpu" and (not bool(got.isnan().any()) if got.is_floating_point()
                                         else not torch.equal(got, blank)):
            return True
    return False


def load_model_and_tokenizer(model, attn_implementation: str | None = None, revision: str | None = None,
                             trust_remote_code: bool | None = None):
    """Returns (model, tokenizer or None, weights folder or None).

    With a folder, `model` is a meta skeleton to be filled from it (StreamingEngine weights_from).
    `trust_remote_code` reaches the config, model and tokenizer loaders as it does in from_pretrained
    (None: transformers asks, where the folder has code of its own).
    """
    if isinstance(model, PreTrainedModel) or is_peft_model(model):
        check_peft_model(model)
        spec_for(model.config if isinstance(model, PreTrainedModel) else model.get_base_model().config)
        devices = {p.device.type for p in model.parameters()}
        if devices - {"cpu"}:
            raise MegaTrainError(
                f"the model's parameters are on {sorted(devices)}; pass a model loaded on the CPU "
                "(hf_megatrain moves layers to the GPU itself), e.g. from_pretrained(..., device_map='cpu')."
            )
        return model, None, None
    if not isinstance(model, (str, os.PathLike)):
        raise MegaTrainError(
            f"model must be a hub id, a local path or a loaded PreTrainedModel, not {type(model).__name__}."
        )
    folder = resolve_folder(str(model), revision)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise MegaTrainError(f"cannot read a model config for {model!r} in {folder}: {e}") from e
    skeleton = None
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        # The model's own code, built first (on meta, no weights): from_config registers its class for
        # its config, so that the architecture check below, which builds the config too, builds that class.
        skeleton = meta_skeleton(config, attn_implementation, trust_remote_code)
    spec_for(config)  # refuse unsupported architectures before touching any weights
    shard_files(folder)
    if skeleton is None:
        skeleton = meta_skeleton(config, attn_implementation)
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        skeleton.generation_config = GenerationConfig.from_pretrained(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, ImportError) as e:  # ImportError: BioGPT's needs sacremoses
        logger.warning("no tokenizer found in %s (%s); pass processing_class= to save one", folder, e)
        tokenizer = None
    return skeleton, tokenizer, folder
