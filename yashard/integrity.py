"""Integrity checks: what the runtime refuses because it would otherwise be silently wrong.

Each check raises before anything changes, naming the cause and the fix: in-place writes through
the modules' gathered weights, a master shard whose storage was replaced, hooks or gradients
asked of shards that cannot have them, parameters added after ``shard()``, gradients that were
never reduced, ``no_sync()`` where unreduced gradients cannot be held exactly, and freezing or
unfreezing after ``shard()``. The runtime runs them at forwards and optimizer steps.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import torch
from torch import nn

from .buffers import Slot
from .build import module_name
from .config import ShardConfig, dtype_name
from .errors import some_names
from .pass_state import PassState
from .patch.spec import ModelSpec
from .unit import Unit, storage_key


def check_slot_writes(slots: dict[str, Slot], config: ShardConfig, spec: ModelSpec,
                      forget_casts: Callable[[], None]) -> None:
    """Refuse in-place writes through the modules' views of gathered weights (the norm group's
    stay installed between forwards): they change a gathered copy, not the master shards, so
    they would be used until the next gather and then lost. The slot's weights are gathered
    again before the error is raised; ``forget_casts`` has the param_dtype copies cast
    again where the write went into a direct slot's shard."""
    for slot in slots.values():
        if slot.weights._version != slot.weights_version:
            slot.weights_version = slot.weights._version
            owner = slot.owner
            slot.owner = None  # gathered again at the next forward
            if owner is not None:
                owner.gathered = None
            where = ""
            if slot.direct:  # the views read the unit's own shard: the write went into it
                if owner is not None and owner.gather_src is owner.master:  # (fp32, or a 16-bit frozen master)
                    where = (" On one rank (shard world 1) these views are the master shards themselves, "
                             "so this write did change them; on more ranks it would not have.")
                forget_casts()  # (a param_dtype copy is cast from the masters again)
            raise RuntimeError(
                f"the gathered weights of {module_name(spec, owner) if owner is not None else 'a unit'} were "
                "written in place through the model's modules (e.g. model.model.norm.weight.fill_(1.0)): they "
                "are a copy gathered from the "
                "master shards, so the write would be used until the next gather, then lost, and "
                "full_state_dict() would not show it." + where + " Write the weights through yashard (dcp.load "
                "into model.sharded_state_dict(), yashard.load_checkpoint) or in place into model.parameters() "
                "under torch.no_grad()"
            )


def check_master_storage(units: list[Unit]) -> None:
    """Refuse a master shard whose data was replaced (``p.data = x``, or a module-wide
    ``_apply``: ``model.cuda()``, ``model.to_empty(...)``): the gathered copies, the gradient
    buffer attached as its ``.grad``, the checkpoint views and the frozen ranges all point at the
    storage ``shard()`` gave it, so the new data would be used by some of them and not others.
    (An in-place write, ``p.copy_(x)`` under ``torch.no_grad()``, keeps the storage and moves the
    version counter: it is the way.)"""
    for u in units:
        if storage_key(u.master) != u.master_storage:
            m = u.master
            was_ptr, was_shape, was_dtype, was_device = u.master_storage
            raise RuntimeError(
                f"the master shard {u.name} no longer holds the storage yashard.shard gave it (now "
                f"{tuple(m.shape)} {dtype_name(m.dtype)} on {m.device}, was {was_shape} {dtype_name(was_dtype)} "
                f"on {was_device}{', another buffer' if m.data_ptr() != was_ptr else ''}): it was replaced, "
                "through p.data = ... or a module-wide .cuda()/.to_empty()/_apply. yashard's gathered weights, "
                "gradient buffer, checkpoint views and optimizer state refer to the old storage, so the new data "
                "would be seen by some and not others. Write new values in place instead: with torch.no_grad(): "
                "p.copy_(new_values)"
            )


def check_masters(units: list[Unit]) -> None:
    """Refuse what autograd would silently ignore on the master shards: a shard whose parameters
    were all frozen at ``shard()`` set to require gradients (it has no gradient storage), and
    hooks registered on one (the reduction writes ``.grad`` itself, so autograd never calls them)."""
    for u in units:
        m = u.master
        if m.requires_grad and not u.trains:
            names = some_names([f[0] for f in u.fqns])
            raise ValueError(
                f"the master shard {u.name} was set to require gradients, but its parameters ({names}) were all "
                "frozen (requires_grad=False) when yashard.shard ran, so it has no gradient buffer: it would train "
                "nothing. Leave them unfrozen before yashard.shard to train them, or set this shard's "
                "requires_grad back to False"
            )
        if m._backward_hooks or getattr(m, "_post_accumulate_grad_hooks", None):
            raise ValueError(
                f"a hook is registered on the master shard {u.name} (register_hook / "
                "register_post_accumulate_grad_hook): yashard writes the reduced gradient into .grad itself, so "
                "autograd would never call it. Step the optimizer after backward(); to act on gradients as they "
                "are reduced, use model.register_comm_hook"
            )


