"""Gradient accumulation with a step's micro-batches run through each layer together
(StreamingEngine.forward_backward_many, layer_major_accumulation): every unit crosses once per pass
and its gradient is summed on the device. The numbers must be those of running the micro-batches one
at a time, bit for bit: losses, clipping norms, gradients and masters, also for a tied head, an MoE
with its load-balancing loss, LoRA, resident units and steps taken during the backward."""

import copy

import pytest
import torch
from transformers import default_data_collator

from hf_megatrain import HostAdamW, MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from tests.support.tiny import make_batch, make_model, make_rows as rows


def micro_batches(step, ga, vary=True):
    # rows of different lengths and padding per micro-batch: each keeps its own masks and positions
    return [make_batch(batch=2 + (m % 2 if vary else 0), seq=10 + (2 * m if vary else 0), seed=100 * step + m,
                       pad_rows=m % 2) for m in range(ga)]


def train(model, ga, together, clip, steps=3, dtype=torch.float32, resident=0, early=False, items=True):
    engine = StreamingEngine(model, device="cpu", compute_dtype=dtype, resident_layers=resident,
                             background_host_jobs=dtype == torch.bfloat16 or early).train()
    opt = HostAdamW(engine, lr=3e-3, weight_decay=0.1)
    record = []
    for step in range(steps):
        batches = micro_batches(step, ga)
        n = sum(int(b["labels"][..., 1:].ne(-100).sum()) for b in batches) if items else None
        scale = 1.0 if items else 1.0 / ga
        if early:  # armed for the next backward, which is the whole step's
            assert opt.step_during_backward()
        if together:
            losses = engine.forward_backward_many(batches, n, scale)
        else:
            losses = [engine.forward_backward(b, n, scale) for b in batches]
        record += [float(x) for x in losses]
        if clip:
            record.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        engine.zero_grad()
    return engine, record


def assert_same(a, b):
    (ea, ra), (eb, rb) = a, b
    assert ra == rb
    mb = dict(eb.named_master_params())
    for name, t in ea.named_master_params():
        assert torch.equal(t, mb[name]), name


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "mixtral"])
@pytest.mark.parametrize("ga", [1, 2, 4])
def test_together_equals_one_at_a_time(kind, ga):
    model = make_model(kind, seed=3)
    ref = train(copy.deepcopy(model), ga, together=False, clip=0.3)
    assert_same(train(model, ga, together=True, clip=0.3), ref)


@pytest.mark.parametrize("kind", ["llama_tied", "mixtral"])
def test_together_equals_one_at_a_time_bf16_resident_and_mean_loss(kind):
    """bf16 compute on host threads, two resident layers, the mean-loss rule (no num_items_in_batch)."""
    model = make_model(kind, seed=5)
    kw = dict(ga=3, clip=0.3, dtype=torch.bfloat16, resident=2, items=False)
    ref = train(copy.deepcopy(model), together=False, **kw)
    assert_same(train(model, together=True, **kw), ref)


def test_together_steps_during_the_backward():
    """No clipping: each unit is stepped as soon as its gradient over all micro-batches is final; the
    same as stepping after the backward (which test_residency shows equals stepping during the last)."""
    model = make_model("mixtral", seed=7)
    ref = train(copy.deepcopy(model), 3, together=False, clip=0.0)
    assert_same(train(model, 3, together=True, clip=0.0, early=True), ref)


def test_together_with_lora():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(make_model("llama", seed=2), cfg)
    ref = train(copy.deepcopy(model), 3, together=False, clip=0.3)
    assert_same(train(model, 3, together=True, clip=0.3), ref)


def test_each_unit_is_streamed_once_per_pass():
    """The point of it: the pipeline is asked for each unit's weights once in the forward and once in the
    backward, and each gradient leaves once, however many micro-batches the step has."""
    model = make_model("llama", seed=1)
    engine = StreamingEngine(model, device="cpu", compute_dtype=torch.float32).train()
    asked, emitted = [], []
    weights, emit = engine.pipeline.weights, engine.pipeline.emit_grad
    engine.pipeline.weights = lambda i: asked.append(i) or weights(i)
    engine.pipeline.emit_grad = lambda i, g: emitted.append(i) or emit(i, g)
    engine.forward_backward_many(micro_batches(0, 4), None, 0.25)
    units = len(engine.units)
    assert len(asked) == 2 * units - 2  # the decoder layers twice; the embedding and head stay for the pass
    assert sorted(emitted) == list(range(units))
    asked.clear()
    for b in micro_batches(1, 4):  # one at a time: four times over
        engine.forward_backward(b, None, 0.25)
    assert len(asked) == 4 * (2 * units - 2)



