"""Trainer's extension points under the engine: each works with stock Trainer's numbers, or the trainer
refuses it when it is built, in one line; never silently different (issue 38). Tiny Llama, fp32, CPU."""

import copy

import datasets
import pytest
import torch
from transformers import Trainer, TrainingArguments, get_constant_schedule

from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer
from tests.support.tiny import VOCAB, make_model

KW = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-2,
          weight_decay=0.1, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, max_steps=4,
          dataloader_num_workers=0, disable_tqdm=True)


def padded_rows(n=16, length=12, seed=0, side="left"):
    """Rows as `tokenizer(..., padding="max_length")` leaves them, labels a copy of input_ids over the padding
    too (what a user who copies the ids gets): no collator can improve on them, stock's default stacks them."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i in range(n):
        real = 4 + i % (length - 4)
        tokens = torch.randint(3, VOCAB, (real,), generator=g).tolist()
        pad = [0] * (length - real)
        ids.append(pad + tokens if side == "left" else tokens + pad)
        ones, zeros = [1] * real, [0] * (length - real)
        masks.append(zeros + ones if side == "left" else ones + zeros)
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": masks, "labels": copy.deepcopy(ids)})


def pair(tmp_path, stock_cls=Trainer, mega_cls=MegaTrainTrainer, train=None, model=None, **kw):
    """Stock and engine trainers over copies of one tiny Llama, neither trained yet."""
    model = model or make_model("llama")
    ref = copy.deepcopy(model)
    train = train if train is not None else padded_rows()
    args = dict(KW, **kw)
    stock = stock_cls(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "stock"), **args),
                      train_dataset=train)
    mega = mega_cls(model=model, args=MegaTrainArguments(output_dir=str(tmp_path / "mega"), **args),
                    train_dataset=train)
    return stock, mega, ref


def assert_same_training(stock, mega, ref, keys=("loss", "grad_norm", "learning_rate")):
    stock.train()
    mega.train()
    a = [h for h in stock.state.log_history if "loss" in h]
    b = [h for h in mega.state.log_history if "loss" in h]
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        for k in keys:
            assert abs(x[k] - y[k]) <= 1e-5 * max(1.0, abs(x[k])), (k, x[k], y[k])
    masters = dict(mega.engine.named_master_params())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("side", ["left", "right"])
def test_pre_padded_rows_without_a_collator_train_as_stock(side, tmp_path):
    """No data_collator: Trainer's own default, so the rows keep their attention_mask and labels as given."""
    stock, mega, ref = pair(tmp_path, train=padded_rows(side=side))
    assert type(mega.data_collator) is type(stock.data_collator)
    assert_same_training(stock, mega, ref)


def test_rows_without_labels_fail_as_stock(tmp_path):
    rows = padded_rows().remove_columns("labels")
    stock, mega, _ = pair(tmp_path, train=rows)
    with pytest.raises(ValueError, match="did not return a loss") as theirs:
        stock.train()
    with pytest.raises(ValueError, match="did not return a loss") as ours:
        mega.train()
    assert "labels" in str(ours.value) and "input_ids" in str(theirs.value)


def test_default_log_keys_are_stock_keys(tmp_path):
    stock, mega, ref = pair(tmp_path)
    assert_same_training(stock, mega, ref)
    assert [sorted(h) for h in stock.state.log_history] == [sorted(h) for h in mega.state.log_history]


def test_pipeline_metrics_when_asked(tmp_path):
    mega = MegaTrainTrainer(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path), log_pipeline=True,
                                                                     **KW), train_dataset=padded_rows())
    mega.train()
    logged = [h for h in mega.state.log_history if "loss" in h]
    assert all("tokens_per_second" in h and "model_tflops" in h for h in logged)


class OwnOptimizer(MegaTrainTrainer):
    def create_optimizer(self, model=None):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        return self.optimizer


class OwnInputs(MegaTrainTrainer):
    def _prepare_inputs(self, inputs):
        return super()._prepare_inputs(inputs)


