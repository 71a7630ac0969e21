"""Sequence-tiled MLPs give the same gradients as untiled ones (tiles far smaller than the sequence)."""

import copy

import pytest
import torch

from hf_megatrain import StreamingEngine
from tests.support.tiny import make_batch, make_model, make_packed_batch


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


def test_packed_rows_longer_than_the_model_do_not_warn():
    """TRL's padding-free batches are one long row whose positions restart per document: the longest
    document counts, not the row."""
    import warnings

    model = make_model("llama", max_position_embeddings=16)
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    batch = make_batch(batch=1, seq=24, pad_rows=0)
    batch["position_ids"] = torch.cat([torch.arange(12), torch.arange(12)]).unsqueeze(0)
    del batch["attention_mask"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.forward_backward(batch)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_activation_offload_gives_identical_gradients(kind):
    """Offloaded layer inputs come back bit-exact: same loss and gradients as keeping them all."""
    batch = make_batch(batch=2, seq=40, pad_rows=1)
    results = []
    for offload in (0, 2, 99):  # none, some, all (more than there are layers)
        engine = StreamingEngine(make_model(kind), compute_dtype=torch.float32, mlp_tile_tokens=14,
                                 offload_activations=offload).train()
        for _ in range(2):  # the second step reuses the host buffers
            engine.zero_grad()
            loss = engine.forward_backward(batch)
        assert len(engine.activations) == 0  # every saved input was handed back and dropped
        results.append((loss, dict(engine.named_grads())))
    (ref_loss, ref), *others = results
    for loss, grads in others:
        assert torch.equal(loss, ref_loss)
        for name, g in ref.items():
            assert torch.equal(grads[name], g), name


def test_offloaded_activations_leave_the_device_copy():
    """The offloaded layers' inputs are held in host buffers, not as the forward's own tensors."""
    from hf_megatrain.engine.activations import Activations

    acts = Activations(torch.device("cpu"), offload=2)
    xs = [torch.randn(2, 5, 8) for _ in range(4)]
    for i, x in enumerate(xs):
        acts.put(i, x)
    assert set(acts._stored) == {0, 1} and set(acts._gpu) == {2, 3}
    assert all(h.data_ptr() != xs[i].data_ptr() for i, h in enumerate(acts._host))
    for i in reversed(range(4)):
        assert torch.equal(acts.get(i), xs[i])
    assert len(acts) == 0


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mixtral"])
def test_long_packed_rows_equal_their_documents_run_separately(kind, monkeypatch):
    """Rows past the dense-mask limit, packed and right-padded, run attention document by document
    under SDPA: loss, gradients and logits equal stock HF run on each document alone."""
    from hf_megatrain.engine import inputs
    from hf_megatrain.patcher import documents

    monkeypatch.setattr(inputs, "_DENSE_MASK_LIMIT", 32 * 32)  # "long" = more than 32 tokens here
    calls = []
    real = documents.sdpa_attention_forward
    monkeypatch.setattr(documents, "sdpa_attention_forward", lambda *a, **k: calls.append(a[1].shape[2]) or real(*a, **k))
    model = make_model(kind, output_router_logits=False)  # the aux loss is a batch statistic: not per document
    ref = copy.deepcopy(model)
    batch, docs = make_packed_batch()
    nib = batch["labels"][..., 1:].ne(-100).sum()

    alone_loss, alone_logits = 0.0, []
    for r, spans in enumerate(docs):
        for s, e in spans:
            out = ref(input_ids=batch["input_ids"][r:r + 1, s:e], labels=batch["labels"][r:r + 1, s:e],
                      num_items_in_batch=nib)
            out.loss.backward()
            alone_loss += float(out.loss)
            alone_logits.append(out.logits[0].detach())

    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert calls and max(calls) == 20  # the documents' own lengths, never the row's
    assert model.config._attn_implementation == "sdpa"  # the batch's switch is undone
    assert abs(float(loss) - alone_loss) < 1e-5
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)

    engine.eval()
    with torch.no_grad():
        logits = engine(**{k: v for k, v in batch.items() if k != "labels"}).logits
    real_tokens = torch.cat([logits[r, s:e] for r, spans in enumerate(docs) for s, e in spans])
    torch.testing.assert_close(real_tokens.float(), torch.cat(alone_logits), atol=1e-5, rtol=1e-5)


def test_long_rows_that_cannot_run_by_document_are_refused(monkeypatch):
    """Left padding, or documents longer than a sliding window, would need the dense mask:
    refused before anything is allocated, with what to do instead."""
    from hf_megatrain import MegaTrainError
    from hf_megatrain.engine import inputs

    monkeypatch.setattr(inputs, "_DENSE_MASK_LIMIT", 32 * 32)
    engine = StreamingEngine(make_model("llama"), compute_dtype=torch.float32).train()
    batch = make_batch(batch=1, seq=40, pad_rows=0)
    engine.forward_backward(batch)  # one plain causal row: no mask needed, runs
    batch["attention_mask"][0, :5] = 0  # left padding
    with pytest.raises(MegaTrainError, match="left or inner padding.*flash_attention_2"):
        engine.forward_backward(batch)

    engine = StreamingEngine(make_model("mistral"), compute_dtype=torch.float32).train()  # window of 5
    batch, _ = make_packed_batch()
    with pytest.raises(MegaTrainError, match="up to 20 tokens under a 5-token sliding window"):
        engine.forward_backward(batch)


ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_scaling_applies_unchanged(kind):
    """The model's own rope scaling, as HF implements it, at a length past max_position_embeddings
    (where dynamic NTK rescales): engine loss and gradients equal stock autograd's."""
    rope = dict(ROPE[kind], rope_theta=10000.0)
    model = make_model("llama", rope_parameters=rope, max_position_embeddings=16)
    plain = make_model("llama", max_position_embeddings=16)
    batch = make_batch(batch=2, seq=40, pad_rows=0)
    ref = copy.deepcopy(model)
    out = ref(**batch)
    out.loss.backward()
    assert abs(float(out.loss) - float(plain(**batch).loss)) > 1e-6  # the scaling changes the model
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    with pytest.warns(UserWarning, match="max_position_embeddings=16"):
        loss = engine.forward_backward(batch)
    assert abs(float(loss) - float(out.loss)) < 1e-5
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
