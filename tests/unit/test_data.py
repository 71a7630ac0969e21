"""Data pipeline: file formats, chat / prompt-completion masking, packing isolation, padding (the SFT example runs
in tests/integration/test_examples.py)."""

import json

import datasets
import pytest
import torch

from hf_megatrain import MegaTrainError, StreamingEngine
from hf_megatrain.data import CausalCollator, count_real_tokens, detect_format, load_raw_dataset, tokenize_dataset
from hf_megatrain.demo import build_tokenizer
from tests.support.tiny import make_model

# The character tokenizer knows a-z, <s>, </s> and ">": user/system turns end in ">", assistant
# turns in "</s>", and the generation prompt is empty.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}>{% endif %}{% endfor %}"
)
TEXTS = ["abc", "hello", "xyz"]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Every dataset this file builds is cached under tmp_path, not in the user's cache."""
    cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    return cache


def chat_tokenizer(template=TEMPLATE):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def toks(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def learned(ids, labels):
    return [t for t, lab in zip(ids, labels) if lab != -100]


# -- loading ---------------------------------------------------------------------------------------
def write(path, ext, texts):
    rows = [{"text": t} for t in texts]
    if ext == "txt":
        path.write_text("\n".join(texts) + "\n")
    elif ext == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif ext == "json":
        path.write_text(json.dumps(rows))
    elif ext == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif ext == "csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)


@pytest.mark.parametrize("ext", ["txt", "jsonl", "json", "parquet", "csv"])
def test_each_file_format_loads(tmp_path, ext):
    path = tmp_path / f"data.{ext}"
    write(path, ext, TEXTS)
    assert load_raw_dataset(str(path))["text"] == TEXTS


def test_folder_of_files_loads_recursively(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "part2").mkdir(parents=True)
    (folder / ".cache").mkdir()
    write(folder / "a.jsonl", "jsonl", TEXTS[:2])
    write(folder / "part2" / "b.jsonl", "jsonl", TEXTS[2:])
    (folder / ".cache" / "junk.jsonl").write_text("not json\n")
    (folder / "README").write_text("ignored: not a data file")
    assert load_raw_dataset(str(folder))["text"] == TEXTS


def test_save_to_disk_folder_loads(tmp_path):
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS})}).save_to_disk(str(tmp_path / "dd"))
    assert load_raw_dataset(str(tmp_path / "saved"))["text"] == TEXTS
    assert load_raw_dataset(str(tmp_path / "dd"))["text"] == TEXTS


def test_dataset_in_local_hf_cache_loads_offline(tmp_path, datasets_cache):
    # Prepare the cache the way a first, online `load_dataset(name)` leaves it: a built Arrow copy.
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    write(tmp_path / "src.jsonl", "jsonl", TEXTS)
    files = DataFilesDict.from_patterns({"train": ["src.jsonl"]}, base_path=str(tmp_path))
    Json(cache_dir=str(datasets_cache), dataset_name="megatrain_cached_ds", config_id="default", data_files=files,
         hash="0123abcd").download_and_prepare()
    assert datasets.config.HF_HUB_OFFLINE
    assert load_raw_dataset("megatrain_cached_ds")["text"] == TEXTS


def test_load_errors_say_what_to_do(tmp_path):
    with pytest.raises(MegaTrainError, match="does not exist; check the path"):
        load_raw_dataset(str(tmp_path / "nope" / "missing"))  # a path: never looked up on the hub
    with pytest.raises(MegaTrainError, match="not a file or folder, and not a dataset in the local HF cache"):
        load_raw_dataset("megatrain-no-such-dataset")  # a name: looked up in the local cache (offline here)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MegaTrainError, match="holds no"):
        load_raw_dataset(str(tmp_path / "empty"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write(mixed / "a.jsonl", "jsonl", TEXTS)
    write(mixed / "b.txt", "txt", TEXTS)
    with pytest.raises(MegaTrainError, match="one format per folder"):
        load_raw_dataset(str(mixed))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "abc"}\n{"text": \n')
    with pytest.raises(MegaTrainError, match="could not read .*bad.jsonl"):
        load_raw_dataset(str(bad))


# -- formats and labels ----------------------------------------------------------------------------
def test_format_detection():
    assert detect_format(["text", "messages"]) == "chat"
    assert detect_format(["prompt", "completion", "text"]) == "prompt_completion"
    assert detect_format(["body"], text_field="body") == "text"
    with pytest.raises(MegaTrainError, match="expected a 'messages' column"):
        detect_format(["prompt", "body"])


def test_chat_labels_only_on_assistant_tokens():
    tok = chat_tokenizer()
    conversation = [
        {"role": "system", "content": "rev"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ba"},
        {"role": "user", "content": "xyz"},
        {"role": "assistant", "content": "zyx"},
    ]
    raw = datasets.Dataset.from_dict({"messages": [conversation, conversation[:3]], "extra": [1, 2]})
    rows = tokenize_dataset(raw, tok, max_seq_length=64, packing=False)
    assert rows.column_names == ["input_ids", "labels"] and len(rows) == 2

    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    assert ids == toks(tok, tok.apply_chat_template(conversation, tokenize=False))
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "r", "e", "v", ">", "a", "b", ">", "b", "a", "</s>",
                                              "x", "y", "z", ">", "z", "y", "x", "</s>"]
    assistant = {8, 9, 10, 15, 16, 17, 18}
    assert labels == [t if i in assistant else -100 for i, t in enumerate(ids)]
    assert learned(*rows[1].values()) == toks(tok, "ba</s>")


def test_template_that_rewrites_past_turns_gives_one_sample_per_turn():
    # Like reasoning templates that drop past thinking: an earlier answer renders as "x".
    tok = chat_tokenizer(TEMPLATE.replace("{{ m['content'] }}{{ eos_token }}",
                                          "{% if loop.last %}{{ m['content'] }}{% else %}x{% endif %}{{ eos_token }}"))
    conversation = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"},
                    {"role": "user", "content": "cd"}, {"role": "assistant", "content": "dc"}]
    rows = tokenize_dataset(datasets.Dataset.from_dict({"messages": [conversation]}), tok, 64, packing=False)
    assert len(rows) == 2
    first, second = rows[0], rows[1]
    assert first["input_ids"] == toks(tok, "<s>ab>ba</s>") and learned(*first.values()) == toks(tok, "ba</s>")
    assert second["input_ids"] == toks(tok, "<s>ab>x</s>cd>dc</s>")
    assert learned(*second.values()) == toks(tok, "dc</s>")


def test_chat_data_without_chat_template_is_refused():
    raw = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "ab"}]]})
    with pytest.raises(MegaTrainError, match="has no chat template"):
        tokenize_dataset(raw, build_tokenizer(), 64, packing=False)


