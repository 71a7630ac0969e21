"""CUDA path: gradient parity, Trainer loss curve, memory stability, odd shapes, stream stress.

Run on a GPU machine: `python -m pytest -q -m gpu tests/gpu`. Skipped without CUDA.
Tolerances: fp32 compute (TF32 off) must match stock to 1e-5 relative; bf16 compute is
compared with an fp32 reference by relative L2 error per parameter (< 3e-2) and loss (< 1e-2).
"""

import copy
import random

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, default_data_collator

from hf_megatrain import HostAdamW, MegaTrainArguments, MegaTrainTrainer, StreamingEngine
from hf_megatrain.patcher.specs import spec_for
from tests.support.tiny import FAMILIES, make_batch, make_model, make_packed_batch, make_prompted

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def stock_grads(model, batch, nib=None):
    ref = copy.deepcopy(model).to(DEV)
    b = {k: v.to(DEV) for k, v in batch.items()}
    out = ref(**b, num_items_in_batch=nib.to(DEV) if nib is not None else None)
    out.loss.backward()
    # a parameter stock leaves without a gradient (DeepSeek-V3.2's detached indexer) is compared with zeros: the
    # engine's must be zero there
    return float(out.loss), {n: p.grad.float().cpu() if p.grad is not None else torch.zeros(p.shape)
                             for n, p in ref.named_parameters()}


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def assert_fp32_matches_stock(model, batch):
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref_loss, ref = stock_grads(model, batch, nib)
    engine = StreamingEngine(model, device=DEV, compute_dtype=torch.float32).train()
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert abs(float(loss) - ref_loss) < 1e-5
    for name, g in engine.named_grads():
        torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "mixtral"])
def test_fp32_gradients_match_stock_on_gpu(kind):
    assert_fp32_matches_stock(make_model(kind), make_batch(batch=3, seq=24))


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning_lstm", "prefix_tuning_mlp"])
@pytest.mark.parametrize("resident", [0, 2])
def test_prompt_learning_on_gpu(method, resident):
    """Prompt tuning, p-tuning and prefix tuning (the prompt encoder in the embedding unit, streamed or resident, an
    LSTM's cuDNN kernels among them; prefix tuning's keys and values handed to streamed and resident layers):
    fp32 gradients equal stock peft's on the GPU; bf16 within the bf16 tolerance."""
    model = make_prompted("llama_tied", method)
    batch = make_batch(batch=3, seq=24)
    ref_loss, ref = stock_grads(model, batch)
    _adapters_beside_stock(model, batch, resident, ref_loss, ref)


@pytest.mark.parametrize("method", ["LORA", "DORA", "IA3", "LOHA", "OFT", "VERA", "TRAINABLE_TOKENS"])
@pytest.mark.parametrize("resident", [0, 2])
def test_peft_methods_on_gpu(method, resident):
    """LoRA, DoRA and the other PEFT methods of patcher/adapters.EXACT_METHODS (their adapters in streamed and in
    resident layers, VeRA's shared projections as buffers, trainable tokens in the embedding): fp32 gradients equal
    stock peft's on the GPU; bf16 within the bf16 tolerance, or within twice stock's own error under bf16 autocast where
    that is larger (VeRA's scaling vectors sum many rounded products: about 3.5% stock, measured on the CPU)."""
    from peft import LoraConfig, get_peft_model

    from tests.integration.test_peft_methods import adapted

    if method in ("LORA", "DORA"):  # adapters drawn at random (B = 0 would leave A without a gradient)
        torch.manual_seed(0)
        model = get_peft_model(make_model("llama"), LoraConfig(
            task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
            use_dora=method == "DORA"))
    else:
        model = adapted("llama", method)
    batch = make_batch(batch=3, seq=24)
    ref_loss, ref = stock_grads(model, batch)
    ref = {n.removeprefix("base_model.model."): g for n, g in ref.items()}
    autocast = copy.deepcopy(model).to(DEV)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        autocast(**{k: v.to(DEV) for k, v in batch.items()}).loss.backward()
    bound = {n.removeprefix("base_model.model."): max(3e-2, 2 * rel_err(p.grad.float().cpu(), ref[n.removeprefix(
        "base_model.model.")])) for n, p in autocast.named_parameters() if p.requires_grad}
    _adapters_beside_stock(model, batch, resident, ref_loss, ref, bound)


