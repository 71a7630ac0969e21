"""MegaTrainTrainer: transformers.Trainer with its forward/backward/step path on the engine.

Thin glue. `self.model` stays the real PreTrainedModel the user gave (config, save hooks, generate),
its Parameter objects kept: what trains views its fp32 master in the host store (engine/store.py,
HostStore.bind), current after train() returns. `_wrap_model` hands Trainer the
engine instead, so accelerate never prepares or moves the model. Everything else (the loop,
gradient accumulation, schedulers, callbacks, logging, evaluation, checkpoint rotation) is
stock Trainer, driven through the hook methods it offers for exactly this.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import shutil
import time
from dataclasses import fields

import torch
from transformers import Trainer, TrainingArguments, set_seed
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy, rotate_checkpoints

from .arguments import MegaTrainArguments, megatrain_arguments, save_dtype
from .checkpoint.loading import load_model_and_tokenizer, with_adapters
from .checkpoint.peft_export import model_writer, save_merged
from .checkpoint.local_hub import LocalHub, default_hub_dir
from .checkpoint.manifest import MANIFEST, commit_dir, partial_dir, verify_manifest, write_manifest
from .checkpoint.optimizer_state import (
    check_optimizer_kind,
    load_masters,
    load_optimizer_state,
    save_optimizer_state,
)
from .data import CausalCollator, count_real_tokens, tokenize_dataset
from .engine.distributed import check_launch
from .engine.loss import loss_denominator
from .engine.host_optim import HostParamOptimizer, optimizer_name
from .engine.optimizer import HostAdamW
from .engine.schedule import StreamingEngine
from .engine.step import ENGINE_KEYS, backward, split_rows
from .engine.timeline import Timeline
from .errors import MegaTrainError, counted
from .checkpoint.stream_load import engine_from_checkpoint
from .logs import show_logs
from .planner import Machine, plan_run, request_from_arguments
from .planner.estimator import GiB
from .patcher.adapters import base_model, decay_names
from .preflight import check_data, check_disk, check_outputs, check_resume

logger = logging.getLogger(__name__)

# Trainer's recompute flag: transformers 5.25 renamed TrainingArguments.gradient_checkpointing to
# activation_checkpointing (the old name is a deprecated mirror that Trainer no longer reads); 5.17 has
# only the old name. Read once from the dataclass so the flag cleared below is the one Trainer acts on.
_RECOMPUTE_FLAG = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                       if name in {f.name for f in fields(TrainingArguments)})


def recompute_off(args) -> bool:
    """Clears Trainer's recompute flag and, from transformers 5.25, its deprecated mirror
    `gradient_checkpointing`, which TRL's trainers still read (clearing one name leaves the other set:
    the mirror is copied only when the arguments are built). True where the flag was set."""
    names = [n for n in (_RECOMPUTE_FLAG, "gradient_checkpointing") if hasattr(args, n)]
    was = any(getattr(args, n) for n in names)
    for n in names:
        setattr(args, n, False)
    return was


class MegaTrainTrainer(Trainer):
    """`Trainer` for models larger than the GPU: state in host RAM, one layer on the GPU at a time.

    `model` is a hub id, a local path, or a loaded CPU `PreTrainedModel`. With no
    `train_dataset`, `args.data_path` is loaded, tokenized and packed. `peft_config` (a peft
    LoraConfig, a dict, inline JSON or a JSON file) trains LoRA adapters, as `args.peft_config`
    does. Everything that can be checked without the weights (see `preflight`) is checked before
    any weight is read.
    """

    def __init__(
        self,
        model=None,
        args: MegaTrainArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        peft_config=None,
        **kwargs,
    ):
        # Trainer's own parameters, in Trainer's order (positional calls mean what they mean there).
        # Everything that can be checked without the weights is checked before any is read (loading a 70B
        # model takes minutes): the arguments, the outputs, the data, the disk, and the memory plan.
        args = self._checked_arguments(model, args, model_init, optimizers, optimizer_cls_and_kwargs, peft_config)
        preloaded = getattr(self, "_loaded", None)  # a subclass (the TRL one) resolved the model already
        if preloaded is not None and preloaded[0] is model:
            model, tokenizer, weights_from = preloaded
        else:  # the model id resolves to a config and a meta skeleton here
            model, tokenizer, weights_from = load_model_and_tokenizer(model)
        processing_class = processing_class if processing_class is not None else tokenizer
        raw_data = {name: check_data(getattr(args, name), processing_class, args, name)
                    for name, given in (("data_path", train_dataset), ("eval_data_path", eval_dataset))
                    if given is None and getattr(args, name)}
        check_disk(args, model)
        run = self._plan(args, model)
        self.args = args
        # Weights are read last: the data is tokenized first, then the LoRA base and the store are filled.
        train_dataset, eval_dataset, data_collator = self._datasets(
            raw_data, train_dataset, eval_dataset, data_collator, processing_class, args, base_model(model).config)
        model = self._build_engine(model, weights_from, args, run.engine)
        # Rows the engine tokenized itself got its CausalCollator above; anything else gets Trainer's own
        # default (DataCollatorWithPadding for a tokenizer, else default_data_collator), as in stock.
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            **kwargs,
        )
        self._custom = self._custom_loss_kind(compute_loss_func, args)
        # What the logs show besides Trainer's own: real tokens/s, model TFLOPS (6 * P * tokens),
        # MFU against args.gpu_peak_tflops, and how busy each pipeline lane was.
        self._tokens_since_log = 0
        self._last_log = None
        self._measured_norm = None  # transient_grads with clipping: the norm pass's, for _clip_grad_norm
        self._timeline = Timeline() if args.log_pipeline else None
        if self._timeline is not None:
            self.engine.attach_timeline(self._timeline)

    def _checked_arguments(self, model, args, model_init, optimizers, optimizer_cls_and_kwargs, peft_config):
        """Our own checked copy of `args` (the user's object is never changed), with what the
        constructor was given checked against what the engine honours."""
        check_trainer_hooks()  # a transformers release that renamed a hook we replace fails here, loudly
        check_overrides(type(self))  # a subclass's hook the engine would silently skip is refused here
        if model_init is not None:
            raise MegaTrainError(
                "model_init is not supported: Trainer calls it again at every train() (and per trial in "
                "hyperparameter_search) for a fresh model, which the engine's host store, filled once, does not "
                "follow. Build the model yourself and pass it as model=.")
        if model is None:
            raise MegaTrainError("MegaTrainTrainer needs a model: a hub id, a local folder or a loaded CPU model.")
        refuse_other_trl_config(args, next(c.__name__ for c in type(self).__mro__  # the library's class
                                           if c.__module__.startswith("hf_megatrain")))
        args = megatrain_arguments(args)
        self._adamw = check_optimizers(optimizers, optimizer_cls_and_kwargs)
        # the memory plan and the modes chosen: at INFO on the main process unless log_level says otherwise
        # (its "passive" would mean transformers' verbosity, WARNING by default, and hide them)
        show_logs(None if args.log_level == "passive" and args.should_log else args.get_process_log_level())
        if peft_config is not None:  # where TRL users put it; the same as args.peft_config
            if args.peft_config is not None and args.peft_config is not peft_config:
                raise MegaTrainError("peft_config was given twice (as an argument and in args); keep one.")
            args.peft_config = peft_config
        check_launch(args)  # several processes but no process group: refused before any weight is read
        check_outputs(args)
        resume = check_resume(args.resume_from_checkpoint, args.output_dir)
        if resume is not None:  # another optimizer's checkpoint: refused before any weight is read
            check_optimizer_kind(resume, run_optimizer(args, self._adamw))
        return args

    def _plan(self, args, model):
        """The run's plan (planner.plan_run) for this machine, logged, and refused before a single large
        allocation where it does not fit; the device settings Trainer reads follow it."""
        device = args.device  # resolves the device now, as Trainer would
        if recompute_off(args):
            logger.info("%s: the engine always recomputes at layer boundaries; flag ignored", _RECOMPUTE_FLAG)
        lora = args.peft_config is not None or hasattr(model, "peft_config")
        machine = Machine.measured(device, max_gpu_memory=args.max_gpu_memory, max_host_memory=args.max_host_memory)
        held = self._host_held(args, model)  # what another engine of this trainer will hold, planned around
        if held is not None and machine.host_free is not None:
            machine = dataclasses.replace(machine, host_free=max(0.0, machine.host_free - held[0]))
        # the optimizer is part of the request: its state sizes the plan, and Adafactor refuses the modes that cut parameters
        request = request_from_arguments(args, device, lora=lora, model=model,
                                         optimizer=run_optimizer(args, self._adamw))
        run = plan_run(base_model(model).config, request, machine)
        main = args.process_index == 0
        for line in run.notes if main else []:
            logger.info(line)
        self._split, self._per_pass, self.step_time = run.split, run.per_pass, run.step_time
        plan, batch, seq = run.memory, run.rows, args.max_seq_length
        if batch * seq >= LONG_CONTEXT_TOKENS and main and device.type == "cuda":
            tiles = run.engine.mlp_tile_tokens
            print(f"hf_megatrain memory plan for {batch} x {seq} tokens: "
                  f"{f'MLP tiles of {tiles} tokens' if tiles else 'MLP untiled'}, "
                  f"{counted(plan.offload_activations, 'layer input')} offloaded to host, "
                  f"{counted(plan.resident_layers, 'layer')} resident on the GPU\n{plan.table()}")
        if held is not None and main:
            logger.info("%s: %.1f GiB of host RAM, held out of what the plan counts as available", held[1],
                        held[0] / GiB)
        if run.refusal is not None:  # before a single large allocation
            first, _, table = run.refusal.partition("\n")
            if held is not None:
                first += f" (The host RAM counted excludes {held[0] / GiB:.1f} GiB for {held[1]}.)"
            raise MegaTrainError("\n".join(filter(None, (first, table))))
        for line in run.warnings if main else []:
            logger.warning(line)
        if device.type == "cpu":
            args.dataloader_pin_memory = False  # nothing to pin for
        args._n_gpu = 1 if device.type == "cuda" else args._n_gpu
        return run

    def _host_held(self, args, model) -> tuple[float, str] | None:
        """(bytes, what) of host RAM that something besides the model's own engine will hold (a preference
        trainer's reference), taken out of what the plan counts as available; None here."""
        return None

    def _datasets(self, raw_data, train_dataset, eval_dataset, data_collator, processing_class, args, config):
        """(train_dataset, eval_dataset, data_collator): data_path / eval_data_path loaded, and datasets as
        TRL takes them (raw text, chat `messages` or prompt/completion columns) tokenized and packed as
        data_path would be, with the engine's collator for what it tokenized; tokenized ones pass as they are."""
        data = {"data_path": train_dataset, "eval_data_path": eval_dataset}
        for name, given in data.items():
            raw = raw_data[name] if name in raw_data else given if _untokenized(given) else None
            if raw is not None:
                data[name] = self._dataset_from(raw, processing_class, args)
                data_collator = data_collator or CausalCollator(_pad_id(processing_class, config))
        train_dataset, eval_dataset = data["data_path"], data["eval_data_path"]
        if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
            raise MegaTrainError("train_dataset is empty: there is nothing to train on.")
        return train_dataset, eval_dataset, data_collator

    def _build_engine(self, model, weights_from, args, engine_config):
        """The engine over the model's weights (read now, from the checkpoint where one is named), with a
        LoRA run's adapters made first; returns the model Trainer keeps (the PEFT one for LoRA)."""
        if args.peft_config is not None:
            # Seeded as TRL's SFTTrainer seeds them: args.seed just before the adapters are made (Trainer seeds
            # again later, for the training itself); after a cloned chat template, where its resize left the RNG
            # (sft.py), as stock makes them right after it
            rng = getattr(self, "_adapter_rng", None)
            if rng is not None:
                torch.set_rng_state(rng)
            else:
                set_seed(args.seed)
            model = with_adapters(model, args.peft_config, weights_from, engine_config.compute_dtype)
            weights_from = None
        self.args = args  # what a subclass's get_decay_parameter_names may read (Trainer sets it again)
        decay = decay_names(self.get_decay_parameter_names, model)
        sharding = None
        if args.world_size > 1:  # data parallel: each rank keeps a slice of the optimizer state
            from .engine.distributed import Sharding

            sharding = Sharding()
        build = dict(config=engine_config, decay_names=decay, sharding=sharding)
        if weights_from is None:
            self.engine = StreamingEngine(model, **build)
        else:
            self.engine = engine_from_checkpoint(model, weights_from, progress=not args.disable_tqdm, **build)
        self.engine.writer = model_writer(base_model(model))  # trainer.engine.save_pretrained works as well
        return model

    def _custom_loss_kind(self, compute_loss_func, args) -> str | None:
        """A loss of the user's (a compute_loss override, compute_loss_func, label smoothing) is honoured through
        Trainer's compute_loss over the whole logits the engine builds for it; what it cannot meet is refused."""
        custom = custom_loss(type(self), compute_loss_func, args)
        if custom:
            if self._split > 1:
                raise MegaTrainError(f"{custom} needs each micro-batch's logits at once, but the memory plan "
                                     f"splits micro-batches of {args.per_device_train_batch_size} rows into "
                                     f"{self._split}: lower per_device_train_batch_size (raise "
                                     "gradient_accumulation_steps instead).")
            if args.world_size > 1:
                raise MegaTrainError(f"{custom} is not combined with data parallel yet; run one process.")
            logger.info("%s: the engine builds each micro-batch's whole [batch, seq, vocab] logits for it, as the "
                        "model's own forward does", custom)
        return custom

    @staticmethod
    def _dataset_from(raw, tokenizer, args):
        return tokenize_dataset(raw, tokenizer, args.max_seq_length, args.packing, args.text_field)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # A wrong or incomplete checkpoint fails now, before the dataloader and optimizer are built.
        resume_from_checkpoint = check_resume(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint is not None:
            check_optimizer_kind(resume_from_checkpoint, self.optimizer_kind)
        # NEFTune's noise in the engine's embedding for this training only, as Trainer hooks it for train() only
        self.engine.set_neftune(self.args.neftune_noise_alpha)
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            try:
                self.engine.synchronize()  # let pending steps land before anyone reads the model
            except Exception:
                pass  # a failed host job raises again here: the exception on its way up says it first
            raise
        finally:
            self.engine.set_neftune(None)
        self.engine.synchronize()  # the last optimizer step lands before anyone reads the model
        return result

    # -- where Trainer would move or wrap the model -----------------------------------------
    def _move_model_to_device(self, model, device):
        pass  # the model's weights live in the host store

    def _wrap_model(self, model, training=True, dataloader=None):
        return self.engine

    def _build_accelerator_args(self, **kwargs):
        # Keep batches on the CPU until the engine takes them (token checks without a GPU sync,
        # pinned non-blocking copies), and never let accelerate copy optimizer state to the GPU.
        args = super()._build_accelerator_args(**kwargs)
        args["device_placement"] = False
        return args

    # -- optimizer ------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            a = self.args
            if self.optimizer_kind == "adamw":
                hyper = self._adamw or dict(lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                                            eps=a.adam_epsilon)
                # weight decay as Trainer's two groups set it (optimizer_cls_and_kwargs cannot change it there either)
                self.optimizer = HostAdamW(self.engine, weight_decay=a.weight_decay, **hyper)
            else:  # the class and kwargs stock builds for args.optim (lr, optim_args, its own defaults)
                cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(a, self.model)
                self.optimizer = HostParamOptimizer(self.engine, cls, kwargs, weight_decay=a.weight_decay,
                                                    name=self.optimizer_kind)
        return self.optimizer

    @property
    def optimizer_kind(self) -> str:
        """The optimizer this run steps, as checkpoints record it: 'adamw' (every AdamW variant, and
        optimizer_cls_and_kwargs' AdamW) or args.optim (sgd, adagrad, rmsprop, adafactor)."""
        return run_optimizer(self.args, self._adamw)

    @property
    def host_optimizer(self) -> HostAdamW | HostParamOptimizer:
        opt = self.optimizer
        return getattr(opt, "optimizer", opt)

    # -- one micro-batch ------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # Trainer fetches a step's micro-batches before it runs them: kept, so that the first
        # training_step can run them all through each layer together (forward_backward_many).
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._step_batches = batches if self._per_pass > 1 and len(batches) * self._split > 1 else None
        return batches, num_items

    def _micro_batch(self, inputs) -> tuple[int, list]:
        """(index of `inputs` among the micro-batches that run with it, those micro-batches)."""
        group = getattr(self, "_step_batches", None)
        if group:
            for k, b in enumerate(group):
                if b is inputs:
                    return k, group
        return 0, [inputs]

    def training_step(self, model, inputs, num_items_in_batch=None):
        if inputs.get("labels") is None:  # stock's model returns no loss then, and stock's compute_loss says so
            raise ValueError(
                "The model did not return a loss from the inputs, only the following keys: logits. For reference, "
                f"the inputs it received are {','.join(inputs.keys())}. (hf_megatrain trains on 'labels': give "
                "the rows labels, or a data_collator that makes them, e.g. DataCollatorForLanguageModeling(tokenizer, "
                "mlm=False).)")
        self.engine.train()
        self.model.train()  # as stock's training_step leaves the model it trains (callbacks and TRL read it)
        # Same loss scaling rule as Trainer.training_step: HF causal LMs divide by
        # num_items_in_batch themselves; otherwise the mean loss is divided by the GA steps
        # (not a compute_loss_func's, which Trainer leaves as it is), unless the trainer's
        # loss_is_scaled_for_ga (transformers >= 5.2x; None: this rule) says otherwise.
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        divide = not scaled and self.compute_loss_func is None
        # newer transformers: what a subclass says of its loss (an older Trainer has no such attribute and ignores it)
        said = getattr(self, "loss_is_scaled_for_ga", None) if hasattr(Trainer, "loss_is_scaled_for_ga") else None
        if said is not None:
            divide = not said
        # read only where it divides, as stock does: a training_step called before train() has none
        ga = self.current_gradient_accumulation_steps if divide else 1
        # Data parallel: stock DDP averages the ranks' gradients of each rank's loss, while the engine sums them,
        # so the engine's gradient takes stock's factor on the loss over the world size (_rank_loss_factor).
        times = self._rank_loss_factor(num_items_in_batch)
        share = times / max(1, self.args.world_size)
        k, group = self._micro_batch(inputs)
        self._micro_index = k
        if k == 0:
            if self._last_log is None:
                self._last_log = time.perf_counter()
            items = num_items_in_batch if scaled else None
            # each micro-batch in chunks of rows (planner.split_step; a short last batch in fewer)
            chunks = [split_rows(b, self._split) for b in group]
            self._owner = [i for i, parts in enumerate(chunks) for _ in parts]  # which micro-batch each chunk is of
            if items is None and len(self._owner) > len(group):  # the mean over the micro-batch's tokens
                items = [loss_denominator(group[i]["labels"], None) for i in self._owner]
            # the host optimizer's step placed by the engine's step policy (engine/step.py): during this
            # backward where it can be (the step's last micro-batches), else after it (_clip_grad_norm, step)
            out = backward(self.engine, self.host_optimizer, [c for parts in chunks for c in parts],
                           num_items_in_batch=items, scale=share / ga,
                           max_grad_norm=self.args.max_grad_norm,
                           last=len(group) > 1 or self.accelerator.sync_gradients,
                           aux_scale=self._aux_loss_scale(items if scaled else None),
                           head_loss=self._head_loss(group, num_items_in_batch))
            self._measured_norm, losses = out.norm, out.losses
            self._losses = [sum(x for x, o in zip(losses, self._owner) if o == i) for i in range(len(group))] \
                if len(losses) > len(group) else losses
        self._tokens_since_log += count_real_tokens(inputs)
        # each rank returns what stock's does (its logging averages them over the ranks): the loss after
        # stock's scaling, times the world size where stock multiplies by it
        loss = self._losses[k] / ga * times
        return loss.to(self.args.device)

    def _rank_loss_factor(self, num_items_in_batch) -> int:
        """The one rule for data parallel's scaling: the factor stock's compute_loss puts on a rank's loss that
        the engine's loss lacks. Stock DDP averages the ranks' gradients of their losses, the engine sums them,
        so the engine's gradient takes this factor over the world size, and the loss it reports, the factor.

        It is the world size where num_items_in_batch counts every rank's tokens (average_tokens_across_devices,
        for a model that takes loss kwargs or a compute_loss_func): stock multiplies the loss by it (Trainer's and
        SFTTrainer's compute_loss) to undo DDP's average, and the engine's sum is already the global token mean.
        Else 1: each rank's loss is over its own tokens (average_tokens_across_devices=False) or its own rows
        (no num_items_in_batch: a model without loss kwargs, TRL's preference losses), and the engine's gradient
        takes 1/world, as DDP's average does. Also 1 for a loss of the user's: that is stock's compute_loss,
        which has put the factor on it already."""
        a = self.args
        counted = num_items_in_batch is not None and (self.model_accepts_loss_kwargs or self.compute_loss_func)
        if a.world_size > 1 and a.average_tokens_across_devices and counted and not self._custom:
            return a.world_size
        return 1

    def _head_loss(self, group: list, num_items_in_batch):
        """The engine's head_loss for this step's micro-batches: None for the causal-LM loss, the user's loss
        (_custom_loss), or a trainer's own (the DPO trainer's loss of per-row sums, engine.loss.RowLoss)."""
        return self._custom_loss(group, num_items_in_batch) if self._custom else None

    def _custom_loss(self, group: list, num_items_in_batch):
        """The engine's head_loss for a loss of the user's (a compute_loss override, compute_loss_func, label
        smoothing): Trainer's own compute_loss, called as stock's training_step calls it, with a model that
        gives the logits the engine built for that micro-batch (LogitsModel)."""
        def head_loss(k, logits, aux):
            model = LogitsModel(self.model, group[k], logits=logits, aux=aux, aux_coef=self.engine.aux_coef)
            return self.compute_loss(model, dict(group[k]), num_items_in_batch=num_items_in_batch)

        return head_loss

    def _aux_loss_scale(self, num_items_in_batch) -> float:
        """Weight of the MoE load-balancing loss in this micro-batch's loss: 1, as the model adds it."""
        return 1.0

    def log(self, logs, start_time=None):
        # The engine's own speed keys only when asked (log_pipeline): by default the logs, and what they
        # send to TensorBoard, W&B or MLflow, carry stock Trainer's keys.
        if self.args.log_pipeline and "loss" in logs and self._last_log is not None:
            logs.update(self._throughput())
        super().log(logs, start_time)

    def _throughput(self) -> dict:
        now = time.perf_counter()
        seconds, tokens = max(now - self._last_log, 1e-9), self._tokens_since_log
        self._last_log, self._tokens_since_log = now, 0
        out = {"tokens_per_second": round(tokens / seconds, 1)}
        tflops = 6 * self.engine.num_parameters * tokens / seconds / 1e12
        out["model_tflops"] = float(f"{tflops:.4g}")
        peak = self.args.gpu_peak_tflops
        if peak:
            out["mfu"] = float(f"{tflops / peak:.4g}")
        if self.step_time is not None:  # how far from the model (which counts every token as real)
            out["pipe_model_tokens_per_second"] = round(self.step_time.tokens_per_s, 1)
            out["pipe_vs_model"] = round(out["tokens_per_second"] / self.step_time.tokens_per_s, 4)
        timeline = self._timeline  # only our own: someone else's (a benchmark's) is theirs to read
        if timeline is not None and self.engine.timeline is timeline:
            busy = timeline.collect()
            out.update({f"pipe_{k}": v for k, v in busy.items() if k.endswith("_busy") or k == "gpu_idle"})
        return out

    def _clip_grad_norm(self, model):
        measured, self._measured_norm = self._measured_norm, None
        if measured is not None:  # transient_grads: measured before the backward, which clipped as it stepped
            return measured
        return self.host_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.grad_norm() if grad_norm is None else grad_norm

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.engine.eval()
        self.model.eval()  # as stock's evaluation leaves the model it evaluates
        if self._custom:  # the user's loss: stock's own prediction_step, with the engine's forward as the model
            return Trainer.prediction_step(self, LogitsModel(self.model, inputs, engine=self.engine), inputs,
                                           prediction_loss_only, ignore_keys)
        has_labels = inputs.get("labels") is not None
        want_logits = not prediction_loss_only
        with torch.no_grad():
            out = self.engine(**{k: v for k, v in inputs.items() if k in ENGINE_KEYS}, return_logits=want_logits)
        loss = out.loss.detach() if has_labels else None
        if prediction_loss_only:
            return loss, None, None
        labels = inputs.get("labels")
        return loss, out.logits, labels.to(out.logits.device) if labels is not None else None

    # -- saving and resuming -------------------------------------------------------------------
    def save_model(self, output_dir=None, _internal_call=False):
        if self.engine.sharding is None:
            return super().save_model(output_dir, _internal_call)
        # Data parallel: the masters are gathered from every rank's slice, so every rank takes
        # part (Trainer would call _save on the main process only); the main process writes.
        self._save(output_dir if output_dir is not None else self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save(self, output_dir=None, state_dict=None):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.synchronize()
        write = self.args.should_save
        # the adapters for a LoRA run (what PeftModel.from_pretrained loads), else the whole model
        self.engine.writer(self.engine, output_dir, save_dtype(self.args), write=write)
        if not write:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def save_merged(self, output_dir: str, dtype=None) -> None:
        """PEFT runs: base + merged adapters as a full HF checkpoint (merge_and_unload, streamed)."""
        if self.engine.peft_model is None:
            raise MegaTrainError("save_merged is for PEFT runs (LoRA and the other adapters); use save_model for full "
                                 "fine-tuning.")
        save_merged(self.engine, output_dir, dtype=dtype or save_dtype(self.args))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir):
        self.engine.synchronize()
        save_optimizer_state(self.host_optimizer, output_dir)  # every rank: its own slices
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # What Trainer's own _save_checkpoint calls (transformers 5.17 to 5.25). Ours writes the same files,
    # into a hidden folder that is renamed into place when complete. No public hook can do that (a
    # callback's on_save runs after the folder is written), so the body is mirrored in _write_checkpoint;
    # a test compares this set with the installed Trainer's, so a release that adds a step fails loudly.
    STOCK_CHECKPOINT_CALLS = frozenset({
        "self._get_output_dir", "self._push_from_checkpoint", "self._save_optimizer_and_scheduler",
        "self._save_rng_state", "self._save_scaler", "self.save_model", "self.store_flos", "rotate_checkpoints",
        "is_sagemaker_mp_enabled", "is_torch_xla_available", "unwrap_model",
    })

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint, written into a hidden folder and renamed into place when complete.

        A failed write (disk full, a lost mount) removes the hidden folder and says which
        checkpoint it was; the complete checkpoints before it are never touched."""
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, folder)
        tmp = partial_dir(final)
        try:
            self._write_checkpoint(run_dir, final, tmp)
        except Exception as e:
            if self.args.should_save:
                shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(
                f"writing checkpoint {final} failed: {e!r}. Earlier complete checkpoints in {run_dir} are intact; "
                "free space or fix the folder, then resume from the last one (resume_from_checkpoint=True)."
            ) from e
        if self.args.push_to_hub:
            self._push_from_checkpoint(final)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _write_checkpoint(self, run_dir: str, final: str, tmp: str) -> None:
        if self.args.should_save:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self._barrier()
        self.save_model(tmp, _internal_call=True)
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and \
                self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best) or best == final:
                self.state.best_model_checkpoint = best
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(tmp)
            self._save_scaler(tmp)
            self._save_rng_state(tmp)
        if self.args.should_save:
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
            self.state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
        self._barrier()  # every rank's optimizer slice is on disk
        if self.args.should_save:
            write_manifest(tmp, hashes=self.args.checkpoint_hashes)
            commit_dir(tmp, final)
        self._barrier()

    def _barrier(self) -> None:
        self.engine.barrier()

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # Masters (fp32) come back with the optimizer state; the model files hold only the save
        # dtype. train() checked the folder is complete (files and sizes); the hashes are read now.
        if os.path.isfile(os.path.join(resume_from_checkpoint, MANIFEST)):
            verify_manifest(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        self.engine.synchronize()
        load_optimizer_state(self.host_optimizer, checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s (score %s)", best, self.state.best_metric)
        self.engine.synchronize()
        load_masters(self.engine.store, best)

    # -- the local hub ---------------------------------------------------------------------------
    def init_hf_repo(self, token=None, private=None):
        # Trainer takes `private` too on newer transformers (5.25); a local hub folder has no visibility to set.
        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        self.local_hub = LocalHub(default_hub_dir(self.args.hub_dir), repo_id)
        self.hub_model_id = repo_id
        self.push_in_progress = None

    def _publish(self, message: str, checkpoint_folder: str | None = None) -> str:
        uploads = [(self.args.output_dir, "")]
        if checkpoint_folder is not None and self.args.hub_strategy in (
            HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS
        ):
            name = "last-checkpoint" if self.args.hub_strategy == HubStrategy.CHECKPOINT else \
                os.path.basename(checkpoint_folder)
            uploads.append((checkpoint_folder, name))
        ignore = ("_*", f"{PREFIX_CHECKPOINT_DIR}-*", ".partial-*", "runs")
        commit = self.local_hub.commit(uploads, message, ignore=ignore)
        logger.info("published %s to local hub %s at commit %s", self.hub_model_id, self.local_hub.root, commit)
        return commit

    def write_model_card(self, output_dir: str | None = None) -> str:
        """README.md beside the saved model: what it was trained from, on what, how, and how it ended."""
        from . import __version__

        out = output_dir or self.args.output_dir
        a, config = self.args, base_model(self.model).config
        base = getattr(config, "_name_or_path", "")  # a hub id, a folder, or '' for a model built in memory
        data = [d for d in (a.data_path, a.eval_data_path) if d]
        for ds in (self.train_dataset, self.eval_dataset):
            name = getattr(getattr(ds, "info", None), "dataset_name", None)
            if name:
                data.append(name)
        hyper = {"learning_rate": a.learning_rate, "lr_scheduler_type": str(getattr(a.lr_scheduler_type, "value",
                                                                                    a.lr_scheduler_type)),
                 "warmup_steps": a.warmup_steps, "weight_decay": a.weight_decay, "max_grad_norm": a.max_grad_norm,
                 "per_device_train_batch_size": a.per_device_train_batch_size,
                 "gradient_accumulation_steps": a.gradient_accumulation_steps, "max_seq_length": a.max_seq_length,
                 "optimizer steps": self.state.global_step, "seed": a.seed,
                 "compute_dtype": str(self.engine.compute_dtype).replace("torch.", ""),
                 "LoRA": "yes" if self.engine.peft_model is not None else "no (full fine-tuning)"}
        final = {}
        for entry in self.state.log_history:  # the last value of each metric
            final.update({k: v for k, v in entry.items() if k in ("loss", "train_loss", "eval_loss", "epoch")})
        world = max(1, a.world_size)
        if self.args.device.type == "cuda":
            where = "layers streamed through one GPU" if world == 1 else \
                f"layers streamed through each of {world} GPUs (data parallel)"
        else:
            where = "trained on the CPU" + (f" in {world} processes (data parallel)" if world > 1 else "")
        lines = ["---", "library_name: transformers", "tags: [hf_megatrain]"]
        if base and not os.path.isdir(base):
            lines.append(f"base_model: {base}")
        lines += ["---", "", f"# {self.hub_model_id if getattr(self, 'hub_model_id', None) else os.path.basename(out)}",
                  "", f"Fine-tuned from {f'`{base}`' if base else f'a {config.model_type} model'} with "
                  f"hf_megatrain {__version__} (fp32 master weights and AdamW state in host RAM, "
                  f"{where}).", "",
                  "## Data", ""] + ([f"- `{d}`" for d in data] or ["- (a dataset passed in memory, unnamed)"])
        lines += ["", "## Hyperparameters", "", "| name | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in hyper.items()]
        lines += ["", "## Results", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in final.items()]
        path = os.path.join(out, "README.md")
        if self.args.should_save:
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
        return path

    def _push_from_checkpoint(self, checkpoint_folder):
        """Stock semantics: the checkpoint's model files go to output_dir, which is published."""
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        out = self.args.output_dir
        for name in os.listdir(checkpoint_folder):
            if name.startswith(("model", "config.json", "generation_config.json")):
                shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(out, name))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)
        torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))
        self.write_model_card(out)
        if self.args.save_strategy == SaveStrategy.STEPS:
            message = f"Training in progress, step {self.state.global_step}"
        else:
            message = f"Training in progress, epoch {int(self.state.epoch)}"
        self._publish(message, checkpoint_folder)

    def push_to_hub(self, commit_message="End of training", blocking=True, token=None, revision=None, **kwargs):
        """Save the model to output_dir and publish it to the local hub; returns the commit id."""
        if getattr(self, "local_hub", None) is None:
            self.init_hf_repo()
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        self.write_model_card()
        return self._publish(commit_message or "End of training")