def test_malformed_messages_are_refused_with_the_row():
    raw = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "ab"}], [{"content": "ab"}]]})
    with pytest.raises(MegaTrainError, match="row 1: 'messages' must be a list of"):
        tokenize_dataset(raw, chat_tokenizer(), 64, packing=False)


def test_prompt_completion_loss_on_completion_only():
    tok = chat_tokenizer()
    raw = datasets.Dataset.from_dict({"prompt": ["ab>", "xyz>"], "completion": ["ba", "zyx"]})
    rows = tokenize_dataset(raw, tok, 64, packing=False)
    assert rows[0]["input_ids"] == toks(tok, "<s>ab>ba</s>")  # the prompt as tokenizer(prompt) gives it
    assert rows[0]["labels"] == [-100] * 4 + toks(tok, "ba</s>")
    assert learned(*rows[1].values()) == toks(tok, "zyx</s>")

    conversational = datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "ab"}]],
        "completion": [[{"role": "assistant", "content": "ba"}]],
    })
    row = tokenize_dataset(conversational, tok, 64, packing=False)[0]
    assert row == rows[0]


def test_samples_with_nothing_to_learn_are_dropped():
    tok = chat_tokenizer()
    raw = datasets.Dataset.from_dict({"prompt": ["abcdefgh>", "ab>"], "completion": ["hg", "ba"]})
    rows = tokenize_dataset(raw, tok, max_seq_length=6, packing=False)  # the first prompt fills the row
    assert len(rows) == 1 and rows[0]["input_ids"] == toks(tok, "<s>ab>ba")
    with pytest.raises(MegaTrainError, match="no sample keeps a token to learn"):
        tokenize_dataset(raw.select([0]), tok, max_seq_length=6, packing=False)


# -- packing -------------------------------------------------------------------------------------
def reference_pack(samples, length):
    """Plain-loop packing: rows of (id, label, position); documents and rows restart positions."""
    rows, cur = [], []
    for ids, labels in samples:
        for k, (t, lab) in enumerate(zip(ids, labels)):
            if len(cur) == length:
                rows.append(cur)
                cur = []
            fresh = k == 0 or not cur
            cur.append((t, -100 if fresh else lab, 0 if fresh else cur[-1][2] + 1))
    if len(cur) == length:
        rows.append(cur)
    return rows