@pytest.mark.parametrize("cls, hook", [(OwnOptimizer, "create_optimizer"), (OwnInputs, "_prepare_inputs")])
def test_overrides_the_engine_never_calls_are_refused_when_built(cls, hook, tmp_path):
    with pytest.raises(MegaTrainError, match=rf"^{cls.__name__}\.{hook} overrides Trainer\.{hook}") as e:
        cls(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path), **KW), train_dataset=padded_rows())
    assert "\n" not in str(e.value)


class ConstantSchedule(Trainer):
    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = get_constant_schedule(self.optimizer if optimizer is None else optimizer)
            self._created_lr_scheduler = True
        return self.lr_scheduler


class MegaConstantSchedule(MegaTrainTrainer):
    create_scheduler = ConstantSchedule.create_scheduler


def fewer_decayed(self, model):
    return [n for n in Trainer.get_decay_parameter_names(self, model) if "mlp" not in n]


class FewerDecayed(Trainer):
    get_decay_parameter_names = fewer_decayed


class MegaFewerDecayed(MegaTrainTrainer):
    get_decay_parameter_names = fewer_decayed


def test_create_scheduler_override_runs_as_stock(tmp_path):
    stock, mega, ref = pair(tmp_path, ConstantSchedule, MegaConstantSchedule, warmup_steps=2)
    assert_same_training(stock, mega, ref)
    assert len({h["learning_rate"] for h in mega.state.log_history if "loss" in h}) == 1


def test_decay_parameter_names_override_runs_as_stock(tmp_path):
    stock, mega, ref = pair(tmp_path, FewerDecayed, MegaFewerDecayed)
    assert_same_training(stock, mega, ref)


def test_optimizer_cls_and_kwargs_adamw_runs_as_stock(tmp_path):
    """Stock builds AdamW(groups, **kwargs): its lr and betas, torch's defaults for the rest, the groups' decay."""
    model = make_model("llama")
    ref = copy.deepcopy(model)
    given = (torch.optim.AdamW, {"lr": 3e-3, "betas": (0.8, 0.95)})
    args = dict(KW)
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "s"), **args),
                    train_dataset=padded_rows(), optimizer_cls_and_kwargs=given)
    mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path / "m"), **args),
                            train_dataset=padded_rows(), optimizer_cls_and_kwargs=given)
    assert_same_training(stock, mega, ref)


@pytest.mark.parametrize("given, pattern", [
    (dict(optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1})), "optimizer_cls_and_kwargs=.SGD"),
    (dict(optimizer_cls_and_kwargs=(torch.optim.AdamW, {"amsgrad": True})), "only torch.optim.AdamW"),
    (dict(optimizers=(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), None)), "optimizers=.SGD"),
    (dict(model_init=lambda: make_model("llama")), "model_init is not supported"),
])
def test_optimizer_and_model_init_refusals_are_one_line(given, pattern, tmp_path):
    model = None if "model_init" in given else make_model("llama")
    with pytest.raises(MegaTrainError, match=pattern) as e:
        MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path), **KW), train_dataset=padded_rows(),
                         **given)
    assert "\n" not in str(e.value)


def test_positional_arguments_mean_what_they_mean_in_trainer(tmp_path):
    """Trainer(model, args, data_collator, train_dataset, eval_dataset, processing_class, ...)."""
    from transformers import default_data_collator

    rows = padded_rows()
    mega = MegaTrainTrainer(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path), **KW),
                            default_data_collator, rows, rows)
    assert mega.data_collator is default_data_collator and mega.train_dataset is rows and mega.eval_dataset is rows


@pytest.mark.parametrize("option", [dict(torch_compile=True), dict(optim="adamw_bnb_8bit"),
                                    dict(use_liger_kernel=True)])
def test_arguments_build_and_the_trainer_refuses(option, tmp_path):
    """Code that only parses arguments (a shared HfArgumentParser setup) keeps working; the trainer refuses."""
    args = MegaTrainArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **option)
    with pytest.raises(MegaTrainError) as e:
        MegaTrainTrainer(make_model("llama"), args, train_dataset=padded_rows())
    assert next(iter(option)).split("_")[0] in str(e.value) and "\n" not in str(e.value)