# Trainer methods that the engine's path never calls, so that a subclass's override of one would be skipped
# without a word: refused when the trainer is built, saying what to do. Every other hook (log,
# create_scheduler, get_train_dataloader, evaluate, prediction_step, callbacks...) runs as in stock.
SKIPPED_HOOKS = {
    "create_optimizer": "the engine steps its own optimizer on the host over flat per-layer buffers. Remove the "
                        "override and set optim (adamw_torch, sgd, adagrad, rmsprop, adafactor), optim_args, "
                        "learning_rate, weight_decay and the adam_* fields in the arguments (parameter groups follow "
                        "get_decay_parameter_names, which may be overridden).",
    "_prepare_inputs": "the engine takes each batch on the CPU and moves it to the GPU itself. Remove the override "
                       "and shape the batch in a data_collator instead.",
}


def _own(cls, name: str) -> type | None:
    """The class below Trainer that defines `name` for `cls`, when it is the user's (not this library's,
    not Trainer's, not TRL's SFTTrainer, whose loss and metrics the engine reproduces)."""
    owner = next(c for c in cls.__mro__ if name in vars(c))
    if owner is Trainer or owner.__module__.startswith("hf_megatrain") or \
            (owner.__module__.startswith("trl.") and owner.__name__ in ENGINE_TRL_TRAINERS):
        return None
    return owner