def _adapters_beside_stock(model, batch, resident, ref_loss, ref, bound=None):
    """The PEFT model's trainable parameters (named as in the base model) on the engine, fp32 then bf16, against
    stock's fp32 loss and gradients `ref`: fp32 to 1e-5, bf16 within 3e-2 or `bound[name]`."""
    trained = sorted(n.removeprefix("base_model.model.") for n, p in model.named_parameters() if p.requires_grad)
    for dtype in (torch.float32, torch.bfloat16):
        engine = StreamingEngine(copy.deepcopy(model), device=DEV, compute_dtype=dtype, resident_layers=resident)
        loss = engine.train().forward_backward(batch)
        grads = dict(engine.named_grads())
        assert sorted(grads) == trained
        if dtype == torch.float32:
            assert abs(float(loss) - ref_loss) < 1e-5
            for name, g in grads.items():
                torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=name)
        else:
            assert abs(float(loss) - ref_loss) < 1e-2
            for name, g in grads.items():
                assert rel_err(g, ref[name]) < (bound or {}).get(name, 3e-2), name


def test_bf16_gradients_close_to_fp32_reference():
    model = make_model("llama")
    batch = make_batch(batch=4, seq=64, pad_rows=1)
    ref_loss, ref = stock_grads(model, batch)
    engine = StreamingEngine(model, device=DEV, compute_dtype=torch.bfloat16).train()
    loss = engine.forward_backward(batch)
    assert abs(float(loss) - ref_loss) < 1e-2
    for name, g in engine.named_grads():
        assert rel_err(g, ref[name]) < 3e-2, name


# olmoe: in bf16 its router gradients stray further from the fp32 reference than stock's (measured on the
# H200, 2026-12-04, three runs: layer 0 router 6.6% against stock's 1.7%); fp32 is exact. The cause is not
# found yet (issue 18); strict, so a fix shows here. (PhiMoE strayed too, in fp32 as well, before the
# comparisons were seeded: it routes by sampling.)
_BF16_OPEN = {"olmoe"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_fp32_on_gpu(family):
    """Each family beyond the first six, fp32 on the GPU: equal to stock (the loss to 1e-5 relative:
    gpt-oss's experts add with index_add_, whose CUDA order is not fixed)."""
    model = make_model(family)  # sdpa, or eager where stock refuses sdpa
    batch = make_batch(batch=3, seq=24)
    nib = batch["labels"][..., 1:].ne(-100).sum()
    torch.manual_seed(1234)  # PhiMoE routes by sampling in training: both draw the same numbers
    ref_loss, ref = stock_grads(model, batch, nib)
    engine = StreamingEngine(model, device=DEV, compute_dtype=torch.float32).train()
    torch.manual_seed(1234)
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    for name, g in engine.named_grads():
        torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason="bf16 router "
                                                 "gradient, issue 18")) if f in _BF16_OPEN else f for f in FAMILIES])
def test_families_bf16_on_gpu(family):
    """bf16 parity: measured against the fp32 reference, the engine's bf16 compute is as close as stock
    with bf16 parameters is (its error at most twice stock's plus 1e-2, loss and every gradient). A fixed
    bound would measure bf16 itself. The MoE routers are made decisive (weights x 20): a tiny random
    router has near-ties that bf16 rounding flips token by token, differently in any two runs, and one
    flipped token moves an expert's gradient more than bf16 does. Rows without padding: a padded query
    whose sliding window holds only padding attends to nothing, which SDPA's bf16 kernels turn into NaN
    in stock and engine alike."""
    assert_bf16_as_close_as_stock(make_model(family))  # sdpa, or eager where stock refuses sdpa


# Where x20 still leaves near-ties: GraniteMoE-SWA's tiny router flips one token of 256 at x20 in stock and engine
# alike, not the same one (unscaled, three in the engine's last layer and none in stock's: the router gradient 8x
# off where stock's is not); at x200 none flips. (LongCat-Flash's zero-compute experts fail at x200: not for all.)
DECISIVE = {"granitemoe_swa": 200}


