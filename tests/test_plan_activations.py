"""The activation estimate (``yashard.plan.activations``) against what autograd keeps, counted with a
saved-tensor hook on tiny models, and the peak models' (yashard's, FSDP2's, ZeRO-3's) invariants.
One process, no collective: a few seconds. The RSS check at world 2 is ``tests/test_plan_peak.py``;
the benchmark models are ``recipes/plan_check.py``'s."""

import pytest
import torch

from models import build
from yashard.plan.activations import activations, shape_of, yashard_peak
from yashard.plan.peers import deepspeed_estimator_bytes, deepspeed_zero3_peak, fsdp2_forward_end, fsdp2_peak


def _kept_bytes(model, ids) -> int:
    """Bytes autograd keeps for the backward (storages other than the parameters'), plus the
    logits the output holds."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    logits = out.logits.untyped_storage()
    kept.pop(logits.data_ptr(), None)
    return sum(v for k, v in kept.items() if k not in params) + logits.nbytes()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_are_what_autograd_keeps(attention, dtype):
    model = build("llama", hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                  attn_implementation=attention).to(dtype).train()
    batch, seq = 3, 40
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    acts = activations(shape_of(model), seq=seq, micro_batch=batch, param_bytes=dtype.itemsize, attention=attention)
    assert _kept_bytes(model, ids) == acts.forward_end


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, overrides", [
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 24}),                               # q/k norms; head_dim != hidden / heads
    ("qwen3", {"head_dim": 24, "tie_word_embeddings": True}),
    ("gemma", {"head_dim": 24}),                               # embedding scale, (1 + w) norms, tied
])
def test_activations_of_other_families_are_what_autograd_keeps(family, overrides, attention, dtype):
    model = build(family, hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                  attn_implementation=attention, **overrides).to(dtype).train()
    shape = shape_of(model)
    assert shape.tied == model.config.tie_word_embeddings and shape.head_dim == overrides.get("head_dim", 16)
    for batch, seq in ((3, 40), (2, 24)):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq))
        acts = activations(shape, seq=seq, micro_batch=batch, param_bytes=dtype.itemsize, attention=attention)
        assert _kept_bytes(model, ids) == acts.forward_end, (batch, seq)


def test_a_family_the_estimate_cannot_model_is_refused():
    shape = shape_of(build("gemma2"))
    with pytest.raises(ValueError, match=r"not model_type='gemma2'.*estimate its activations by measuring"):
        activations(shape, seq=8, micro_batch=1, param_bytes=4)


def test_checkpointed_layers_keep_their_input():
    shape = shape_of(build("llama"))
    full = activations(shape, seq=64, micro_batch=2, param_bytes=2)
    ckpt = activations(shape, seq=64, micro_batch=2, param_bytes=2, checkpoint_layers=3)
    assert ckpt.checkpointed == 2 * 64 * shape.hidden * 2
    assert full.forward_end - ckpt.forward_end == 3 * (full.layer - ckpt.checkpointed)
    assert activations(shape, seq=64, micro_batch=2, param_bytes=2, checkpoint_layers=99).checkpoint_layers == shape.layers


def test_peaks_sit_above_the_forward_end_and_grow_with_the_batch():
    shape = shape_of(build("llama"))
    for mb in (1, 2, 8):
        acts = activations(shape, seq=32, micro_batch=mb, param_bytes=2)
        y = yashard_peak(1000, shape, acts)
        assert y.bytes >= 1000 + acts.forward_end + acts.loss_backward
        # FSDP2 holds the lm_head's group's unsharded parameters over the forward's end, and, while
        # the loss runs, the last group's all-gather output (freed by the root's post-forward): the
        # last layer's with the root wrapping, [norm, lm_head]'s with torchtitan's
        outer = shape.total_numel - shape.layers * shape.layer_numel
        for root_group, last in ((True, shape.layer_numel), (False, outer - shape.embed_numel)):
            f = fsdp2_peak(shape, acts, world=4, param_bytes=2, root_group=root_group)
            assert any(m.name == "forward end (loss)" and m.bytes == f.state + fsdp2_forward_end(
                shape, acts, param_bytes=2, root_group=root_group) + last * 2 + acts.loss_forward for m in f.moments)
        d = deepspeed_zero3_peak(shape, acts, world=4, param_bytes=2)
        assert d.bytes > deepspeed_estimator_bytes(shape, 4) + acts.forward_end
    small = fsdp2_peak(shape, activations(shape, seq=32, micro_batch=1, param_bytes=2), world=4, param_bytes=2)
    assert small.bytes < f.bytes


def test_gloo_staging_and_the_world_size():
    shape = shape_of(build("llama"))
    acts = activations(shape, seq=32, micro_batch=1, param_bytes=4)
    nccl, gloo = (fsdp2_peak(shape, acts, world=2, param_bytes=4, backend=b) for b in ("nccl", "gloo"))
    assert gloo.bytes >= nccl.bytes
    # gloo stages a whole layer during each layer's all-gather (fp32 here)
    assert [a.bytes - b.bytes for a, b in zip(gloo.moments, nccl.moments) if a.name == "forward layer 1: all-gather"] \
        == [shape.layer_numel * 4]
    assert fsdp2_peak(shape, acts, world=8, param_bytes=4).state == 12 * shape.total_numel // 8


def test_deepspeed_estimator_matches_its_formula_for_llama_3_8b():
    """DeepSpeed's estimator for Llama-3-8B at 8 GPUs: 4 * the embedding + 18 * N/8, 18.78 GiB
    (issue 36's table)."""
    from yashard.plan.presets import preset_config

    shape = shape_of(preset_config("llama-3-8b"))
    assert shape.total_numel == 8_030_261_248
    assert round(deepspeed_estimator_bytes(shape, 8) / 2**30, 2) == 18.78


def test_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="attention='flex'"):
        activations(shape_of(build("llama")), seq=8, micro_batch=1, param_bytes=4, attention="flex")