def test_metrics_and_logits_preprocessing_as_stock(tmp_path):
    """compute_metrics and preprocess_logits_for_metrics see what stock's see (the full logits)."""
    rows = padded_rows(8, side="right")
    seen = {}

    def preprocess(logits, labels):
        return logits.argmax(-1)

    def metrics(pred):
        hits = (pred.predictions[:, :-1] == pred.label_ids[:, 1:]) & (pred.label_ids[:, 1:] != -100)
        return {"hits": float(hits.sum())}

    out = {}
    for name, cls, args_cls in (("stock", Trainer, TrainingArguments), ("mega", MegaTrainTrainer, MegaTrainArguments)):
        model = make_model("llama")
        t = cls(model=model, args=args_cls(output_dir=str(tmp_path / name), **KW), train_dataset=rows,
                eval_dataset=rows, compute_metrics=metrics, preprocess_logits_for_metrics=preprocess)
        out[name] = t.evaluate()
        seen[name] = t
    assert out["stock"]["eval_hits"] == out["mega"]["eval_hits"]
    assert abs(out["stock"]["eval_loss"] - out["mega"]["eval_loss"]) < 1e-5


# -- a loss of the user's: honoured through Trainer's compute_loss over the logits the engine builds --------
def weighted_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """The common customization: the model's own loss (through Trainer's compute_loss) plus a term over
    the logits, with a per-token weight."""
    loss, outputs = Trainer.compute_loss(self, model, inputs, return_outputs=True,
                                         num_items_in_batch=num_items_in_batch)
    logits = outputs.logits.float()
    weight = inputs["attention_mask"].unsqueeze(-1).float() if "attention_mask" in inputs else 1.0
    loss = 2.0 * loss + 1e-3 * (logits.pow(2) * weight).mean()
    return (loss, outputs) if return_outputs else loss


def own_cross_entropy(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """A loss that pops the labels and ignores the model's loss (and, for an MoE, its router loss)."""
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    logits = outputs.logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)
    return (loss, outputs) if return_outputs else loss


def uses_aux_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """An MoE's outputs.aux_loss, weighted the user's own way."""
    outputs = model(**inputs)
    loss = outputs.loss + 0.5 * outputs.aux_loss
    return (loss, outputs) if return_outputs else loss


def trainers_with(loss_fn, **attributes):
    return (type("Stock", (Trainer,), {"compute_loss": loss_fn, **attributes}),
            type("Mega", (MegaTrainTrainer,), {"compute_loss": loss_fn, **attributes}))


# own_cross_entropy is a per-batch mean: a subclass of a newer Trainer says so by loss_is_scaled_for_ga=False, and
# Trainer then divides it by the GA steps where its default rule would not (older Trainers ignore the attribute)
@pytest.mark.parametrize("kind, loss_fn, attributes", [
    ("llama", weighted_loss, {}), ("llama_tied", own_cross_entropy, {}), ("mixtral", weighted_loss, {}),
    ("mixtral", own_cross_entropy, {}), ("mixtral", uses_aux_loss, {}),
    ("llama", own_cross_entropy, {"loss_is_scaled_for_ga": False})])
def test_compute_loss_override_trains_and_evaluates_as_stock(kind, loss_fn, attributes, tmp_path):
    """GA 2 with clipping and weight decay: the same logged losses, norms, eval_loss and final weights."""
    stock_cls, mega_cls = trainers_with(loss_fn, **attributes)
    model = make_model(kind)
    ref = copy.deepcopy(model)
    args = dict(KW, eval_strategy="steps", eval_steps=2)
    if loss_fn is uses_aux_loss:
        # The router's share (1 + 0.5 / coef) multiplies its gradient after autograd rather than inside it: the
        # same number to the last bits, which Adam's first steps at lr 1e-2 magnify past 1e-5 where |g| ~ eps.
        args["learning_rate"] = 1e-3
    train, ev = padded_rows(side="right"), padded_rows(6, seed=5, side="right")
    stock = stock_cls(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "s"), **args),
                      train_dataset=train, eval_dataset=ev)
    mega = mega_cls(model=model, args=MegaTrainArguments(output_dir=str(tmp_path / "m"), **args),
                    train_dataset=train, eval_dataset=ev)
    assert_same_training(stock, mega, ref)
    a = [h["eval_loss"] for h in stock.state.log_history if "eval_loss" in h]
    b = [h["eval_loss"] for h in mega.state.log_history if "eval_loss" in h]
    assert len(a) == len(b) == 2 and all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)


