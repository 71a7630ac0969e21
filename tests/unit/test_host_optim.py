"""HostParamOptimizer runs Trainer's own optimizer classes (SGD, Adagrad, RMSprop, Adafactor) over the
unit's parameter views: given the same gradients, the masters are stock's bit for bit (clipping, a
scheduler, Trainer's two weight-decay groups, resident units, the background stepper)."""

import copy

import pytest
import torch
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

from hf_megatrain import StreamingEngine
from hf_megatrain.engine.host_optim import HostParamOptimizer, unsupported_modes
from tests.support.tiny import make_batch, make_model

OPTIM_ARGS = {
    "sgd": "momentum=0.9,nesterov=True",
    "adagrad": "lr_decay=0.01",
    "rmsprop": "momentum=0.5,alpha=0.9,centered=True",  # eps 1e-8: badly conditioned, and still bit for bit
    "adafactor": None,
}


def stock_cls_and_kwargs(optim):
    args = TrainingArguments(output_dir="unused", optim=optim, optim_args=OPTIM_ARGS[optim], learning_rate=1e-2,
                             use_cpu=True, report_to=[])
    return Trainer.get_optimizer_cls_and_kwargs(args)


@pytest.mark.parametrize("optim", list(OPTIM_ARGS))
@pytest.mark.parametrize("kind,resident,background", [("llama_tied", 0, False), ("mixtral", 1, True)])
def test_same_gradients_same_masters(optim, kind, resident, background):
    model = make_model(kind, seed=3)
    ref = copy.deepcopy(model)
    decay = Trainer.get_decay_parameter_names(None, ref)
    cls, kwargs = stock_cls_and_kwargs(optim)
    groups = [{"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0}]
    ref_opt = cls(groups, **kwargs)
    ref_sched = get_linear_schedule_with_warmup(ref_opt, 1, 4)
    engine = StreamingEngine(model, compute_dtype=torch.float32, decay_names=decay, resident_layers=resident,
                             background_host_jobs=background).train()
    opt = HostParamOptimizer(engine, cls, kwargs, weight_decay=0.1, name=optim)
    sched = get_linear_schedule_with_warmup(opt, 1, 4)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.step_during_backward() is False  # the step policy then steps after the backward
    params = dict(ref.named_parameters())
    for step in range(4):
        engine.forward_backward(make_batch(seed=step))
        for name, g in engine.named_grads():  # the engine's gradients, handed to stock as they are
            params[name].grad = g.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()
        norm = opt.clip_grad_norm_(0.05)
        opt.step(), sched.step(), engine.zero_grad()
        opt.synchronize()
        assert torch.equal(norm, ref_norm), (step, norm, ref_norm)
    masters = dict(engine.named_master_params())
    for name, p in ref.named_parameters():
        assert torch.equal(masters[name], p.detach()), name


def test_refused_modes_say_so_in_one_line():
    assert unsupported_modes("sgd") is None
    for kw in (dict(world_size=2), dict(transient_grads=True), dict(gpu_grad_layers=2)):
        why = unsupported_modes("adafactor", **kw)
        assert "\n" not in why and why.startswith("optim='adafactor' is not combined with")
    engine = StreamingEngine(make_model("llama"), compute_dtype=torch.float32, transient_grads=True,
                             background_host_jobs=True)
    with pytest.raises(ValueError, match="transient_grads"):
        HostParamOptimizer(engine, *stock_cls_and_kwargs("sgd"), name="sgd")
