"""Checkpoint tensor names as transformers' `from_pretrained` reads them, for the streaming loader.

transformers v5 keeps, per family, a conversion mapping between the names a checkpoint holds and the model's
own (`transformers.conversion_mapping`): renamed modules (Nemotron-H's `backbone.` is the model's `model.`,
GPT-NeoX's `embed_out` its `lm_head`), and MoE experts saved one by one that the model holds fused
(`experts.E.w1` and `experts.E.w3` are rows of `experts.gate_up_proj[E]`). `save_pretrained` writes the
checkpoint's names (it reverts the mapping), so every folder of such a family holds them, including the ones
this package writes (hf_format.py reverts the same way).

`CheckpointNames` maps every checkpoint tensor with the model's own mapping, as from_pretrained does:
transformers' renaming of a key, and for a converter the place of the tensor in the fused one (a name no
transform matches is the model's own). Only the converters whose result is a placement are taken (experts stacked along dim 0, pieces
concatenated along one dim); any other (a transpose, a permutation for rotary, an interleave) is refused by
name before a byte is read.
"""

from __future__ import annotations

import re

from ..errors import MegaTrainError


class CheckpointNames:
    """`names(entry, slot_shapes) -> [(entry, target, index), ...]`: the model's name for checkpoint tensor
    `entry` and where in that parameter it lands (() for all of it; (E,) for expert E of a stacked tensor;
    (E, rows) or (rows,) for a piece of a concatenation); a tensor that transformers splits into several
    parameters (a fused query_key_value) gives one entry per piece, each a range of its rows. `slot_shapes`: the
    model's name -> shape, to size the pieces."""

    def __init__(self, model):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        try:
            transforms = get_model_conversion_mapping(model)
        except Exception:  # a model's own code (trust_remote_code) that transformers' mapping cannot read: none
            transforms = []  # then every name is the model's own, and one it does not hold is refused by the loader
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.prefix = getattr(model, "base_model_prefix", None) or None
        # what rename_source_key asks of the state dict: which names exist (it reads .get(name) is not None)
        self.known = dict.fromkeys(model.state_dict(keep_vars=True), True)

    def __call__(self, entry, slot_shapes: dict) -> list[tuple]:
        from transformers.core_model_loading import rename_source_key

        key, shape = entry.name, entry.shape
        # transformers' order: every renaming, then at most one converter, then the base model's prefix
        renamed, _ = rename_source_key(key, self.renamings, [])
        target, pattern = rename_source_key(renamed, [], self.converters, self.prefix, self.known)
        if pattern is None:
            return [(entry, target, ())]
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        if ops == [("Split", 0)]:
            return _split_rows(entry, target, converter.target_patterns, slot_shapes)
        index: tuple = ()
        if ops and ops[0] == ("MergeModulelist", 0):
            # the expert's number: what the pattern's '*' stands for in the renamed key
            found = re.search(pattern.lstrip("^").rstrip("$").replace("*", r"(\d+)"), renamed)
            if found is None or not found.groups():
                raise MegaTrainError(f"checkpoint tensor {key!r}: cannot tell its expert from transformers' pattern "
                                     f"{pattern!r}; load the model with from_pretrained and pass it in")
            index, ops = (int(found.group(1)),), ops[1:]
        if len(ops) == 1 and ops[0][0] == "Concatenate" and target in slot_shapes:
            # piece p of n, concatenated along `dim` of each expert (or of the whole tensor): equal pieces,
            # which the slot's size along that dim shows (n pieces of this tensor's size)
            dim, n, p = ops[0][1], len(converter.source_patterns), converter.source_patterns.index(pattern)
            along = dim - len(index)  # the dim within the checkpoint tensor (the stacked one lacks dim 0)
            size, whole = shape[along], slot_shapes[target][dim]
            if along < 0 or whole != n * size:
                raise MegaTrainError(f"checkpoint tensor {key!r} (shape {list(shape)}) is one of {n} pieces of "
                                     f"{target!r} (shape {list(slot_shapes[target])}) along dim {dim}, and they do "
                                     "not divide it evenly; does config.json match these weights?")
            index = index + (slice(None),) * along + (slice(p * size, (p + 1) * size),)
            ops = []
        if ops:
            raise MegaTrainError(
                f"checkpoint tensor {key!r} becomes {target!r} through transformers' "
                f"{', '.join(name for name, _ in ops)}, which hf_megatrain's streaming loader does not apply; "
                "load the model with AutoModelForCausalLM.from_pretrained and pass the model in instead of its folder")
        return [(entry, target, index)]


def _split_rows(entry, target: str, patterns: list[str], slot_shapes: dict) -> list[tuple]:
    """A tensor transformers splits along its rows into several parameters, each as large as its parameter (a
    fused query_key_value into q_proj, k_proj and v_proj): one entry per parameter, its range of the rows."""
    from dataclasses import replace

    targets = [target.replace(patterns[0], p) for p in patterns]
    missing = [t for t in targets if t not in slot_shapes]
    if missing:
        raise MegaTrainError(f"checkpoint tensor {entry.name!r} splits into {targets}, and the model has no "
                             f"{missing[0]!r}; does config.json match these weights?")
    rows = [slot_shapes[t][0] for t in targets]
    if sum(rows) != entry.shape[0]:
        raise MegaTrainError(f"checkpoint tensor {entry.name!r} (shape {list(entry.shape)}) splits into {targets} "
                             f"of {rows} rows, {sum(rows)} in all; does config.json match these weights?")
    row_bytes = entry.nbytes // entry.shape[0]
    pieces, first = [], 0
    for t, n in zip(targets, rows):
        part = replace(entry, shape=(n, *entry.shape[1:]), start=entry.start + first * row_bytes, nbytes=n * row_bytes)
        pieces.append((part, t, ()))
        first += n
    return pieces