def assert_bf16_as_close_as_stock(model):
    """The engine's bf16 loss and gradients are at most twice as far from the fp32 reference as stock's
    with bf16 parameters, plus 1e-2; the model's MoE routers are made decisive first (weights x 20)."""
    # A spec that names no router (one without a router loss to capture: GraniteMoE-SWA, Granite-4 hybrid,
    # LongCat-Flash): the modules named router
    routers = spec_for(model.config).router_paths or ("router",)
    scale = DECISIVE.get(model.config.model_type, 20)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(f".{r}." in name for r in routers):
                p.mul_(scale)
    batch = make_batch(batch=4, seq=64, pad_rows=0)
    torch.manual_seed(1234)
    ref_loss, ref = stock_grads(model, batch)
    torch.manual_seed(1234)
    stock_loss, stock = stock_grads(copy.deepcopy(model).to(torch.bfloat16), batch)
    engine = StreamingEngine(model, device=DEV, compute_dtype=torch.bfloat16).train()
    torch.manual_seed(1234)
    loss = engine.forward_backward(batch)
    assert abs(float(loss) - ref_loss) <= 2 * abs(stock_loss - ref_loss) + 1e-2
    for name, g in engine.named_grads():
        assert rel_err(g, ref[name]) <= 2 * rel_err(stock[name], ref[name]) + 1e-2, name


def test_odd_shapes_match_stock():
    """Batch 1, a length that is not a multiple of 8, and a row that is all padding."""
    for batch in (make_batch(batch=1, seq=37, pad_rows=0), make_batch(batch=3, seq=13, pad_rows=1)):
        if batch["input_ids"].shape[0] == 3:
            batch["attention_mask"][1] = 0
            batch["input_ids"][1] = 0
            batch["labels"][1] = -100
        assert_fp32_matches_stock(make_model("mistral"), batch)


def _train_masters(chaos_seed, steps=20, ga=2):
    """Tiny deep model, depth-2 ring, GA and clipping, optionally with random stream delays."""
    model = make_model("llama", num_hidden_layers=12, seed=3)
    engine = StreamingEngine(model, device=DEV, compute_dtype=torch.float32, prefetch_depth=2).train()
    if chaos_seed is not None:
        engine.pipeline.chaos = random.Random(chaos_seed)
    opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        for micro in range(ga):
            engine.forward_backward(make_batch(seed=100 * step + micro), scale=1.0 / ga)
        opt.clip_grad_norm_(0.1)
        opt.step()
        engine.zero_grad()
    return dict(engine.named_master_params()), model


def test_stream_ordering_under_random_delays():
    calm, model = _train_masters(None)
    shaken, _ = _train_masters(1234)
    for name in calm:
        assert torch.equal(calm[name], shaken[name]), name
    # and the GPU pipeline agrees with the synchronous CPU path
    cpu_model = make_model("llama", num_hidden_layers=12, seed=3)
    engine = StreamingEngine(cpu_model, compute_dtype=torch.float32).train()
    opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
    for step in range(20):
        for micro in range(2):
            engine.forward_backward(make_batch(seed=100 * step + micro), scale=0.5)
        opt.clip_grad_norm_(0.1)
        opt.step()
        engine.zero_grad()
    for name, t in engine.named_master_params():
        torch.testing.assert_close(calm[name], t, atol=1e-4, rtol=1e-3, msg=name)


