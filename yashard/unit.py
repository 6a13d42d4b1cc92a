"""A unit: parameters that are gathered and reduced together, and their per-pass state.

A unit knows its layout, its slot, its master shard and gradient storage, and the views it puts on
the HF modules. It holds no reference to the runtime: the autograd Functions call it
(``write_grad``, ``on_grads_complete``, ``on_backward_start``) and it hands those moments to the
backward schedule it is given (:attr:`Unit.backward`), reading the shared :class:`PassState`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from .layout import FlatLayout, shard_ranges_of, uncovered_ranges

from .narrow import Narrow
from .pass_state import PassState

if TYPE_CHECKING:  # pragma: no cover
    from .buffers import Slot
    from .events import Pending


_TENSOR_DATA = torch._C.TensorBase.data  # torch's own .data: an alias with a version counter of its own


class MasterShard(nn.Parameter):
    """A unit's master shard (fp32; a frozen unit's in a 16-bit ``param_dtype``:
    :func:`yashard.build.master_dtype`): an ``nn.Parameter`` whose ``.data`` reads as ``detach()``, the
    same storage *and the same version counter*. An in-place write through ``p.data``
    (``p.data.clamp_(...)``, weight-init code, optimizers written the old way) therefore moves the
    shard's version like any in-place write under ``torch.no_grad()``, and the runtime gathers and
    casts the new values; through a plain Parameter's ``.data``, which counts versions of its own,
    the write would go unseen and stale gathered weights would be used. Assigning ``p.data = x``
    still swaps the storage, which the runtime refuses (:func:`yashard.integrity.check_master_storage`)."""

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _TENSOR_DATA.__set__(self, value)


def own_version_alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage under a version counter of its own (torch's ``.data``, also for a
    :class:`MasterShard`): in-place writes through the alias move only its counter, writes to ``t``
    only ``t``'s."""
    return _TENSOR_DATA.__get__(t)


def storage_key(t: torch.Tensor) -> tuple:
    """Where and what ``t``'s data is: a ``p.data = x`` (or a module's ``_apply``) changes it, an
    in-place write does not."""
    return (t.data_ptr(), tuple(t.shape), t.dtype, t.device)


