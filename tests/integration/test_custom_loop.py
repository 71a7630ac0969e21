"""prepare(): the engine in a plain PyTorch loop equals stock autograd + torch AdamW."""

import copy

import pytest
import torch
from transformers import Trainer

import hf_megatrain
from tests.support.tiny import make_batch, make_model


def test_prepare_loop_matches_stock_adamw():
    model = make_model("qwen3")
    ref = copy.deepcopy(model)
    decay = Trainer.get_decay_parameter_names(None, ref)
    ref_opt = torch.optim.AdamW(
        [{"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": 0.1},
         {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0}],
        lr=2e-3, fused=True)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)

    engine, opt = hf_megatrain.prepare(model, device="cpu", lr=2e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(4):
        for micro in range(2):
            batch = make_batch(seed=10 * step + micro)
            (ref(**batch).loss / 2).backward()
            engine.forward_backward(batch, scale=0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()
        opt.clip_grad_norm_(1.0)
        opt.step(), sched.step(), engine.zero_grad()
    masters = dict(engine.named_master_params())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), atol=1e-6, rtol=1e-5, msg=name)


def test_custom_loop_example_runs(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "trained"
    r = subprocess.run([sys.executable, "examples/custom_loop.py", "--tiny", "--out", str(out)], capture_output=True,
                       text=True, cwd=__file__.rsplit("/tests/", 1)[0], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    losses = [float(line.split()[3]) for line in r.stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0]
    assert r.stdout.strip().splitlines()[-1].endswith("from_pretrained gives back the trained weights: True")
    assert (out / "tokenizer_config.json").exists()


@pytest.mark.parametrize("method", ["lora", "p_tuning_mlp"])
def test_prepare_decays_a_peft_model_as_trainer_does(method):
    """A PeftModel through prepare(): the parameters Trainer's grouping decays (LoRA's A and B, a prompt encoder's
    weights, not its biases) are decayed by the engine's AdamW too, so two steps equal torch's AdamW over Trainer's
    groups. (prepare() once matched Trainer's names of a PeftModel against the base model's and decayed nothing.)"""
    from peft import LoraConfig, get_peft_model

    from tests.support.tiny import make_prompted

    if method == "lora":
        torch.manual_seed(0)
        model = get_peft_model(make_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                               init_lora_weights=False))
    else:
        model = make_prompted("llama", method)
    ref = copy.deepcopy(model)
    decay = Trainer.get_decay_parameter_names(None, ref)
    trained = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    assert any(n in decay for n, _ in trained)
    ref_opt = torch.optim.AdamW([{"params": [p for n, p in trained if n in decay], "weight_decay": 0.5},
                                 {"params": [p for n, p in trained if n not in decay], "weight_decay": 0.0}], lr=1e-2)
    engine, opt = hf_megatrain.prepare(model, device="cpu", lr=1e-2, weight_decay=0.5)
    for step in range(2):
        batch = make_batch(seed=step)
        ref(**batch).loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        engine.forward_backward(batch)
        opt.step(), engine.zero_grad()
    masters = dict(engine.named_master_params())
    for name, p in trained:
        torch.testing.assert_close(masters[name.removeprefix("base_model.model.")], p.detach(), atol=1e-6, rtol=1e-5,
                                   msg=name)


def test_prepare_saves_a_full_model_and_lora_adapters(tmp_path):
    """engine.save_pretrained from prepare(): from_pretrained (or PeftModel.from_pretrained) gives the
    trained weights back; the tokenizer is saved beside them."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_megatrain.demo import build_tokenizer

    engine, opt = hf_megatrain.prepare(make_model("llama"), device="cpu", lr=1e-2)
    engine.forward_backward(make_batch())
    opt.step()
    engine.save_pretrained(tmp_path / "full", tokenizer=build_tokenizer())
    masters = dict(engine.named_master_params())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), masters[name]), name
    assert (tmp_path / "full" / "tokenizer_config.json").exists()

    base = make_model("llama", seed=3)
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    engine, opt = hf_megatrain.prepare(lora, device="cpu", lr=1e-2)
    engine.forward_backward(make_batch())
    opt.step()
    engine.save_pretrained(tmp_path / "adapter")
    trained = dict(engine.named_master_params())
    back = PeftModel.from_pretrained(base, tmp_path / "adapter")
    got = {n.removeprefix("base_model.model."): p for n, p in back.named_parameters() if "lora_" in n}
    assert got.keys() == trained.keys()
    for name, t in trained.items():
        assert torch.equal(got[name].detach(), t), name


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_train_step_runs_a_step_as_stock_does(together, clip):
    """hf_megatrain.train_step: a step's micro-batches through the engine's step policy (engine/step.py, the
    trainer's own), as prepare() planned them (one at a time, or together), clipped or not: the step's loss
    is the mean over its label tokens and the weights are stock autograd's with torch AdamW, as Trainer's
    num_items_in_batch makes them."""
    model = make_model("llama")
    ref = copy.deepcopy(model)
    decay = Trainer.get_decay_parameter_names(None, ref)
    ref_opt = torch.optim.AdamW(
        [{"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": 0.1},
         {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0}], lr=2e-3)
    engine, opt = hf_megatrain.prepare(model, device="cpu", lr=2e-3, weight_decay=0.1, batch=2, seq=16, grad_accum=2,
                                       max_grad_norm=clip, layer_major_accumulation=together)
    assert (engine.run_plan.per_pass > 1) is together
    for step in range(3):
        batches = [make_batch(seed=10 * step + micro) for micro in range(2)]
        items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        ref_loss = sum(ref(**b, num_items_in_batch=items).loss for b in batches)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else None
        ref_opt.step(), ref_opt.zero_grad()
        out = hf_megatrain.train_step(engine, opt, batches, max_grad_norm=clip)
        engine.zero_grad()
        torch.testing.assert_close(out.loss, ref_loss.detach(), atol=1e-6, rtol=1e-5)
        if clip:
            torch.testing.assert_close(out.grad_norm, ref_norm, atol=1e-6, rtol=1e-5)
        else:
            assert out.grad_norm is None
    masters = dict(engine.named_master_params())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(masters[name], p.detach(), atol=1e-6, rtol=1e-5, msg=name)
