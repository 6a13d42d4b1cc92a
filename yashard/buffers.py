"""Preallocated buffer slots: the only memory gathered weights and unreduced gradients ever use.

A :class:`Slot` is a weight buffer (``param_dtype``) and a gradient buffer (``reduce_dtype``, or
``param_dtype`` when that is the narrower: :func:`yashard.build.compact_grads`), allocated once at
:func:`yashard.shard` time and reused for the whole run. More buffers are shared by all slots: the
reduce-scatter output (reductions run one after another, rule R6 in :mod:`yashard.events`), with
16-bit gradient buffers the reduction's fp32 staging buffer, and, with qwZ, the codes workspace (a
quantized gather has finished dequantizing before the next one starts). Units take turns owning a slot:

* slots 0 and 1 alternate between even and odd decoder layers (sized by the largest layer);
* the *outer* slot is shared by the embedding and the lm_head (they never need their weights at the
  same time), so a large vocabulary never inflates the layer slots;
* the *small* slot holds the group of all 1-D parameters, resident for the whole step.

With ``ShardConfig(reshard_after_forward=False)`` every unit owns a slot of its own instead (named
after the unit): weights stay gathered until the masters change, and gradients may wait in the
slot, unreduced, across micro-batches (``ShardedModel.no_sync``).

Over a shard group of one rank (one process, or hybrid sharding with ``shard_group_size=1``) a shard
is the whole unit, so there is nothing to gather: slots are then *direct*. They hold gradients only,
and :meth:`Slot.show` points their weights at the owning unit's own shard (its ``param_dtype`` gather
source), which the modules' views read in place: no copy, and no weight buffer. Over one
data-parallel rank with fp32 reductions they hold no gradients either (``PassState.direct_grads``:
``Narrow`` adds them to the masters' gradients in place), so their buffers are empty.

With ``ShardConfig(share_outer_slot=True)`` the two layer slots lie end to end in one buffer
(:class:`SharedBuffer`, one for the weights and one for the gradients), and the embedding and the
lm_head get slots that are views into it (:func:`yashard.layout.outer_arena` places them): no outer
slot of their own. Slots that share memory know it (``overlaps``, ``grad_overlaps``), and the rules
of :mod:`yashard.events` then hold for every slot a write touches (R1, R4), not just its own.

A slot remembers its current weight owner, the event that releases it, whether compute may still
read it (``reading``) or it holds a gather no compute used yet (``fresh``), and the reduction that
is still reading its gradient buffer; the gathers, the backward schedule and the reduction enforce
the ordering rules of :mod:`yashard.events` through these fields.
"""

from __future__ import annotations

import torch


class Slot:
    """One weight buffer + one gradient buffer, owned in turn."""

    def __init__(self, name: str, numel: int, world: int, param_dtype, grad_dtype, device, *, direct: bool = False,
                 grad_numel: int | None = None, shared: "SharedBuffer | None" = None):
        if numel % world:
            raise ValueError(f"slot {name}: size {numel} is not a multiple of world size {world}")
        if direct and world != 1:
            raise ValueError(f"slot {name}: a direct slot shows a unit's own shard, which is the whole unit "
                             f"only over one rank, not {world}")
        self.name = name
        self.numel = numel
        self.direct = direct
        # (sized by the units with a trainable parameter: 0 if every unit using the slot is frozen)
        self.grad_numel = numel if grad_numel is None else grad_numel
        self.shared = shared  # the buffer this slot is a view of, or None: it allocated its own
        if shared is None:
            self.weights = torch.empty(0 if direct else numel, dtype=param_dtype, device=device)
            self.grads = torch.zeros(self.grad_numel, dtype=grad_dtype, device=device)
        else:
            # (``.data``: each view under a version counter of its own, as a buffer of its own has,
            # so a write through one slot's module views is told from the others')
            self.weights = shared.weights.narrow(0, shared.weight_arena.offsets[name], numel).data
            self.grads = shared.grad_view(name)
        self.overlaps: list[Slot] = []       # other slots sharing weight memory with this one
        self.grad_overlaps: list[Slot] = []  # ... gradient memory
        # Aliases with their own autograd version counters: collectives write through these, so
        # refilling a buffer never trips autograd's "modified by an inplace operation" check on the
        # parameter views saved for backward (the refill is ordered by events, not by autograd).
        self.weights_io = self.weights.data
        # slot.weights' own version counter then moves only when something else writes through the
        # modules' views of it (a user's in-place edit): the runtime compares it with this
        self.weights_version = self.weights._version
        # Ownership state.
        self.owner = None            # unit whose weights are (being) gathered here
        self.release = None          # event: compute finished reading the owner's weights
        self.reading = False         # compute may read the owner's weights (from ensure to release)
        self.fresh = False           # a gather no compute used yet (a prefetch)
        self.grad_owner = None       # unit whose gradients are (being) written here
        self.grad_busy = None        # Pending reduction still reading the gradient buffer
        self.zeroed_signature = None  # layout whose non-parameter ranges are known to be zero

    def show(self, source: torch.Tensor) -> None:
        """Direct slots: make ``source`` (a unit's whole-unit shard, through an alias with its own
        version counter) the weights the views read, in place of a gathered copy."""
        self.weights = source
        self.weights_version = source._version

    def tensors(self) -> dict[str, torch.Tensor]:
        """The buffers this slot allocated (a direct slot's weights belong to the units; a view of a
        :class:`SharedBuffer`, none)."""
        if self.shared is not None:
            return {}
        return {"grads": self.grads} if self.direct else {"weights": self.weights, "grads": self.grads}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class SharedBuffer:
    """The weight buffer and the gradient buffer that the layer slots and the outer units' slots
    are views of (``ShardConfig.share_outer_slot``), laid out by two
    :class:`~yashard.layout.Arena`: one over the weight sizes, one over the gradient sizes."""

    def __init__(self, weight_arena, grad_arena, param_dtype, grad_dtype, device):
        self.weight_arena = weight_arena
        self.grad_arena = grad_arena
        self.weights = torch.empty(weight_arena.numel, dtype=param_dtype, device=device)
        self.grads = torch.zeros(grad_arena.numel, dtype=grad_dtype, device=device)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weights": self.weights, "grads": self.grads}

    def grad_view(self, name: str) -> torch.Tensor:
        """Slot ``name``'s gradient buffer: its range of :attr:`grads`."""
        lo, hi = self.grad_arena.span(name)
        return self.grads.narrow(0, lo, hi - lo).data

    def link(self, slots: dict[str, "Slot"]) -> None:
        """Tell each slot which others share its memory."""
        for name, slot in slots.items():
            if slot.shared is self:
                slot.overlaps = [slots[o] for o in self.weight_arena.overlaps(name) if o in slots]
                slot.grad_overlaps = [slots[o] for o in self.grad_arena.overlaps(name) if o in slots]