def test_compute_loss_func_and_label_smoothing_train_as_stock(tmp_path):
    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                               ignore_index=-100, reduction="sum")
        return ce / num_items_in_batch

    for extra, given in ((dict(), dict(compute_loss_func=loss_func)), (dict(label_smoothing_factor=0.1), dict())):
        model = make_model("llama")
        ref = copy.deepcopy(model)
        args = dict(KW, **extra)
        out = tmp_path / str(len(extra))
        stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(out / "s"), **args),
                        train_dataset=padded_rows(side="right"), **given)
        mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(out / "m"), **args),
                                train_dataset=padded_rows(side="right"), **given)
        assert_same_training(stock, mega, ref)


def test_compute_loss_that_calls_the_model_twice_is_refused(tmp_path):
    def twice(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss + model(**inputs).loss

    _, mega_cls = trainers_with(twice)
    mega = mega_cls(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path), **KW),
                    train_dataset=padded_rows())
    with pytest.raises(MegaTrainError, match="twice"):
        mega.train()


def test_training_step_override_without_super_says_so(tmp_path):
    """Stock's training_step body copied into an override calls the model for a loss to backpropagate."""
    def stock_body(self, model, inputs, num_items_in_batch=None):
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self.accelerator.backward(loss)
        return loss.detach()

    def wrapped(self, model, inputs, num_items_in_batch=None):
        wrapped.calls += 1
        return MegaTrainTrainer.training_step(self, model, inputs, num_items_in_batch)

    wrapped.calls = 0
    plain = type("Plain", (MegaTrainTrainer,), {"training_step": stock_body})
    with pytest.raises(MegaTrainError, match=r"must call super\(\)\.training_step"):
        plain(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path / "a"), **KW),
              train_dataset=padded_rows()).train()
    around = type("Around", (MegaTrainTrainer,), {"training_step": wrapped})
    around(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path / "b"), **KW),
           train_dataset=padded_rows()).train()
    assert wrapped.calls == KW["max_steps"] * KW["gradient_accumulation_steps"]


def test_the_model_is_in_train_or_eval_mode_as_in_stock(tmp_path):
    """A callback reading trainer.model.training sees what it sees under stock Trainer."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, args, state, control, model=None, **kw):
            self.seen.append(("step", model.training))

        def on_evaluate(self, args, state, control, model=None, **kw):
            self.seen.append(("eval", model.training))

    seen = {}
    for name, cls, args_cls in (("stock", Trainer, TrainingArguments), ("mega", MegaTrainTrainer, MegaTrainArguments)):
        record = Record()
        t = cls(model=make_model("llama"), args=args_cls(output_dir=str(tmp_path / name), eval_strategy="steps",
                                                          eval_steps=2, **KW),
                train_dataset=padded_rows(), eval_dataset=padded_rows(4), callbacks=[record])
        t.train()
        seen[name] = record.seen
    assert seen["stock"] == seen["mega"] and ("eval", False) in seen["mega"]


def test_trainable_parameter_count_is_stocks(tmp_path):
    """Trainer logs get_model_param_count of the model it runs: the engine counts the model's parameters."""
    from peft import LoraConfig
    from transformers.trainer_pt_utils import get_model_param_count

    for lora in (None, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")):
        model = make_model("llama")
        mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path), **KW), train_dataset=padded_rows(),
                                peft_config=lora)
        wanted = sum(p.numel() for p in mega.model.parameters() if p.requires_grad)
        assert wanted > 0 and get_model_param_count(mega.engine, trainable_only=True) == wanted
        assert get_model_param_count(mega.engine) == sum(p.numel() for p in mega.model.parameters())
