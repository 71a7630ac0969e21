"""Training data from files: load with `datasets`, tokenize, pack into rows, collate.

Three row formats, told apart by their columns (the first that fits wins):

* `messages`: a list of {"role", "content"} turns, rendered with the tokenizer's chat template;
  only assistant turns are learned (every other label is -100).
* `prompt` + `completion`: strings (the prompt tokenized as `tokenizer(prompt)` would at
  generation time, the completion followed by EOS), or lists of messages rendered with the chat
  template; only the completion is learned.
* `text_field` (default `text`): raw text followed by EOS, every token learned.

Packing concatenates documents into rows of exactly `max_seq_length` tokens. Position ids restart
at every document, which HF's mask builder turns into a block-diagonal causal mask, so no token
attends across documents; the first token of each document gets label -100, so no document is
asked to predict its neighbour. A document longer than the room left in a row continues at the
start of the next row with positions restarting at 0: rows are independent, so its second part
cannot see the first either way, and restarting keeps every position below `max_seq_length`.
The tokens after the last full row are dropped, so packed rows never hold padding.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import numpy as np
import torch

from .constants import IGNORE_INDEX
from .errors import MegaTrainError
from .paths import looks_local, missing_path

logger = logging.getLogger(__name__)

SMALL_DATA = 64 << 20  # data files loaded without a progress bar: their load takes a moment at most
_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# -- loading ---------------------------------------------------------------------------------------
def load_raw_dataset(path: str):
    """A `datasets.Dataset` from a file, a folder of files (or a `save_to_disk` folder), or a dataset
    name already in the local HF cache."""
    import datasets

    path = os.fspath(path)
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")):
            return _train_split(datasets.load_from_disk(path), path)
        files = _data_files(path)
    elif os.path.isfile(path):
        files = [path]
    elif looks_local(path):  # a missing file is reported here, before datasets would try the hub for it
        raise missing_path("data", path)
    else:
        try:
            return _train_split(datasets.load_dataset(path), path)
        except MegaTrainError:
            raise
        except Exception as e:
            raise MegaTrainError(
                f"{path!r} is not a file or folder, and not a dataset in the local HF cache "
                f"({datasets.config.HF_DATASETS_CACHE}): {type(e).__name__}: {e}. Check the path, or load the "
                "dataset once with network access (datasets.load_dataset) so that it is cached."
            ) from e
    kinds = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise MegaTrainError(
            f"cannot tell the format of {files}: use one of {sorted(_BUILDERS)} (one format per folder)."
        )
    kind = kinds.pop()
    for f in files:
        if _is_empty(f):
            raise MegaTrainError(f"{f} is empty: it holds no rows to train on. Point the data at a file with rows"
                                 f"{' (or remove it from the folder)' if len(files) > 1 else ''}.")
    datasets_logger = logging.getLogger("datasets")
    level = datasets_logger.level
    datasets_logger.setLevel(logging.CRITICAL)  # its own error line about a bad row: said once, below, better
    small = sum(os.path.getsize(f) for f in files) < SMALL_DATA  # read in a moment: no progress bar
    try:
        with progress_bars(not small):
            return datasets.load_dataset(kind, data_files=files, split="train")
    except Exception as e:
        where = _first_bad_json(files) if kind == "json" else None
        if where:
            raise MegaTrainError(f"could not read {where}; fix or remove that line (.jsonl needs one JSON object "
                                 "per line, .json an array of objects or JSON Lines).") from None
        text = " ".join(f"{type(e).__name__}: {e}".split())
        raise MegaTrainError(
            f"could not read {files if len(files) > 1 else files[0]} as {kind}: {text}. "
            "Check the file: .jsonl needs one JSON object per line, .json an array of objects (or JSON Lines)."
        ) from None
    finally:
        datasets_logger.setLevel(level)


@contextmanager
def progress_bars(on: bool):
    """datasets' progress bars on or off inside the block, as they were after it."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if on and was else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


