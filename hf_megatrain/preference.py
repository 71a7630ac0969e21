"""What the engine changes in TRL's offline preference trainers: shared by hf_megatrain.dpo, .kto (EnginePreference:
with a reference), .orpo and .cpo (ReferenceFreePairs: trl.experimental's, without one), over EngineTrl.

TRL prepares the data (prompts, tokenization, truncation, its collator); the engine runs every forward:
the reference's, forward only, over the whole dataset before the first step (TRL's precompute path,
taken whether or not the config asks for it: the reference is the starting policy, or the
adapter-disabled model under PEFT (adapters_disabled), so no second model is kept), and the policy's, whose loss is a
function of per-row sums of token log-probabilities (engine/loss.py RowLoss).

A ref_model that differs from the policy runs through a second engine, forward only: every weight
frozen, so its host store is one compute copy (bf16 by default; no fp32 master, gradient or
optimizer state), filled straight from the checkpoint for a hub id or folder. It is built at the
first reference pass (before the first step), with the policy engine's settings but nothing
resident on the GPU, and kept for a dataset evaluated later (as TRL keeps its ref_model). Its
passes stream each layer once per batch, as the policy's forward does.

A streamed train_dataset and sync_ref_model (whose reference moves towards the policy) need the
reference batch by batch through the whole run, as stock computes it: each step's batches get it
before the step, from the ref_model's engine, the adapter-disabled policy under LoRA, or, for full
fine-tuning without a ref_model, a forward-only engine over a copy of the starting policy."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random

import numpy as np
import torch

from .constants import IGNORE_INDEX
from .errors import MegaTrainError
from .patcher.adapters import check_adapter_config, is_peft_model
from .preflight import check_outputs, check_resume
from .sft import load_for_trl
from .trainer import recompute_off


def check_engine_trl(args, model, train_dataset, peft_config, quantization_config, trl_name: str,
                     with_reference: bool = False) -> None:
    """What TRL's offline preference trainers (DPO, KTO, ORPO, CPO) offer that the engine cannot honour, refused
    before any data is tokenized. with_reference: DPO's and KTO's (a PeftModel may be the model, and a streamed
    train_dataset is taken: its reference is computed batch by batch)."""
    if is_peft_model(model) and not with_reference:
        raise MegaTrainError(f"a PeftModel as model is not supported: {trl_name}Trainer would keep a copy of its "
                             "adapter as the reference. Pass the base model with peft_config for new adapters, or "
                             "merge the adapter into the base first (merge_and_unload, save_pretrained) and train that.")
    if getattr(args, "activation_offloading", False):
        raise MegaTrainError("activation_offloading=True is TRL's offload for a model on the GPU; the engine keeps "
                             "activations itself (offload_activations). Leave it False.")
    if args.use_liger_kernel:
        raise MegaTrainError("use_liger_kernel is not supported; the engine's head is already chunked.")
    if args.neftune_noise_alpha:  # stock's hook would also noise a PEFT reference's forward (the adapter off)
        raise MegaTrainError(f"neftune_noise_alpha is not supported by the engine's {trl_name}Trainer (only by "
                             "MegaTrainTrainer and MegaTrainSFTTrainer); leave it unset.")
    if quantization_config is not None or (args.model_init_kwargs or {}).get("quantization_config"):
        raise MegaTrainError("quantization_config is not supported: hf_megatrain trains at full precision (fp32 "
                             "master weights); a frozen LoRA base streams in bf16. Remove it.")
    check_adapter_config(peft_config)  # multitask prompt tuning and the like: refused in one line
    check_prompt_learning_of(model, peft_config, trl_name)
    targets = getattr(peft_config, "target_modules", None) or ()
    if "lm_head" in (targets if not isinstance(targets, str) else [targets]):
        raise MegaTrainError(f"a LoRA adapter on lm_head is not supported by {trl_name} (TRL refuses it too: the "
                             "log-probabilities come from lm_head's weight); remove 'lm_head' from target_modules.")
    if train_dataset is None:  # in stock's words
        raise MegaTrainError("`train_dataset` is required (preference data: prompt and completions).")
    import datasets

    if isinstance(train_dataset, datasets.IterableDataset) and not with_reference:
        raise MegaTrainError(f"train_dataset is an IterableDataset: {trl_name}Trainer prepares a map-style "
                             "datasets.Dataset; pass one (Dataset.from_generator, or load_dataset without streaming).")
    sample = next(iter(train_dataset))
    if "image" in sample or "images" in sample:
        raise MegaTrainError("vision preference data (an 'image' or 'images' column) is not supported: the engine "
                             "trains text decoders.")


def check_preference(args, model, ref_model, train_dataset, peft_config, quantization_config, trl_name: str) -> None:
    """What TRL's DPO and KTO trainers offer that the engine cannot honour, refused before any data is tokenized:
    check_engine_trl's, and the reference's."""
    import datasets

    if args.precompute_ref_log_probs and isinstance(train_dataset, datasets.IterableDataset):  # stock's refusal
        raise MegaTrainError("`precompute_ref_log_probs=True` is not supported with IterableDataset. Please use a "
                             "map-style Dataset or set `precompute_ref_log_probs=False`.")
    check_engine_trl(args, model, train_dataset, peft_config, quantization_config, trl_name, with_reference=True)
    if args.sync_ref_model:  # stock's two refusals, in its words
        if peft_config is not None or is_peft_model(model):
            raise MegaTrainError(
                "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported. With "
                f"PEFT, {trl_name}Trainer does not keep a separate reference model in memory; instead, it recovers "
                "reference behavior by temporarily disabling the adapter. As a result, there is no standalone "
                "`ref_model` instance to synchronize. Use `sync_ref_model=False`, or opt for full fine-tuning if you "
                "need a synced reference model.")
        if args.precompute_ref_log_probs:
            raise MegaTrainError(
                "You cannot use `sync_ref_model=True` together with `precompute_ref_log_probs=True`. "
                "`precompute_ref_log_probs=True` assumes a fixed reference model, but with `sync_ref_model=True` the "
                "reference model is periodically updated during training, making any precomputed reference log-probs "
                "stale. Set `precompute_ref_log_probs=False` or disable `sync_ref_model`.")
    if ref_model is not None:
        if ref_model is model:
            raise MegaTrainError("model and ref_model are the same object; omit ref_model (the reference is then the "
                                 "starting policy, computed in a forward-only pass before the first step).")
        if is_peft_model(ref_model):
            raise MegaTrainError("a PeftModel as ref_model is not supported: merge its adapter into the base first "
                                 "(merge_and_unload, save_pretrained) and pass that.")


class EngineTrl:
    """Placed before a TRL preference trainer and MegaTrainTrainer among a trainer's bases
    (class MegaTrainORPOTrainer(ReferenceFreePairs, ORPOTrainer, MegaTrainTrainer)): what the engine changes
    in every one of them (DPO, KTO, ORPO, CPO).

    A subclass sets `rows_per_example` (rows of a micro-batch per example the batch size counts: the pair
    trainers' batches stack chosen over rejected rows) and `trl_name`, and calls `_engine_setup` first in
    __init__."""

    rows_per_example = 1
    trl_name = ""

    def _engine_setup(self, model, args, processing_class, peft_config, check):
        """Before the TRL trainer's __init__: the refusals (check(args, peft_config)), the outputs, the model as a
        meta skeleton the engine fills. Returns (skeleton, processing_class) for the TRL trainer."""
        if peft_config is not None:  # the engine wraps the base itself (TRL would wrap a meta skeleton)
            if args.peft_config is not None and args.peft_config is not peft_config:
                raise MegaTrainError("peft_config was given twice (as an argument and in args); keep one.")
            args.peft_config = peft_config
        check(args, args.peft_config)
        check_outputs(args)
        check_resume(args.resume_from_checkpoint, args.output_dir)
        self._loaded = load_for_trl(model, args)  # a folder or hub id: a meta skeleton the engine fills
        skeleton, tokenizer, _ = self._loaded
        if processing_class is None:
            processing_class = tokenizer
        if args.device.type == "cuda":
            args._n_gpu = 1  # one GPU per process: TRL would refuse nn.DataParallel on a multi-GPU host
        self._rows: dict[int, dict] = {}  # what each micro-batch's loss keeps for its metrics
        return skeleton, processing_class

    # -- what MegaTrainTrainer.__init__ calls before the engine exists ---------------------------------
    def _datasets(self, raw_data, train_dataset, eval_dataset, data_collator, processing_class, args, config):
        return train_dataset, eval_dataset, data_collator  # prepared by the TRL trainer already

    def _plan(self, args, model):
        planned = copy.copy(args)
        planned.per_device_train_batch_size = self.rows_per_example * args.per_device_train_batch_size
        run = super()._plan(planned, model)
        for name in ("dataloader_pin_memory", "_n_gpu"):
            if hasattr(planned, name):
                setattr(args, name, getattr(planned, name))
        recompute_off(args)  # as the plan cleared it on its copy (both names: Trainer reads one, TRL the other)
        if self._split > 1:
            raise MegaTrainError(
                f"the memory plan splits each micro-batch of {planned.per_device_train_batch_size} rows into "
                f"{self._split}, but {self.trl_name}'s loss couples a micro-batch's rows; lower "
                "per_device_train_batch_size (raise gradient_accumulation_steps instead).")
        return run

    def _build_engine(self, model, weights_from, args, engine_config):
        model = super()._build_engine(model, weights_from, args, engine_config)
        self._engine_config = engine_config  # a reference engine's settings start from these
        self.engine.head_stats = []  # the MoE load-balancing loss of each micro-batch, for TRL's aux_loss metric
        if args.disable_dropout:  # what the TRL trainer does to the model, done to the engine's copies of its modules
            from trl.trainer.utils import disable_dropout_in_model

            for tmpl in self.engine._templates.values():
                disable_dropout_in_model(tmpl.module)
        return model

    # -- the trainer after the TRL trainer's __init__ ---------------------------------------------------
    def _post_init_engine(self):
        """The MoE router loss as the TRL trainer settled it (coefficient and switch), on the engine's config copy:
        DPO and KTO name the coefficient router_aux_loss_coef, ORPO and CPO aux_loss_coef."""
        own = self.engine.config.get_text_config()
        if hasattr(own, "output_router_logits"):
            own.output_router_logits = bool(self.aux_loss_enabled)
            coef = getattr(self, "router_aux_loss_coef", None)
            setattr(own, self.engine.aux_coef, coef if coef is not None else self.aux_loss_coef)

    def _micro_aux(self, k):
        """Micro-batch k's MoE load-balancing loss (before its coefficient) of this step's training pass, or None."""
        aux = [c.get("aux_loss") for c, o in zip(self.engine.head_stats, self._owner) if o == k]
        return aux[0] if aux else None

    def _engine_eval(self, inputs, loss_fn, want_logits: bool):
        """One evaluation batch through the engine's eval-mode forward under `loss_fn` (a RowLoss fn of its
        per-row sums), the model left in eval mode as stock's evaluation leaves it (TRL's log then reports the
        eval metrics). Returns (the engine's output, the batch's MoE load-balancing loss or None)."""
        from .engine.step import ENGINE_KEYS

        self.engine.eval()
        self.model.eval()
        if "labels" not in inputs:
            self._engine_batch(inputs)
        with torch.no_grad():
            out = self.engine(**{k: v for k, v in inputs.items() if k in ENGINE_KEYS}, return_logits=want_logits,
                              row_loss=loss_fn)
        aux = self.engine.head_stats[0].get("aux_loss") if self.engine.head_stats else None
        return out, aux

    @contextlib.contextmanager
    def _no_head_stats(self):
        stats, self.engine.head_stats = self.engine.head_stats, None
        try:
            yield
        finally:
            self.engine.head_stats = stats

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        for batch in batches:  # what the engine trains on: the TRL batch's rows, with labels (_engine_batch)
            self._engine_batch(batch)
        return batches, num_items

    def _engine_batch(self, batch) -> None:
        """Adds to a collated batch what the engine runs: labels (the completion tokens, as TRL's loss counts them)."""
        batch["labels"] = completion_labels(batch)

    def _metric_buffers(self):
        """The TRL trainer's per-mode metric lists (DPO's and KTO's _metrics)."""
        return self._metrics.values()

    def log(self, logs, start_time=None):
        # device tensors become numbers once per log; a (value, present) pair is a value TRL appends only when
        # present is true (KTO's chosen metrics of a micro-batch with chosen rows), and a metric with no value is
        # absent from the log, as in stock
        for buffer in self._metric_buffers():
            for key in list(buffer):
                values = [float(v[0]) if isinstance(v, tuple) else float(v) for v in buffer[key]
                          if not isinstance(v, tuple) or bool(v[1])]
                if values:
                    buffer[key][:] = values
                else:
                    del buffer[key]
        super().log(logs, start_time)


class EnginePreference(EngineTrl):
    """EngineTrl for the trainers with a reference (DPO, KTO): the reference's log-probabilities computed by the
    engine before the first step (the starting policy, the adapter-disabled model under LoRA, a PeftModel's own
    adapter as TRL's copy of it ('ref') keeps it, or a ref_model streamed through a second, forward-only engine).
    A subclass calls `_engine_init` first in __init__ and names the batch keys of the reference's log-probabilities
    in `ref_columns` (compute_ref_log_probs' order)."""

    ref_columns: tuple[str, ...] = ()

    def _engine_init(self, model, ref_model, args, train_dataset, eval_dataset, processing_class, peft_config,
                     quantization_config, check):
        """_engine_setup, then the reference's settings. Returns (skeleton, processing_class) for the TRL trainer."""
        skeleton, processing_class = self._engine_setup(
            model, args, processing_class, peft_config,
            lambda a, peft: check(a, model, ref_model, train_dataset, peft, quantization_config))
        import datasets

        # The reference's log-probabilities are computed before the first step whatever the config says (TRL's
        # precompute path, with no ref_model built), except where stock computes them batch by batch and a
        # precomputed copy cannot stand in: a streamed train_dataset (nothing to cache by index) and sync_ref_model
        # (the reference moves). Those take the reference batch by batch, as stock does, from the engine that
        # keeps it: the policy's under LoRA (adapters off), ref_model's, or, for full fine-tuning without one, a
        # forward-only copy of the starting policy (_starting_policy_engine).
        self._per_batch = isinstance(train_dataset, datasets.IterableDataset) or args.sync_ref_model
        streams = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        if (any(isinstance(d, datasets.IterableDataset) for d in streams) and args.eval_strategy != "no"
                and ref_model is None and args.peft_config is None and not args.precompute_ref_log_probs
                and not self._per_batch):
            raise MegaTrainError(self._no_reference_for_stream)  # it would be evaluated after steps
        # TRL's __init__ is handed precompute (it then builds no reference model of its own: the engine's run the
        # reference) and no sync_ref_model (whose callback would mix a model TRL does not have); _reference_ready
        # sets both back as asked once it is done
        self._asked_precompute, self._asked_sync = args.precompute_ref_log_probs, args.sync_ref_model
        args.precompute_ref_log_probs, args.sync_ref_model = True, False
        self._ref_source, self._ref_engine = None, None  # a different reference: streamed at the first pass
        self._ref_pairs = {}  # sync_ref_model: name -> (the reference's parameter, its compute copy)
        if ref_model is not None:  # its config and architecture read now (no weights): refused before tokenizing
            from .checkpoint.loading import load_model_and_tokenizer

            self._ref_source = load_model_and_tokenizer(ref_model, trust_remote_code=args.trust_remote_code)
        return skeleton, processing_class

    def _host_held(self, args, model):
        """The reference engine's host RAM, held out of what the policy's plan counts as available: its compute copy,
        and under sync_ref_model its fp32 parameters (a loaded ref_model's own tensors are in memory already)."""
        from .arguments import compute_dtype
        from .patcher.adapters import base_model
        from .planner.estimator import model_sizes

        if self._ref_source is not None:
            config, what = base_model(self._ref_source[0]).config, "the ref_model's forward-only engine"
        elif self._per_batch and args.peft_config is None and not is_peft_model(model):
            config, what = base_model(model).config, "the reference, a forward-only copy of the starting policy"
        else:
            return None
        size = compute_dtype(args, args.device).itemsize
        fp32 = 4 if self._asked_sync and size != 4 and (self._ref_source is None or self._ref_source[2]) else 0
        return (float(model_sizes(config).params * (size + fp32)),
                what + (" with its fp32 parameters (sync_ref_model)" if fp32 else ""))

    @contextlib.contextmanager
    def _fingerprint_in_trl_init(self):
        """Around the TRL trainer's __init__, which keys its cache of the reference's log-probabilities by
        hash_module(model), one thread over every fp32 master: that name in the TRL trainer's module is
        weights_fingerprint for the policy meanwhile (stock pays the hash only when asked to precompute, which the
        engine always does)."""
        import sys

        module = sys.modules[next(c for c in type(self).__mro__ if c.__module__.startswith("trl.")).__module__]
        original = module.hash_module
        module.hash_module = lambda m: weights_fingerprint(self.engine, m) if m is self.model else original(m)
        try:
            yield
        finally:
            module.hash_module = original

    def _reference_ready(self) -> None:
        """The end of a subclass's __init__, after the TRL trainer's: the reference batch by batch where stock
        computes it so (see _engine_init), and sync_ref_model's callback."""
        if self._per_batch:
            self.args.precompute_ref_log_probs = self.precompute_ref_logps = False
            self._precompute_model_hash = None
        if self._asked_sync:
            self.args.sync_ref_model = True
            self.add_callback(_synced_reference(self))

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self._post_init_engine()  # the first thing after the TRL trainer's settings; before any forward
        if self._ref_engine is None:
            if self._ref_source is not None:
                self._ref_engine = self._reference_engine()
            elif self._per_batch and self.engine.peft_model is None:
                self._ref_engine = self._starting_policy_engine()
        import datasets

        if self._per_batch or (isinstance(dataset, datasets.IterableDataset) and not self._asked_precompute):
            # computed batch by batch (_batch_reference), as stock computes it: for an evaluation stream nothing can
            # be cached by index; the training data of the per-batch cases (_engine_init) likewise
            return dataset
        self._share_cache_file(dataset)
        if self._asked_precompute:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        # Stock computes the reference batch by batch, from a second model; the engine computes it here, before
        # training. The pass leaves the random state as it found it, as stock's absence of it would.
        states = (torch.get_rng_state(), np.random.get_state(), random.getstate(),
                  torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
        try:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            torch.set_rng_state(states[0])
            np.random.set_state(states[1])
            random.setstate(states[2])
            if states[3] is not None:
                torch.cuda.set_rng_state_all(states[3])

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._per_batch:  # each batch's reference before the step's passes (stock's: in each micro-batch's loss)
            for batch in batches:
                self._batch_reference(batch)
        return batches, num_items

    def _share_cache_file(self, dataset) -> None:
        """Under data parallel, one folder for TRL's cache file of the reference's log-probabilities that every rank
        sees. TRL's main process writes the file and every rank reads it back, at the path the dataset names; a
        dataset without cache files of its own (made in memory, or with datasets' caching off) names a temporary
        folder of each process's own, so the other ranks would find nothing. Stock meets this only when asked to
        precompute; the engine always precomputes. The folder: a temporary one of the main process's (the ranks
        on one host), or under output_dir when the ranks span hosts."""
        import datasets

        if self.args.world_size <= 1 or (datasets.is_caching_enabled() and dataset.cache_files):
            return
        if getattr(self, "_ref_cache_dir", None) is None:
            import tempfile

            from accelerate.utils import broadcast_object_list

            one_host = int(os.environ.get("LOCAL_WORLD_SIZE", self.args.world_size)) == self.args.world_size
            where = [None]
            if self.accelerator.is_main_process:
                if not one_host:
                    os.makedirs(self.args.output_dir, exist_ok=True)
                where[0] = tempfile.mkdtemp(prefix="hf_megatrain-ref-logps-",
                                            dir=None if one_host else self.args.output_dir)
            broadcast_object_list(where, from_process=0)
            self._ref_cache_dir = where[0]
        # an attribute of this dataset object only, in place of Dataset._get_cache_file_path
        dataset._get_cache_file_path = lambda fingerprint: os.path.join(self._ref_cache_dir,
                                                                        f"cache-{fingerprint}.arrow")

    def _reference_engine(self):
        """A second engine over ref_model, forward only: every weight frozen, so its store holds only the compute
        copy that streams (no fp32 master, no gradient, no optimizer state), with the policy engine's settings. A
        hub id or folder is streamed in from disk (never loaded whole); a loaded CPU model's weights move into the
        store where they are of the compute dtype (its parameters then view the store), and are copied there where
        not (it keeps its own). Under sync_ref_model the parameters keep fp32 values beside the compute copy (a
        folder's are read whole, in fp32, as stock's ref_model holds them): the policy is mixed into those. TRL's
        cache key for the precomputed log-probabilities names its weights (stock hashes ref_model)."""
        from .checkpoint.stream_load import engine_from_checkpoint, read_parameters
        from .engine.schedule import StreamingEngine

        skeleton, _, weights_from = self._ref_source
        skeleton.requires_grad_(False)
        config = self._reference_config()
        build = dict(config=config, decay_names=set(), sharding=None)
        if self._asked_sync and weights_from is not None and config.compute_dtype != torch.float32:
            read_parameters(skeleton, weights_from, [name for name, _ in skeleton.named_parameters()])
        # a loaded model (or one read whole): the store copies its weights and points its parameters at the copy.
        # Where the copy is of another dtype (an fp32 model, bf16 compute) the model keeps its own tensors: ref_model
        # stays as it was passed (as stock leaves it), not rounded to the compute dtype
        own = {p: p.data for p in skeleton.parameters() if p.device.type != "meta" and p.dtype != config.compute_dtype}
        if weights_from is None:
            engine = StreamingEngine(skeleton, **build)
        else:
            engine = engine_from_checkpoint(skeleton, weights_from, progress=not self.args.disable_tqdm, **build)
        for p, data in own.items():
            p.data = data
        if self._precompute_model_hash is not None and not self._per_batch:
            self._precompute_model_hash = weights_fingerprint(engine, skeleton)
        return self._as_reference(engine, skeleton)

    def _starting_policy_engine(self):
        """The reference of full fine-tuning without a ref_model where it is needed batch by batch (_engine_init): a
        forward-only engine over a copy of the starting policy, its store one compute copy filled from the policy's
        (no fp32 master, gradient or optimizer state; under sync_ref_model its parameters also keep fp32 copies of
        the policy's, into which the policy is mixed). Stock loads its reference again from the policy's checkpoint
        (get_config_model_id); this is the policy as training starts, which is that checkpoint when the model came
        from it, and what the precomputed path's reference is too. Built before TRL's __init__ is done, so the
        starting weights are the model's, not a checkpoint's that train() resumes (as stock's reference)."""
        from .checkpoint.loading import meta_skeleton
        from .engine.schedule import StreamingEngine
        from .patcher.templates import persistent_buffers

        policy = self.model
        skeleton = meta_skeleton(copy.deepcopy(policy.config), policy.config._attn_implementation,
                                 self.args.trust_remote_code)
        skeleton.requires_grad_(False)
        buffers = persistent_buffers(policy)
        for name, b in persistent_buffers(skeleton).items():
            b.copy_(buffers[name])
        config = self._reference_config()
        # under sync_ref_model in 16-bit compute: fp32 copies of the policy's weights, taken in the same pass
        fp32 = {} if self._asked_sync and config.compute_dtype != torch.float32 else None

        def fill(store):  # the compute copy, cast from the policy's masters as the policy's own copy is
            from tqdm.auto import tqdm

            where = {s.name: (u.index, s) for u in store.units for s in u.slots}
            quiet = self.args.disable_tqdm or not self.accelerator.is_main_process
            for weights in tqdm(self._policy_units(), total=len(self.engine.store.units), disable=quiet,
                                desc="copying the starting policy for the reference", unit="unit"):
                for name, w in weights.items():
                    index, s = where[name]
                    store.compute[index][s.offset : s.offset + s.numel].copy_(w.reshape(-1))
                    if fp32 is not None:
                        fp32[name] = w.detach().to("cpu", torch.float32, copy=True)

        engine = StreamingEngine(skeleton, config=config, decay_names=set(), sharding=None, load_weights=fill)
        if fp32:  # the parameters the policy is mixed into (they viewed the compute copy after the store bound them)
            for name, p in skeleton.named_parameters():
                p.data = fp32[name]
        return self._as_reference(engine, skeleton)

    def _reference_config(self):
        """The policy engine's settings for a forward-only reference: nothing resident on the GPU beside the
        policy's, no fp32 state to keep lean, a plain stream."""
        return dataclasses.replace(self._engine_config, resident_layers=0, offload_activations=0, lean_resident=False,
                                   lean_streamed=False, transient_grads=False, gpu_grad_layers=0)

    def _as_reference(self, engine, skeleton):
        """A reference engine in eval mode, dropout off as asked; its model becomes self.ref_model (what TRL reads as
        "a reference model is kept", whose parameters a user reads); under sync_ref_model, each parameter paired with
        the compute copy that streams (_sync_reference)."""
        from trl.trainer.utils import disable_dropout_in_model

        engine.eval()
        if self.args.disable_dropout:
            for tmpl in engine._templates.values():
                disable_dropout_in_model(tmpl.module)
        if self._asked_sync:
            params = dict(skeleton.named_parameters())
            for unit in engine.store.units:
                for name, view in engine.store.param_views(unit.index).items():
                    self._ref_pairs[name] = (params[name], view)
        self.ref_model = skeleton
        return engine

    def _policy_units(self):
        """The policy's weights, one unit at a time ({name: tensor}): fp32 masters, gathered whole under data
        parallel (a collective: every rank walks them), where they train; the compute copy where frozen."""
        store = self.engine.store
        for unit in store.units:
            master = store.full(store.master, unit.index) if unit.n_train else None
            compute = store.compute[unit.index]
            yield {s.name: (master if s.trainable else compute)[s.offset : s.offset + s.numel].view(s.shape)
                   for s in unit.slots}

    def _sync_reference(self, alpha: float) -> None:
        """sync_ref_model (TR-DPO) every ref_model_sync_steps: reference = (1 - alpha) * reference + alpha * policy,
        parameter by parameter as TRL's SyncRefModelCallback computes it, then the reference's compute copy is
        refreshed from the result."""
        # the step's host updates have landed; the reference's last pass has long read its compute copy (the
        # policy's step, queued after it on the compute stream, has been waited for)
        self.engine.synchronize()
        with torch.no_grad():
            for weights in self._policy_units():
                for name, w in weights.items():
                    if name not in self._ref_pairs:
                        continue
                    param, compute = self._ref_pairs[name]
                    param.data.mul_(1.0 - alpha).add_(w.to(param.device), alpha=alpha)
                    if compute.data_ptr() != param.data.data_ptr():
                        compute.copy_(param.data)

    def _engine_logps(self, input_ids, attention_mask, completion_mask, reference: bool, reduce=None) -> torch.Tensor:
        """Each row's summed log-probabilities of its completion tokens, from a forward-only pass of an engine:
        the reference's (ref_model's engine, or the policy's in eval mode with its reference_adapters) or
        the policy's as it is now (its mode kept). reduce(per_row): the rows' values from the pass's per-row sums
        (RowLoss), other than their plain sums (DPO's ld_alpha)."""
        logps = {}

        def keep(per_row):
            logps["rows"] = (per_row["logps"] if reduce is None else reduce(per_row)).detach()
            return logps["rows"].sum()

        engine = self._ref_engine if reference and self._ref_engine is not None else self.engine
        training = engine.training
        if reference:
            engine.eval()
        labels = completion_labels({"input_ids": input_ids, "completion_mask": completion_mask})
        own = engine is self.engine
        try:
            with torch.no_grad(), reference_adapters(engine) if reference and own else contextlib.nullcontext(), \
                    self._no_head_stats() if own else contextlib.nullcontext():
                engine(input_ids=input_ids, attention_mask=attention_mask, labels=labels, return_logits=False,
                       row_loss=keep)
        finally:
            engine.train(training)
        return logps["rows"].to(self.accelerator.device)

    def _reference_kept(self) -> bool:
        """Whether the reference can be computed at any time: under LoRA (reference_adapters), or by a ref_model's
        engine (full fine-tuning's starting policy exists only until the first step)."""
        return self.engine.peft_model is not None or self._ref_engine is not None

    _no_reference_for_stream = (
        "a streamed (IterableDataset) eval dataset has no precomputed reference log-probabilities: the engine "
        "computes them batch by batch from the starting policy, which full fine-tuning no longer has once training "
        "started (no second model is kept). Pass a map-style Dataset (its reference is computed before the first "
        "step), a ref_model, or train LoRA adapters (peft_config).")

    def _batch_reference(self, inputs) -> None:
        """An evaluation batch of a stream (whose reference TRL cannot precompute) gets the reference's
        log-probabilities here, as stock's evaluation computes them batch by batch; a batch with them is left as is."""
        if self.ref_columns[0] in inputs:
            return
        if not self._reference_kept() and self.state.global_step > 0:
            raise MegaTrainError(self._no_reference_for_stream)
        for key, value in zip(self.ref_columns, self.compute_ref_log_probs(self.model, inputs)):
            if value is not None:
                inputs[key] = value

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        if (eval_dataset is not None and not isinstance(eval_dataset, str) and not self._reference_kept()
                and not self._asked_precompute and self.state.global_step > 0):
            raise MegaTrainError(
                "evaluate() was given a new dataset after training started: its reference log-probabilities are "
                "those of the starting policy, which the engine computes before the first step (no second model is "
                "kept). Pass it as eval_dataset when building the trainer.")
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)


def weights_fingerprint(engine, model) -> str:
    """A sha256 of what the engine's forward reads: each unit's streamed copy (its compute copy, or the fp32 master
    a lean unit streams), with its dtype, the model's persistent buffers and its config. TRL keys its cache of the
    reference's log-probabilities by hash_module, which reads every parameter's bytes through numpy on one thread
    (about 0.25 GiB/s on a 2-core CI machine: 18 minutes for a 70B model's fp32 masters); here the units hash on
    threads (hashlib lets go of the GIL), straight from the store's flat buffers. Equal copies give equal keys, so a
    cache of another model's (or another precision's) log-probabilities is never read back."""
    import hashlib
    import json
    from concurrent.futures import ThreadPoolExecutor

    from .patcher.adapters import base_model
    from .patcher.templates import persistent_buffers

    store = engine.store

    def unit_digest(index: int) -> bytes:
        flat = store.compute[index] if store.compute[index] is not None else store.master[index]
        unit = store.units[index]
        h = hashlib.sha256(f"{','.join(s.name for s in unit.slots)}:{flat.dtype}:{flat.numel()}".encode())
        h.update(flat.detach().cpu().contiguous().view(torch.uint8).numpy())
        return h.digest()

    with ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1))) as pool:
        digests = list(pool.map(unit_digest, range(len(store.units))))
    total = hashlib.sha256(json.dumps(base_model(model).config.to_dict(), sort_keys=True, default=str).encode())
    for d in digests:
        total.update(d)
    for name, b in sorted(persistent_buffers(base_model(model)).items()):
        total.update(f"{name}:{b.dtype}".encode())
        total.update(b.detach().cpu().contiguous().view(torch.uint8).numpy())
    return total.hexdigest()


