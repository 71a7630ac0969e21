"""The streaming loader reads checkpoint names through transformers' own conversion mapping, as from_pretrained
does (checkpoint/hf_names.py). The zoo (tests/support/zoo.py) streams every exact family's saved
folder in; these tests pin the placements and the refusals."""

import pytest
import torch

from hf_megatrain import MegaTrainError
from hf_megatrain.checkpoint.hf_names import CheckpointNames
from hf_megatrain.checkpoint.safetensors_io import TensorEntry
from tests.support.tiny import make_model


def entry(name, shape, start=0):
    return TensorEntry("model.safetensors", name, torch.float32, tuple(shape), start, 4 * torch.Size(shape).numel())


def _names(kind, converters=None):
    names = CheckpointNames(make_model(kind))
    if converters is not None:
        names.converters = converters
    return names


def test_a_renamed_module_and_stacked_experts_land_where_from_pretrained_puts_them():
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

    names = _names("mixtral")
    names.renamings = [WeightRenaming("backbone.", "model.")]
    names.converters = [WeightConverter(["experts.*.w1.weight", "experts.*.w3.weight"], "experts.gate_up_proj",
                                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)])]
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": torch.Size([4, 256, 64])}
    e = entry("backbone.embed_tokens.weight", [128, 64])
    assert names(e, shapes) == [(e, "model.embed_tokens.weight", ())]
    # expert 3's w3 (up): the second half of the rows of gate_up_proj[3]
    e = entry("backbone.layers.0.mlp.experts.3.w3.weight", [128, 64])
    assert names(e, shapes) == [(e, "model.layers.0.mlp.experts.gate_up_proj", (3, slice(128, 256)))]
    with pytest.raises(MegaTrainError, match="do not divide it evenly"):
        names(entry("backbone.layers.0.mlp.experts.3.w1.weight", [100, 64]), shapes)


def test_a_fused_tensor_split_into_parameters_is_read_as_ranges_of_its_rows():
    """Sarvam-MoE's query_key_value: q_proj, k_proj and v_proj, each as many rows as its parameter (transformers
    5.25's Split; on 5.17, which has none, a stand-in of the same name and dim)."""
    from transformers import core_model_loading
    from transformers.core_model_loading import WeightConverter

    class Split(core_model_loading.ConversionOps):
        def __init__(self, dim=0):
            self.dim = dim

        def convert(self, *args, **kwargs):  # never run: the loader reads the pieces itself
            raise NotImplementedError

    Split = getattr(core_model_loading, "Split", Split)

    names = _names("llama", [WeightConverter("query_key_value", ["q_proj", "k_proj", "v_proj"],
                                             operations=[Split(dim=0)])])
    shapes = {f"model.layers.0.self_attn.{p}_proj.weight": torch.Size([n, 64]) for p, n in (("q", 64), ("k", 32),
                                                                                         ("v", 32))}
    e = entry("model.layers.0.self_attn.query_key_value.weight", [128, 64], start=1000)
    pieces = names(e, shapes)
    assert [(t, p.shape, p.start, p.nbytes) for p, t, _ in pieces] == [
        ("model.layers.0.self_attn.q_proj.weight", (64, 64), 1000, 64 * 64 * 4),
        ("model.layers.0.self_attn.k_proj.weight", (32, 64), 1000 + 64 * 64 * 4, 32 * 64 * 4),
        ("model.layers.0.self_attn.v_proj.weight", (32, 64), 1000 + 96 * 64 * 4, 32 * 64 * 4)]
    with pytest.raises(MegaTrainError, match=r"shape \[96, 64\]\) splits .* 128 in all"):
        names(entry("model.layers.0.self_attn.query_key_value.weight", [96, 64]), shapes)


def test_a_conversion_the_loader_does_not_apply_is_refused_by_name():
    from transformers.core_model_loading import Transpose, WeightConverter

    names = _names("llama", [WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight",
                                             operations=[Transpose(0, 1)])])
    with pytest.raises(MegaTrainError, match="Transpose.*pass the model in instead of its folder"):
        names(entry("model.layers.0.mlp.down_proj.weight", [128, 64]), {})
