"""LoRA through the engine: gradients and Trainer equal stock peft; adapters and merged exports load."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, PrefixTuningConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments, default_data_collator

from hf_megatrain import HostAdamW, MegaTrainArguments, MegaTrainError, MegaTrainTrainer, StreamingEngine
from tests.support.tiny import (PREFIX_METHODS, PROMPT_METHODS, make_batch, make_model, make_prompted,
                                make_rows as rows)

PREFIX = "base_model.model."


def lora(kind="llama_tied", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
               init_lora_weights=False)
    cfg.update(kw)
    return get_peft_model(make_model(kind, seed=seed), LoraConfig(**cfg))


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2", "mixtral"])
def test_lora_gradients_match_stock_peft(kind):
    targets = ["q_proj", "o_proj"] if kind == "mixtral" else ["q_proj", "v_proj", "down_proj"]
    pm = lora(kind, target_modules=targets)
    ref = copy.deepcopy(pm)
    batch = make_batch()
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref(**batch, num_items_in_batch=nib).loss.backward()
    engine = StreamingEngine(pm, compute_dtype=torch.float32).train()
    engine.forward_backward(batch, num_items_in_batch=nib)
    grads = dict(engine.named_grads())
    expected = {n.removeprefix(PREFIX): p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert list(grads) == list(expected) and all("lora_" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("method", list(PROMPT_METHODS))
@pytest.mark.parametrize("kind", ["llama_tied", "gemma2", "mixtral", "gpt2"])
def test_prompt_learning_gradients_match_stock_peft(kind, method):
    """Prompt tuning and p-tuning (MLP and LSTM encoders): the prompt encoder's output before each row's token
    embeddings (after Gemma's scaling, before GPT-2's positions, in the router loss's mask), as PeftModel.forward
    puts it: the same loss and prompt-encoder gradients as stock peft, a padded row among them; only those train."""
    # the logits have the virtual tokens' positions too, as stock returns them
    _prompt_matches_stock(make_prompted(kind, method), [make_batch()])


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("method", ["p_tuning_mlp", "prefix_tuning_mlp"])
def test_prompt_tuning_resumes_bit_for_bit(method, tmp_path):
    """A p-tuning or prefix-tuning run saved at step 3 and resumed ends where the run without a stop ends: the
    prompt encoder's masters and Adam moments come back with the optimizer state."""
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-2,
              weight_decay=0.1, logging_steps=1, report_to=[], seed=0, use_cpu=True, max_steps=6,
              dataloader_num_workers=0, disable_tqdm=True, save_strategy="steps", save_steps=3)
    train = rows(24, 0)
    finals = []
    for resume in (False, True):
        out = tmp_path / ("resumed" if resume else "straight")
        trainer = MegaTrainTrainer(make_prompted("llama", method), MegaTrainArguments(output_dir=str(out), **kw),
                                   train_dataset=train, data_collator=default_data_collator)
        if resume:  # the run stops after its checkpoint at step 3, its schedule still planned for 6
            trainer.add_callback(StopAt(3))
            trainer.train()
            # the same base, another prompt encoder: what trained comes from the checkpoint
            trainer = MegaTrainTrainer(make_prompted("llama", method, adapter_seed=1),
                                       MegaTrainArguments(output_dir=str(out), **kw), train_dataset=train,
                                       data_collator=default_data_collator)
            trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
        else:
            trainer.train()
        finals.append({n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})
    assert finals[0].keys() == finals[1].keys() and finals[0]
    for n in finals[0]:
        assert torch.equal(finals[0][n], finals[1][n]), n
    # saved as PEFT saves it (the encoder's output, which PeftModel.from_pretrained loads); nothing to merge
    trainer.save_model(str(tmp_path / "adapter"))
    back = PeftModel.from_pretrained(make_model("llama"), str(tmp_path / "adapter"))
    torch.testing.assert_close(back.prompt_encoder["default"].embedding.weight.detach(),  # inference mode: the output
                               trainer.model.get_prompt_embedding_to_save("default"))
    with pytest.raises(MegaTrainError, match="no weight to merge"):
        trainer.save_merged(str(tmp_path / "merged"))