# TRL trainers whose loss and metrics the engine reproduces (hf_megatrain.sft, .dpo, .kto, .orpo, .cpo), and
# what TRL's base class adds between them and Trainer
ENGINE_TRL_TRAINERS = ("SFTTrainer", "DPOTrainer", "KTOTrainer", "ORPOTrainer", "CPOTrainer", "_BaseTrainer")
# TRL's online trainers, by the name of their config: each generates completions during training
ONLINE_TRL = {"GRPO": "GRPO", "RLOO": "RLOO", "PPO": "PPO", "OnlineDPO": "online DPO", "XPO": "XPO",
              "NashMD": "Nash-MD", "GKD": "GKD", "GOLD": "GOLD"}
# the TRL trainers the engine runs, by the name of their config: our trainer's module and class
ENGINE_TRL = {"SFT": "sft.MegaTrainSFTTrainer", "DPO": "dpo.MegaTrainDPOTrainer", "KTO": "kto.MegaTrainKTOTrainer",
              "ORPO": "orpo.MegaTrainORPOTrainer", "CPO": "cpo.MegaTrainCPOTrainer"}
_OFFERED = ", ".join(f"{kind} (hf_megatrain.{where})" for kind, where in ENGINE_TRL.items())


def refuse_other_trl_config(args, trainer: str) -> None:
    """One line for a TRL config (GRPOConfig, DPOConfig...) that `trainer` does not take, saying why and
    which trainer does; nothing for any other arguments. Checked before any data is tokenized."""
    cls = type(args)
    if not (cls.__module__ or "").startswith("trl") or not cls.__name__.endswith("Config"):
        return
    kind, name = cls.__name__[: -len("Config")], cls.__name__
    if f"MegaTrain{kind}Trainer" == trainer:
        return
    if kind in ONLINE_TRL:
        raise MegaTrainError(f"args is TRL's {name}: {ONLINE_TRL[kind]} is an online method that generates "
                             "completions during training, which hf_megatrain does not do (no generation); it trains "
                             f"offline: {_OFFERED}.")
    if kind in ENGINE_TRL:
        raise MegaTrainError(f"args is TRL's {name}, which {trainer} does not take: TRL's {kind} trainer runs on the "
                             f"engine as hf_megatrain.{ENGINE_TRL[kind]} ({name}).")
    raise MegaTrainError(f"args is TRL's {name}: TRL's {kind} trainer is not supported by hf_megatrain (its loss "
                         f"needs forwards the engine does not run); these are: {_OFFERED}.")