class Unit:
    """One decoder layer, the embedding, the lm_head, or the group of all 1-D parameters.

    Owns the master shard (an ``nn.Parameter`` the optimizer sees; fp32, or ``param_dtype`` for a
    unit with no trainable parameter: :func:`yashard.build.master_dtype`), its persistent fp32
    gradient storage, and the bookkeeping of the current forward/backward pass. Parameters of the
    original modules are replaced by views into ``slot.weights`` (see :mod:`yashard.narrow`).
    """

    def __init__(
        self,
        state: PassState,
        shard_rank: int,
        name: str,
        kind: str,
        index: int,
        layout: FlatLayout,
        locations: list[list[tuple[nn.Module, str]]],
        fqns: list[list[str]],
        slot: "Slot",
        master: nn.Parameter,
        trainable: list[bool] | None = None,
        keep_grads: bool = True,
    ):
        self.state = state          # the pass state shared with the runtime's components
        # What the autograd Functions' moments are handed to (the backward schedule: set by the runtime).
        self.backward: BackwardHooks | None = None
        self.name = name
        self.kind = kind            # "layer" | "outer" | "small" (a resident group: the norm or adapter group)
        self.index = index          # layer index, -1 for non-layers
        self.layout = layout
        self.locations = locations  # per entry: every (module, attribute) that holds the parameter
        self.fqns = fqns            # per entry: every HF name of the parameter (tied names included)
        self.slot = slot
        self.master = master
        self.ref = weakref.ref(self)  # (what the autograd nodes of this unit hold: see Narrow)
        self._grad_views: list[torch.Tensor] | None = None  # per entry: its range of the grad slot
        self._flat_grads: torch.Tensor | None = None  # the unit's padded range of the grad slot
        # What the master's storage is: gathers, the gradient buffer's attachment, checkpoint views
        # and the optimizer state all assume it stays (see integrity.check_master_storage).
        self.master_storage = storage_key(master)
        # Per entry: did the parameter require gradients when yashard.shard ran (fixed from then on).
        # Frozen entries get plain views (autograd computes no gradient for them); a unit with no
        # trainable entry has no gradient storage, and its master never requires gradients.
        self.trainable = list(trainable) if trainable is not None else [True] * len(layout.entries)
        if len(self.trainable) != len(layout.entries):
            raise ValueError(f"{len(self.trainable)} trainable flags for {len(layout.entries)} entries of {name}")
        # Whether any parameter trains: the unit reduces its gradients and the optimizer steps it.
        self.trains = any(self.trainable)
        # Its persistent fp32 gradient (attached as master.grad); none with ShardConfig.step_in_backward
        # (``keep_grads=False``): the step reads the reduce-scatter output (yashard.step_in_backward).
        self.grad_storage: torch.Tensor | None = None
        if self.trains and keep_grads:
            self.grad_storage = torch.zeros_like(master, memory_format=torch.contiguous_format)
        elif not self.trains:
            master.requires_grad_(False)
        # Partly frozen: this rank's shard ranges of the frozen entries, and their values, kept over
        # each optimizer step (the step sees zero gradients there but may still move them: weight
        # decay) and put back after it (:meth:`keep_frozen` / :meth:`restore_frozen`).
        self.frozen_ranges: list[tuple[int, int]] = []
        self.frozen_values: torch.Tensor | None = None
        if self.trains and not all(self.trainable):
            self.frozen_ranges = shard_ranges_of(layout, shard_rank, [not t for t in self.trainable])
            n = sum(hi - lo for lo, hi in self.frozen_ranges)
            self.frozen_values = torch.empty(n, dtype=master.dtype, device=master.device) if n else None
        self.frozen_kept = False
        self.gather_src = master    # direct slots, fp32 master, 16-bit param_dtype: its cast copy (build.make_units)
        self.direct_source: torch.Tensor | None = None  # direct slots (shard world 1): gather_src's alias
        # A byte unit (bitsandbytes 4-bit weights): per entry, what turns its bytes in the slot into
        # the weight the module computes with (yashard.bnb4.Rebuild); None: the views are the values.
        self.rebuild: list | None = None
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's secondary slice of the gathered unit
        self.secondary_version = -1  # master._version of the weights ``secondary`` holds
        self.order = -1             # position in the runtime's units (index of its check flags)
        self.name_in_traces(name)   # (build names the HF module path)
        self.token = torch.empty(0, device=master.device, requires_grad=True)
        self.frozen_token = torch.empty(0, device=master.device)  # the gate's token while frozen
        # Per-pass state.
        self.gathered: "Pending | None" = None
        self.gathered_version = -1  # master._version of the shards ``gathered`` was gathered from
        self.fwd_id = -1            # id of the last grad-enabled forward this unit ran in
        self.fwd_version = -1       # master._version at that forward
        self.fwd_trains = False     # that forward computed gradients for this unit's parameters
        self.fwd_backward = False   # its outputs required gradients (its backward runs: BackwardEntry)
        self.next_forward: Unit | None = None
        self.grad_claimed = False
        self.written = [False] * len(layout.entries)
        # Per entry: did this rank's backwards give it a gradient since the last optimizer step, or
        # since .grad was dropped (the step's checks tell a parameter no rank's loss reached: see
        # guards.step_checks).
        self.got_grad = [False] * len(layout.entries)
        # Since then, a backward attached grad_storage as .grad where it was None (a shard no rank's
        # backward reached goes back to None at the step: guards.step_checks).
        self.attached_from_none = False
        self.grad_end_version = -1  # grad_storage._version at the end of the last backward
        self.reduced_in_pass = False
        self.skip_step = False  # step_in_backward: no rank's loss reached it in this backward (no step)
        # no_sync(): the grad slot holds this unit's gradients of earlier backwards, not yet reduced
        # (only with reshard_after_forward=False, where the slot is the unit's alone; over one rank
        # they are in master.grad, and the flag only makes the step refuse as on more ranks).
        self.unreduced = False
        self.unreduced_version = -1  # grad_storage._version then: a zero_grad since drops them
        # When the module views come off again: None (the slot is this unit's alone, so they stay
        # right), "forward" or "backward" (set by the runtime).
        self.views_until = None
        # Activation checkpointing (a checkpointed layer, and the norm group when any layer is):
        # the views of the last grad-enabled forward, which the recompute in backward must read
        # (put back by restore_backward_views).
        self.keep_backward_views = False
        self.backward_views: list[torch.Tensor] | None = None
        # master.grad was attached after a zero_grad(set_to_none=True) and holds nothing yet: the
        # first reduction of the backward writes it instead of adding to it (over one rank, each
        # entry's first Narrow write, and zero_unwritten the rest).
        self.grad_unwritten = False

    def __repr__(self) -> str:
        return f"Unit({self.name}, {self.layout.total} params, slot={self.slot.name})"

    def name_in_traces(self, path: str) -> None:
        """Label this unit's collectives in profiler traces with ``path``, the HF module path
        ("model.layers.3", "lm_head"; "norm group"), as FSDP2 does: ``yashard::all_gather (path)``,
        ``yashard::reduce_scatter (path)``, ``yashard::post_divide (path)``. Made once, here: a
        step formats no label (:func:`yashard.events.labelled` records one only while a profiler
        records)."""
        self.path = path
        self.gather_label = f"yashard::all_gather ({path})"
        self.reduce_label = f"yashard::reduce_scatter ({path})"
        self.post_divide_label = f"yashard::post_divide ({path})"

    # ---- views -------------------------------------------------------------------------------
    def install_views(self, token: torch.Tensor | None, grad_forward: bool = False) -> None:
        """Point every owning module attribute at a view of this unit's slot.

        With ``token`` the views of trainable entries are :class:`~yashard.narrow.Narrow` outputs
        (gradients flow into the grad slot); every other view is a plain view (no autograd): frozen
        entries, and every entry without ``token`` (no-grad forwards, a unit frozen for this forward).
        ``grad_forward``: this is a grad-enabled forward, whose views an activation-checkpointed
        unit keeps for its recompute.
        """
        weights = self.slot.weights
        views = []
        for i, (entry, locs) in enumerate(zip(self.layout.entries, self.locations)):
            if token is not None and self.trainable[i]:
                view = Narrow.apply(token, weights, self, i)
            else:
                view = weights.narrow(0, entry.offset, entry.numel).view(entry.shape)
                if self.rebuild is not None:
                    view = self.rebuild[i](view)
            views.append(view)
            for module, attr in locs:
                module.__dict__[attr] = view
        if grad_forward and self.keep_backward_views:
            self.backward_views = views

    def restore_backward_views(self, views: list[torch.Tensor] | None = None) -> None:
        """Put back the views of a grad-enabled forward (``views``, else the last ones kept): when an
        activation-checkpointed layer's backward starts, the recompute must build its graph on them
        (so gradients reach the grad slot through ``Narrow``), and a no-grad forward since (an
        evaluation, ``generate()``) installed plain views, or the end of a backward took them off
        (``retain_graph=True``, then a second backward). They show the same slot range the backward
        re-gathered the unit into. A layer's views are kept by its ``BackwardEntry`` node (as long
        as that forward's graph lives), the norm group's (from a leaf token: no graph) here."""
        views = self.backward_views if views is None else views
        if views is None:
            return
        for view, locs in zip(views, self.locations):
            for module, attr in locs:
                module.__dict__[attr] = view

    def remove_views(self) -> None:
        """Take the views off the modules again. A slot another unit takes over next would
        otherwise show that unit's weights under this unit's names (``layer.q_proj.weight`` read
        after the forward); reading them now raises, naming what to use instead."""
        for locs in self.locations:
            for module, attr in locs:
                module.__dict__.pop(attr, None)

    # ---- frozen parameters in a trained unit ---------------------------------------------------
    @torch.no_grad()
    def keep_frozen(self) -> None:
        """Before an optimizer step: copy this rank's frozen ranges of the master aside."""
        if self.frozen_values is None:
            return
        pos = 0
        for lo, hi in self.frozen_ranges:
            self.frozen_values[pos : pos + hi - lo].copy_(self.master.detach()[lo:hi])
            pos += hi - lo
        self.frozen_kept = True

    @torch.no_grad()
    def restore_frozen(self) -> None:
        """After an optimizer step: put the frozen ranges back as they were before it."""
        if not self.frozen_kept:
            return
        pos = 0
        for lo, hi in self.frozen_ranges:
            self.master.detach()[lo:hi].copy_(self.frozen_values[pos : pos + hi - lo])
            pos += hi - lo
        self.frozen_kept = False

    # ---- backward ----------------------------------------------------------------------------
    def write_grad(self, index: int, grad: torch.Tensor) -> None:
        """Called by ``Narrow.backward``: put one parameter's gradient into the grad slot (over one
        rank, :func:`~yashard.build.direct_grads`: add it to ``master.grad``)."""
        self.backward.begin_backward()
        if not self.state.accumulating:  # torch.autograd.grad / backward(inputs=...): no parameter's .grad changes
            return
        if grad.requires_grad:
            raise RuntimeError(
                f"backward(create_graph=True) reached {self.name}: yashard writes each gradient into its flat "
                "gradient buffer as data, so a graph of the gradients (higher-order gradients, gradient "
                "penalties) cannot be built through a sharded model. Call backward() without create_graph"
            )
        target = self.grad_destination(index)
        if target is not None:
            dst, add = target
            dst.add_(grad) if add else dst.copy_(grad)

    def grad_destination(self, index: int) -> tuple[torch.Tensor, bool] | None:
        """Where parameter ``index``'s gradient of this backward goes: its range of the grad slot
        (over one rank, of ``master.grad``), in the parameter's shape, and whether to add to what it
        holds (else write over it); None when nothing is written (``torch.autograd.grad``, a shard
        turned off). Takes the grad slot for this backward first (R4). What ``write_grad`` writes
        through; the fused chunked loss (:mod:`yashard.fused_head`) adds its chunks into it."""
        self.backward.begin_backward()
        if not self.state.accumulating:  # torch.autograd.grad / backward(inputs=...): no parameter's .grad changes
            return None
        if not self.grad_claimed:
            self.backward.claim_grad_slot(self)
        self.got_grad[index] = True
        if self.state.direct_grads:  # one rank: the gradient goes straight into master.grad, summed as torch would
            target = self.master.grad
            if target is None or not self.master.requires_grad:  # turned off since its forward: as
                return None                                     # torch, nothing accumulates into it
            dst = self.grad_views()[index] if target is self.grad_storage else self._entry_view(target, index)
            if self.written[index] or not self.grad_unwritten:
                return dst, True
            self.written[index] = True  # the first write into a gradient that zero_grad(set_to_none=True) dropped
            return dst, False
        add = self.written[index] or self.unreduced
        if not add:
            self.written[index] = True
        return self.grad_views()[index], add

    def flat_grads(self) -> torch.Tensor:
        """The unit's flat, padded range of the grad slot (what its reduction reads; made once)."""
        if self._flat_grads is None:
            self._flat_grads = self.slot.grads.narrow(0, 0, self.layout.padded)
        return self._flat_grads

    def grad_views(self) -> list[torch.Tensor]:
        """Per entry, its range of the grad slot in the parameter's shape (with
        ``PassState.direct_grads``: of the unit's persistent gradient storage); made once, as both
        live as long as the runtime."""
        if self._grad_views is None:
            self._grad_views = self._entry_views(self.grad_storage if self.state.direct_grads else self.slot.grads)
        return self._grad_views

    def forget_grad_views(self) -> None:
        """The gradient buffers changed (a comm hook gave the slots theirs): make the views again."""
        self._grad_views = self._flat_grads = None

    def _entry_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self._entry_view(flat, i) for i in range(len(self.layout.entries))]

    def _entry_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Entry ``index``'s range of a flat unit-sized tensor, in the parameter's shape."""
        e = self.layout.entries[index]
        return flat.narrow(0, e.offset, e.numel).view(e.shape)

    def zero_unwritten(self) -> None:
        """Zero every grad-slot range of this unit that this pass did not write.

        Parameters that got no gradient must not inherit the previous owner's values; alignment
        gaps and padding are re-zeroed only when the previous writer had another layout. Under
        ``no_sync()`` accumulation the ranges keep what earlier backwards wrote.
        """
        if self.state.direct_grads:  # master.grad itself: only a dropped one (set_to_none) holds stale values
            grads = self.master.grad
            if grads is not None and self.grad_unwritten:
                for lo, hi in uncovered_ranges(self.layout, self.written) + list(self.layout.gaps()):
                    grads[lo:hi].zero_()
                self.grad_unwritten = False
            return
        grads = self.slot.grads
        if not self.unreduced:  # else those ranges hold earlier micro-batches' gradients
            for lo, hi in uncovered_ranges(self.layout, self.written):
                grads[lo:hi].zero_()
        sig = self.layout.signature
        if self.slot.zeroed_signature != sig:
            for lo, hi in self.layout.gaps():
                grads[lo:hi].zero_()
            self.slot.zeroed_signature = sig

    def on_grads_complete(self) -> None:
        """``GateGradFlow.backward``: all of this unit's gradients are in the grad slot."""
        self.backward.on_unit_grads_complete(self)

    def on_backward_start(self, fwd_id: int, views: list[torch.Tensor] | None = None) -> None:
        """``BackwardEntry.backward``: gradients of this unit's outputs (of forward ``fwd_id``) are
        ready; ``views``: its parameter views of that forward (activation-checkpointed layers)."""
        self.backward.on_unit_backward_start(self, fwd_id, views)

    def drop_unreduced_if_zeroed(self) -> None:
        """A ``zero_grad()`` since a ``no_sync()`` backward drops what it accumulated, as in DDP: the
        unit's ``.grad`` was set to None (or another tensor), or zeroed (its version moved)."""
        if self.unreduced and (self.grad_unwritten or self.master.grad is not self.grad_storage
                               or self.grad_storage._version != self.unreduced_version):
            self.unreduced = False


class BackwardHooks(Protocol):
    """What a unit hands its backward moments to (the runtime's backward schedule)."""

    def begin_backward(self) -> None: ...

    def claim_grad_slot(self, unit: Unit) -> None: ...

    def on_unit_grads_complete(self, unit: Unit) -> None: ...

    def on_unit_backward_start(self, unit: Unit, fwd_id: int, views: list[torch.Tensor] | None) -> None: ...


def same_named_subclass(cls: type, cache: dict, members: dict) -> type:
    """A subclass of ``cls`` with ``cls``'s name, module and qualname and the given ``members``,
    made once per class (``cache``): what the runtime gives HF modules whose behaviour it changes,
    so ``type(m).__name__``, ``isinstance`` and reprs stay as they were."""
    sub = cache.get(cls)
    if sub is None:
        sub = cache[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                        **members})
    return sub
