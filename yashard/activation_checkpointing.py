"""Activation checkpointing of decoder layers inside yashard's hooks (``ShardConfig.checkpoint_layers``).

The first ``checkpoint_layers`` decoder layers run their forward under
``torch.utils.checkpoint`` and recompute it in backward. yashard's hooks stay outside the
checkpointed region: the layer's gather, gate and views are made once, and the recompute reads the
views its ``BackwardEntry`` put back after re-gathering the layer (:mod:`yashard.backward`).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn


# What a decoder layer's KV-cache argument is called: ``past_key_values`` (transformers 4.57-5.23),
# ``past_key_value`` (older 4.x layers), ``cache`` (5.24 and later), ``layer_past`` (GPT-style).
CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


def checkpointed_forward(module: nn.Module, inner, *args, **kwargs):
    """Activation checkpointing of one decoder layer, inside yashard's hooks.

    The hooks (gather, gate, views) run once outside the checkpointed region; the recompute in
    backward re-reads the same parameter views, whose slot was re-gathered by the layer's
    ``BackwardEntry`` before any of its backward ops run. As transformers' own checkpointing, only
    a layer in training mode with grad enabled is checkpointed (an evaluation with grad on, a cached
    decode among them, runs as is). A KV cache is not passed in (the recompute would write it a
    second time), whatever transformers calls it, unless the layer declares it only reads the cache
    (``_can_checkpoint_with_cache``, transformers >= 5.24); one already holding tokens is refused,
    since dropping it would attend without them.
    """
    if not (torch.is_grad_enabled() and module.training):
        return inner(*args, **kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in CACHE_KWARGS:
            cache = kwargs.get(name)
            if cache is None:
                continue
            tokens = cached_tokens(cache)
            if tokens:
                raise ValueError(
                    f"{type(module).__name__} is checkpointed (ShardConfig.checkpoint_layers) and was given a KV cache "
                    f"holding {tokens} token(s) in training mode; a recomputed layer cannot write a "
                    "cache, and dropping it would attend without those tokens. Call model.eval() to continue from a "
                    "cache with grad on (transformers does not checkpoint then either), or checkpoint fewer layers"
                )
            kwargs[name] = None
    return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)


def cached_tokens(cache) -> int:
    """How many tokens a transformers ``Cache`` holds in any layer (0 for anything else: nothing
    to lose)."""
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return 0
    try:
        return max(int(length(i)) for i in range(max(len(cache), 1)))
    except Exception:  # noqa: BLE001 - a cache whose length cannot be read here: treated as empty
        return 0


def no_cache_when_checkpointing(module: nn.Module, args, kwargs):
    """A training forward with grad on of a model with checkpointed layers builds no KV cache, as
    transformers turns ``use_cache`` off under its own checkpointing: the checkpointed layers cannot
    write one, so a cache returned would hold only the other layers' tokens."""
    if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is not False:
        kwargs["use_cache"] = False
        return args, kwargs
    return None
