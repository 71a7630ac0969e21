"""TRL's SFTTrainer on the streaming engine: one change of class.

    from hf_megatrain.sft import MegaTrainSFTConfig, MegaTrainSFTTrainer

    trainer = MegaTrainSFTTrainer(model="path/or/hub-id", args=MegaTrainSFTConfig(...),
                                  train_dataset=dataset, peft_config=lora)   # was SFTTrainer / SFTConfig
    trainer.train()

TRL prepares the data as it always does (chat templates, completion-only and assistant-only
labels, BFD packing with padding-free rows, its collator); the engine runs the step. The class
order makes that work: SFTTrainer's `__init__` prepares the data and then calls the next
`__init__` in line, which is MegaTrainTrainer's (it builds the engine and then calls Trainer's),
and every hook the engine replaces comes from MegaTrainTrainer unless SFTTrainer wraps it
around a `super()` call. The loss is the same number: TRL's 'nll' is the token-summed negative
log-likelihood over `num_items_in_batch`, which the engine's chunked loss computes, and its 'dft'
the same sum with each token's term weighted by its detached probability. The logs are
TRL's too: `entropy`, `mean_token_accuracy`, `num_tokens` and a MoE's `aux_loss` from the engine's
head, in training and (as `eval_*`, which `evaluate()` returns) in evaluation.

Other TRL trainers (DPO, KTO, ORPO, GRPO, RLOO, reward modelling, distillation) compute their
losses from forwards the engine does not run (a reference model, generations, a value head);
their configs are refused by name.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import MISSING, dataclass, field, fields

import torch
from transformers import TrainingArguments

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as e:  # an optional extra
    raise ImportError("hf_megatrain.sft needs TRL: pip install 'hf_megatrain[trl]'") from e

from .arguments import MegaTrainArguments, check_arguments, compute_dtype, megatrain_arguments
from .checkpoint.loading import load_model_and_tokenizer, peft_config_from
from .checkpoint.stream_load import read_parameters
from .engine.loss import LOSS_TYPES
from .engine.prompts import check_prefix_early
from .errors import MegaTrainError
from .logs import show_logs
from .patcher.adapters import base_model, check_adapter_config
from .preflight import check_outputs, check_resume
from .trainer import MegaTrainTrainer, refuse_other_trl_config

logger = logging.getLogger(__name__)


@dataclass
class TrlEngineFields:
    """What each MegaTrain*Config (SFT, DPO, KTO) changes in its TRL config, beside MegaTrainArguments' fields:
    put first among the bases, before the TRL config and MegaTrainArguments."""

    # TRL turns recompute on by default; the engine always recomputes at layer boundaries, so this
    # keeps Trainer's own default (False, or None from transformers 5.25, where the name is deprecated).
    gradient_checkpointing: bool | None = field(
        default=next(f.default for f in fields(TrainingArguments) if f.name == "gradient_checkpointing"),
        metadata={"help": "Ignored: the engine always recomputes each layer in the backward."},
    )

    def __post_init__(self):
        super().__post_init__()  # the TRL config's, then MegaTrainArguments' checks, then TrainingArguments'
        self.follow_max_length()

    def follow_max_length(self) -> None:
        """The engine plans its memory for max_seq_length: TRL's max_length, when it sets one."""
        if self.max_length is not None:
            self.max_seq_length = self.max_length


@dataclass
class MegaTrainSFTConfig(TrlEngineFields, SFTConfig, MegaTrainArguments):
    """`SFTConfig` with the engine's fields (those of `MegaTrainArguments`) besides.

    Where the two overlap, TRL's meaning holds: `max_length` is the row length (the engine plans
    its memory for it: `max_seq_length` follows it), `packing` is TRL's packing, `bf16` defaults
    to True as in every TRL config (pass `bf16=False` for fp32 compute on a CPU)."""


def sft_arguments(args, model) -> MegaTrainSFTConfig:
    """The trainer's own MegaTrainSFTConfig for what the user passed: None (TRL's default, an
    output folder named after the model), an SFTConfig, a MegaTrainSFTConfig or TrainingArguments."""
    own = trl_arguments(args, model, MegaTrainSFTConfig, SFTConfig, "MegaTrainSFTTrainer", "SFT")
    check_arguments(own)
    return own