def _is_empty(path: str) -> bool:
    """No bytes, or only white space (read only when the file is small)."""
    size = os.path.getsize(path)
    if size > 1 << 20 or os.path.splitext(path)[1].lower() == ".parquet":
        return size == 0
    with open(path, "rb") as f:
        return not f.read().strip()


def _first_bad_json(files: list[str]) -> str | None:
    """'FILE line N: what is wrong' for the first line of a JSON Lines file that is not a JSON object (a
    .json file that holds one array is parsed whole); None when every line is one."""
    import json

    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 16).lstrip()
        if path.lower().endswith(".json") and head.startswith("["):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except json.JSONDecodeError as e:
                return f"{path} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{path} line {n}: not valid JSON ({e.msg}, column {e.colno})"
                if not isinstance(row, dict):
                    return f"{path} line {n}: a JSON {type(row).__name__}, where each line must be one object"
    return None


def _data_files(folder: str) -> list[str]:
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # skips caches and VCS folders
        files += [os.path.join(root, f) for f in sorted(names)
                  if not f.startswith(".") and os.path.splitext(f)[1].lower() in _BUILDERS]
    if not files:
        raise MegaTrainError(f"{folder} holds no {'/'.join(sorted(_BUILDERS))} files to train on.")
    return files


def _train_split(ds, path):
    import datasets

    if isinstance(ds, datasets.Dataset):
        return ds
    if "train" in ds:
        return ds["train"]
    if len(ds) == 1:
        return next(iter(ds.values()))
    raise MegaTrainError(f"{path!r} has splits {list(ds)} and none is called 'train'; save the split you want alone.")


# -- formats ---------------------------------------------------------------------------------------
def detect_format(columns, text_field: str = "text") -> str:
    """'chat', 'prompt_completion' or 'text', from a dataset's column names."""
    if "messages" in columns:
        return "chat"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if text_field in columns:
        return "text"
    raise MegaTrainError(
        f"the data has columns {list(columns)}; expected a 'messages' column (chat), 'prompt' and 'completion' "
        f"columns, or a text column named text_field={text_field!r}. Rename a column or set text_field."
    )


def _render(tokenizer, messages, generation_prompt=False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:
        raise MegaTrainError(
            f"the tokenizer's chat template failed on {messages!r}: {type(e).__name__}: {e}. Fix the row (roles, "
            "order) or the template."
        ) from e


def _clean(messages, row):
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in messages):
        raise MegaTrainError(f"row {row}: 'messages' must be a list of {{'role', 'content'}} dicts, got {messages!r}.")
    # Arrow gives every message every key any message had (None where absent); templates test
    # `is defined`, so absent keys must stay absent.
    return [{k: v for k, v in m.items() if v is not None or k in ("role", "content")} for m in messages]


def _split_after(tokenizer, prompt, conversation):
    """[(prompt text, not learned), (rest, learned)]: what a generation from `prompt` would have to produce."""
    before = _render(tokenizer, prompt, True)
    through = _render(tokenizer, conversation)
    if not through.startswith(before):
        raise MegaTrainError(
            "the chat template renders a conversation so that it does not start with its own prompt plus the "
            "generation prompt, so the assistant tokens cannot be located. Use a template whose "
            "add_generation_prompt output is a prefix of the rendered answer."
        )
    return [(before, False), (through[len(before):], True)]