def _synced_reference(trainer):
    """TRL's SyncRefModelCallback (the class a user looks for, its step rule) mixing the policy into the engine's
    reference (EnginePreference._sync_reference) instead of into a model."""
    from trl.trainer.callbacks import SyncRefModelCallback

    class SyncedReference(SyncRefModelCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % args.ref_model_sync_steps == 0:
                trainer._sync_reference(args.ref_model_mixup_alpha)

    return SyncedReference(ref_model=trainer.ref_model, accelerator=trainer.accelerator)


def check_prompt_learning_of(model, peft_config, trl_name: str) -> None:
    """Prompt learning in a preference trainer, where the engine trains it as stock does: a new adapter (peft_config),
    whose reference is the base model (adapters_disabled). Prefix tuning keeps every row's length, so each trainer's
    per-row sums see the rows stock sees. Prompt tuning and p-tuning put virtual tokens before each row: DPO and
    KTO sum over the completion labels, which the virtual tokens (labelled -100) leave as they are, while ORPO and
    CPO count positions and TRL's logits metrics average over them, so those two refuse them. A PeftModel with its
    own prompt-learning adapter is refused: TRL's reference is then a frozen copy of it ('ref'), a second prompt
    encoder the engine does not run."""
    if is_peft_model(model) and model.active_peft_config.is_prompt_learning:
        raise MegaTrainError(f"a PeftModel with a prompt-learning adapter ({model.active_peft_config.peft_type.value}) "
                             f"is not supported by the engine's {trl_name}Trainer: TRL's reference is a frozen copy of "
                             "that adapter, which the engine does not run. Pass the base model and the adapter's "
                             "config as peft_config (the reference is then the base model, as in TRL).")
    if getattr(peft_config, "is_prompt_learning", False) and peft_config.peft_type.value != "PREFIX_TUNING" \
            and trl_name not in ("DPO", "KTO"):
        raise MegaTrainError(f"peft_config is {peft_config.peft_type.value}, whose virtual tokens the engine's "
                             f"{trl_name}Trainer does not lay out (its losses and logits metrics count row positions); "
                             "prefix tuning (PrefixTuningConfig) or LoRA train there, and prompt tuning in DPO and KTO.")


def completion_labels(batch) -> torch.Tensor:
    """The batch's tokens where its completion_mask is set, IGNORE_INDEX elsewhere (TRL's preference labels)."""
    ids = torch.as_tensor(batch["input_ids"])
    return ids.masked_fill(torch.as_tensor(batch["completion_mask"]).to(ids.device) == 0, IGNORE_INDEX)


@contextlib.contextmanager
def reference_adapters(engine):
    """The policy engine's adapters as the reference runs them, as TRL's use_adapter gives them: a PeftModel
    passed with an adapter of its own has TRL's frozen copy of it, adapter 'ref' (the starting adapter), made
    the active one; new adapters (peft_config) are turned off (adapters_disabled)."""
    peft = engine.peft_model
    if peft is None or "ref" not in peft.peft_config:
        with adapters_disabled(engine):
            yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for t in engine._templates.values() for m in t.module.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = "ref"
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._active_adapter = b


@contextlib.contextmanager
def adapters_disabled(engine):
    """The engine's adapters off (their layers return the base layer's output, a prompt-learning adapter's tokens
    are left out), as PEFT's disable_adapter does to a model; nothing for a full fine-tune."""
    if engine.peft_model is None:
        yield
        return
    if engine.peft_model.active_peft_config.is_prompt_learning:
        with engine.prompt_disabled():
            yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for t in engine._templates.values() for m in t.module.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def check_pairs(args, model, train_dataset, peft_config, quantization_config, trl_name: str) -> None:
    """What trl.experimental's ORPO and CPO trainers offer that the engine cannot honour, refused before any data is
    tokenized: check_engine_trl's, and generation."""
    check_engine_trl(args, model, train_dataset, peft_config, quantization_config, trl_name)
    if args.generate_during_eval:
        raise MegaTrainError("generate_during_eval=True is not supported: the engine does not generate (it streams "
                             "layers for training); leave it False.")


class ReferenceFreePairs(EngineTrl):
    """EngineTrl for trl.experimental's reference-free pair trainers, ORPO and CPO (with CPO's SimPO and AlphaPO
    variants), whose __init__ this is: a subclass names the TRL config (`trl_config`, `own_config`), says which
    tokens its NLL term counts (`_nll_tokens`) and computes its loss from the rows' log-probabilities
    (`_objective`, through the TRL trainer's own loss function of them).

    TRL tokenizes the pairs and its collator pads each side; the engine runs each micro-batch as TRL's
    concatenated_forward does (the chosen rows over the rejected rows, padded to one length). Every position of a
    row is a target of the head's first, no-grad pass: TRL's logits/* metrics average the logits over every
    position, padding and prompt included (CPO's over the last position too: the engine's batch gets one
    more padded column for it, which no real token attends to). The loss needs each row's summed completion
    log-probabilities (ORPO and CPO's ipo and simpo: their mean) and an NLL over the chosen rows' tokens (ORPO:
    prompt and completion, CPO: the completion), both sums over the token log-probabilities the pass hands it
    (engine/loss.py RowLoss); the second pass, with autograd, runs only over the tokens that carry a gradient."""

    rows_per_example = 2  # each micro-batch is its pairs' chosen rows over their rejected rows
    last_position = False  # whether TRL's logits metrics count each row's last position (CPO's do)
    trl_config = own_config = None

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, model_init=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None, peft_config=None, compute_metrics=None):
        from .arguments import check_arguments
        from .sft import trl_arguments

        name = self.trl_name
        args = trl_arguments(args, model, self.own_config, self.trl_config, f"MegaTrain{name}Trainer", name)
        check_arguments(args)
        skeleton, processing_class = self._engine_setup(
            model, args, processing_class, peft_config,
            lambda a, peft: self._check(a, model, train_dataset, peft))
        recompute_off(args)  # the engine always recomputes; TRL would hook the skeleton's embeddings
        super().__init__(model=skeleton, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
                         callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, compute_metrics=compute_metrics)
        self._post_init_engine()

    def _check(self, args, model, train_dataset, peft_config) -> None:
        check_pairs(args, model, train_dataset, peft_config, None, self.trl_name)

    def _metric_buffers(self):
        return self._stored_metrics.values()

    def _head_loss(self, group, num_items_in_batch):
        from .engine.loss import RowLoss

        return RowLoss(lambda k, per_row: self._pair_loss(group[k], per_row, k))

    # -- the engine's batch ------------------------------------------------------------------------
    def _engine_batch(self, batch) -> None:
        """The collated pairs as TRL's concatenated_inputs stacks them (chosen rows over rejected rows, padded to
        one length with the trainer's padding value), every position a target, and which tokens the loss sums."""
        pad = getattr(self, "padding_value", None)  # ORPO's; CPO's is the tokenizer's pad token
        pad = self.pad_token_id if pad is None else pad
        width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1]) + self.last_position

        def both(key, value):
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
                              for t in (batch[f"chosen_{key}"], batch[f"rejected_{key}"])])

        ids, mask, labels = both("input_ids", pad), both("attention_mask", 0), both("labels", IGNORE_INDEX)
        batch["input_ids"], batch["attention_mask"] = ids, mask
        # every position but the last predicts a token: the head's first pass sees them all (the logits metrics)
        batch["labels"] = ids
        # the counted tokens, row by row, position t predicting token t + 1 (loss.counted_rows' order)
        completion = labels[:, 1:] != IGNORE_INDEX
        chosen = (torch.arange(ids.shape[0]) < ids.shape[0] // 2).unsqueeze(1)
        nll = self._nll_tokens(mask[:, 1:].bool(), completion) & chosen
        batch["pair_tokens"] = {"completion": completion.reshape(-1), "nll": nll.reshape(-1),
                                "row": torch.arange(ids.shape[0]).repeat_interleave(width - 1)}

    def _nll_tokens(self, attended, completion) -> torch.Tensor:
        """Which tokens of each row the NLL term counts (its chosen rows' only are kept)."""
        raise NotImplementedError

    ENGINE_KEYS_ADDED = ("input_ids", "attention_mask", "labels", "pair_tokens")  # what _engine_batch adds

    def floating_point_ops(self, inputs):
        # what stock counts (total_flos): over the TRL batch, which has no input_ids (chosen_input_ids ...)
        return super().floating_point_ops({k: v for k, v in inputs.items() if k not in self.ENGINE_KEYS_ADDED})

    # -- the loss ---------------------------------------------------------------------------------------
    def _pair_loss(self, batch, per_row, k):
        """The TRL trainer's loss of one micro-batch from the token log-probabilities the engine's head hands over;
        keeps what the metrics need in self._rows[k]."""
        tokens = batch["pair_tokens"]
        tok = per_row["token_logps"]
        dev, n = tok.device, per_row["tokens"].numel()
        row = tokens["row"].to(dev)
        completion, nll_mask = (tokens[key].to(dev, tok.dtype) for key in ("completion", "nll"))
        sums = torch.zeros(n, dtype=tok.dtype, device=dev).index_add(0, row, tok * completion)
        counts = torch.zeros(n, dtype=tok.dtype, device=dev).index_add(0, row, completion)
        # TRL's mean over the counted tokens (nn.CrossEntropyLoss); CPO with cpo_alpha 0 counts none: 0
        nll = -(tok * nll_mask).sum() / nll_mask.sum() if bool(tokens["nll"].any()) else tok.new_zeros(())
        per_row["live"] = tokens["completion"] | tokens["nll"]  # only these carry a gradient
        loss, chosen, rejected, rewards, extra = self._objective(sums, counts, nll)
        width = tokens["row"].numel() // n
        logits = per_row["mean_logits"].detach().chunk(2)
        self._rows[k] = {"chosen": chosen.detach(), "rejected": rejected.detach(), "rewards": rewards,
                         "logits": [s.sum() / (s.numel() * width) for s in logits],
                         "nll_loss": nll.detach(), **{name: v.detach() for name, v in extra.items()}}
        return loss

    def _objective(self, sums, counts, nll):
        """(loss, chosen logps, rejected logps, (chosen rewards, rejected rewards), extra metrics) of one
        micro-batch from its rows' summed completion log-probabilities, their token counts and the NLL term."""
        raise NotImplementedError

    def _record(self, rows, mode: str) -> dict:
        """The metrics the TRL trainer's get_batch_loss_metrics stores for one micro-batch, as device tensors
        until the next log, in its order and with its names (eval_* in evaluation)."""
        gather = self.accelerator.gather_for_metrics
        chosen_rewards, rejected_rewards = rows["rewards"]
        values = {"rewards/chosen": gather(chosen_rewards).mean(), "rewards/rejected": gather(rejected_rewards).mean(),
                  "rewards/accuracies": gather((chosen_rewards > rejected_rewards).float()).mean(),
                  "rewards/margins": gather(chosen_rewards - rejected_rewards).mean(),
                  "logps/rejected": gather(rows["rejected"]).mean(), "logps/chosen": gather(rows["chosen"]).mean(),
                  "logits/rejected": gather(rows["logits"][1]).mean(), "logits/chosen": gather(rows["logits"][0]).mean()}
        for name in ("nll_loss", "log_odds_ratio", "log_odds_chosen"):
            if name in rows:
                values[name] = gather(rows[name]).mean()
        prefix = "eval_" if mode == "eval" else ""
        stored = {prefix + key: v for key, v in values.items()}
        for key, v in stored.items():
            self._stored_metrics[mode][key].append(v)
        return stored

    # -- one micro-batch ---------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if "labels" not in inputs:  # called outside train()'s loop
            self._engine_batch(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._record(self._rows[self._micro_index], "train")
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        out, _ = self._engine_eval(inputs, lambda per_row: self._pair_loss(inputs, per_row, 0), want_logits=False)
        stored = self._record(self._rows[0], "eval")
        loss = out.loss.detach().to(self.args.device)
        if prediction_loss_only:
            return loss, None, None
        # what TRL returns as the logits: the two logits metrics, less ignore_keys
        if ignore_keys is None:
            ignore_keys = getattr(self.model.config, "keys_to_ignore_at_inference", [])
        logits = [stored[k] for k in ("eval_logits/chosen", "eval_logits/rejected") if k not in ignore_keys]
        logits = torch.stack(logits).to(self.accelerator.device) if logits else torch.zeros(0, device=loss.device)
        return loss, logits, torch.zeros(logits.shape[0], device=self.accelerator.device)