def _lm_rows(n, seq, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    # a learnable stream: noisy repeats of short patterns
    base = torch.randint(3, vocab, (n, 8), generator=g).repeat(1, seq // 8 + 1)[:, :seq]
    return datasets.Dataset.from_dict({"input_ids": base.tolist(), "labels": base.tolist()})


def _100m_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def test_trainer_loss_curve_matches_stock_bf16(tmp_path):
    train = _lm_rows(30 * 8, 256, 32000, 0)
    kw = dict(per_device_train_batch_size=8, max_steps=30, learning_rate=1e-3, warmup_steps=5, max_grad_norm=1.0,
              logging_steps=1, save_strategy="no", report_to=[], bf16=True, seed=0, disable_tqdm=True)
    model = _100m_model()
    ref = copy.deepcopy(model)
    stock = Trainer(model=ref, args=TrainingArguments(output_dir=str(tmp_path / "s"), **kw),
                    train_dataset=train, data_collator=default_data_collator)
    stock.train()
    mega = MegaTrainTrainer(model, MegaTrainArguments(output_dir=str(tmp_path / "m"), log_pipeline=True, **kw),
                            train_dataset=train, data_collator=default_data_collator)
    mega.train()
    a = [h["loss"] for h in stock.state.log_history if "loss" in h]
    b = [h["loss"] for h in mega.state.log_history if "loss" in h]
    assert len(a) == len(b) == 30
    assert b[-1] < b[0], "it learns"
    for x, y in zip(a, b):
        assert abs(x - y) < 0.05 * max(1.0, abs(x)), (x, y)
    # the step-time model: predicted at the start, and every log says how far the run is from it
    assert mega.step_time is not None and mega.step_time.step_s > 0 and mega.step_time.bound
    ratios = [h["pipe_vs_model"] for h in mega.state.log_history if "pipe_vs_model" in h]
    assert len(ratios) == len(b) and all(r > 0 for r in ratios)


def test_gpu_memory_is_stable_over_50_steps():
    model = make_model("llama", num_hidden_layers=6)
    engine = StreamingEngine(model, device=DEV, compute_dtype=torch.bfloat16).train()
    opt = HostAdamW(engine, lr=1e-3)
    seen = []
    for step in range(50):
        engine.forward_backward(make_batch(batch=4, seq=64, seed=step))
        opt.clip_grad_norm_(1.0)
        opt.step()
        engine.zero_grad()
        torch.cuda.synchronize()
        if step in (10, 49):
            seen.append(torch.cuda.memory_allocated())
    assert seen[1] <= seen[0] + (1 << 20), seen


def test_stepping_during_backward_is_exact():
    """Without clipping, stepping each unit as its gradient lands equals stepping after backward."""

    def run(eager):
        model = make_model("llama_tied", num_hidden_layers=6, seed=3)
        engine = StreamingEngine(model, device=DEV, compute_dtype=torch.float32).train()
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
        for step in range(5):
            for micro in range(2):
                if eager and micro == 1:
                    assert opt.step_during_backward()
                engine.forward_backward(make_batch(seed=10 * step + micro), scale=0.5)
            opt.step()
            engine.zero_grad()
        return dict(engine.named_master_params())

    plain, eager = run(False), run(True)
    for name in plain:
        assert torch.equal(plain[name], eager[name]), name


def test_residency_matches_streaming_on_gpu():
    """Resident units step with the GPU's fused AdamW, streamed ones with the host's: same math.
    With gradient accumulation, and an embedding larger than a layer: its later contributions
    cross PCIe through staging slabs sized for it (layout.slab_numel)."""

    def run(resident):
        model = make_model("llama_tied", num_hidden_layers=4, seed=5, vocab_size=4096)
        engine = StreamingEngine(model, device=DEV, compute_dtype=torch.float32, resident_layers=resident).train()
        embed = engine.units[0]
        assert embed.numel > max(u.numel for u in engine.units if u.kind == "layer")
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
        for step in range(4):
            for micro in range(2):
                engine.forward_backward(make_batch(seed=10 * step + micro), scale=0.5)
            opt.clip_grad_norm_(0.5)
            opt.step()
            engine.zero_grad()
        return dict(engine.named_master_params())

    base = run(0)
    for resident in (2, 4):
        got = run(resident)
        for name in base:
            torch.testing.assert_close(got[name], base[name], atol=1e-6, rtol=1e-5, msg=f"{resident} {name}")


@pytest.mark.parametrize("clip", [1e-2, 0.0])
def test_lean_residency_is_bit_identical_on_gpu(clip):
    """Lean resident layers (their fp32 master cast into a ring slot on the H2D stream for each use,
    with random GPU sleeps on the copy streams) equal resident layers with a bf16 copy, bit for
    bit, with gradient accumulation, with clipping and with steps taken during the backward."""

    def run(resident, lean):
        model = make_model("mixtral", num_hidden_layers=4, seed=8)
        engine = StreamingEngine(model, device=DEV, compute_dtype=torch.bfloat16, resident_layers=resident,
                                 lean_resident=lean).train()
        engine.pipeline.chaos = random.Random(3)
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
        losses = []
        for step in range(4):
            for micro in range(2):
                if not clip and micro == 1:
                    assert opt.step_during_backward()
                losses.append(float(engine.forward_backward(make_batch(seed=10 * step + micro), scale=0.5)))
            if clip:
                losses.append(float(opt.clip_grad_norm_(clip)))
            opt.step()
            engine.zero_grad()
        assert engine.engine_config.lean_resident == lean
        return losses, dict(engine.named_master_params())

    for resident in (2, 4):
        ref_losses, ref = run(resident, False)
        losses, got = run(resident, True)
        assert losses == ref_losses, resident
        for name in ref:
            assert torch.equal(got[name], ref[name]), (resident, name)


@pytest.mark.parametrize("modes,clip", [(dict(lean_streamed=True), 1e-2), (dict(lean_streamed=True), 0.0),
                                        (dict(lean_streamed=True, transient_grads=True), 0.0),
                                        (dict(lean_streamed=True, transient_grads=True, lean_resident=True), 0.0),
                                        (dict(gpu_grad_layers=1), 1e-2), (dict(lean_streamed=True, gpu_grad_layers=2), 1e-2),
                                        (dict(gpu_grad_layers=2), 0.0)])
def test_host_memory_modes_are_bit_identical_on_gpu(modes, clip):
    """lean_streamed (the pinned fp32 master crosses PCIe and is cast into the ring slot on the H2D
    stream) and transient_grads (each gradient in one of three shared pinned buffers, stepped during
    the backward; the resident layers then share one device buffer, each stepped on the compute stream
    right after its backward), and gpu_grad_layers (the last streamed layers' gradients kept on the GPU,
    clipped there and brought over tile by tile for their host steps; with clipping, the gradients
    after the step too): with random GPU sleeps on the copy streams, beside two resident layers, with
    micro-batches together, with clipping and with steps during the backward, equal to the default
    bit for bit, losses, gradient norms and masters."""

    def run(**fields):
        model = make_model("mixtral", num_hidden_layers=4, seed=8)
        engine = StreamingEngine(model, device=DEV, compute_dtype=torch.bfloat16, resident_layers=2, **fields).train()
        engine.pipeline.chaos = random.Random(5)
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
        record = []
        for step in range(4):
            batches = [make_batch(seed=10 * step + m) for m in range(2)]
            if not clip:
                assert opt.step_during_backward()
            record += [float(x) for x in engine.forward_backward_many(batches, None, 0.5)]
            if clip:
                record.append(float(opt.clip_grad_norm_(clip)))
            opt.step()
            if not clip:
                record.append(float(engine.grad_norm()))
            engine.zero_grad()
        lean = bool(fields.get("lean_streamed"))
        assert engine.engine_config.lean_streamed == lean and engine.store.transient == bool(fields.get("transient_grads"))
        assert [engine.store.compute[u.index] is None for u in engine.units if u.kind == "layer"] == \
            [bool(fields.get("lean_resident"))] * 2 + [lean, lean]
        if fields.get("transient_grads"):  # the two resident layers stepped from one shared device buffer
            assert engine.store.grad[1].data_ptr() == engine.store.grad[2].data_ptr()
        on_gpu = [u.layer for u in engine.units if engine.store.grad[u.index] is not None and not u.resident
                  and engine.store.grad[u.index].is_cuda]
        assert on_gpu == [3, 2][: fields.get("gpu_grad_layers", 0)][::-1]  # the last streamed layers
        assert all(s is None for s in engine.pipeline.slabs)  # one contribution per step: no slab allocated
        return record, dict(engine.named_master_params(), **{"grad:" + k: v for k, v in engine.named_grads()}
                            if clip else {})

    ref_record, ref = run()
    record, got = run(**modes)
    assert record == ref_record
    for name in ref:
        assert torch.equal(got[name], ref[name]), name



@pytest.mark.parametrize("clip,modes", [(0.0, {}), (1e-2, {}), (1e-2, dict(lean_streamed=True, transient_grads=True))])
def test_train_step_is_the_plain_loop_on_gpu(clip, modes):
    """hf_megatrain.train_step (engine/step.py's policy: the host AdamW during the backward without clipping,
    after a norm pass with transient_grads and clipping, else after the backward) on the CUDA path gives the
    losses and weights of the plain loop (forward_backward_many, clip_grad_norm_, step): bit for bit where
    nothing but the time of the step moves, to the kernels' determinism where a norm pass runs first."""
    from types import SimpleNamespace

    from hf_megatrain import train_step

    def run(policy):
        engine = StreamingEngine(make_model("llama", num_hidden_layers=4, seed=8), device=DEV,
                                 compute_dtype=torch.bfloat16, **(modes if policy else {})).train()
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
        losses = []
        for step in range(3):
            batches = [make_batch(seed=10 * step + m) for m in range(2)]
            if policy:
                out = train_step(engine, opt, batches, max_grad_norm=clip, plan=SimpleNamespace(split=1, per_pass=2))
                losses.append(float(out.loss))
            else:
                items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
                step_losses = engine.forward_backward_many(batches, items)
                losses.append(float(torch.stack([x.float().cpu() for x in step_losses]).sum()))
                if clip:
                    opt.clip_grad_norm_(clip)
                opt.step()
            engine.zero_grad()
        return losses, dict(engine.named_master_params())

    ref_losses, ref = run(False)
    losses, got = run(True)
    exact = not modes
    assert losses == (ref_losses if exact else pytest.approx(ref_losses, rel=1e-5))
    for name in ref:
        if exact:
            assert torch.equal(got[name], ref[name]), name
        else:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_transient_grads_clip_after_a_norm_pass_on_gpu():
    """transient_grads with clipping on the GPU: each step's norm pass (a forward and backward whose
    gradients only leave their norms, the ring's gradient slots freed without a copy) gives the norm
    clip_grad_norm_ takes on the default path; then every unit is stepped, clipped by it, as its
    gradient lands: the streamed ones from the shared pinned buffers on the host, the two resident
    layers from the shared device buffer on the compute stream, with random GPU sleeps on the copy
    streams. The two passes' gradients are equal as far as the GPU's kernels are deterministic, so
    the comparison with the default path allows the last digits."""

    def run(**fields):
        engine = StreamingEngine(make_model("llama", num_hidden_layers=4, seed=8), device=DEV,
                                 compute_dtype=torch.bfloat16, resident_layers=2, **fields).train()
        engine.pipeline.chaos = random.Random(5)
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
        losses, norms = [], []
        for step in range(4):
            batches = [make_batch(seed=10 * step + m) for m in range(2)]
            if engine.store.transient:
                norm = engine.gradient_norm(batches, None, 0.5)
                assert opt.step_during_backward(clip_norm=(norm, 1e-2))
            losses += [float(x) for x in engine.forward_backward_many(batches, None, 0.5)]
            norms.append(float(norm) if engine.store.transient else float(opt.clip_grad_norm_(1e-2)))
            opt.step()
            engine.zero_grad()
        return engine, losses, norms, dict(engine.named_master_params())

    _, ref_losses, ref_norms, ref = run()
    engine, losses, norms, got = run(lean_streamed=True, transient_grads=True)
    assert engine.store.transient and engine.store._device_grad is not None
    assert min(norms) > 1e-2  # the clipping was active at every step
    assert losses == pytest.approx(ref_losses, rel=1e-5) and norms == pytest.approx(ref_norms, rel=1e-5)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_gradients_kept_on_the_gpu_one_micro_batch_at_a_time(monkeypatch):
    """gpu_grad_layers with micro-batches one at a time: the later contributions are added on the GPU
    (the default adds them on the host, from a pinned slab allocated at its first use). The first step's
    gradients are equal bit for bit (the same fp32 additions; named_grads gives copies, so the first
    step's are still the first step's after two more steps); the clipping norm is taken on the GPU
    from the summed gradient, as for a resident layer, so it can differ from the host's in the last
    digits, and so can everything after the first clipped step. Landing tiles smaller than a layer, so
    that a layer crosses in several tiles."""
    import hf_megatrain.engine.optimizer as optimizer

    monkeypatch.setattr(optimizer, "LANDING_TILE", 1 << 12)

    def run(**fields):
        engine = StreamingEngine(make_model("llama", num_hidden_layers=4, seed=8), device=DEV,
                                 compute_dtype=torch.bfloat16, **fields).train()
        engine.pipeline.chaos = random.Random(5)
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
        norms = []
        for step in range(3):
            for m in range(2):
                engine.forward_backward(make_batch(seed=10 * step + m), None, 0.5)
            if step == 0:  # before any update: the same weights
                grads = dict(engine.named_grads())
            norms.append(float(opt.clip_grad_norm_(1e-2)))
            opt.step()
            engine.zero_grad()
        return engine, grads, norms, dict(engine.named_master_params())

    ref_engine, ref_grads, ref_norms, ref = run()
    # later contributions: a slab allocated at its first use (a second one only while the first is busy)
    assert any(s is not None for s in ref_engine.pipeline.slabs)
    engine, grads, norms, got = run(gpu_grad_layers=3)
    assert engine.store.units[2].grad_on_gpu and not engine.store.units[1].grad_on_gpu
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    assert norms == pytest.approx(ref_norms, rel=1e-5) and min(norms) > 1e-2  # clipped at every step
    for name, t in ref.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_micro_batches_together_are_bit_identical_on_gpu():
    """A step's micro-batches through each layer together (forward_backward_many: the gradient summed
    in the ring slot from a scratch buffer, sent to the host once) equal one at a time, bit for bit:
    bf16 compute, a tied embedding larger than a layer, resident and streamed layers, offloaded
    layer inputs, random GPU sleeps on the copy streams. Gradients of one step, and masters over
    steps taken during the backward (no clipping). The clipping norms differ in their last digits:
    together, a streamed unit's norm is taken on the GPU from its summed gradient (as stock takes it);
    one at a time, the host takes it from its accumulator, whose fp32 sums run longer (checked
    against the norm in float64)."""

    def batches(step):
        return [make_batch(batch=2 + m % 2, seq=10 + 2 * m, seed=10 * step + m, pad_rows=m % 2) for m in range(3)]

    def engine_for(resident):
        model = make_model("llama_tied", num_hidden_layers=4, seed=8, vocab_size=4096)
        engine = StreamingEngine(model, device=DEV, compute_dtype=torch.bfloat16, resident_layers=resident,
                                 offload_activations=1).train()
        engine.pipeline.chaos = random.Random(5)
        return engine

    def backward(engine, together, step, opt=None):
        """opt: arm it to step each unit as its gradient is final (before the last backward of the step)."""
        if together:
            assert opt is None or opt.step_during_backward()
            return [float(x) for x in engine.forward_backward_many(batches(step), None, 1 / 3)]
        losses = []
        for m, b in enumerate(batches(step)):
            assert opt is None or m < 2 or opt.step_during_backward()
            losses.append(float(engine.forward_backward(b, None, 1 / 3)))
        return losses

    def run(together, resident):
        engine = engine_for(resident)
        opt = HostAdamW(engine, lr=1e-3, weight_decay=0.1)
        record = []
        for step in range(4):
            record += backward(engine, together, step, opt)  # no clipping: steps during the backward
            opt.step()
            engine.zero_grad()
        return record, dict(engine.named_master_params())

    for resident in (0, 2):
        one, many = engine_for(resident), engine_for(resident)
        assert backward(one, False, 0) == backward(many, True, 0)
        grads = dict(one.named_grads())
        for name, g in many.named_grads():
            assert torch.equal(g, grads[name]), (resident, name)
        exact = torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for _, g in many.named_grads()]))
        assert float(many.grad_norm()) == pytest.approx(float(exact), rel=2e-6)  # the GPU's fp32 sums
        assert float(one.grad_norm()) == pytest.approx(float(exact), rel=1e-4)  # the host's, in longer runs
        ref_record, ref = run(False, resident)
        record, got = run(True, resident)
        assert record == ref_record, resident
        for name in ref:
            assert torch.equal(got[name], ref[name]), (resident, name)


