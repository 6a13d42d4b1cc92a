"""The names and shapes HF checkpoints store, against the ones the model holds.

From transformers 5 on, some models hold weights in another form than their checkpoints store
them: a Mixtral or Qwen3-MoE layer holds its experts fused (``mlp.experts.gate_up_proj``, one 3-D
tensor) where the checkpoint stores one 2-D tensor per expert and projection
(``block_sparse_moe.experts.3.w1.weight``). ``from_pretrained`` converts on loading and
``save_pretrained`` converts back. yashard does the same, one unit at a time (the conversions of
these models never cross a decoder layer):

* :func:`to_stored` turns a unit's tensors into the stored ones (``export_hf``);
  :func:`stored_shapes` gives their names and shapes without data (the meta device), so that files
  can be planned before anything is gathered;
* :func:`from_stored` turns stored tensors into the model's (loading a folder).

Both use the model's own conversion list (``_weight_conversions`` when transformers loaded it, else
the list transformers registers for its class); for a model with none, and with transformers 4,
names are stored as held and both are the identity.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def _machinery():
    """transformers' conversion helpers, or None where it has none (4.x)."""
    try:
        from transformers import core_model_loading as cml
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    needed = ("revert_weight_conversion", "apply_converters", "apply_renamings", "dot_natural_key",
              "WeightConverter", "WeightRenaming", "PrefixChange")
    if not all(hasattr(cml, n) for n in needed):  # pragma: no cover - an early 5.x without them
        return None
    return cml, get_model_conversion_mapping


def _conversions(model: nn.Module) -> list | None:
    """The model's load-time conversions (renamings and converters), prefix changes left out as
    ``save_pretrained`` leaves them out for a model built from a config; None when there are none."""
    found = _machinery()
    if found is None or not hasattr(model, "config"):
        return None
    cml, get_mapping = found
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_mapping(model, add_legacy=False) if not isinstance(c, cml.PrefixChange)]
    return conversions or None


def converts(model: nn.Module) -> bool:
    """Whether the model's checkpoints store any weight under another name or form."""
    return _conversions(model) is not None


def to_stored(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores for the model's ``tensors`` (one unit's, say), as
    ``save_pretrained`` writes them. Meta tensors give the names and shapes only."""
    if _conversions(model) is None:
        return dict(tensors)
    cml, _ = _machinery()
    return cml.revert_weight_conversion(model, dict(tensors))


def stored_shapes(model: nn.Module, held: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of what a checkpoint stores for the model's ``held`` names and shapes, in
    the order ``to_stored`` returns them."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in held}
    return [(name, tuple(t.shape)) for name, t in to_stored(model, meta).items()]


def from_stored(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors from stored ``tensors`` (all that one unit needs), as ``from_pretrained``
    converts them: renamings first, then the converters, each fed every source it matches."""
    conversions = _conversions(model)
    if conversions is None:
        return dict(tensors)
    cml, _ = _machinery()
    renamings = [c for c in conversions if isinstance(c, cml.WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, cml.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict[str, object] = {}
    for key, tensor in sorted(tensors.items(), key=lambda kv: cml.dot_natural_key(kv[0])):
        renamed = cml.apply_renamings(key, renamings)
        target, pattern = cml.apply_converters(renamed, converters)
        if pattern is None:
            op = pending.setdefault(renamed, cml.WeightRenaming(key, renamed))
            target, pattern = renamed, key
        else:
            op = pending.setdefault(target, copy.deepcopy(by_pattern[pattern]))
        op.add_tensor(target, key, pattern, tensor)
    out = {}
    for first, op in pending.items():
        for name, value in op.convert(first, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out
