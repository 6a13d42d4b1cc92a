"""The differentiable tensors of a unit's inputs or outputs, found and replaced without building a
pytree spec: the per-layer hooks do this twice per layer and forward, where ``torch.utils._pytree``'s
flatten/unflatten cost tens of microseconds of host time.

Contract: :func:`diff_leaves` and :func:`put_back` visit the same leaves in the same order, and find
the same differentiable tensors, in the same order, as ``torch.utils._pytree``: plain tuples, lists
and dicts are walked; tensors and objects that are not pytree containers are leaves (so is a
``torch.Size``, which holds no tensor: it is passed on as it is, where pytree would rebuild it as a
tuple). Any other pytree container (a namedtuple, an ``OrderedDict``, a HF ``ModelOutput``, a type
registered with ``register_pytree_node``) makes :func:`diff_leaves` return ``None``: the caller then
uses pytree itself.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

_LEAF_TYPES = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size})


def is_diff_tensor(x) -> bool:
    """A tensor that autograd would carry a gradient for (floating or complex, ``requires_grad``)."""
    return isinstance(x, torch.Tensor) and x.requires_grad and (x.is_floating_point() or x.is_complex())


def diff_leaves(tree) -> list[torch.Tensor] | None:
    """The differentiable tensors in ``tree`` (in walk order), or ``None`` if ``tree`` holds a pytree
    container other than a plain tuple, list or dict."""
    found: list[torch.Tensor] = []
    return found if _walk(tree, found) else None


def _walk(x, found: list) -> bool:
    t = type(x)
    if t is tuple or t is list:
        return all(_walk(v, found) for v in x)
    if t is dict:
        return all(_walk(v, found) for v in x.values())
    if t in _LEAF_TYPES:
        return True
    if isinstance(x, torch.Tensor):
        if is_diff_tensor(x):
            found.append(x)
        return True
    return pytree._get_node_type(x) not in pytree.SUPPORTED_NODES  # (else: a container pytree walks)


def put_back(tree, replacements):
    """``tree`` with its differentiable tensors replaced, in walk order, by the items of the
    iterator ``replacements``; containers holding none are returned as they are."""
    t = type(tree)
    if t is tuple or t is list:
        new = [put_back(v, replacements) for v in tree]
        return tree if all(a is b for a, b in zip(new, tree)) else t(new)
    if t is dict:
        new = {k: put_back(v, replacements) for k, v in tree.items()}
        return tree if all(new[k] is v for k, v in tree.items()) else new
    if is_diff_tensor(tree):
        return next(replacements)
    return tree