def test_activation_offload_is_exact_on_gpu():
    """Layer inputs offloaded to pinned host memory and brought back on their own streams (with
    random GPU sleeps on the compute stream to shake the ordering): bit-identical gradients."""
    batch = make_batch(batch=4, seq=64, pad_rows=1)
    results = []
    for offload in (0, 2, 4):
        model = make_model("llama", num_hidden_layers=4, seed=3)
        engine = StreamingEngine(model, device=DEV, compute_dtype=torch.bfloat16, mlp_tile_tokens=48,
                                 offload_activations=offload).train()
        for _ in range(3):
            engine.zero_grad()
            torch.cuda._sleep(2_000_000)  # the D2H copies must wait for the forward, not race it
            loss = engine.forward_backward(batch)
        results.append((float(loss), dict(engine.named_grads())))
    (ref_loss, ref), *others = results
    for loss, grads in others:
        assert loss == ref_loss
        for name, g in ref.items():
            assert torch.equal(grads[name], g), name


def test_long_packed_rows_by_document_match_stock_on_gpu(monkeypatch):
    """Packed, right-padded rows past the dense-mask limit run attention document by document
    (SDPA on CUDA, fp32): loss and gradients equal stock HF on each document alone."""
    from hf_megatrain.engine import inputs

    monkeypatch.setattr(inputs, "_DENSE_MASK_LIMIT", 32 * 32)
    model = make_model("llama")
    ref = copy.deepcopy(model).to(DEV)
    batch, docs = make_packed_batch()
    nib = batch["labels"][..., 1:].ne(-100).sum()
    ref_loss = 0.0
    for r, spans in enumerate(docs):
        for s, e in spans:
            out = ref(input_ids=batch["input_ids"][r:r + 1, s:e].to(DEV),
                      labels=batch["labels"][r:r + 1, s:e].to(DEV), num_items_in_batch=nib.to(DEV))
            out.loss.backward()
            ref_loss += float(out.loss)
    engine = StreamingEngine(model, device=DEV, compute_dtype=torch.float32).train()
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert abs(float(loss) - ref_loss) < 1e-5
    grads = dict(engine.named_grads())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad.float().cpu(), atol=1e-6, rtol=1e-5, msg=name)