def _chat_pieces(tokenizer, messages):
    """One sample per conversation, all assistant turns learned; or, when the template renders earlier
    turns differently once later ones follow (e.g. dropping past reasoning), one sample per assistant
    turn, each exactly what generating that turn would see."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    full, pieces, done = _render(tokenizer, messages), [], 0
    for i in turns:
        before, through = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[: i + 1])
        if len(before) < done or not through.startswith(before) or not full.startswith(through):
            return [_split_after(tokenizer, messages[:i], messages[: i + 1]) for i in turns]
        pieces += [(full[done : len(before)], False), (full[len(before) : len(through)], True)]
        done = len(through)
    return [pieces + [(full[done:], False)]]


def _tokenize_pieces(tokenizer, samples):
    """Each sample's pieces tokenized on their own (as generation would see the boundary) and joined."""
    texts = [text for pieces in samples for text, _ in pieces]
    toks = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    out = {"input_ids": [], "labels": []}
    for pieces in samples:
        ids, labels = [], []
        for (_, learned), t in zip(pieces, toks):
            ids += t
            labels += t if learned else [IGNORE_INDEX] * len(t)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def _strings(values, rows, column):
    for row, value in zip(rows, values):
        if not isinstance(value, str):
            raise MegaTrainError(f"row {row}: {column!r} holds {type(value).__name__} {value!r:.60}, where it "
                                 "must be a string; fix that row or choose another column.")


def _encoder(fmt, tokenizer, text_field):
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def text(batch, rows):
        _strings(batch[text_field], rows, text_field)
        ids = [x + eos for x in tokenizer(batch[text_field], add_special_tokens=False)["input_ids"] if x]
        return {"input_ids": ids, "labels": ids}

    def chat(batch, rows):
        samples = []
        for row, messages in zip(rows, batch["messages"]):
            samples += _chat_pieces(tokenizer, _clean(messages, row))
        return _tokenize_pieces(tokenizer, samples)

    def prompt_completion(batch, rows):
        if all(isinstance(p, str) for p in batch["prompt"]):
            _strings(batch["completion"], rows, "completion")
            prompts = tokenizer(batch["prompt"])["input_ids"]
            answers = tokenizer(batch["completion"], add_special_tokens=False)["input_ids"]
            return {"input_ids": [p + a + eos for p, a in zip(prompts, answers)],
                    "labels": [[IGNORE_INDEX] * len(p) + a + eos for p, a in zip(prompts, answers)]}
        samples = []
        for row, p, c in zip(rows, batch["prompt"], batch["completion"]):
            p, c = _clean(p, row), _clean(c, row)
            samples.append(_split_after(tokenizer, p, p + c))
        return _tokenize_pieces(tokenizer, samples)

    return {"text": text, "chat": chat, "prompt_completion": prompt_completion}[fmt]


def _uses_template(fmt, raw) -> bool:
    return fmt == "chat" or (fmt == "prompt_completion" and not isinstance(raw[0]["prompt"], str))


def _learns(labels) -> bool:
    # A row's first label is never a target (targets are shifted by one).
    return any(x != IGNORE_INDEX for x in labels[1:])


# -- tokenize, pack or truncate -------------------------------------------------------------------
def tokenize_dataset(raw, tokenizer, max_seq_length: int, packing: bool, text_field: str = "text"):
    """Rows of input_ids / labels (/ position_ids when packing), ready for `CausalCollator`."""
    docs = tokenize_documents(raw, tokenizer, text_field)
    if len(docs) == 0:
        raise MegaTrainError(
            "after tokenization no sample has a token to learn (empty texts, or no assistant/completion tokens)."
        )
    return _pack(docs, max_seq_length) if packing else truncate(docs, max_seq_length)


def tokenize_documents(raw, tokenizer, text_field: str = "text", announce: bool = True):
    """One sample of input_ids / labels per document (per assistant turn when the template needs it),
    without the samples that have no token to learn; neither packed nor truncated. announce: log the
    format and the counts (preflight's look at the first rows does not)."""
    if tokenizer is None:
        raise MegaTrainError("loading data from a file needs a tokenizer: pass processing_class=.")
    if len(raw) == 0:
        raise MegaTrainError("the training dataset is empty: it has no rows.")
    fmt = detect_format(raw.column_names, text_field)
    if _uses_template(fmt, raw) and not getattr(tokenizer, "chat_template", None):
        raise MegaTrainError(
            f"the data holds chat messages but the tokenizer ({type(tokenizer).__name__}, "
            f"{getattr(tokenizer, 'name_or_path', '')!r}) has no chat template. Use the model's instruct/chat "
            "tokenizer, set tokenizer.chat_template to a Jinja template, or convert the data to "
            "'prompt'/'completion' strings or a 'text' column."
        )
    docs = raw.map(_encoder(fmt, tokenizer, text_field), batched=True, with_indices=True,
                   remove_columns=raw.column_names, desc=f"tokenizing ({fmt})")
    docs = docs.filter(lambda b: [_learns(x) for x in b["labels"]], batched=True, desc="dropping empty samples")
    if announce:
        logger.info("data format %r: %d rows -> %d samples with tokens to learn", fmt, len(raw), len(docs))
    return docs


