"""Training data from files: load with `datasets`, tokenize, pack into rows, collate.

Packing concatenates documents (each ending in EOS) into rows of `max_seq_length` tokens.
Position ids restart at every document, which HF's mask builder turns into a block-diagonal
causal mask, so no token attends across documents; the first token of each document gets
label -100, so no document is asked to predict its neighbour.
"""

from __future__ import annotations

import os

import torch

from .errors import MegaTrainError

_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_raw_dataset(path: str):
    """A `datasets.Dataset` from a file, a folder of files, or a dataset in the local HF cache."""
    import datasets

    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if os.path.splitext(f)[1] in _BUILDERS)
        if not files:
            raise MegaTrainError(f"{path} holds no .txt/.jsonl/.json/.parquet/.csv files to train on.")
    elif os.path.isfile(path):
        files = [path]
    else:
        try:
            return datasets.load_dataset(path, split="train")
        except Exception as e:
            raise MegaTrainError(
                f"{path!r} is neither a file nor a folder, and loading it as a cached dataset failed: {e}"
            ) from e
    kinds = {_BUILDERS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise MegaTrainError(
            f"cannot tell the format of {files}: use one of {sorted(_BUILDERS)} (one format per folder)."
        )
    return datasets.load_dataset(kinds.pop(), data_files=files, split="train")


def tokenize_dataset(raw, tokenizer, max_seq_length: int, packing: bool, text_field: str = "text"):
    """Rows of input_ids / labels (/ position_ids when packing), ready for `CausalCollator`."""
    import datasets

    if tokenizer is None:
        raise MegaTrainError("loading data from a file needs a tokenizer: pass processing_class=.")
    if len(raw) == 0:
        raise MegaTrainError("the training dataset is empty: it has no rows.")
    if text_field not in raw.column_names:
        raise MegaTrainError(f"the data has columns {raw.column_names}, but text_field={text_field!r}.")
    eos = tokenizer.eos_token_id

    def encode(batch):
        ids = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
        return {"ids": [x + ([eos] if eos is not None else []) for x in ids if x]}

    tok = raw.map(encode, batched=True, remove_columns=raw.column_names, desc="tokenizing")
    if not packing:
        rows = [ids[:max_seq_length] for ids in tok["ids"]]
        rows = [r for r in rows if len(r) > 1]
        if not rows:
            raise MegaTrainError("after tokenization no row has 2 or more tokens; nothing to train on.")
        return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})

    rows, positions, labels = [], [], []
    cur, pos, lab = [], [], []
    for doc in tok["ids"]:
        for start in range(0, len(doc), max_seq_length):
            piece = doc[start : start + max_seq_length]
            while piece:
                room = max_seq_length - len(cur)
                take = piece[:room]
                first = len(cur)
                cur += take
                pos += list(range(len(take)))
                lab += take
                lab[first] = -100  # never predict a document's first token from the previous one
                piece = piece[room:]
                if len(cur) == max_seq_length:
                    rows.append(cur), positions.append(pos), labels.append(lab)
                    cur, pos, lab = [], [], []
    if not rows:
        raise MegaTrainError(
            f"the data holds fewer than max_seq_length={max_seq_length} tokens; lower max_seq_length or add data."
        )
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": labels, "position_ids": positions})


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
            out["labels"].append(labels + [-100] * pad)
            out["attention_mask"].append([1] * n + [0] * pad)
            if packed:
                out["position_ids"].append(list(f["position_ids"]) + list(range(pad)))
        batch = {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}
        if packed or bool(batch["attention_mask"].all()):
            del batch["attention_mask"]  # no padding: let the mask builder use position ids / pure causal
        return batch