# Hybrid stacks through the generic spec (issue 35): linear attention / gated delta nets, Mamba and Mamba-2 mixers,
# short convolutions, beside attention or alone. On the CPU their mixers run transformers' torch paths; here, where
# causal-conv1d, mamba-ssm or fla (flash-linear-attention) are installed, stock and the engine call the same kernels
# (transformers picks them per call), so these tests check the engine's layer calls on the CUDA path: fp32 equal to
# stock within fp32 tolerance, bf16 as close to the fp32 reference as stock's own bf16.
HYBRID_GPU = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "minimax", "jamba",
              "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "lfm2", "lfm2_moe", "mamba", "mamba2",
              "falcon_mamba", "gptj", "codegen",
              # DeepSeek-V3.2's sparse attention (MLA with a top-k indexer), AXK2 on it
              "deepseek_v32", "axk2",
              # Inkling's short convs, embedding norm and µP head
              "inkling_text",
              # NanoChat's weightless final norm, applied to the embeddings too
              "nanochat",
              # absolute positions at the embedding (learned tables, OPT's projections, XGLM's and CTRL's sinusoids),
              # BLOOM's ALiBi and embedding norm
              "xglm", "ctrl", "gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt", "bloom",
              # layer lists shorter than num_hidden_layers: LongCat-Flash's two sublayers a layer, shortcut MoE
              "longcat_flash",
              # Gemma 3n and Gemma 4 text (registered specs): the per-layer unit streamed like the embedding, KV
              # sharing across the last 2 of 5 layers, Gemma 4's per-layer head_dim, Gemma 3n's AltUp stack
              "gemma3n_text", "gemma4_text", "gemma4_unified_text",
              # a rotary base per layer (NoPE where 0), from a list of rotary modules beside the layers
              "granitemoe_swa", "granite_swa",
              # GLM-5's indexer top-k carried from layer to layer (a shared layer reuses it)
              "glm_moe_dsa"]