def truncate(docs, length):
    def cut(batch):
        pairs = [(i[:length], lab[:length]) for i, lab in zip(batch["input_ids"], batch["labels"])]
        pairs = [p for p in pairs if _learns(p[1])]
        return {"input_ids": [p[0] for p in pairs], "labels": [p[1] for p in pairs]}

    rows = docs.map(cut, batched=True, desc=f"truncating to {length} tokens")
    if len(rows) == 0:
        raise MegaTrainError(
            f"truncated to max_seq_length={length}, no sample keeps a token to learn (prompts longer than "
            "max_seq_length?); raise max_seq_length or shorten the prompts."
        )
    return rows


def _pack(docs, length):
    import datasets
    import pyarrow.compute as pc

    table = docs.with_format("arrow")[:]
    ids_col = table.column("input_ids").combine_chunks()
    ids = ids_col.flatten().to_numpy()
    labels = table.column("labels").combine_chunks().flatten().to_numpy().copy()
    sizes = pc.list_value_length(ids_col).to_numpy().astype(np.int64)
    starts = np.cumsum(sizes) - sizes
    labels[starts] = IGNORE_INDEX  # never predict a document's first token from the previous one
    n_rows = len(ids) // length
    if n_rows == 0:
        raise MegaTrainError(
            f"the data holds {len(ids)} tokens, fewer than max_seq_length={length}; lower max_seq_length, "
            "add data, or set packing=False."
        )
    total = n_rows * length
    token = np.arange(total)
    block_start = np.maximum(np.repeat(starts, sizes)[:total], token - token % length)
    positions = token - block_start

    def rows(a):
        return a[:total].astype(np.int32).reshape(n_rows, length)

    labels = rows(labels)
    labels[:, 0] = IGNORE_INDEX  # a continued document has nothing in this row to predict its first token from
    return datasets.Dataset.from_dict({"input_ids": rows(ids), "labels": labels, "position_ids": rows(positions)})


# -- batches --------------------------------------------------------------------------------------
class CausalCollator:
    """Stacks packed rows as they are; pads unpacked rows (labels -100, attention_mask 0)."""

    def __init__(self, pad_token_id: int = 0):
        self.pad = pad_token_id

    def __call__(self, features):
        if not features:
            raise MegaTrainError("empty batch")
        length = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": [], "labels": [], "attention_mask": []}
        packed = "position_ids" in features[0]
        if packed:
            out["position_ids"] = []
        for f in features:
            ids = list(f["input_ids"])
            labels = list(f.get("labels", ids))
            n = len(ids)
            pad = length - n
            out["input_ids"].append(ids + [self.pad] * pad)
            out["labels"].append(labels + [IGNORE_INDEX] * pad)
            out["attention_mask"].append([1] * n + [0] * pad)
            if packed:
                out["position_ids"].append(list(f["position_ids"]) + list(range(pad)))
        batch = {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}
        if packed or bool(batch["attention_mask"].all()):
            del batch["attention_mask"]  # no padding: let the mask builder use position ids / pure causal
        return batch


def count_real_tokens(batch) -> int:
    """Tokens of a collated batch that are not padding: the attention mask's ones, or every token when
    there is no mask (unpadded rows, and packed rows, which are full by construction)."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(torch.as_tensor(mask).sum())
    return int(torch.as_tensor(batch["input_ids"]).numel())