@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_trainer_together_equals_one_at_a_time(tmp_path, clip):
    """Through MegaTrainTrainer (Trainer's num_items_in_batch, GA 4, a last step with fewer micro-batches):
    the same logged losses and norms and the same weights with layer_major_accumulation on and off."""
    data, model = rows(27, 0), make_model("mixtral", seed=1)
    results = {}
    for together in ("true", "false"):
        args = MegaTrainArguments(output_dir=str(tmp_path / together), per_device_train_batch_size=2,
                                  gradient_accumulation_steps=4, max_grad_norm=clip, learning_rate=1e-2,
                                  num_train_epochs=1, logging_steps=1, save_strategy="no", report_to=[],
                                  use_cpu=True, disable_tqdm=True, layer_major_accumulation=together)
        trainer = MegaTrainTrainer(copy.deepcopy(model), args, train_dataset=data,
                                   data_collator=default_data_collator)
        assert trainer._per_pass == (4 if together == "true" else 1)
        trainer.train()
        logs = [(h["loss"], h.get("grad_norm")) for h in trainer.state.log_history if "loss" in h]
        results[together] = (logs, dict(trainer.engine.named_master_params()))
    assert results["true"][0] == results["false"][0] and len(results["true"][0]) == 4  # 14 batches: 4+4+4+2
    for name, t in results["true"][1].items():
        assert torch.equal(t, results["false"][1][name]), name


def test_together_is_refused_with_data_parallel_and_off_on_the_cpu_by_default(tmp_path):
    args = MegaTrainArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], gradient_accumulation_steps=4)
    assert MegaTrainTrainer(make_model("llama"), args, train_dataset=rows(4, 0))._per_pass == 1  # auto: nothing streams
    with pytest.raises(MegaTrainError, match="layer_major_accumulation"):
        MegaTrainArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], layer_major_accumulation="maybe")


@pytest.mark.parametrize("mean_loss", [False, True])
def test_trainer_cut_micro_batches_equal_uncut(tmp_path, monkeypatch, mean_loss):
    """Micro-batches cut into chunks of rows (what planner.split_step picks on a GPU when the asked batch
    does not fit), run through each layer together: the same loss function, so the same logged losses,
    norms and weights as uncut, to rounding (fp32), both with Trainer's num_items_in_batch and with the
    mean-loss rule (each chunk divided by its whole micro-batch's token count)."""
    import hf_megatrain.planner.run as run_module
    from hf_megatrain.planner.placement import StepSplit

    data, model = rows(25, 0), make_model("llama", seed=1)  # the last micro-batch has one row: it stays whole
    results = {}
    for cut in (False, True):
        args = MegaTrainArguments(output_dir=str(tmp_path / str(cut)), per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-3,
                                  num_train_epochs=1,
                                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
        if cut:
            real = run_module.split_step  # what the planner (planner.plan_run) calls
            monkeypatch.setattr(run_module, "split_step",
                                lambda *a, **k: StepSplit(2, 4, real(*a, **{**k, "asked": False}).placement))
        trainer = MegaTrainTrainer(copy.deepcopy(model), args, train_dataset=data, data_collator=default_data_collator)
        if mean_loss:
            trainer.model_accepts_loss_kwargs = False
        assert (trainer._split, trainer._per_pass) == ((2, 4) if cut else (1, 1))
        trainer.train()
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        results[cut] = (logs, dict(trainer.engine.named_master_params()))
    assert len(results[True][0]) == len(results[False][0]) == 4
    for (a, an), (b, bn) in zip(results[True][0], results[False][0]):
        assert a == pytest.approx(b, rel=1e-6) and an == pytest.approx(bn, rel=1e-5)
    for name, t in results[True][1].items():
        torch.testing.assert_close(t, results[False][1][name], atol=1e-5, rtol=1e-5, msg=name)
