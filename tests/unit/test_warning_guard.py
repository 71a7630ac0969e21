"""The guard conftest.py puts around every test: catches transformers' deprecations raised inside hf_megatrain."""

import warnings

import torch
from transformers.utils.deprecation import deprecate_kwarg

from hf_megatrain.engine.schedule import StreamingEngine
from hf_megatrain.patcher import specs
from tests.support.tiny import make_batch, make_model
from tests.support.warning_guard import deprecations_from_our_calls


def deprecated_past_key_values():
    """create_causal_mask as transformers 5.25 ships it: `past_key_values=` still works but warns, through
    transformers' own deprecation helper."""
    real = specs.create_causal_mask

    @deprecate_kwarg("past_key_values", version="99.0.0", new_name="cache")
    def causal_mask(config, inputs_embeds, attention_mask, cache=None, **kw):
        return real(config, inputs_embeds, attention_mask, cache, **kw)

    return causal_mask


def test_guard_catches_a_deprecated_keyword_passed_by_hf_megatrain_only(monkeypatch):
    causal_mask = deprecated_past_key_values()
    monkeypatch.setattr(specs, "create_causal_mask", causal_mask)
    monkeypatch.setattr(specs, "_CACHE_KW", "past_key_values")  # how specs called it before 5.25 support
    model = make_model("llama")
    engine = StreamingEngine(model, compute_dtype=torch.float32).train()
    with warnings.catch_warnings(record=True) as passed_on:
        warnings.simplefilter("always")
        with deprecations_from_our_calls() as caught:
            engine.forward_backward(make_batch(batch=1, seq=8, pad_rows=0))  # hf_megatrain passes the old name
            causal_mask(model.config, torch.zeros(1, 8, 64), None, past_key_values=None)  # this test does

    assert [(w.category, w.filename) for w in caught] == [(FutureWarning, specs.__file__)]
    assert "past_key_values" in str(caught[0].message)
    ours = [w for w in passed_on if "past_key_values" in str(w.message)]
    assert [(w.category, w.filename) for w in ours] == [(FutureWarning, __file__)]


def test_guard_leaves_a_deprecated_call_made_by_another_library_to_it(monkeypatch):
    """hf_megatrain -> peft -> deprecated transformers API (as peft 0.21 reads `is_gradient_checkpointing` in
    get_peft_model on transformers 5.25) is peft's use: passed on, not caught."""
    causal_mask = deprecated_past_key_values()
    in_peft = {"__name__": "peft.guard_probe"}  # a function whose frames belong to peft, as peft's own would
    exec("def passes_old_name(make, cache, **kw):\n    return make(past_key_values=cache, **kw)", in_peft)
    monkeypatch.setattr(specs, "create_causal_mask", lambda **kw: in_peft["passes_old_name"](causal_mask, **kw))
    monkeypatch.setattr(specs, "_CACHE_KW", "cache")
    engine = StreamingEngine(make_model("llama"), compute_dtype=torch.float32).train()
    with warnings.catch_warnings(record=True) as passed_on:
        warnings.simplefilter("always")
        with deprecations_from_our_calls() as caught:
            engine.forward_backward(make_batch(batch=1, seq=8, pad_rows=0))

    assert caught == []
    deprecations = [str(w.message) for w in passed_on if w.category is FutureWarning]
    assert len(deprecations) == 1 and deprecations[0].startswith("`past_key_values` is deprecated"), deprecations