def custom_loss(cls, compute_loss_func, args) -> str | None:
    """What makes the loss the user's rather than the causal LM's own, named; None when nothing does."""
    owner = _own(cls, "compute_loss")
    trl = next((c.__name__ for c in cls.__mro__ if c.__name__ in ENGINE_TRL_TRAINERS[:-1]), None)
    if trl is not None:  # TRL's loss runs a fused head the engine reproduces
        if owner is not None:
            raise MegaTrainError(f"{owner.__name__}.compute_loss overrides {trl}.compute_loss, whose fused "
                                 "head the engine reproduces but cannot call; remove the override.")
        if args.label_smoothing_factor:
            raise MegaTrainError(f"label_smoothing_factor is not applied by TRL's {trl[:-len('Trainer')]} loss, "
                                 "which the engine reproduces; set it to 0.")
        return None
    if owner is not None:
        return f"{owner.__name__}.compute_loss"
    if compute_loss_func is not None:
        return "compute_loss_func"
    return "label_smoothing_factor" if args.label_smoothing_factor else None


class LogitsModel:
    """What a user's compute_loss gets as `model` under the engine. In training (`logits=` given) the
    engine has already run the layers on the micro-batch and built its logits with autograd; calling
    this returns the model's outputs over them: `loss` as the model computes it (its loss_function, plus
    an MoE's load-balancing term), `logits`, and for an MoE `aux_loss`. In evaluation (`engine=`) a call
    runs the engine's forward. Every other attribute is the real model's (config, loss_function, ...)."""

    def __init__(self, model, batch: dict, logits=None, aux=None, engine=None, aux_coef="router_aux_loss_coef"):
        self._model, self._batch, self._logits, self._aux, self._engine = model, batch, logits, aux, engine
        self._aux_coef = aux_coef  # the config field of the family's coefficient (JetMoE: aux_loss_coef)
        self._called = False

    def __getattr__(self, name):  # only for what __init__ did not set
        if name in ("_model", "_batch", "_logits", "_aux", "_engine", "_called", "_aux_coef"):
            raise AttributeError(name)  # a copy made without __init__ must not recurse
        return getattr(self._model, name)

    def _get_name(self):  # what Trainer's label smoother reads to know it is a causal LM
        return base_model(self._model)._get_name()

    def __call__(self, input_ids=None, attention_mask=None, labels=None, position_ids=None, num_items_in_batch=None,
                 **kwargs):
        if self._engine is not None:
            return self._engine(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                position_ids=position_ids, num_items_in_batch=num_items_in_batch)
        if self._called:
            raise MegaTrainError("compute_loss called the model twice for one micro-batch; under the engine it "
                                 "runs one forward per micro-batch (the batch the Trainer gave).")
        self._called = True
        given = self._batch.get("input_ids")
        if input_ids is not None and input_ids is not given and not torch.equal(input_ids.cpu(), given.cpu()):
            raise MegaTrainError("compute_loss called the model with input_ids other than the batch's; the engine "
                                 "has run the layers on the batch as the Trainer gave it.")
        inner = base_model(self._model)
        loss = aux_loss = None
        if labels is not None:
            extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
            loss = inner.loss_function(logits=self._logits, labels=labels, vocab_size=inner.config.vocab_size, **extra)
        if self._aux is not None:
            coef = getattr(inner.config, self._aux_coef, None)
            aux_loss = self._aux / coef if coef else None  # the leaf is coef * aux, as the model adds it
            if loss is not None:
                loss = loss + self._aux
            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=self._logits)
        return CausalLMOutputWithPast(loss=loss, logits=self._logits)