def _prompt_matches_stock(pm, batches, rows_keep_length=False):
    """Each batch through stock peft and through the engine (a fresh backward each): the same loss, the same
    prompt-encoder gradients (the only ones), and in evaluation the same logits (as long as the rows with
    `rows_keep_length`: prefix tuning's)."""
    ref = copy.deepcopy(pm)
    engine = StreamingEngine(pm, compute_dtype=torch.float32).train()
    for batch in batches:
        ref.train().zero_grad()
        out = ref(**batch)
        out.loss.backward()
        engine.train().zero_grad()
        loss = engine.forward_backward(batch)
        assert float(loss) == pytest.approx(float(out.loss), abs=1e-6)
        grads = dict(engine.named_grads())
        expected = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        assert list(grads) == list(expected) and all(n.startswith("prompt_encoder.default.") for n in grads)
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=name)
        engine.eval()
        with torch.no_grad():
            ours, theirs = engine(**batch), ref.eval()(**batch)
        assert ours.logits.shape == theirs.logits.shape
        assert not rows_keep_length or ours.logits.shape[:2] == batch["input_ids"].shape
        torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=1e-5)


def _with_positions(batch):
    """The batch as padding-free packed rows: no mask, positions restarting (which PEFT moves by the prefix)."""
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(batch["input_ids"].shape[0], -1)
    return {"input_ids": batch["input_ids"], "labels": batch["labels"], "position_ids": pos}


@pytest.mark.parametrize("method", list(PREFIX_METHODS))
@pytest.mark.parametrize("kind", ["llama_tied", "qwen2", "gpt2", "gemma3_text"])
def test_prefix_tuning_matches_stock_peft(kind, method):
    """Prefix tuning (the encoder's output as every layer's keys and values before its own; Qwen2's sliding-window
    layers, GPT-2's absolute positions moved by the prefix, Gemma 3's cache made from its config, whose 4-token
    sliding layers keep 3 of the 5 prefix tokens): a padded batch and packed rows with position ids give stock
    peft's loss, prompt-encoder gradients and logits."""
    batch = make_batch()
    _prompt_matches_stock(make_prompted(kind, method), [batch, _with_positions(batch)], rows_keep_length=True)


