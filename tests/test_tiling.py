"""Sequence-tiled MLPs give the same gradients as untiled ones (tiles far smaller than the sequence)."""

import copy

import pytest
import torch

from hf_megatrain import StreamingEngine
from tiny import make_batch, make_model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_tiled_mlp_gradients_equal_untiled(kind):
    model = make_model(kind)
    batch = make_batch(batch=2, seq=40, pad_rows=1)
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref = copy.deepcopy(model)
    ref(**batch, num_items_in_batch=nib).loss.backward()
    engine = StreamingEngine(model, compute_dtype=torch.float32, mlp_tile_tokens=14).train()  # 7 rows x 2
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    engine.eval()
    torch.testing.assert_close(engine(**batch).logits, ref.eval()(**batch).logits, atol=1e-5, rtol=1e-5)
    assert abs(float(loss) - float(ref(**batch, num_items_in_batch=nib).loss)) < 1e-5


def test_tiling_bounds_the_mlp_intermediate():
    """With tiles, no tensor of [tokens, intermediate] for the whole sequence appears in the backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self, inter):
            super().__init__()
            self.inter, self.rows = inter, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if getattr(func, "is_view", False) or func is torch.ops.aten.expand.default:
                return out  # views allocate nothing
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == self.inter:
                    self.rows = max(self.rows, t.shape[0] * t.shape[1])
            return out

    batch = make_batch(batch=1, seq=64, pad_rows=0)
    for tile, expect in ((None, 64), (16, 16)):
        model = make_model("llama")
        engine = StreamingEngine(model, compute_dtype=torch.float32, mlp_tile_tokens=tile).train()
        with Largest(model.config.intermediate_size) as probe:
            engine.forward_backward(batch)
        assert probe.rows == expect, (tile, probe.rows)


def test_sequence_longer_than_the_model_warns_once():
    model = make_model("llama", max_position_embeddings=16)
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    with pytest.warns(UserWarning, match="max_position_embeddings=16.*rope"):
        engine.forward_backward(make_batch(batch=1, seq=24, pad_rows=0))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.forward_backward(make_batch(batch=1, seq=24, pad_rows=0))
