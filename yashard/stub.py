"""What a sharded parameter reads as on its HF module while its unit is not running.

``yashard.shard`` takes every parameter off its module (its values move into a flat master shard);
while the unit runs, the module's attribute is a view into the gathered weights. Outside that
window the attribute is a :class:`ShardedStub`: a tensor with the parameter's metadata and no
values. HF forwards read that metadata from outside the unit that owns the weight (Llama 4:
``input_ids.to(self.embed_tokens.weight.device)``; others: ``x.to(self.lm_head.weight.dtype)``),
and ``print(model)`` reads shapes. Anything that would need the values (an operator, a copy,
``data_ptr()``, ``tolist()``) raises, naming the parameter and where its values are: a stale or
garbage value is never handed out.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


def sharded_message(fqn: str, needs: str = "") -> str:
    """Why ``fqn`` has no values here (``needs``: the operation that asked for them) and where they are."""
    return (f"{fqn} is sharded by yashard{f' ({needs} needs its values)' if needs else ''}: its values live in "
            "flat per-rank shards and are gathered into a shared buffer only while its layer runs (outside "
            "that, its shape, dtype, device and requires_grad can be read). Read full tensors with "
            "model.full_state_dict() (a collective: every rank calls it) or write them with yashard.export_hf")


class ShardedStub(torch.Tensor):
    """Contract: ``shape``, ``dtype`` (the runtime's ``param_dtype``, what the module computes in),
    ``device`` (the runtime's) and ``requires_grad`` (whether the parameter trains) are the
    parameter's; every operation on its values raises ``RuntimeError`` (:func:`sharded_message`).
    It owns no storage; a new one is made at each attribute read."""

    @staticmethod
    def __new__(cls, fqn: str, shape: torch.Size, dtype: torch.dtype, device: torch.device, requires_grad: bool):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t._fqn = fqn
        return t

    def __init__(self, *args, **kwargs):  # (all done in __new__)
        pass

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"ShardedStub({self._fqn}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"requires_grad={self.requires_grad})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # (.detach(), .data: metadata again, no values)
            t = args[0]
            return ShardedStub(t._fqn, t.shape, t.dtype, t.device, False)
        stubs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, ShardedStub)]  # (torch.cat's list too)
        raise RuntimeError(sharded_message(stubs[0]._fqn if stubs else "a parameter", str(func)))

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(sharded_message(self._fqn))

    # Reads that do not go through __torch_dispatch__ (a wrapper tensor would answer them with a
    # null pointer, an empty storage, or torch's own error).
    data_ptr = untyped_storage = storage = tolist = numpy = item = __array__ = __reduce_ex__ = _refuse

    def _refuse_freeze(self, requires_grad: bool = True):
        """Setting ``requires_grad`` on a stub to what it is not: a new stub is made at each read, so
        the flag was lost and nothing froze. Which parameters train is fixed at ``shard()``. (To what
        it is: nothing to do.)"""
        if bool(requires_grad) == torch._C.TensorBase.requires_grad.__get__(self):
            return self
        raise RuntimeError(
            f"setting requires_grad of {self._fqn} after yashard.shard: which parameters train is fixed when "
            "yashard.shard runs (their values live in flat master shards shared with other parameters), so this "
            "would freeze nothing. Freeze them before yashard.shard (p.requires_grad_(False) on the unsharded "
            "model), or turn a whole master shard off (a tensor of model.parameters(): shards.layer_<i>, ...)")

    requires_grad_ = _refuse_freeze
    requires_grad = property(torch._C.TensorBase.requires_grad.__get__, _refuse_freeze,
                             doc="Whether the parameter trains (read only: fixed at shard())")