def load_for_trl(model, args):
    """load_model_and_tokenizer for a TRL trainer of ours: a folder or hub id becomes a meta skeleton,
    filled by the engine, so the TRL trainer never loads the whole model into RAM (MegaTrainTrainer.__init__
    picks up what was resolved). Of model_init_kwargs, the revision, attention implementation and
    trust_remote_code apply (the last defaulting to args.trust_remote_code, as in TRL); what else is asked
    is said. For a loaded model the TRL trainer warns that model_init_kwargs are ignored, as stock does."""
    init = {}
    if isinstance(model, str):
        show_logs(None if args.log_level == "passive" and args.should_log else args.get_process_log_level())
        init = dict(args.model_init_kwargs or {})
        init.setdefault("trust_remote_code", args.trust_remote_code)
        _say_unapplied(init, args)
        args.model_init_kwargs = None  # used here, so the TRL trainer does not warn that it ignores them
    return load_model_and_tokenizer(model, attn_implementation=init.get("attn_implementation"),
                                    revision=init.get("revision"), trust_remote_code=init.get("trust_remote_code"))


def trl_arguments(args, model, own_class, trl_class, trainer: str, suffix: str):
    """The TRL trainer's config as `own_class` (TRL's `trl_class` plus MegaTrainArguments' fields) for
    what the user passed: None (TRL's default, an output folder named after the model), a `trl_class`,
    an `own_class` or TrainingArguments; a config of another TRL trainer is refused by name, before any
    data is tokenized. Shared by the SFT and DPO trainers."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return own_class(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-{suffix}")
    refuse_other_trl_config(args, trainer)  # GRPO, DPO...: one line, before any data is tokenized
    if isinstance(args, own_class):
        return copy.copy(args)
    if isinstance(args, trl_class):
        if type(args) is not trl_class:
            raise MegaTrainError(f"args is a {type(args).__name__}, a subclass of {trl_class.__name__} whose fields "
                                 f"hf_megatrain cannot carry over; pass {own_class.__name__} (every "
                                 f"{trl_class.__name__} field works there).")
        own = copy.copy(args)
        own.__class__ = own_class  # it only adds fields, each with a default
        for f in fields(MegaTrainArguments):
            if f.name not in vars(own):
                setattr(own, f.name, f.default_factory() if f.default_factory is not MISSING else f.default)
        own.follow_max_length()  # its __post_init__ ran as the TRL class's
        return own
    if isinstance(args, TrainingArguments):
        megatrain_arguments(args)  # refuses another library's subclass with the reason
        values = {f.name: getattr(args, f.name) for f in fields(args) if f.init}
        return own_class(**values)  # what TRL's trainers do with TrainingArguments, with our fields kept
    raise MegaTrainError(f"args must be {own_class.__name__}, {trl_class.__name__} or TrainingArguments, not "
                         f"{type(args).__name__}.")


def check_sft(args, kwargs: dict) -> None:
    """What SFTTrainer offers that the engine cannot honour, refused before any data is tokenized."""
    if args.loss_type not in LOSS_TYPES:  # SFTTrainer raises its own ValueError later; say it before tokenizing
        raise MegaTrainError(f"loss_type={args.loss_type!r} is not supported: the engine's chunked loss computes "
                             f"{' and '.join(repr(t) for t in LOSS_TYPES)}, as SFTTrainer does.")
    if args.activation_offloading:
        raise MegaTrainError("activation_offloading=True is TRL's offload for a model on the GPU; the engine keeps "
                             "activations itself (MegaTrainSFTConfig.offload_activations). Leave it False.")
    if kwargs.get("quantization_config") is not None or (args.model_init_kwargs or {}).get("quantization_config"):
        raise MegaTrainError("quantization_config is not supported: hf_megatrain trains at full precision (fp32 "
                             "master weights); a frozen LoRA base streams in bf16. Remove it.")
    check_adapter_config(kwargs.get("peft_config") or args.peft_config)  # multitask prompts: refused in one line
    if kwargs.get("compute_loss_func") is not None:
        raise MegaTrainError("compute_loss_func is not supported: the engine computes the causal-LM loss itself.")


def clones_template(args) -> bool:
    """Whether SFTTrainer clones a tokenizer's chat template (adding its tokens, resizing the embeddings) rather
    than reading a .jinja file: the same test as SFTTrainer's."""
    path = args.chat_template_path
    return path is not None and not (os.path.isfile(path) and path.endswith((".jinja", ".j2")))


def embedding_names(model) -> list[str]:
    """The names (in the base model) of the input embedding's and the output head's weights, the parameters
    resize_token_embeddings changes; a tied head's once."""
    base = base_model(model)
    wanted = [m.weight for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None]
    names = {id(p): name for name, p in base.named_parameters()}  # named_parameters gives a tied weight once
    return list(dict.fromkeys(names[id(w)] for w in wanted if id(w) in names))


