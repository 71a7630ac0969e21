"""The streaming loader reads checkpoint names through transformers' own conversion mapping where a family's spec
does not map them (checkpoint/hf_names.py). The zoo (tests/support/zoo.py) streams every exact family's saved
folder in; these tests pin the placements and the refusals."""

import pytest
import torch

from hf_megatrain import MegaTrainError
from hf_megatrain.checkpoint.hf_names import CheckpointNames
from tests.support.tiny import make_model


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
    assert names("backbone.embed_tokens.weight", [128, 64], shapes) == ("model.embed_tokens.weight", ())
    # expert 3's w3 (up): the second half of the rows of gate_up_proj[3]
    target, index = names("backbone.layers.0.mlp.experts.3.w3.weight", [128, 64], shapes)
    assert target == "model.layers.0.mlp.experts.gate_up_proj"
    assert index == (3, slice(128, 256))
    with pytest.raises(MegaTrainError, match="do not divide it evenly"):
        names("backbone.layers.0.mlp.experts.3.w1.weight", [100, 64], shapes)


def test_a_conversion_the_loader_does_not_apply_is_refused_by_name():
    from transformers.core_model_loading import Transpose, WeightConverter

    names = _names("llama", [WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight",
                                             operations=[Transpose(0, 1)])])
    with pytest.raises(MegaTrainError, match="Transpose.*pass the model in instead of its folder"):
        names("model.layers.0.mlp.down_proj.weight", [128, 64], {})
