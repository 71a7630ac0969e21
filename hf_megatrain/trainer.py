"""MegaTrainTrainer: transformers.Trainer with its forward/backward/step path on the engine.

Thin glue. `self.model` stays the real PreTrainedModel (config, save hooks, generate); its
parameters are views of the host store's compute copies. `_wrap_model` hands Trainer the
engine instead, so accelerate never prepares or moves the model. Everything else (the loop,
gradient accumulation, schedulers, callbacks, logging, evaluation, checkpoint rotation) is
stock Trainer, driven through the hook methods it offers for exactly this.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import fields
from functools import partial

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy, rotate_checkpoints

from .arguments import MegaTrainArguments, check_arguments
from .checkpoint.hf_format import save_hf_model
from .checkpoint.loading import is_peft_model, load_model_and_tokenizer, with_adapters
from .checkpoint.peft_export import save_adapter, save_merged
from .checkpoint.local_hub import LocalHub, default_hub_dir
from .checkpoint.manifest import MANIFEST, commit_dir, partial_dir, verify_manifest, write_manifest
from .checkpoint.optimizer_state import (
    load_masters,
    load_optimizer_state,
    save_optimizer_state,
)
from .data import CausalCollator, count_real_tokens, tokenize_dataset
from .engine.distributed import check_launch
from .engine.optimizer import HostAdamW
from .engine.schedule import StreamingEngine
from .engine.timeline import Timeline
from .errors import MegaTrainError
from .memory import (GiB, admit, estimate, gpu_available, host_available, longest_fitting_row, mlp_tile,
                     plan_placement, ranks_on_this_host)
from .preflight import check_data, check_disk, check_outputs, check_resume

logger = logging.getLogger(__name__)

# Trainer's recompute flag: transformers 5.25 renamed TrainingArguments.gradient_checkpointing to
# activation_checkpointing (the old name is a deprecated mirror that Trainer no longer reads); 5.17 has
# only the old name. Read once from the dataclass so the flag cleared below is the one Trainer acts on.
_RECOMPUTE_FLAG = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                       if name in {f.name for f in fields(TrainingArguments)})

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def resolve_compute_dtype(args, device: torch.device) -> torch.dtype:
    choice = getattr(args, "compute_dtype", "auto")
    if choice != "auto":
        return _DTYPES[choice]
    if getattr(args, "bf16", False) or device.type == "cuda":
        return torch.bfloat16
    return torch.float32


class MegaTrainTrainer(Trainer):
    """`Trainer` for models larger than the GPU: state in host RAM, one layer on the GPU at a time.

    `model` is a hub id, a local path, or a loaded CPU `PreTrainedModel`. With no
    `train_dataset`, `args.data_path` is loaded, tokenized and packed. Everything that can be
    checked without the weights (see `preflight`) is checked before any weight is read.
    """

    def __init__(
        self,
        model,
        args: MegaTrainArguments | None = None,
        train_dataset=None,
        eval_dataset=None,
        data_collator=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        **kwargs,
    ):
        args = args if args is not None else MegaTrainArguments(output_dir="megatrain_output")
        check_arguments(args)
        check_launch(args)  # several processes but no process group: refused before any weight is read
        if optimizers[0] is not None and not isinstance(optimizers[0], HostAdamW):
            raise MegaTrainError("a custom optimizer was passed; hf_megatrain steps its own HostAdamW on the host.")
        # Preflight: what can be checked without the weights is checked before any is read (loading
        # a 70B model takes minutes). The model id resolves to a config and a meta skeleton here.
        check_outputs(args)
        check_resume(getattr(args, "resume_from_checkpoint", None), args.output_dir)
        model, tokenizer, weights_from = load_model_and_tokenizer(model)
        processing_class = processing_class if processing_class is not None else tokenizer
        raw_data = {name: check_data(getattr(args, name), processing_class, args, name)
                    for name, given in (("data_path", train_dataset), ("eval_data_path", eval_dataset))
                    if given is None and getattr(args, name, None)}
        check_disk(args, model)
        device = args.device  # resolves the device now, as Trainer would
        if getattr(args, _RECOMPUTE_FLAG, False):
            logger.info("%s: the engine always recomputes at layer boundaries; flag ignored", _RECOMPUTE_FLAG)
            setattr(args, _RECOMPUTE_FLAG, False)

        tiles = mlp_tile(getattr(args, "max_seq_length", 0), getattr(args, "mlp_tile_tokens", None))
        plan_kw = dict(compute_dtype=str(resolve_compute_dtype(args, device)).replace("torch.", ""),
                       device=device.type, prefetch_depth=getattr(args, "prefetch_depth", 2), mlp_tile_tokens=tiles,
                       world_size=args.world_size, local_ranks=ranks_on_this_host(args.world_size))
        batch, seq = args.per_device_train_batch_size, getattr(args, "max_seq_length", 1024)
        # Data parallel streams every layer (residency is not combined with sharding yet): the plan
        # that admission checks must say so, or it would count host memory the run does not save.
        resident, offload = resolve_placement(args, _config(model), batch, seq, device, plan_kw,
                                              stream_all=args.world_size > 1)
        plan = estimate(_config(model), batch, seq, resident_layers=resident, offload_activations=offload, **plan_kw)
        if batch * seq >= LONG_CONTEXT_TOKENS and args.process_index == 0:
            print(f"hf_megatrain memory plan for {batch} x {seq} tokens: MLP tiles of {tiles} tokens, "
                  f"{offload} layer inputs offloaded to host, {resident} layers resident on the GPU\n{plan.table()}")
        if getattr(args, "memory_check", True):
            hint = None
            if device.type == "cuda" and batch * seq >= LONG_CONTEXT_TOKENS and args.world_size == 1:
                # a long-context refusal also names the longest row that would fit
                hint = partial(longest_fitting_row, _config(model), batch, seq,
                               **dict(plan_kw, mlp_tile_tokens=getattr(args, "mlp_tile_tokens", None)))
            planned = device.type == "cuda" and str(getattr(args, "gpu_resident_layers", "auto")) == "auto" \
                and args.world_size == 1
            admit(plan, hint=hint, residency_planned=planned)  # before a single large allocation: does it fit?
        if device.type == "cpu":
            args.dataloader_pin_memory = False  # nothing to pin for
        args._n_gpu = 1 if device.type == "cuda" else args._n_gpu
        # Weights are read last: the data is tokenized first, then the LoRA base and the store are filled.
        if "data_path" in raw_data:
            train_dataset = self._dataset_from(raw_data["data_path"], processing_class, args)
            data_collator = data_collator or CausalCollator(_pad_id(processing_class, model))
        if "eval_data_path" in raw_data:
            eval_dataset = self._dataset_from(raw_data["eval_data_path"], processing_class, args)
            data_collator = data_collator or CausalCollator(_pad_id(processing_class, model))
        if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) == 0:
            raise MegaTrainError("train_dataset is empty: there is nothing to train on.")
        if getattr(args, "peft_config", None) is not None:
            model = with_adapters(model, args.peft_config, weights_from, resolve_compute_dtype(args, device))
            weights_from = None
        base = model.get_base_model() if is_peft_model(model) else model
        decay = Trainer.get_decay_parameter_names(None, base)
        sharding = None
        if args.world_size > 1:  # data parallel: each rank keeps a slice of the optimizer state
            from .engine.distributed import Sharding

            sharding = Sharding()
        self.engine = StreamingEngine(
            model,
            device=device,
            compute_dtype=resolve_compute_dtype(args, device),
            decay_names=decay,
            loss_chunk_tokens=getattr(args, "loss_chunk_tokens", None),
            pipeline_options={"depth": getattr(args, "prefetch_depth", 2)} if device.type == "cuda" else None,
            weights_from=weights_from,
            progress=not args.disable_tqdm,
            mlp_tile_tokens=tiles,
            resident_layers=resident,
            sharding=sharding,
            offload_activations=offload,
            background_host_jobs=getattr(args, "background_host_jobs", None),
        )

        if data_collator is None and train_dataset is not None:
            data_collator = CausalCollator(_pad_id(processing_class, model))

        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=data_collator,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        if self.label_smoother is not None or self.compute_loss_func is not None:
            raise MegaTrainError("custom losses (compute_loss_func, label smoothing) are not supported by the engine.")
        # What the logs show besides Trainer's own: real tokens/s, model TFLOPS (6 * P * tokens),
        # MFU against args.gpu_peak_tflops, and how busy each pipeline lane was.
        self._tokens_since_log = 0
        self._last_log = None
        self._timeline = Timeline() if getattr(args, "log_pipeline", True) else None
        if self._timeline is not None:
            self.engine.pipeline.timeline = self._timeline

    @staticmethod
    def _dataset_from(raw, tokenizer, args):
        return tokenize_dataset(raw, tokenizer, args.max_seq_length, args.packing, args.text_field)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # A wrong or incomplete checkpoint fails now, before the dataloader and optimizer are built.
        resume_from_checkpoint = check_resume(resume_from_checkpoint, self.args.output_dir)
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            try:
                self.engine.synchronize()  # let pending steps land before anyone reads the model
            except Exception:
                pass  # a failed host job raises again here: the exception on its way up says it first
            raise
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
            self.optimizer = HostAdamW(
                self.engine, lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                weight_decay=a.weight_decay,
            )
        return self.optimizer

    @property
    def host_optimizer(self) -> HostAdamW:
        opt = self.optimizer
        return getattr(opt, "optimizer", opt)

    # -- one micro-batch ------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.engine.train()
        # Same loss scaling rule as Trainer.training_step: HF causal LMs divide by
        # num_items_in_batch themselves; otherwise the mean loss is divided by the GA steps.
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        ga = self.current_gradient_accumulation_steps
        scale = 1.0 if scaled else 1.0 / ga
        if self.args.max_grad_norm <= 0 and self.accelerator.sync_gradients:
            # No clipping: the norm is not needed before stepping, so each unit is stepped on the
            # host as soon as its gradient lands, overlapping the CPU optimizer with the backward.
            self.host_optimizer.step_during_backward()
        if self._last_log is None:
            self._last_log = time.perf_counter()
        self._tokens_since_log += count_real_tokens(inputs)
        loss = self.engine.forward_backward(inputs, num_items_in_batch if scaled else None, scale)
        if not scaled:
            loss = loss / ga
        elif self.args.average_tokens_across_devices and self.args.world_size > 1:
            # Stock Trainer reports loss * world here (num_items_in_batch counts every rank's
            # tokens) and its logging averages over ranks; the gradients are already exact.
            loss = loss * self.args.world_size
        return loss.to(self.args.device)

    def log(self, logs, start_time=None):
        if "loss" in logs and self._last_log is not None:
            logs.update(self._throughput())
        super().log(logs, start_time)

    def _throughput(self) -> dict:
        now = time.perf_counter()
        seconds, tokens = max(now - self._last_log, 1e-9), self._tokens_since_log
        self._last_log, self._tokens_since_log = now, 0
        out = {"tokens_per_second": round(tokens / seconds, 1)}
        tflops = 6 * self.engine.num_parameters * tokens / seconds / 1e12
        out["model_tflops"] = float(f"{tflops:.4g}")
        peak = getattr(self.args, "gpu_peak_tflops", None)
        if peak:
            out["mfu"] = float(f"{tflops / peak:.4g}")
        timeline = self._timeline  # only our own: someone else's (a benchmark's) is theirs to read
        if timeline is not None and self.engine.pipeline.timeline is timeline:
            busy = timeline.collect()
            out.update({f"pipe_{k}": v for k, v in busy.items() if k.endswith("_busy") or k == "gpu_idle"})
        return out

    def _clip_grad_norm(self, model):
        return self.host_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.grad_norm() if grad_norm is None else grad_norm

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.engine.eval()
        has_labels = inputs.get("labels") is not None
        want_logits = not prediction_loss_only
        with torch.no_grad():
            out = self.engine(**{k: v for k, v in inputs.items() if k in _ENGINE_KEYS}, return_logits=want_logits)
        loss = out.loss.detach() if has_labels else None
        if prediction_loss_only:
            return loss, None, None
        labels = inputs.get("labels")
        return loss, out.logits, labels.to(out.logits.device) if labels is not None else None

    # -- saving and resuming -------------------------------------------------------------------
    def save_model(self, output_dir=None, _internal_call=False):
        if self.engine.store.sharding is None:
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
        if self.engine.peft_model is not None:
            save_adapter(self.engine, output_dir)  # what PeftModel.from_pretrained loads
        else:
            save_hf_model(self.engine.store, self.model, output_dir, dtype=self._save_dtype(), write=write)
        if not write:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_dtype(self):
        choice = getattr(self.args, "save_dtype", "auto")
        return None if choice == "auto" else getattr(torch, choice)

    def save_merged(self, output_dir: str, dtype=None) -> None:
        """LoRA runs: base + merged adapters as a full HF checkpoint (merge_and_unload, streamed)."""
        if self.engine.peft_model is None:
            raise MegaTrainError("save_merged is for LoRA runs; use save_model for full fine-tuning.")
        save_merged(self.engine, output_dir, dtype=dtype or self._save_dtype())
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir):
        self.engine.synchronize()
        save_optimizer_state(self.host_optimizer, output_dir)  # every rank: its own slices
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

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
            write_manifest(tmp, hashes=getattr(self.args, "checkpoint_hashes", True))
            commit_dir(tmp, final)
        self._barrier()

    def _barrier(self) -> None:
        if self.engine.store.sharding is not None:
            self.engine.store.sharding.barrier()

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
        self.local_hub = LocalHub(default_hub_dir(self.args), repo_id)
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
        return self._publish(commit_message or "End of training")


_ENGINE_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


LONG_CONTEXT_TOKENS = 65536  # from here on the plan (tiles, offload, residency) is printed


def resolve_placement(args, config, batch, seq, device, plan_kw, stream_all: bool = False) -> tuple[int, int]:
    """(gpu_resident_layers, offload_activations): the user's numbers, or the memory plan's for 'auto'.

    stream_all (data parallel): no resident layers, whatever was asked for."""
    choices = [str(getattr(args, name, "auto")) for name in ("gpu_resident_layers", "offload_activations")]
    fixed = [None if c == "auto" else int(c) for c in choices]
    if stream_all and fixed[0] != 0:
        if fixed[0]:
            logger.info("data parallel: GPU residency is not combined with sharding yet; streaming all layers")
        fixed[0] = 0
    if device.type != "cuda":
        return fixed[0] or 0, fixed[1] or 0
    if None not in fixed:
        return fixed[0], fixed[1]
    gpu_free = gpu_available(device)
    resident, offload = plan_placement(config, batch, seq, gpu_free, resident_layers=fixed[0],
                                       offload_activations=fixed[1], host_free=host_available(), **plan_kw)
    logger.info("memory plan: %d of %d layers resident on the GPU, %d layer inputs offloaded (%.0f GiB free)",
                resident, config.num_hidden_layers, offload, gpu_free / GiB)
    return resident, offload


def _config(model):
    return model.get_base_model().config if is_peft_model(model) else model.config


def _pad_id(tokenizer, model) -> int:
    for src in (tokenizer, _config(model)):
        pid = getattr(src, "pad_token_id", None)
        if pid is not None:
            return int(pid)
    return 0