class NewParameterCheck:
    """Raises if the HF module holds a parameter again (``yashard.shard`` took them all)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._structure = None  # (module, its parameters, its children) at the last full walk

    def __call__(self) -> None:
        """Raise if the HF module holds a parameter again (``yashard.shard`` took them all): one added
        after sharding (a module replaced, say) is neither sharded nor reduced across ranks.

        The full walk runs when a module's parameters or children differ from the last walk's
        (a parameter set, a module added or replaced, anywhere in the model); otherwise a snapshot
        comparison (identity of each module's entries) stands for it."""
        snapshot = self._structure
        if snapshot is not None and all(tuple(m._parameters.values()) == params and tuple(m._modules.values()) == kids
                                        for m, params, kids in snapshot):
            return
        name, p = next(iter(nn.Module.named_parameters(self.model)), (None, None))  # (not the shards it answers)
        if name is not None:
            raise RuntimeError(
                f"{name} (shape {tuple(p.shape)}) is a parameter of the sharded model that yashard.shard did not shard: "
                "it was added afterwards (peft's get_peft_model, a module replaced or appended?), so its gradient is "
                "never reduced across ranks and the ranks' copies drift apart. Apply it before sharding: "
                "yashard.shard(get_peft_model(model, lora_config)), or make the change on the unsharded model and "
                "shard that; or freeze it as a buffer"
            )
        self._structure = [(m, tuple(m._parameters.values()), tuple(m._modules.values())) for m in self.model.modules()]


def check_no_sync(config: ShardConfig, state: PassState) -> None:
    """Refuse ``no_sync()`` where unreduced gradients cannot be held exactly. Over one rank
    (:func:`yashard.build.direct_grads`) they accumulate in ``master.grad`` itself: nothing to refuse."""
    if config.step_in_backward:
        raise RuntimeError(
            "no_sync() with ShardConfig(step_in_backward=True): gradient accumulation needs the gradients of every "
            "micro-batch summed before the step, but each backward steps every unit on its own gradients (none are "
            "kept); train with one backward per step, or use the ordinary step (drop step_in_backward)"
        )
    if state.direct_grads:
        return
    if config.reshard_after_forward:
        raise RuntimeError(
            "model.no_sync() needs ShardConfig(reshard_after_forward=False): by default the decoder layers take "
            "turns in two gradient buffers, so a layer's gradients must be reduced before the layer two below "
            "writes its own. Shard with reshard_after_forward=False (every unit keeps a buffer of its own; "
            "memory_plan() shows the cost) or drop no_sync() (reducing every micro-batch gives the same gradients)"
        )
    if config.wire_dtype != torch.float32:
        raise RuntimeError(
            f"model.no_sync() would add micro-batches' gradients in the reduce_dtype="
            f"{str(config.wire_dtype).replace('torch.', '')} gradient buffers, rounding at every micro-batch; "
            "use ShardConfig(reduce_dtype=torch.float32) or drop no_sync() (each micro-batch's reduced gradient "
            "is then accumulated in fp32)"
        )


def check_grads_reduced(state: PassState, units: list[Unit], spec: ModelSpec, what: str) -> None:
    """Raise if a ``no_sync()`` backward left gradients that were never reduced across ranks, or
    if the last backward raised (its gradients are incomplete until the next forward resets)."""
    if state.in_backward:
        raise RuntimeError(
            f"{what} after a backward that raised: its gradients are incomplete (some reductions never ran). "
            "Call optimizer.zero_grad() and go on with the next batch: its forward resets the runtime"
        )
    for u in units:
        u.drop_unreduced_if_zeroed()
    held = [module_name(spec, u) for u in units if u.unreduced]
    if held:
        names = some_names(held)
        raise RuntimeError(
            f"{what} after a backward inside model.no_sync(): the gradients of {names} were accumulated on "
            "this rank but never reduced across ranks. Run the last micro-batch's forward and backward outside "
            "no_sync() (that backward reduces everything accumulated), or zero_grad() to drop them"
        )


def set_requires_grad(units: list[Unit], requires_grad: bool) -> None:
    """``requires_grad_`` of the whole sharded model: every master shard off, or back to what
    ``shard()`` decided (a shard whose parameters were all frozen then stays off)."""
    for u in units:
        u.master.requires_grad_(requires_grad and u.trains)


def refuse_freezing_after_shard(model: nn.Module, units_of: Callable[[], list[Unit] | None]) -> None:
    """Make ``requires_grad_`` of every submodule of ``model`` refuse what would freeze nothing (the
    root's own reaches the shards: :mod:`yashard.sharded_model`). ``units_of()``: the model's
    units, or None once its runtime is gone."""
    for module in list(model.modules())[1:]:
        object.__setattr__(module, "requires_grad_",
                           types.MethodType(functools.partial(_module_requires_grad, units_of), module))


def _module_requires_grad(units_of, self, requires_grad: bool = True):
    """``requires_grad_`` of every submodule of a sharded HF model. Its parameters now live in
    master shards that hold other modules' parameters too, and which parameters train is fixed
    at ``shard()``: freezing one now (``False``) would freeze nothing, and unfreezing (``True``)
    parameters frozen then would train nothing, so both raise; ``True`` on trainable ones is a no-op."""
    if not requires_grad:
        raise ValueError(
            f"{type(self).__name__}.requires_grad_(False) on a yashard-sharded model: which parameters train is "
            "fixed when yashard.shard runs (this module's parameters now live in master shards shared with other "
            "modules), so this would freeze nothing. Freeze them before yashard.shard (module.requires_grad_(False) "
            "on the unsharded model), or turn a whole master shard off (a tensor of model.parameters())"
        )
    units = units_of() or ()
    mine = {id(m) for m in self.modules()}
    frozen = [fqns[0] for u in units for ok, locs, fqns in zip(u.trainable, u.locations, u.fqns)
              if not ok and any(id(m) in mine for m, _ in locs)]
    if frozen:
        names = some_names(frozen)
        raise ValueError(
            f"{type(self).__name__}.requires_grad_(True) on a yashard-sharded model: {names} were frozen "
            "(requires_grad=False) when yashard.shard ran and stay frozen (they have no gradient storage). Leave them "
            "unfrozen before yashard.shard to train them"
        )
    return nn.Module.requires_grad_(self, requires_grad)