def check_overrides(cls) -> None:
    """Refuse a subclass whose own version of a SKIPPED_HOOKS method the engine would never run. The
    library's classes (and TRL's SFTTrainer, whose loss and metrics the engine reproduces) are exempt."""
    for name, why in SKIPPED_HOOKS.items():
        owner = _own(cls, name)
        if owner is not None:
            raise MegaTrainError(f"{owner.__name__}.{name} overrides Trainer.{name}, but {why}")


def run_optimizer(args, adamw: dict | None) -> str:
    """What steps a run, as checkpoints record it: 'adamw' (every AdamW variant, and optimizer_cls_and_kwargs'
    AdamW: `adamw`, check_optimizers' answer) or args.optim (sgd, adagrad, rmsprop, adafactor)."""
    return "adamw" if adamw else optimizer_name(str(getattr(args.optim, "value", args.optim)))


def check_optimizers(optimizers, optimizer_cls_and_kwargs) -> dict | None:
    """Trainer's `optimizers` and `optimizer_cls_and_kwargs`, as far as the host AdamW honours them.
    Returns the AdamW hyperparameters that replace the arguments' (None: the arguments'): torch's AdamW
    class with its own kwargs gives what stock builds from it, `AdamW(param_groups, **kwargs)`, where the
    groups set weight decay and the kwargs (or torch's defaults) the rest. Anything else: one line."""
    optimizer, scheduler = optimizers
    if optimizer is not None and not isinstance(optimizer, HostAdamW):
        raise MegaTrainError(f"optimizers=({type(optimizer).__name__}, ...): the engine steps its own AdamW on the "
                             "host over flat per-layer buffers; leave optimizers unset and set learning_rate, "
                             "weight_decay and adam_* in the arguments.")
    if scheduler is not None and optimizer is None:
        raise MegaTrainError("optimizers=(None, scheduler): a scheduler built beforehand drives an optimizer the "
                             "engine does not step. Set lr_scheduler_type (and lr_scheduler_kwargs), or override "
                             "create_scheduler, which runs as in stock Trainer.")
    if optimizer_cls_and_kwargs is None:
        return None
    cls, kw = optimizer_cls_and_kwargs
    honoured = {"lr", "betas", "eps", "weight_decay", "foreach", "fused"}  # the last two: kernels, same numbers
    if cls is not torch.optim.AdamW or set(kw) - honoured:
        raise MegaTrainError(f"optimizer_cls_and_kwargs=({getattr(cls, '__name__', cls)}, {kw}): the engine runs "
                             "AdamW on the host; only torch.optim.AdamW with lr, betas and eps is honoured (or "
                             "set them in the arguments).")
    defaults = inspect.signature(torch.optim.AdamW).parameters
    return {k: kw.get(k, defaults[k].default) for k in ("lr", "betas", "eps")}