def _hybrid_gpu_model(model_type):
    from transformers import AutoModelForCausalLM

    from tests.support.zoo import tiny_config

    cfg = tiny_config(model_type)
    if getattr(cfg, "output_router_logits", False) and model_type in ("granitemoehybrid", "granitemoe_swa"):
        cfg.output_router_logits = False  # stock's own router loss fails a training step (transformers 5.17)
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        try:
            return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).train()
        except ValueError as e:
            if "does not support an attention implementation" not in str(e):
                raise
    raise AssertionError("unreachable")


@pytest.mark.parametrize("model_type", HYBRID_GPU)
def test_hybrid_stacks_fp32_on_gpu(model_type):
    """fp32 on the GPU, one right-padded row: loss and every gradient equal stock's (to fp32 tolerance: the
    kernels' reductions may order their sums differently from one call to the next)."""
    model = _hybrid_gpu_model(model_type)
    batch = make_batch(batch=3, seq=24)
    nib = batch["labels"][..., 1:].ne(-100).sum()
    torch.manual_seed(1234)
    ref_loss, ref = stock_grads(model, batch, nib)
    engine = StreamingEngine(model, device=DEV, compute_dtype=torch.float32).train()
    torch.manual_seed(1234)
    loss = engine.forward_backward(batch, num_items_in_batch=nib)
    assert abs(float(loss) - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    for name, g in engine.named_grads():
        torch.testing.assert_close(g, ref[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("model_type", HYBRID_GPU)
def test_hybrid_stacks_bf16_on_gpu(model_type):
    """bf16 parity as test_families_bf16_on_gpu measures it: against the fp32 reference, the engine's bf16 compute
    is as close as stock with bf16 parameters (at most twice stock's error plus 1e-2), routers made decisive."""
    assert_bf16_as_close_as_stock(_hybrid_gpu_model(model_type))
