"""The optimizer step in backward: ``ShardConfig(step_in_backward=True)``.

Each unit's optimizer step runs as soon as its reduced gradient shard is ready, in the reduction's
follow-up (:meth:`yashard.reduction.Reducer._accumulate`, events rule R7), straight from the
reduce-scatter output: no fp32 gradient shard is held between the reduction and the step.

:class:`OptimizerInBackward` is what the user holds (``model.optimizer_in_backward``). It is a
``torch.optim.Optimizer`` whose ``param_groups`` and ``state`` *are* those of one ordinary torch
optimizer over the master shards, the inner one, unmodified. So LR schedulers, ``state_dict`` and
yashard's checkpoints see a plain optimizer. A unit's step is that inner optimizer's ``step()``
while only this unit's master has a ``.grad``: torch optimizers skip parameters without one, so
each master is updated exactly as one step over all of them would update it.

Its own ``step()`` updates nothing: the backward did. Call it once after every backward, as in a
plain loop: its pre-hook runs the step checks (non-finite values, after the fact), and its
post-hook starts the next forward's gathers (:mod:`yashard.guards`). A second backward before it
is refused: gradient accumulation would need the gradients the mode does not keep.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.optim import Optimizer

from .grad_norm import nonfinite
from .guards import check_optimizer_kind
from .unit import Unit


def inner_optimizer(optimizer):
    """The plain torch optimizer that holds the state: ``optimizer.inner`` for an
    :class:`OptimizerInBackward`, else ``optimizer`` itself (what checkpoints and DCP read)."""
    return optimizer.inner if isinstance(optimizer, OptimizerInBackward) else optimizer


class OptimizerInBackward(Optimizer):
    """The optimizer of a model sharded with ``ShardConfig(step_in_backward=True)``.

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, the same objects: an LR
    scheduler's edits of ``param_groups[i]["lr"]`` are what the next unit's step reads.
    ``step()`` and ``zero_grad()`` change nothing (the backward stepped; no gradient is kept).
    ``state_dict()`` / ``load_state_dict()`` are the inner optimizer's.
    """

    _yashard_steps_in_backward = True

    def __init__(self, inner: Optimizer, units: list[Unit], device: torch.device):
        # (torch's own init: the step hooks, the hook dicts; its groups are replaced by the inner's below)
        super().__init__([{"params": list(g["params"])} for g in inner.param_groups], dict(inner.defaults))
        self.__dict__["inner"] = inner
        for name in ("param_groups", "state", "defaults"):
            self.__dict__.pop(name, None)
        # Per unit (``unit.order``): its last stepped gradient had no NaN/inf (read by the step checks)
        self._finite = torch.ones(len(units), dtype=torch.bool, device=device)
        # the masters it steps, fixed here (add_param_group is refused; load_state_dict keeps the tensors):
        # read at every unit's step, so not rebuilt from the param groups there
        self._held = frozenset(id(p) for g in inner.param_groups for p in g["params"])

    # The inner optimizer's own objects, so nothing can drift apart (load_state_dict replaces them).
    param_groups = property(lambda self: self._inner_attr("param_groups"),
                            lambda self, v: self._set_inner_attr("param_groups", v))
    state = property(lambda self: self._inner_attr("state"), lambda self, v: self._set_inner_attr("state", v))
    defaults = property(lambda self: self._inner_attr("defaults"), lambda self, v: self._set_inner_attr("defaults", v))

    def _inner_attr(self, name: str):
        inner = self.__dict__.get("inner")
        return getattr(inner, name) if inner is not None else self.__dict__[name]

    def _set_inner_attr(self, name: str, value) -> None:
        inner = self.__dict__.get("inner")
        if inner is None:  # (torch's __init__, before the inner optimizer is attached)
            self.__dict__[name] = value
        else:
            setattr(inner, name, value)

    @property
    def inner(self) -> Optimizer:
        """The plain torch optimizer that steps each unit."""
        return self.__dict__["inner"]

    def __repr__(self) -> str:
        return f"OptimizerInBackward({self.inner!r})"

    def step(self, closure: Callable | None = None):
        """Nothing to update: every unit stepped in backward. Its hooks run the step checks and
        start the next forward's gathers; call it once after each backward."""
        if closure is not None:
            raise TypeError(
                "OptimizerInBackward.step(closure): with ShardConfig(step_in_backward=True) the step runs inside "
                "backward, so a closure that re-evaluates the loss cannot be used; call step() without one"
            )
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to zero: no gradient is kept past its unit's step."""
        return None

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        if "inner" in self.__dict__:
            raise RuntimeError(
                "OptimizerInBackward.add_param_group: the model's masters are fixed at shard(); build the optimizer "
                "with every param group (model.optimizer_in_backward(cls, params=...))"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step_unit(self, unit: Unit, grad: torch.Tensor) -> None:
        """Step ``unit``'s master on ``grad``, its reduced and post-divided gradient shard (a view of
        the reduce-scatter output, or over one rank of the slot's gradient buffer). Runs in the
        reduction's follow-up, on the communication stream (events rule R7). Frozen ranges of a
        partly frozen unit are kept over the step, as around an ordinary one."""
        master = unit.master
        if id(master) not in self._held:
            return  # (a master turned off: build checked that every trained one is held)
        unit.keep_frozen()
        inner = self.inner
        master.grad = grad
        inner._yashard_stepping_unit = True  # (guards: these steps skip the optimizer-step hooks)
        try:
            inner.step()
        finally:
            inner._yashard_stepping_unit = False
            master.grad = None
        unit.restore_frozen()
        self._finite[unit.order] = ~nonfinite(grad)
        torch.autograd.graph.increment_version(master)  # (a fused step does not: every cache must see it)

    def finite_flags(self) -> torch.Tensor:
        """Per unit, whether the gradients stepped since the last call held no NaN/inf; reset."""
        out = self._finite.clone()
        self._finite.fill_(True)
        return out


def build(units: list[Unit], device: torch.device, optimizer_class, params, kwargs: dict) -> OptimizerInBackward:
    """An :class:`OptimizerInBackward` over ``units``' masters: ``optimizer_class(params, **kwargs)``,
    or ``optimizer_class`` itself when it is an optimizer already built over them."""
    if isinstance(optimizer_class, OptimizerInBackward):
        raise TypeError("optimizer_in_backward got an OptimizerInBackward; pass the torch optimizer class or instance")
    if isinstance(optimizer_class, Optimizer):
        if params is not None or kwargs:
            raise TypeError("optimizer_in_backward(optimizer): an optimizer already built takes no params or keywords")
        inner = optimizer_class
    elif isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer):
        if params is None:
            params = [u.master for u in units if u.master.requires_grad]
        inner = optimizer_class(params, **kwargs)
    else:
        raise TypeError(
            f"optimizer_in_backward expects a torch.optim.Optimizer class (torch.optim.AdamW) or instance, got "
            f"{type(optimizer_class).__name__}"
        )
    check_optimizer_kind(inner)
    masters = {id(u.master): u for u in units}
    held = [p for g in inner.param_groups for p in g["params"]]
    foreign = next((p for p in held if id(p) not in masters), None)
    if foreign is not None:
        raise ValueError(
            f"optimizer_in_backward: the optimizer holds a tensor of shape {tuple(foreign.shape)} that is not a master "
            "shard of this model; its step runs inside this model's backward, one unit at a time, so it may hold "
            "only the model's masters: model.parameters() or model.param_groups(weight_decay)"
        )
    ids = {id(p) for p in held}
    missing = [u.name for u in units if u.trains and u.master.requires_grad and id(u.master) not in ids]
    if missing:
        raise ValueError(
            f"optimizer_in_backward: the optimizer leaves out the trained master shard(s) {', '.join(missing[:4])}; "
            "with step_in_backward each unit's gradient lives only until its step, so it would be lost. Pass every "
            "trained shard (model.parameters() or model.param_groups(weight_decay)), or freeze those parameters "
            "before yashard.shard"
        )
    if any(p.grad is not None for p in held):
        raise RuntimeError("optimizer_in_backward: a master shard has a .grad; build it before the first backward "
                           "(or after optimizer.zero_grad(set_to_none=True))")
    return OptimizerInBackward(inner, units, device)
