"""Activation checkpointing of decoder layers (``ShardConfig.checkpoint_layers``) and the KV cache.

transformers builds a cache whenever ``use_cache`` is on, training included, and hands it to each
layer under a name that changed across releases (``past_key_values`` up to 5.23, ``cache`` from
5.24). A checkpointed layer that receives it appends its keys and values once in the forward and
again in the recompute, and its attention then sees twice the sequence. So the layer is never
given a cache to write, whatever it is called; a layer that declares it only reads one
(``_can_checkpoint_with_cache``) keeps it. As in transformers, a layer in eval mode is not
checkpointed, and a training layer given a cache that already holds tokens is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import yashard
from yashard.activation_checkpointing import CACHE_KWARGS as _CACHE_KWARGS, checkpointed_forward as _checkpointed_forward
from models import batches, build


class _Recorder(nn.Module):
    def __init__(self, reads_only: bool = False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._can_checkpoint_with_cache = reads_only
        self.calls: list[dict] = []

    def forward(self, x, **kwargs):
        self.calls.append(dict(kwargs))
        return self.lin(x)


class _Cache:
    """Stands for a transformers Cache holding ``tokens`` tokens in each layer (a list: per layer)."""

    def __init__(self, tokens: int | list[int] = 0):
        self.tokens = tokens if isinstance(tokens, list) else [tokens]

    def __len__(self) -> int:
        return len(self.tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.tokens[layer_idx]


@pytest.mark.parametrize("name", _CACHE_KWARGS)
def test_a_checkpointed_layer_is_given_no_cache_under_any_name(name):
    layer, cache = _Recorder(), _Cache()
    x = torch.randn(2, 4, requires_grad=True)
    _checkpointed_forward(layer, layer.forward, x, **{name: cache, "use_cache": True, "position_ids": 3}).sum().backward()
    # the forward and the recompute both ran without the cache, with the other arguments as given
    assert len(layer.calls) == 2
    assert all(c == {name: None, "use_cache": False, "position_ids": 3} for c in layer.calls)
    assert layer.lin.weight.grad is not None


def test_a_layer_that_only_reads_the_cache_keeps_it_and_no_grad_runs_as_is():
    reader, cache = _Recorder(reads_only=True), _Cache(5)
    x = torch.randn(2, 4, requires_grad=True)
    _checkpointed_forward(reader, reader.forward, x, cache=cache, use_cache=True).sum().backward()
    assert [c["cache"] for c in reader.calls] == [cache, cache]
    layer = _Recorder()
    with torch.no_grad():  # generation: no recompute, so the cache is used as usual
        _checkpointed_forward(layer, layer.forward, x, cache=cache, use_cache=True)
    assert layer.calls == [{"cache": cache, "use_cache": True}]


def test_an_eval_layer_keeps_its_cache_and_a_training_layer_refuses_a_filled_one():
    """transformers checkpoints only in training mode: with grad on in eval mode (continuing from a
    cache, say) the layer runs once, with the cache. A training layer given a cache that holds
    tokens is refused: dropping it would attend without them (or fail on the mask's shape)."""
    layer, cache = _Recorder().eval(), _Cache(6)
    x = torch.randn(2, 4, requires_grad=True)
    _checkpointed_forward(layer, layer.forward, x, cache=cache, use_cache=True).sum().backward()
    assert layer.calls == [{"cache": cache, "use_cache": True}]
    layer.train()
    with pytest.raises(ValueError, match=r"_Recorder is checkpointed \(ShardConfig.checkpoint_layers\) and was given "
                                         r"a KV cache holding 6 token\(s\) in training mode.*Call model.eval\(\)"):
        _checkpointed_forward(layer, layer.forward, x, cache=cache, use_cache=True)
    # tokens in a later layer only (transformers' get_seq_length() reads layer 0)
    with pytest.raises(ValueError, match=r"a KV cache holding 6 token\(s\) in training mode"):
        _checkpointed_forward(layer, layer.forward, x, cache=_Cache([0, 0, 6, 6]), use_cache=True)


def test_a_training_forward_returns_no_cache_as_transformers_does(pg):
    """With the config's use_cache=True, the layers that are not checkpointed filled a cache and the
    checkpointed ones did not: continuing from it attended to half the past (silently, under sdpa).
    transformers turns use_cache off under its own checkpointing; so does yashard."""
    ids = batches(1, 2, 10, 96)[0]
    ref = build(num_hidden_layers=4)
    ref.gradient_checkpointing_enable()
    sm = yashard.shard(build(num_hidden_layers=4), config=yashard.ShardConfig(checkpoint_layers=2))
    assert ref.training and sm.training and ref.config.use_cache
    assert ref(input_ids=ids).past_key_values is None
    assert sm(input_ids=ids).past_key_values is None
    assert sm(input_ids=ids, use_cache=True).past_key_values is None
    with torch.no_grad():  # (under no_grad nothing is recomputed: the cache is built)
        assert sm(input_ids=ids).past_key_values.get_seq_length(3) == 10
    sm.eval()
    assert sm(input_ids=ids).past_key_values.get_seq_length(3) == 10


@pytest.mark.parametrize("use_cache", [None, True])
def test_checkpointed_layers_with_the_cache_on_match_the_unsharded_model(pg, use_cache):
    """The model's config has ``use_cache=True`` (HF's default): the run must equal the plain model."""
    ids = batches(1, 2, 16, 96)[0]
    kw = {} if use_cache is None else {"use_cache": use_cache}
    ref = build(num_hidden_layers=4)
    assert ref.config.use_cache
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    sm = yashard.shard(build(num_hidden_layers=4), config=yashard.ShardConfig(checkpoint_layers=4))
    loss = sm(input_ids=ids, labels=ids, **kw).loss
    loss.backward()
    grads = sm.full_grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "noreshard"])
