"""Engine gradients equal stock autograd for every parameter, fp32 on CPU."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_megatrain import StreamingEngine
from tests.support.tiny import KINDS, make_batch, make_model


def reference_grads(model, batch, nib):
    ref = copy.deepcopy(model)
    out = ref(**batch, num_items_in_batch=nib)
    out.loss.backward()
    return float(out.loss), {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_match_stock(kind):
    model = make_model(kind)
    batch = make_batch(batch=3, seq=12)  # one right-padded row
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref_loss, ref = reference_grads(model, batch, nib)
    engine = StreamingEngine(model, compute_dtype=torch.float32, loss_chunk_tokens=7).train()
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    grads = dict(engine.named_grads())
    assert list(grads) == list(ref), "named_grads must name parameters exactly as model.named_parameters()"
    assert abs(float(loss) - ref_loss) < 1e-5
    for name, g in grads.items():
        assert g.dtype == torch.float32 and g.device.type == "cpu"
        torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=name)


def test_eager_attention_and_mean_loss():
    """Without num_items_in_batch the loss is the mean over counted tokens, as ForCausalLMLoss."""
    model = make_model("llama", attn="eager")
    batch = make_batch(batch=2, seq=9)
    ref_loss, ref = reference_grads(model, batch, None)
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    loss = engine.forward_backward(batch)
    assert abs(float(loss) - ref_loss) < 1e-5
    for name, g in engine.named_grads():
        torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=name)


def test_gradients_accumulate_and_scale():
    model = make_model("llama_tied")
    b1, b2 = make_batch(seed=1), make_batch(seed=2)
    ref = copy.deepcopy(model)
    (ref(**b1).loss * 0.5).backward()
    (ref(**b2).loss * 0.5).backward()
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    engine.forward_backward(b1, scale=0.5)
    engine.forward_backward(b2, scale=0.5)
    grads = dict(engine.named_grads())
    assert "lm_head.weight" not in grads  # tied: one entry
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    engine.zero_grad()
    assert all(float(g.abs().max()) == 0 for _, g in engine.named_grads())


def test_master_params_are_the_model_weights():
    model = make_model("qwen2")
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = StreamingEngine(model, compute_dtype=torch.bfloat16)
    masters = dict(engine.named_master_params())
    assert list(masters) == list(expected)
    for n, t in masters.items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, expected[n], atol=0, rtol=0)
    # the model object is the model that trains: its parameters (the same objects) view the fp32 masters,
    # not the bf16 copy that streams
    views = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for p in views.values())
    for unit in engine.units:
        for slot, view in zip(unit.train_slots, engine.store.views(unit.index, engine.store.master[unit.index])):
            assert views[slot.name].data_ptr() == view.data_ptr(), slot.name


class _LargestLogits(TorchDispatchMode):
    """Records the largest tensor shaped like logits (last dimension = vocabulary)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):  # e.g. lm_head.weight.t(): no new memory
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def test_loss_never_materialises_full_logits():
    model = make_model("llama")
    batch = make_batch(batch=4, seq=32, pad_rows=0)
    vocab = model.config.vocab_size
    engine = StreamingEngine(model, compute_dtype=torch.float32, loss_chunk_tokens=16).train()
    with _LargestLogits(vocab) as probe:
        engine.forward_backward(batch)
    full = 4 * 32 * vocab
    assert probe.largest < full / 4, f"a tensor of {probe.largest} elements appeared (full logits: {full})"
    # and the same probe does see full logits in stock HF, so it can fail
    with _LargestLogits(vocab) as probe:
        model_ref = make_model("llama")
        model_ref(**batch).loss.backward()
    assert probe.largest >= full


def test_dropout_recompute_is_consistent():
    """With attention dropout on, the recompute draws the same mask as the forward."""
    model = make_model("llama", attention_dropout=0.3)
    batch = make_batch()
    ref = copy.deepcopy(model)
    torch.manual_seed(123)
    ref(**batch).loss.backward()
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    torch.manual_seed(123)
    engine.forward_backward(batch)
    grads = dict(engine.named_grads())
    without = copy.deepcopy(ref)
    without.zero_grad()
    torch.manual_seed(124)
    without(**batch).loss.backward()
    assert any((p.grad - grads[n]).abs().max() > 1e-4 for n, p in without.named_parameters()), "dropout is active"
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
