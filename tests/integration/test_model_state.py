"""What a user reads and saves of the model equals what stock Trainer / TRL gives (issues 32.1, 38.3).

`trainer.model` is the model the user passed, with its own Parameter objects: after `train()` they hold
the trained weights, in the precision stock's model holds them (the fp32 masters, whatever the compute
dtype), and anything built on them beforehand (an optimizer, an EMA, a dict of parameters) sees training.
Every save path writes the trained masters in the model's own dtype, whatever was called before it
(`trainer.model.save_pretrained()` rewrites `config.dtype`)."""

import copy
import logging
import os

import datasets
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

from hf_megatrain import HostAdamW, MegaTrainArguments, MegaTrainTrainer, StreamingEngine
from hf_megatrain.checkpoint.hf_format import model_dtype
from hf_megatrain.checkpoint.peft_export import model_writer
from tests.support.tiny import make_batch, make_model, make_rows as rows

PREFIX = "base_model.model."



KW = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5, warmup_steps=1,
          learning_rate=1e-2, weight_decay=0.1, logging_steps=1, save_strategy="no", report_to=[], seed=0,
          use_cpu=True, max_steps=4, dataloader_num_workers=0, disable_tqdm=True)


def stock_and_mega(model, tmp_path, **overrides):
    """Stock Trainer on a copy of `model`, and MegaTrainTrainer on `model` itself (fp32, CPU)."""
    train, kw = rows(16, 0), dict(KW, **overrides)
    ref = copy.deepcopy(model)
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "s"), **kw), train_dataset=train,
                    data_collator=default_data_collator)
    mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path / "m"), **kw), train_dataset=train,
                            data_collator=default_data_collator)
    return stock, mega


def assert_files_hold(folder, masters):
    """The model file in `folder` holds exactly `masters`, in fp32."""
    got = load_file(os.path.join(folder, "model.safetensors"))
    assert got.keys() <= masters.keys()
    for n, t in got.items():
        assert t.dtype == torch.float32, n
        assert torch.equal(t, masters[n]), n
    return got


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_the_users_parameters_are_the_ones_that_train(kind, tmp_path):
    """A reference to a parameter, a dict of them and an optimizer built on them before the trainer, all
    hold stock's trained values after train(), and are the very objects trainer.model names."""
    model = make_model(kind)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    held = dict(model.named_parameters())
    head = model.lm_head.weight
    before = torch.optim.SGD(model.parameters(), lr=0.0)  # e.g. an EMA or optimizer made beforehand
    stock, mega = stock_and_mega(model, tmp_path)
    assert mega.model is model and mega.model.dtype == stock.model.dtype == torch.float32
    stock.train()
    mega.train()
    trained = dict(stock.model.named_parameters())
    now = dict(mega.model.named_parameters())
    masters = dict(mega.engine.named_master_params())
    assert list(now) == list(held) == list(trained)
    for n, p in held.items():
        assert now[n] is p, n
        assert p.dtype == torch.float32 and p.device.type == "cpu"
        assert torch.equal(p.detach(), masters[n]), n  # the master itself, no rounding
        assert not torch.equal(p.detach(), start[n]), n
        torch.testing.assert_close(p.detach(), trained[n].detach(), atol=1e-5, rtol=1e-5, msg=n)
    assert all(q is held[n] for q, n in zip(before.param_groups[0]["params"], held, strict=True))
    assert (head is model.model.embed_tokens.weight) == (kind == "llama_tied")
    torch.testing.assert_close(head.detach(), stock.model.lm_head.weight.detach(), atol=1e-5, rtol=1e-5)

    # usable as stock's: the same logits and the same greedy generation as the stock-trained model
    batch = make_batch(2, 10, seed=3, pad_rows=0)
    mega.model.eval(), stock.model.eval()
    with torch.no_grad():
        ours = mega.model(input_ids=batch["input_ids"]).logits
        theirs = stock.model(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    prompt = batch["input_ids"][:1, :4]
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(mega.model.generate(prompt, **gen), stock.model.generate(prompt, **gen))


def test_saves_write_the_trained_masters_whatever_ran_before(tmp_path):
    """trainer.model.save_pretrained() then save_model(), and a save after something rewrote config.dtype
    (what save_pretrained of a lower-precision view does): each writes the fp32 masters, as stock writes
    its fp32 model."""
    stock, mega = stock_and_mega(make_model("llama"), tmp_path, max_steps=2)
    stock.train()
    mega.train()
    masters = dict(mega.engine.named_master_params())
    stock.model.save_pretrained(tmp_path / "stock")
    expect = load_file(tmp_path / "stock" / "model.safetensors")
    mega.model.save_pretrained(tmp_path / "d1")
    mega.save_model(str(tmp_path / "d2"))
    mega.model.config.dtype = "bfloat16"  # as model.save_pretrained() leaves it after a bf16 view
    mega.save_model(str(tmp_path / "d3"))
    mega.model.config.dtype = "float32"
    for d in ("d1", "d2", "d3"):
        got = assert_files_hold(tmp_path / d, masters)
        assert got.keys() == expect.keys()
        assert {t.dtype for t in got.values()} == {t.dtype for t in expect.values()}
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / d)  # dtype "auto": the config's
        assert loaded.dtype == torch.float32, d
        for n, p in loaded.named_parameters():
            assert torch.equal(p.detach(), masters[n]), (d, n)