def test_prefix_tuning_of_opt_counts_positions_over_the_prefix():
    """OPT counts its positions from the attention mask: from PEFT's lengthened mask, cut after the prefix (a
    left-padded row among them), or n, n + 1, ... without a mask; the batch's own position ids moved by PEFT."""
    from peft import get_peft_model

    from tests.support.zoo import stock_model, tiny_config

    torch.manual_seed(0)
    pm = get_peft_model(stock_model(tiny_config("opt")), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    right = make_batch()
    left = {k: v.flip(1) for k, v in right.items()}
    bare = {"input_ids": right["input_ids"], "labels": right["labels"]}
    _prompt_matches_stock(pm, [right, left, bare, _with_positions(right)], rows_keep_length=True)


def test_prefix_tuning_of_a_moe_with_its_router_loss():
    """Mixtral with its load-balancing loss: padding-free rows equal stock peft; with an attention mask stock fails
    (the loss weighs the router outputs by the mask PEFT lengthened), and the engine refuses in one line instead."""
    pm = make_prompted("mixtral", "prefix_tuning")
    _prompt_matches_stock(copy.deepcopy(pm), [_with_positions(make_batch())], rows_keep_length=True)
    with pytest.raises(RuntimeError, match="must match"):
        copy.deepcopy(pm)(**make_batch())
    engine = StreamingEngine(pm, compute_dtype=torch.float32).train()
    with pytest.raises(MegaTrainError, match="output_router_logits and an attention mask"):
        engine.forward_backward(make_batch())


@pytest.mark.parametrize("model_type, why", [
    ("gemma4_text", "PEFT builds its prefix cache another way"),  # keys and values of two widths, cut per layer
    ("deepseek_v3", "its keys and values are not 4 heads of 8"),  # MLA: keys and values of their own widths
    ("qwen3_next", "not all its layers are attention layers"),  # linear attention
    ("gemma3n_text", "some of its layers read keys and values or inputs that other units make"),
])
def test_prefix_tuning_refusals(model_type, why):
    """Families whose layers do not take PEFT's prefix as the engine hands it are refused in one line, with what
    works instead, when the engine is built."""
    from peft import get_peft_model

    from tests.support.zoo import stock_model, tiny_config

    model = get_peft_model(stock_model(tiny_config(model_type)),
                           PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(MegaTrainError, match=f"prefix tuning on {model_type}: {why}.*LoRA work"):
        StreamingEngine(model, compute_dtype=torch.float32)


def test_prefix_tuning_under_gradient_checkpointing(tmp_path):
    """gradient_checkpointing=True (TRL's default): stock fails (a checkpointed layer drops the cache, so the mask no
    longer fits its keys); the engine, whose recompute is its own, trains with stock's numbers without it."""
    train = rows(8, 0)
    kw = dict(KW, max_steps=2)
    with pytest.raises(RuntimeError, match="must match"):
        Trainer(model=make_prompted("llama", "prefix_tuning"), train_dataset=train, data_collator=default_data_collator,
                args=TrainingArguments(output_dir=str(tmp_path / "c"), gradient_checkpointing=True, **kw)).train()
    stock = Trainer(model=make_prompted("llama", "prefix_tuning"), train_dataset=train,
                    args=TrainingArguments(output_dir=str(tmp_path / "s"), **kw), data_collator=default_data_collator)
    stock.train()
    mega = MegaTrainTrainer(make_prompted("llama", "prefix_tuning"), train_dataset=train,
                            args=MegaTrainArguments(output_dir=str(tmp_path / "m"), gradient_checkpointing=True, **kw),
                            data_collator=default_data_collator)
    mega.train()
    a = [h["loss"] for h in stock.state.log_history if "loss" in h]
    b = [h["loss"] for h in mega.state.log_history if "loss" in h]
    assert len(a) == len(b) == 2 and all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)


def test_prefix_tuning_trainer_matches_stock_and_saves(tmp_path):
    """MegaTrainTrainer with prefix tuning (an MLP encoder) equals stock Trainer over four steps of two accumulated
    micro-batches with clipping: losses, grad norms, the encoder's weights; the adapter PEFT's save writes loads
    back with PeftModel.from_pretrained and gives the trained model's logits."""
    ref, mega = _beside_stock(make_prompted("llama", "prefix_tuning_mlp"), tmp_path)
    masters = dict(mega.engine.named_master_params())
    trained = {n: p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    assert sorted(masters) == sorted(trained)
    for n, t in trained.items():
        torch.testing.assert_close(masters[n], t, atol=1e-5, rtol=1e-5, msg=n)
    mega.save_model(str(tmp_path / "adapter"))
    back = PeftModel.from_pretrained(make_model("llama"), str(tmp_path / "adapter")).eval()
    batch = make_batch()
    with torch.no_grad():
        torch.testing.assert_close(back(**batch).logits, ref.eval()(**batch).logits, atol=1e-5, rtol=1e-5)


def test_prompt_tuning_of_per_layer_embeddings_is_refused():
    """Gemma 3n makes its per-layer embeddings from the token ids, which PeftModel.forward does not pass: refused
    rather than made from the placeholders."""
    from peft import PromptTuningConfig

    from tests.support.zoo import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("gemma3n_text"), dtype=torch.float32)
    model = get_peft_model(model, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(MegaTrainError, match="per-layer embeddings are made from the token ids"):
        StreamingEngine(model, compute_dtype=torch.float32)


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_lora_on_moe_expert_parameters_gradients_match_stock_peft(kind):
    """LoRA on the fused expert tensors (target_parameters): PEFT parametrizes them during the forward,
    which `set_`s the wrapped weight; the recompute's other weights (the router's) must not look
    modified. Router aux loss on, one padded row."""
    pm = lora(kind, target_modules=[], target_parameters=EXPERTS)
    ref = copy.deepcopy(pm)
    batch = make_batch()
    nib = batch["labels"][..., 1:].ne(-100).sum()
    out = ref(**batch, num_items_in_batch=nib)
    out.loss.backward()
    engine = StreamingEngine(pm, compute_dtype=torch.float32).train()
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert float(loss) == pytest.approx(float(out.loss), abs=1e-6)
    grads = dict(engine.named_grads())
    expected = {n.removeprefix(PREFIX): p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert list(grads) == list(expected) and all(".experts." in n and "lora_" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def test_frozen_base_has_no_master_grad_or_moments():
    pm = lora()
    engine = StreamingEngine(pm, compute_dtype=torch.bfloat16)
    opt = HostAdamW(engine)
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    total = sum(p.numel() for p in pm.parameters())
    assert sum(m.numel() for m in engine.store.master) == trainable
    assert sum(m.numel() for m in opt.exp_avg) == trainable
    assert sum(c.numel() for c in engine.store.compute) == total  # the base streams, 2 bytes/param



KW = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5, warmup_steps=1,
          learning_rate=1e-2, weight_decay=0.1, logging_steps=1, save_strategy="no", report_to=[], seed=0,
          use_cpu=True, max_steps=4, dataloader_num_workers=0, disable_tqdm=True)


def _beside_stock(pm, tmp_path):
    """Stock Trainer on a copy of `pm` and MegaTrainTrainer on `pm`, KW's four steps each: the same losses and grad
    norms. Returns (stock's model, the engine's trainer)."""
    train = rows(16, 0)
    ref = copy.deepcopy(pm)
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "s"), **KW), train_dataset=train,
                    data_collator=default_data_collator)
    stock.train()
    mega = MegaTrainTrainer(pm, MegaTrainArguments(output_dir=str(tmp_path / "m"), **KW), train_dataset=train,
                            data_collator=default_data_collator)
    mega.train()
    a = [(h["loss"], h["grad_norm"]) for h in stock.state.log_history if "loss" in h]
    b = [(h["loss"], h["grad_norm"]) for h in mega.state.log_history if "loss" in h]
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x[0] - y[0]) < 1e-5 and abs(x[1] - y[1]) < 1e-5 * max(1, x[1]), (x, y)
    return ref, mega


