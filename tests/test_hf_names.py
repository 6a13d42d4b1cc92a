"""yashard.hf_names: the names and shapes checkpoints store against the ones a model holds (fast,
no process group)."""

from __future__ import annotations

import pytest
import torch
import transformers

from yashard import hf_names
from models import build

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def test_a_model_without_conversions_stores_what_it_holds():
    model = build("llama")
    held = {k: v.detach() for k, v in model.named_parameters()}
    assert not hf_names.converts(model)
    assert hf_names.to_stored(model, held).keys() == held.keys()
    assert hf_names.from_stored(model, held).keys() == held.keys()


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x holds the experts as stored")
def test_fused_experts_split_and_fuse_back_bitwise():
    model = build("mixtral")
    layer = {k: v.detach() for k, v in model.named_parameters() if k.startswith("model.layers.1.")}
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert fused in layer and layer[fused].dim() == 3
    n_experts, two_inter, hidden = layer[fused].shape
    stored = hf_names.to_stored(model, layer)
    w1 = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    assert fused not in stored and stored[w1].shape == (two_inter // 2, hidden)
    assert len([k for k in stored if ".experts." in k]) == 3 * n_experts
    shapes = hf_names.stored_shapes(model, [(k, tuple(v.shape)) for k, v in layer.items()])
    assert shapes == [(k, tuple(v.shape)) for k, v in stored.items()]  # same names, order and shapes, no data
    back = hf_names.from_stored(model, stored)
    assert back.keys() == layer.keys() and all(torch.equal(back[k], layer[k]) for k in layer)