# The Trainer methods MegaTrainTrainer replaces. Most are private, so a transformers release may rename
# or re-sign one; then Trainer would go on calling its own (moving the model to the GPU, stepping a torch
# optimizer) and training would silently bypass the engine. check_trainer_hooks refuses that instead.
TRAINER_OVERRIDES = (
    "train", "_move_model_to_device", "_wrap_model", "_build_accelerator_args", "create_optimizer",
    "get_batch_samples", "training_step", "log", "_clip_grad_norm", "_get_grad_norm", "prediction_step", "save_model",
    "_save", "_save_optimizer_and_scheduler", "_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
    "_load_best_model", "init_hf_repo", "_push_from_checkpoint", "push_to_hub",
)


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def hook_problems(base=Trainer) -> list[str]:
    """What in `base` (the installed Trainer) no longer fits the methods we override: a method that is
    gone, or one whose parameters ours do not accept as Trainer passes them (same names, same order)."""
    problems = []
    for name in TRAINER_OVERRIDES:
        theirs = getattr(base, name, None)
        if theirs is None:
            problems.append(f"Trainer.{name} is gone")
            continue
        ours = list(inspect.signature(getattr(MegaTrainTrainer, name)).parameters.values())[1:]
        wanted = list(inspect.signature(theirs).parameters.values())[1:]
        absorbs = any(p.kind in _VARIADIC for p in ours)  # *args / **kwargs take whatever comes
        for i, p in enumerate(wanted):
            same_place = i < len(ours) and ours[i].name == p.name and ours[i].kind not in _VARIADIC
            by_keyword = p.kind == p.KEYWORD_ONLY and any(q.name == p.name for q in ours)
            if p.kind not in _VARIADIC and not (same_place or by_keyword or absorbs):
                problems.append(f"Trainer.{name} takes {p.name!r}, which ours does not take where Trainer passes it")
        given = {p.name for p in wanted}
        needed = [p.name for p in ours if p.default is p.empty and p.kind not in _VARIADIC and p.name not in given]
        if needed and not any(p.kind in _VARIADIC for p in wanted):
            problems.append(f"Trainer.{name} no longer takes {', '.join(needed)}")
    return problems


def check_trainer_hooks() -> None:
    problems = hook_problems()
    if problems:
        import transformers

        raise MegaTrainError(
            f"transformers {transformers.__version__} changed Trainer methods hf_megatrain replaces: "
            + "; ".join(problems) + ". Install a transformers version hf_megatrain supports (pip install -e . "
            "picks one), or report this so the engine can follow."
        )


LONG_CONTEXT_TOKENS = 65536  # from here on the plan (tiles, offload, residency) is printed



def _untokenized(dataset) -> bool:
    """A `datasets.Dataset` of raw rows (text, messages or prompt/completion), with no input_ids yet."""
    import datasets

    return isinstance(dataset, datasets.Dataset) and "input_ids" not in dataset.column_names


def _pad_id(tokenizer, config) -> int:
    for src in (tokenizer, config):
        pid = getattr(src, "pad_token_id", None)
        if pid is not None:
            return int(pid)
    return 0