def test_lora_adapters_of_the_users_peft_model_train(tmp_path):
    """A PEFT model passed in: its own adapter Parameter objects hold stock's trained adapters, and
    trainer.model.save_pretrained() writes the same adapter file as save_model()."""
    torch.manual_seed(0)
    pm = get_peft_model(make_model("llama_tied"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              lora_dropout=0.0, init_lora_weights=False))
    held = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    stock, mega = stock_and_mega(pm, tmp_path)
    stock.train()
    mega.train()
    assert mega.model is pm
    trained = dict(stock.model.named_parameters())
    now = dict(mega.model.named_parameters())
    masters = {PREFIX + n: t for n, t in mega.engine.named_master_params()}
    assert held.keys() == masters.keys()
    for n, p in held.items():
        assert now[n] is p and p.dtype == torch.float32
        assert torch.equal(p.detach(), masters[n]), n
        torch.testing.assert_close(p.detach(), trained[n].detach(), atol=1e-5, rtol=1e-5, msg=n)
    mega.model.save_pretrained(tmp_path / "d1")
    mega.save_model(str(tmp_path / "d2"))
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("d1", "d2"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_trl_bf16_shows_the_trained_fp32_weights_and_saves_them(tmp_path):
    """TRL's default bf16=True, on the CPU: stock loads fp32 and trains under autocast, so trainer.model is
    fp32 before and after and every tensor moves. The engine computes in bf16; trainer.model shows its
    fp32 masters the same way, and save_pretrained then save_model both write them."""
    pytest.importorskip("trl")
    from trl import SFTConfig, SFTTrainer

    from hf_megatrain.demo import build_tokenizer, make_words
    from hf_megatrain.sft import MegaTrainSFTTrainer

    folder = tmp_path / "model"
    model, tok = make_model("llama"), build_tokenizer()
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    words = make_words(40, seed=0)
    data = datasets.Dataset.from_dict({"prompt": [w + ">" for w in words], "completion": [w[::-1] for w in words]})
    kw = dict(bf16=True, use_cpu=True, max_steps=9, per_device_train_batch_size=4, learning_rate=2e-5,
              logging_steps=9, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0)
    seen, count = {}, len(list(model.parameters()))
    for name, cls in (("stock", SFTTrainer), ("mega", MegaTrainSFTTrainer)):
        trainer = cls(model=str(folder), args=SFTConfig(output_dir=str(tmp_path / name), **kw), train_dataset=data)
        held = dict(trainer.model.named_parameters())
        start = {n: p.detach().clone() for n, p in held.items()}
        dtype_before = trainer.model.dtype
        trainer.train()
        now = dict(trainer.model.named_parameters())
        assert all(now[n] is p for n, p in held.items()), name
        changed = {n for n, p in held.items() if not torch.equal(p.detach(), start[n])}
        seen[name] = (dtype_before, trainer.model.dtype, {p.dtype for p in held.values()}, changed)
        if name == "mega":
            assert trainer.engine.compute_dtype == torch.bfloat16  # what it trains with
            masters = dict(trainer.engine.named_master_params())
            assert all(torch.equal(p.detach(), masters[n]) for n, p in held.items())
            trainer.model.save_pretrained(tmp_path / "d1")
            trainer.save_model(str(tmp_path / "d2"))
            for d in ("d1", "d2"):
                assert_files_hold(tmp_path / d, masters)
                loaded = AutoModelForCausalLM.from_pretrained(tmp_path / d)
                assert loaded.dtype == torch.float32
                for n, p in loaded.named_parameters():
                    assert torch.equal(p.detach(), masters[n]), (d, n)
            # generate on the trained model object, as from the saved files
            ids = torch.tensor([tok(words[0] + ">")["input_ids"]])
            gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
            assert torch.equal(trainer.model.generate(ids, **gen), loaded.eval().generate(ids, **gen))
    assert seen["mega"] == seen["stock"]
    assert seen["stock"][:3] == (torch.float32, torch.float32, {torch.float32})
    assert len(seen["stock"][3]) == count  # every tensor moved


def test_data_parallel_shows_the_compute_copy_says_so_and_saves_the_masters(tmp_path, caplog):
    """Data parallel (one rank here): a rank holds a slice of each master, so the model's trainable
    parameters view the bf16 compute copy (the same objects still), one line says so and where the fp32
    weights are; a save after model.save_pretrained() (which sets config.dtype to bf16) writes the fp32
    masters in the model's own dtype."""
    import torch.distributed as dist

    from hf_megatrain.engine.distributed import Sharding

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = make_model("llama")
        held = dict(model.named_parameters())
        with caplog.at_level(logging.INFO, logger="hf_megatrain"):
            engine = StreamingEngine(model, compute_dtype=torch.bfloat16, sharding=Sharding()).train()
        said = [r.getMessage() for r in caplog.records if "compute copy" in r.getMessage()]
        assert len(said) == 1 and "bfloat16" in said[0] and "save_model()" in said[0]
        engine.writer = model_writer(model)
        opt = HostAdamW(engine, lr=1e-2)
        for step in range(2):
            engine.forward_backward(make_batch(seed=step))
            opt.step()
            engine.zero_grad()
        engine.synchronize()
        masters = dict(engine.named_master_params())
        for n, p in model.named_parameters():
            assert p is held[n] and p.dtype == torch.bfloat16
            assert torch.equal(p.detach(), masters[n].to(torch.bfloat16)), n  # the compute copy, current
        model.save_pretrained(tmp_path / "d1")
        assert model_dtype(model.config) == torch.bfloat16  # what transformers' save_pretrained leaves behind
        engine.save_pretrained(str(tmp_path / "d2"))
        assert_files_hold(tmp_path / "d2", masters)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("resident", ["99", "0"])
def test_gpu_model_shows_the_fp32_masters(resident, tmp_path):
    """On the GPU (bf16 compute, background host jobs): the user's parameters are the fp32 masters, on the
    GPU for resident units and on the host for streamed ones, equal to them after train() (which waits for
    the last host step), saved by both paths; a fully resident model generates on the GPU as the saved
    files do. Stock Trainer(bf16=True) shows fp32 parameters that all moved: so does the engine."""
    no_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        kw = dict(KW, use_cpu=False, bf16=True)
        model = make_model("llama")
        held = dict(model.named_parameters())
        start = {n: p.detach().clone() for n, p in held.items()}
        ref = copy.deepcopy(model)
        stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "s"), **kw),
                        train_dataset=rows(16, 0), data_collator=default_data_collator)
        stock.train()
        mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path / "m"), gpu_resident_layers=resident,
                                                          **kw),
                                train_dataset=rows(16, 0), data_collator=default_data_collator)
        mega.train()
        masters = {n: t for n, t in mega.engine.named_master_params()}
        all_resident = all(u.resident for u in mega.engine.units)
        assert all_resident == (resident == "99") and mega.engine.compute_dtype == torch.bfloat16
        now = dict(mega.model.named_parameters())
        for n, p in held.items():
            assert now[n] is p and p.dtype == torch.float32 == stock.model.get_parameter(n).dtype
            unit = next(u for u in mega.engine.units if any(s.name == n for s in u.slots))
            assert p.device.type == ("cuda" if unit.resident else "cpu"), n
            assert torch.equal(p.detach().cpu(), masters[n]), n
            assert not torch.equal(p.detach().cpu(), start[n]), n
        mega.model.save_pretrained(tmp_path / "d1")
        mega.save_model(str(tmp_path / "d2"))
        for d in ("d1", "d2"):
            assert_files_hold(tmp_path / d, masters)
        if all_resident:
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "d2").to("cuda").eval()
            prompt = make_batch(1, 6, seed=3, pad_rows=0)["input_ids"].cuda()
            gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
            mega.model.eval()
            assert torch.equal(mega.model.generate(prompt, **gen), loaded.generate(prompt, **gen))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = no_tf32