def test_packing_layout_keeps_masks_and_splits_long_samples():
    tok = chat_tokenizer()
    chats = [[{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]
             for w in ("abc", "defghijklmnopqrstu", "vw", "xyzab", "cdefg")]
    raw = datasets.Dataset.from_dict({"messages": chats})
    samples = tokenize_dataset(raw, tok, 1000, packing=False)
    packed = tokenize_dataset(raw, tok, max_seq_length=16, packing=True)
    assert all(len(r["input_ids"]) == 16 for r in packed)
    assert max(len(s) for s in samples["input_ids"]) > 16  # one sample is split across rows
    expected = reference_pack(zip(samples["input_ids"], samples["labels"]), 16)
    assert len(packed) == len(expected) == sum(len(s) for s in samples["input_ids"]) // 16
    for row, want in zip(packed, expected):
        assert list(zip(row["input_ids"], row["labels"], row["position_ids"])) == want
    with pytest.raises(MegaTrainError, match="fewer than max_seq_length"):
        tokenize_dataset(raw, tok, max_seq_length=4096, packing=True)


def test_packed_documents_do_not_see_each_other():
    """A packed row of 3 documents gives each token the logits of its document run alone:
    stock HF forward and StreamingEngine; the engine's loss equals stock HF's on the packed row."""
    tok = build_tokenizer()
    raw = datasets.Dataset.from_dict({"text": ["abcd", "efghij", "klm"]})  # 5 + 7 + 4 tokens with EOS
    rows = tokenize_dataset(raw, tok, max_seq_length=16, packing=True)
    assert len(rows) == 1
    batch = CausalCollator(tok.pad_token_id)([rows[0]])
    assert "attention_mask" not in batch
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    docs = [(0, 5), (5, 12), (12, 16)]
    assert [labels[0, s].item() for s, _ in docs] == [-100, -100, -100]

    model = make_model("llama").eval()
    # use_cache=False: with a KV cache (HF's default, even in train mode) the mask builder does not
    # look for restarting position ids, and packed documents would attend to each other.
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, s:e]).logits[0] for s, e in docs])
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        leaky = model(input_ids=ids, use_cache=False).logits[0]
        stock_loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert not torch.allclose(leaky[5:], alone[5:], atol=1e-3)  # without the restarts the documents mix

    engine = StreamingEngine(model, compute_dtype=torch.float32)
    engine.eval()
    with torch.no_grad():
        eng_logits = engine.forward(input_ids=ids, position_ids=pos, labels=None).logits[0]
        eng_loss = engine.forward(input_ids=ids, position_ids=pos, labels=labels).loss
    torch.testing.assert_close(eng_logits.float(), alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(eng_loss, stock_loss, atol=1e-5, rtol=0)


# -- padding and counting ------------------------------------------------------------------------
def test_dynamic_padding_matches_unpadded_samples():
    tok = build_tokenizer()
    raw = datasets.Dataset.from_dict({"text": ["ab", "abcdefghijklmnop", "abcde"]})
    rows = tokenize_dataset(raw, tok, max_seq_length=10, packing=False)
    lengths = [len(r["input_ids"]) for r in rows]
    assert lengths == [3, 10, 6]  # one sample per row, truncated to max_seq_length
    batch = CausalCollator(tok.pad_token_id)(list(rows))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(v.shape == (3, 10) for v in batch.values())
    for i, n in enumerate(lengths):
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (10 - n)
        assert batch["labels"][i, n:].eq(-100).all() and batch["input_ids"][i, n:].eq(tok.pad_token_id).all()
    assert count_real_tokens(batch) == sum(lengths)

    model = make_model("llama").eval()
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]])).loss
                 for r in rows]
        for i in range(3):
            padded = model(**{k: v[i : i + 1] for k, v in batch.items()}).loss
            torch.testing.assert_close(padded, alone[i], atol=1e-5, rtol=0)
        whole = model(**batch).loss
    weights = torch.tensor([n - 1 for n in lengths], dtype=torch.float32)
    torch.testing.assert_close(whole, (torch.stack(alone) * weights).sum() / weights.sum(), atol=1e-5, rtol=0)


def test_count_real_tokens():
    collate = CausalCollator(0)
    assert count_real_tokens(collate([{"input_ids": [5, 6, 7]}, {"input_ids": [5]}])) == 4
    assert count_real_tokens(collate([{"input_ids": [5, 6]}, {"input_ids": [7, 8]}])) == 4  # no padding, no mask
    packed = {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8], "position_ids": [0, 1, 0, 1]}
    assert count_real_tokens(collate([packed, packed])) == 8


@pytest.mark.parametrize("fmt", ["text", "chat", "prompt_completion"])
def test_a_raw_train_dataset_is_tokenized_like_data_path(tmp_path, fmt):
    """train_dataset= of raw rows (as TRL accepts them) trains exactly as the same rows in a data_path file:
    same losses, same weights."""
    from hf_megatrain import MegaTrainArguments, MegaTrainTrainer

    rows = {
        "text": [{"text": t * 3} for t in ("abc", "hello", "xyz", "qrs")],
        "chat": [{"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}
                 for u, a in (("ab", "cde"), ("xy", "zzz"), ("hello", "olleh"), ("q", "rs"))],
        "prompt_completion": [{"prompt": p, "completion": c} for p, c in (("ab", "cd"), ("xyz", "zyx"),
                                                                         ("hi", "ih"), ("q", "rst"))],
    }[fmt]
    folder = tmp_path / "model"
    make_model("llama").save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = []
    for how in ("data_path", "train_dataset"):
        args = MegaTrainArguments(output_dir=str(tmp_path / how), max_steps=3, per_device_train_batch_size=2,
                                  max_seq_length=16, learning_rate=1e-2, logging_steps=1, report_to=[],
                                  save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                                  **({"data_path": str(path)} if how == "data_path" else {}))
        extra = {"train_dataset": datasets.Dataset.from_list(rows)} if how == "train_dataset" else {}
        trainer = MegaTrainTrainer(str(folder), args, **extra)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append((losses, dict(trainer.engine.named_master_params())))
    (ref_losses, ref), (losses, got) = results
    assert len(losses) == 3 and losses == ref_losses
    for name, t in ref.items():
        assert torch.equal(got[name], t), name