class MegaTrainSFTTrainer(SFTTrainer, MegaTrainTrainer):
    """`trl.SFTTrainer` whose forward, backward and optimizer step run on the streaming engine.

    Takes what SFTTrainer takes; `args` may be an SFTConfig (the engine's options at their
    defaults) or a MegaTrainSFTConfig. `model` is a hub id, a folder (its weights are streamed
    into host RAM, never loaded whole) or a CPU model (without `processing_class`, its tokenizer
    is loaded from `config._name_or_path`, as stock does); `peft_config` trains LoRA adapters
    (also on parameters, e.g. MoE experts), prompt tuning, p-tuning and prefix tuning."""

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, **kwargs):
        args = sft_arguments(args, model)
        if peft_config is not None:  # the engine wraps the base itself (SFTTrainer would wrap a meta skeleton)
            if args.peft_config is not None and args.peft_config is not peft_config:
                raise MegaTrainError("peft_config was given twice (as an argument and in args); keep one.")
            args.peft_config = peft_config
        check_sft(args, kwargs)
        check_outputs(args)
        check_resume(args.resume_from_checkpoint, args.output_dir)
        self._loaded = load_for_trl(model, args)
        skeleton, tokenizer, weights_from = self._loaded
        # prefix tuning on a family the engine refuses: say so now (peft_config as a config, from the dict or JSON
        # that MegaTrainArguments also takes)
        check_prefix_early(skeleton, None if args.peft_config is None else peft_config_from(args.peft_config))
        if processing_class is None:
            # the folder's tokenizer; for a loaded model None, and SFTTrainer loads it as stock does, from the
            # model's config._name_or_path (AutoProcessor, with args.trust_remote_code)
            processing_class = tokenizer
        template = None
        if clones_template(args):
            processing_class, template = self._clone_template(skeleton, processing_class, weights_from, args)
        if args.device.type == "cuda":
            args._n_gpu = 1  # one GPU per process: SFTTrainer would refuse nn.DataParallel on a multi-GPU host
        try:
            super().__init__(model=skeleton, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        finally:
            if template is not None:  # the config says what the user asked, as stock's does
                for own in {id(a): a for a in (args, getattr(self, "args", None)) if a is not None}.values():
                    own.chat_template_path = template
        # SFTTrainer settles the MoE load-balancing loss on the model's config after the engine took
        # its own copy of that config: carry the two settings over.
        text, own = self.model.config.get_text_config(), self.engine.config.get_text_config()
        for name in ("output_router_logits", self.engine.aux_coef):  # router_aux_loss_coef, or the family's
            if hasattr(text, name):
                setattr(own, name, getattr(text, name))
        # entropy, top-1 hits and the MoE aux loss for TRL's metrics, from the engine's loss
        self.engine.head_stats = []
        self.engine.loss_type = args.loss_type  # 'dft' weights each token's NLL in the engine's chunked head

    def _clone_template(self, skeleton, processing_class, weights_from, args):
        """A cloned chat template (chat_template_path naming a tokenizer), done here as SFTTrainer does it: seeded
        with args.seed, the tokens added and the embeddings resized with rows drawn from the old ones' mean and
        covariance (from a folder, those two weights are read for real first, the rest stays on disk, and the
        engine takes them from the skeleton as resized). With LoRA, TRL's two changes to the PEFT config follow
        (the new tokens trainable through trainable_token_indices, lm_head fully trained through
        modules_to_save, with TRL's warning); SFTTrainer makes the adapters right after its clone, from the RNG
        as the resize left it, and the engine makes them later (after the data), so that state is kept for it
        (MegaTrainTrainer._build_engine). Returns the tokenizer and the path SFTTrainer must not clone again
        (args.chat_template_path is None while it runs, and given back after)."""
        from transformers import AutoTokenizer
        from transformers.trainer_utils import set_seed
        from trl import clone_chat_template

        if processing_class is None:  # as SFTTrainer would load it
            processing_class = AutoTokenizer.from_pretrained(skeleton.config._name_or_path,
                                                             trust_remote_code=args.trust_remote_code)
        if weights_from is not None:
            read_parameters(skeleton, weights_from, embedding_names(skeleton))
        set_seed(args.seed)
        _, processing_class, added = clone_chat_template(skeleton, processing_class, args.chat_template_path)
        template, args.chat_template_path = args.chat_template_path, None
        if args.peft_config is None:
            return processing_class, template
        self._adapter_rng = torch.get_rng_state()
        config = copy.deepcopy(peft_config_from(args.peft_config))
        if added:
            indices = dict(config.trainable_token_indices or {})
            indices["embed_tokens"] = list(indices.get("embed_tokens", [])) + list(added)
            config.trainable_token_indices = indices
            if not config.modules_to_save or "lm_head" not in config.modules_to_save:
                logger.warning("Cloning chat template added new tokens to the tokenizer, but 'lm_head' is not in "
                               "PEFT's `modules_to_save`. As a result, the model may not learn to generate outputs "
                               "with these new tokens, leading to degraded generation quality. To fix this, add "
                               "`modules_to_save=['lm_head']` to your PEFT configuration.")
                config.modules_to_save = list(config.modules_to_save or []) + ["lm_head"]
        args.peft_config = config
        return processing_class, template

    def training_step(self, model, inputs, num_items_in_batch=None):
        # SFTTrainer's own training_step only adds its activation offloading (refused above). Ours puts
        # self.model in training mode, as stock's does, which TRL's log reads to pick its metrics.
        loss = MegaTrainTrainer.training_step(self, model, inputs, num_items_in_batch)
        self._record_metrics(inputs, "train")
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # SFTTrainer's own evaluation step runs its fused head through the model; the engine has its own.
        # Ours puts self.model in eval mode, as stock's evaluation does: TRL's log then reports the "eval"
        # metrics, under eval_ names, and leaves the training ones alone.
        out = MegaTrainTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
        if inputs.get("labels") is not None:
            self._record_metrics(inputs, "eval")
        return out

    def _record_metrics(self, inputs, mode: str) -> None:
        """TRL's metrics, counted as SFTTrainer.compute_loss counts them, kept as device tensors (no
        sync per micro-batch) until the next log. Training counts the tokens; evaluation repeats the count."""
        if mode == "train":
            k = self._micro_index
            chunks = [c for c, o in zip(self.engine.head_stats, self._owner) if o == k]  # the chunks it ran as
        else:
            chunks = list(self.engine.head_stats)
        stats = {key: sum(c[key] for c in chunks) for key in ("tokens", "entropy", "correct")}
        gather = self.accelerator.gather_for_metrics
        valid = gather(stats["tokens"]).sum()
        metrics = self._metrics[mode]
        metrics["entropy"].append(gather(stats["entropy"]).sum() / valid.clamp(min=1))
        metrics["mean_token_accuracy"].append(gather(stats["correct"]).sum() / valid.clamp(min=1))
        if mode == "train":
            if "attention_mask" in inputs:
                tokens = torch.as_tensor(inputs["attention_mask"]).sum()
            else:  # padding-free rows: every position counts, as in TRL
                tokens = torch.tensor(inputs["position_ids"].size(1))
            if self.args.world_size > 1:
                tokens = gather(tokens.to(self.args.device)).sum()
            self._total_train_tokens += int(tokens) // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        aux = [c["aux_loss"] for c in chunks if "aux_loss" in c]
        if self.aux_loss_enabled and aux:
            # the model's outputs.aux_loss (before its coefficient); a micro-batch the engine ran in row
            # chunks (planner.split_step) has one per chunk: their mean
            metrics["aux_loss"].append(gather(sum(aux) / len(aux)).mean())

    def log(self, logs, start_time=None):
        for buffer in self._metrics.values():  # device tensors become numbers once per log
            for values in buffer.values():
                values[:] = [float(v) for v in values]
        super().log(logs, start_time)

    def _aux_loss_scale(self, num_items_in_batch) -> float:
        # TRL averages the MoE load-balancing loss over the accumulation steps when the token loss is
        # normalised by num_items_in_batch (SFTTrainer.compute_loss); stock Trainer does not. And TRL adds it
        # after multiplying the token loss by the world size (data parallel, average_tokens_across_devices),
        # where stock Trainer's model has it inside the loss it multiplies: relative to the token loss (the
        # engine weighs it within that loss), it takes that factor off again.
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        return 1.0 / (steps * self._rank_loss_factor(num_items_in_batch))


_APPLIED = ("revision", "attn_implementation", "trust_remote_code")


def _say_unapplied(init: dict, args) -> None:
    """A warning line for each model_init_kwargs setting the engine's loader does not apply."""
    dtype = init.get("dtype", init.get("torch_dtype"))
    if dtype is not None and str(dtype).removeprefix("torch.") != "float32":
        compute = str(compute_dtype(args, args.device)).removeprefix("torch.")
        logger.warning(
            "model_init_kwargs dtype=%s is not applied: stock SFTTrainer would load the model in %s, while "
            "hf_megatrain keeps fp32 master weights and AdamW state in host RAM and computes in %s (set "
            "compute_dtype, or bf16, to choose the compute dtype).", str(dtype).removeprefix("torch."),
            "the checkpoint's dtype" if dtype == "auto" else str(dtype).removeprefix("torch."), compute)
    other = sorted(k for k, v in init.items()
                   if k not in _APPLIED + ("dtype", "torch_dtype", "device_map") and v is not None)
    if other:
        logger.warning("model_init_kwargs %s: not applied; hf_megatrain's loader builds the model from its config "
                       "and streams the weights (it applies %s).", ", ".join(other), ", ".join(_APPLIED))