@pytest.mark.parametrize("between", ["eval", "generate", "retain_graph"])
def test_a_checkpointed_backward_after_a_no_grad_forward_or_a_second_time(pg, reshard, between):
    """The recompute reads the views of the forward it belongs to: a no-grad forward in between (an
    evaluation, generate()) installs plain views (the recompute then saved fewer tensors: torch's
    CheckpointError), and the end of a backward takes them off (a second backward of a graph kept
    with retain_graph=True raised AttributeError). Both match the unsharded model."""
    ids, other = batches(2, 2, 16, 96)
    ref = build(num_hidden_layers=4)
    ref(input_ids=ids, labels=ids).loss.backward(retain_graph=between == "retain_graph")
    sm = yashard.shard(build(num_hidden_layers=4),
                       config=yashard.ShardConfig(checkpoint_layers=2, reshard_after_forward=reshard))
    loss = sm(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        if between == "eval":
            want = ref(input_ids=other, labels=other).loss
            torch.testing.assert_close(sm(input_ids=other, labels=other).loss, want, rtol=1e-5, atol=1e-6)
        elif between == "generate":
            assert torch.equal(sm.generate(other[:, :4], max_new_tokens=3, do_sample=False),
                               ref.generate(other[:, :4], max_new_tokens=3, do_sample=False))
    if between == "retain_graph":
        loss.backward(retain_graph=True)
        ref(input_ids=ids, labels=ids).loss.backward()  # the reference's gradients twice over, too
    loss.backward()
    grads = sm.full_grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "noreshard"])
def test_a_checkpointed_forward_never_backwarded_is_freed_with_its_output(pg, reshard):
    """The views a checkpointed layer's recompute needs live on its BackwardEntry node, with the
    forward's graph: the modules do not hold them after the forward, so a forward that is never
    backwarded (an evaluation without no_grad, a skipped batch) frees its graph, and a model dropped
    after one is collected (the modules' views kept the graph, and through it the runtime, alive)."""
    import gc
    import weakref

    ids = batches(1, 2, 16, 96)[0]
    sm = yashard.shard(build(num_hidden_layers=4),
                       config=yashard.ShardConfig(checkpoint_layers=4, reshard_after_forward=reshard))
    out = sm(input_ids=ids, labels=ids)
    hidden = weakref.ref(out.logits)
    runtime = weakref.ref(sm.runtime)
    del out
    gc.collect()
    assert hidden() is None
    del sm
    gc.collect()
    assert runtime() is None


def test_an_eval_model_continues_from_a_cache_with_grad_on(pg):
    """An evaluation with grad on (attribution, say) that continues from a prefilled cache: the
    checkpointed layers were given no cache and attended without it (a mask-shape error)."""
    ids = batches(1, 2, 10, 96)[0]
    ref = build(num_hidden_layers=4).eval()
    # (loss="hf": the check reads the logits of a grad-enabled call with labels)
    sm = yashard.shard(build(num_hidden_layers=4), config=yashard.ShardConfig(checkpoint_layers=2, loss="hf"))
    sm.eval()
    out = {}
    for name, m in (("ref", ref), ("yashard", sm)):
        with torch.no_grad():
            past = m(input_ids=ids[:, :6], use_cache=True).past_key_values
        o = m(input_ids=ids[:, 6:], past_key_values=past, use_cache=True, labels=ids[:, 6:])
        o.loss.backward()
        out[name] = o.logits.detach()
    torch.testing.assert_close(out["yashard"], out["ref"], rtol=1e-5, atol=1e-6)
    grads = sm.full_grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
