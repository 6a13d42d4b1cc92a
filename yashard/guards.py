"""Checks that run before every optimizer step: stale parameters, non-finite values, collective order.

One global ``torch.optim`` step pre-hook (installed by the first :func:`yashard.shard`) looks at the
parameters of the optimizer being stepped:

* a parameter that ``yashard.shard`` removed from the model (the optimizer was built before
  ``shard``) raises: stepping it would silently train nothing;
* for every yashard runtime whose master shards the optimizer holds, :meth:`Runtime.step_checks`
  runs: non-finite gradients or forward outputs (``ShardConfig.on_nonfinite``) and, with
  ``ShardConfig.debug_collectives``, the comparison of every rank's collective sequence.

A global step post-hook lets each such runtime start the next forward's first gathers right after
the step (:meth:`Runtime.after_optimizer_step`).

Optimizers that hold no yashard parameter pay one set lookup per parameter.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

_handles: list = []


class _ByIdentity:
    """``{tensor: value}`` keyed by identity, holding only weak references to the tensors
    (``WeakKeyDictionary`` compares keys with ``==``, which tensors answer elementwise)."""

    def __init__(self):
        self._data: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, key: torch.Tensor, value) -> None:
        k = id(key)
        self._data[k] = (weakref.ref(key, lambda _, k=k: self._data.pop(k, None)), value)

    def get(self, key: torch.Tensor):
        entry = self._data.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None


_removed = _ByIdentity()   # parameters yashard.shard took out of a model -> their name
_owners = _ByIdentity()    # master shards -> their Runtime


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached the gradients (``ShardConfig(on_nonfinite="raise")``)."""


class CollectiveOrderError(RuntimeError):
    """Ranks issued different sequences of collectives (``ShardConfig(debug_collectives=True)``)."""


def track(runtime, removed: dict[torch.nn.Parameter, str]) -> None:
    """Remember ``runtime``'s masters and the parameters it took from the model (name by param)."""
    for p, name in removed.items():
        _removed[p] = name
    for u in runtime.units:
        _owners[u.master] = runtime
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(_before_step))
        _handles.append(register_optimizer_step_post_hook(_after_step))


def _runtimes(optimizer, check: bool) -> list:
    """The yashard runtimes whose master shards ``optimizer`` holds (and, with ``check``, refuse
    parameters that yashard.shard removed from a model)."""
    runtimes = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _removed.get(p) if check else None
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds {name}, a parameter yashard.shard removed from the model "
                    "(the optimizer was built before yashard.shard): stepping it trains nothing. Build the "
                    "optimizer after yashard.shard, from model.param_groups(weight_decay) or model.parameters()"
                )
            rt = _owners.get(p)
            if rt is not None and rt not in runtimes:
                runtimes.append(rt)
    return runtimes


def _before_step(optimizer, args, kwargs):
    for rt in _runtimes(optimizer, check=True):
        rt.step_checks()
    return None


def _after_step(optimizer, args, kwargs):
    for rt in _runtimes(optimizer, check=False):
        rt.after_optimizer_step()