def test_lora_trainer_matches_stock_and_saves(tmp_path):
    ref, mega = _beside_stock(lora(), tmp_path)
    trained = {n.removeprefix(PREFIX): p.detach() for n, p in ref.named_parameters() if p.requires_grad}
    masters = dict(mega.engine.named_master_params())
    for n, t in trained.items():
        torch.testing.assert_close(masters[n], t, atol=1e-5, rtol=1e-5, msg=n)

    # the adapter, as PEFT writes it
    mega.save_model(str(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(make_model("llama_tied"), str(tmp_path / "adapter"))
    for n, p in reloaded.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p.detach(), masters[n.removeprefix(PREFIX)], atol=0, rtol=0, msg=n)

    # the merged export equals stock merge_and_unload of the same adapters
    mega.save_merged(str(tmp_path / "merged"), dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    expect = reloaded.merge_and_unload()
    for (n, p), (n2, q) in zip(merged.named_parameters(), expect.named_parameters()):
        assert n == n2
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)


def test_peft_config_argument_is_one_flag(tmp_path):
    train = rows(8, 0)
    args = MegaTrainArguments(output_dir=str(tmp_path), peft_config={"r": 2, "target_modules": ["q_proj"]},
                              **dict(KW, max_steps=2))
    trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=train, data_collator=default_data_collator)
    trainer.train()
    names = [n for n, _ in trainer.engine.named_master_params()]
    assert names and all("lora_" in n for n in names)


def test_peft_config_as_a_constructor_argument_as_trl_users_write_it(tmp_path):
    """MegaTrainTrainer(..., peft_config=LoraConfig(...)) trains the same adapters as args.peft_config."""
    from peft import LoraConfig

    train = rows(8, 0)
    lora = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    results = []
    for where in ("argument", "args"):
        args = MegaTrainArguments(output_dir=str(tmp_path / where), **dict(KW, max_steps=2),
                                  **({"peft_config": dict(lora)} if where == "args" else {}))
        extra = {"peft_config": LoraConfig(task_type="CAUSAL_LM", **lora)} if where == "argument" else {}
        trainer = MegaTrainTrainer(make_model("llama"), args, train_dataset=train,
                                   data_collator=default_data_collator, **extra)
        trainer.train()
        results.append(dict(trainer.engine.named_master_params()))
    assert results[0].keys() == results[1].keys() and all("lora_" in n for n in results[0])
    for name, t in results[0].items():
        assert torch.equal(t, results[1][name]), name
    with pytest.raises(MegaTrainError, match="peft_config was given twice"):
        MegaTrainTrainer(make_model("llama"), MegaTrainArguments(output_dir=str(tmp_path / "x"), peft_config=lora,
                                                                 **KW),
                         train_dataset=train, data_collator=default_data_collator, peft_config=dict(lora))
