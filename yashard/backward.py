"""The backward schedule: re-gather each unit, collect its gradients, reduce them once complete.

Autograd drives it through the unit's autograd Functions:

* ``BackwardEntry.backward`` (:meth:`BackwardSchedule.on_unit_backward_start`): the unit's output
  gradients are ready; its weights are re-gathered (R2) and the next unit's prefetched;
* ``Narrow.backward`` (``Unit.write_grad``): a parameter's gradient goes into the unit's grad slot,
  taken for this backward first (:meth:`BackwardSchedule.claim_grad_slot`, R4);
* ``GateGradFlow.backward`` (:meth:`BackwardSchedule.on_unit_grads_complete`): the unit's gradients
  are complete; its slot is released (R1) and its reduction starts (R3,
  :class:`~yashard.reduction.Reducer`);
* the engine's final callback (``_end_backward``): the norm group and anything not yet reduced
  are reduced, everything is waited for, and gradients no backward wrote go back to ``None``.

A backward that raised is recovered from by the next forward
(:meth:`BackwardSchedule.recover_from_failed_backward`).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .buffers import Slot
from .build import UnitSet
from .errors import OrderError
from .events import Streams
from .gate_grad_flow import will_accumulate
from .gathers import Gathers
from .grad_norm import ForwardSums
from .norm_group import NormGroup
from .pass_state import PassState
from .patch.spec import ModelSpec
from .reduction import Reducer
from .unit import Unit

logger = logging.getLogger("yashard")


class BackwardSchedule:
    """What each unit's backward moments do (the :class:`~yashard.unit.BackwardHooks` of the units)."""

    def __init__(self, spec: ModelSpec, state: PassState, units: UnitSet, slots: dict[str, Slot], streams: Streams,
                 gathers: Gathers, reducer: Reducer, sums: ForwardSums, drain: Callable[[], None]):
        self.spec = spec
        self.state = state
        self.units = units
        self.slots = slots
        self.streams = streams
        self.gathers = gathers
        self.reducer = reducer
        self.sums = sums
        self.drain = drain  # wait for every gather and reduction in flight (the runtime's)
        self.norm_group: NormGroup | None = None  # (built on this schedule's on_unit_grads_complete)
        # ShardConfig.step_in_backward (the reducer's step_unit steps each unit: set by the runtime)
        self.steps_in_backward = False

    def begin_backward(self) -> None:
        """First hook of a backward: attach grad storage and queue the end-of-backward callback."""
        state = self.state
        if state.in_backward:
            return
        if _in_compiled_autograd():
            raise RuntimeError(
                "a sharded model's backward ran under compiled autograd (torch._dynamo.compiled_autograd, or "
                "torch._dynamo.config.compiled_autograd=True): yashard's backward hooks reduce gradients and "
                "re-gather weights as each layer's backward starts and ends, which compiled autograd would trace "
                "into one graph. Run backward() without it; the forward can still be compiled "
                "(layer.compile() or torch.compile(model))"
            )
        if self.steps_in_backward and any(will_accumulate(u.token) for u in self.units.units
                                          if u.fwd_trains and u.fwd_id == state.grad_fwd_id):
            self._check_step_in_backward()  # (before anything moves: a refused backward leaves no state)
        state.in_backward = True
        Gathers.settle(self.slots.values())
        self.reducer.bucket_index = 0
        state.bwd_last_layer = None
        for u in self.units.units:
            u.reduced_in_pass = False
        # torch.autograd.grad(loss, inputs) and backward(inputs=...) leave every parameter's .grad as
        # it is: such a pass only carries gradients through the units (their weights are gathered,
        # nothing is written or reduced). Every unit trained by this forward has its token in the
        # graph; the engine runs their AccumulateGrad nodes exactly when it accumulates into leaves.
        state.accumulating = any(will_accumulate(u.token) for u in self.units.units
                                 if u.fwd_trains and u.fwd_id == state.grad_fwd_id)
        if state.accumulating:
            self._count_forward_sums()
            fresh = state.stepped_since_backward  # (not at the step itself: a second optimizer of this
            state.stepped_since_backward = False  # model checks the same flags, see guards.step_checks)
            for u in self.units.units:
                # the flags say which parameters the gradients in .grad came from: they start afresh
                # after a step, and for a shard whose .grad was dropped since (zero_grad() with no step,
                # a batch thrown away): else the step would keep a .grad no backward since reached
                if fresh or u.master.grad is None:
                    u.got_grad = [False] * len(u.got_grad)
                    u.attached_from_none = False
                if u.grad_storage is None or not u.master.requires_grad:
                    continue  # (a shard turned off since its forward gets no .grad, as torch leaves it)
                # A master the loss reads itself (a penalty on model.parameters()) gets a gradient
                # from autograd in this pass, at a moment the graph decides.
                by_autograd = (u.master.grad is None or u.attached_from_none) and will_accumulate(u.master)
                if by_autograd:
                    u.attached_from_none = False  # (reached: the step keeps its .grad)
                if u.master.grad is None:
                    u.master.grad = u.grad_storage
                    if by_autograd:  # zeroed: autograd and the reductions both add to it
                        u.grad_storage.zero_()
                    else:  # the unit's first reduction writes it (no zero-fill pass), and
                        u.grad_unwritten = True   # _end_backward zeroes any that none wrote
                        u.attached_from_none = True
            for u in self.units.units:
                u.drop_unreduced_if_zeroed()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _check_step_in_backward(self) -> None:
        """``ShardConfig.step_in_backward``: refuse a backward whose steps would be wrong. Raised at
        the backward's first hook, before any state moves or any unit has stepped; then mark the step
        pending (the optimizer-step post-hook clears it)."""
        state = self.state
        if self.reducer.step_unit is None:
            raise RuntimeError(
                "a backward of a model sharded with ShardConfig(step_in_backward=True), but no optimizer steps it: each "
                "unit's gradient lives only until its optimizer step, in backward, so it would be lost. Build the "
                "optimizer with opt = model.optimizer_in_backward(torch.optim.AdamW, lr=...) before the first backward"
            )
        if state.step_pending:
            raise RuntimeError(
                "a second backward before opt.step() with ShardConfig(step_in_backward=True): gradient accumulation "
                "above 1 needs the summed gradients of every micro-batch, but each backward already stepped every "
                "unit on its own gradients (none are kept). Call opt.step() after every backward (it runs the step "
                "checks), or use the ordinary step (drop step_in_backward) to accumulate"
            )
        for u in self.units.units:
            if not u.trains or not u.master.requires_grad:
                continue
            if will_accumulate(u.master):
                raise RuntimeError(
                    f"the loss reads the master shard {u.name} itself (a penalty on model.parameters()?) with "
                    "ShardConfig(step_in_backward=True): that gradient reaches .grad at a moment autograd picks, after "
                    "or before the unit's step, so it would be lost or stepped twice. Compute such terms from the "
                    "module weights in the forward, or drop step_in_backward"
                )
            if u.master.grad is not None:
                raise RuntimeError(
                    f"the master shard {u.name} has a .grad with ShardConfig(step_in_backward=True): no gradient is "
                    "kept in this mode (each unit steps on its reduced gradient in backward), so one set by hand would "
                    "be ignored; set it to None"
                )
        state.step_pending = True

    def _skip_unreached(self, late: list[Unit]) -> None:
        """``step_in_backward``: of the units reduced at the end of the backward (their gate never fired),
        those no rank's loss reached skip their step, as torch skips a parameter whose ``.grad`` is None
        (the ordinary step drops such a ``.grad``: ``guards.step_checks``). One small all-reduce over the
        data-parallel group, issued only when such units exist (on every rank alike: their reductions'
        order needs it already)."""
        trained = [u for u in late if u.fwd_trains and u.trains]
        if not trained:
            return
        comm = self.reducer.comm
        reached = torch.tensor([float(any(u.got_grad)) for u in trained], device=trained[0].master.device)
        comm.all_reduce(reached, "units no gradient reached (step in backward)", comm.group, op="max")
        for u, r in zip(trained, reached.tolist()):
            u.skip_step = r == 0.0

    def _count_forward_sums(self) -> None:
        """A backward of forward ``grad_fwd_id`` starts: its forward-output sums now count for the
        step (``ForwardSums.sums``). When every gradient the last backward left was dropped or zeroed since
        (``zero_grad()``, either mode, with no step: a batch thrown away), the sums of the forwards
        that made them go too."""
        kept = any(u.grad_storage is not None and u.master.grad is u.grad_storage
                   and u.grad_storage._version == u.grad_end_version for u in self.units.units)
        self.sums.count(self.state.grad_fwd_id, kept)

    def on_unit_backward_start(self, unit: Unit, fwd_id: int, views: list | None = None) -> None:
        self.begin_backward()
        state = self.state
        if fwd_id != state.grad_fwd_id:
            raise OrderError(
                f"backward reached {unit.name} of forward #{fwd_id}, but forward #{state.grad_fwd_id} ran "
                "since; yashard keeps one forward's weights in its buffers: call backward() before the next "
                "grad-enabled forward"
            )
        if unit.master._version != unit.fwd_version:
            raise RuntimeError(
                f"the master weights of {unit.name} changed between forward and backward (an optimizer.step(), "
                "yashard.load_checkpoint or an in-place edit of the shards), and this graph was built with the old "
                "ones; call backward() before changing them, or run the forward again after"
            )
        if unit.kind == "layer":
            last = state.bwd_last_layer
            if last is not None and unit.index >= last:
                raise OrderError(
                    f"backward of {self.spec.layers}.{unit.index} started after {self.spec.layers}.{last}; "
                    "each layer's backward must run once, last layer first"
                )
            state.bwd_last_layer = unit.index
        self.gathers.ensure(unit)
        if views is not None:  # (an activation-checkpointed layer) before the recompute reads them
            unit.restore_backward_views(views)
            if self.norm_group is not None:  # (the resident groups' views: the recompute reads them too)
                self.norm_group.restore_backward_views()
        self.gathers.prefetch(self._next_backward(unit))  # R5: one unit ahead

    def _next_backward(self, unit: Unit) -> Unit | None:
        """The next unit whose weights the backward needs (layers in reverse; the embedding needs
        none), if its backward runs (frozen layers that no gradient flows into have none)."""
        nxt = None
        layers = self.units.layers
        if unit.kind == "layer":
            nxt = layers[unit.index - 1] if unit.index > 0 else None
        elif unit is self.units.lm_head and layers:
            nxt = layers[-1]
        return nxt if nxt is not None and nxt.fwd_backward else None

    def claim_grad_slot(self, unit: Unit) -> None:
        """Take ``unit``'s grad slot for this backward (R4: after the previous reduction finished,
        and every reduction still reading memory the slot shares with others)."""
        slot = unit.slot
        for s in (slot, *slot.grad_overlaps):
            if s.grad_busy is not None:
                s.grad_busy.wait()
                s.grad_busy = None
        for s in slot.grad_overlaps:  # (their zero padding is written over)
            s.zeroed_signature = None
            s.grad_owner = None
        slot.grad_owner = unit
        unit.grad_claimed = True
        unit.written = [False] * len(unit.layout.entries)

    def on_unit_grads_complete(self, unit: Unit) -> None:
        """All gradients of ``unit`` are in its grad slot: zero the rest and reduce-scatter (R3).
        Over one rank (:func:`yashard.build.direct_grads`) they are in ``master.grad`` already: only the ranges a
        dropped ``master.grad`` still holds stale values in are zeroed.
        A unit frozen in its forward has none: its backward (gradients for its inputs) is over, so
        only its weights are released."""
        self.begin_backward()
        state = self.state
        if not unit.fwd_trains or not state.accumulating:
            if unit.kind != "small":
                self.gathers.release(unit.slot)
            unit.reduced_in_pass = True
            return
        if not unit.grad_claimed:
            self.claim_grad_slot(unit)
        unit.zero_unwritten()
        if unit.kind != "small":
            self.gathers.release(unit.slot)  # weights no longer read (R1 for re-gathers)
        unit.grad_claimed = False
        unit.reduced_in_pass = True
        if state.direct_grads:  # Narrow added them to master.grad in place: that was the reduction.
            unit.unreduced = not state.fwd_sync  # (no_sync(): a step before a synced backward is refused
            return                               # here too, as it must be on more ranks)
        if not state.fwd_sync:  # no_sync(): the unit's own grad slot keeps accumulating, unreduced
            unit.unreduced = True  # (its grad_storage version is taken at the end of the backward)
            return
        unit.unreduced = False
        self.reducer.reduce(unit)  # R3

    def _end_backward(self) -> None:
        """Autograd's final callback: reduce the norm group and anything not yet reduced, then wait."""
        try:
            # Units that ran forward with grad but whose gate never fired (their outputs did not reach
            # the loss) still reduce, in a fixed order, so every rank issues the same collectives.
            late = [u for u in self.units.forward_order if u.fwd_id == self.state.grad_fwd_id and not u.reduced_in_pass]
            if late and self.steps_in_backward and self.state.accumulating:
                self._skip_unreached(late)
            for u in late:
                self.on_unit_grads_complete(u)
            if self.norm_group is not None:
                self.norm_group.end_backward()
            self.drain()
            self.streams.current_waits_for_backward()  # (backward() may run on another stream than the forward)
            # Gradients attached at begin_backward that no reduction wrote. Under no_sync() (the unit's
            # own buffer accumulates) they are zeroed: the synced backward adds to them. Otherwise no
            # rank's loss reached any parameter of the unit in this backward (reductions are
            # collective: none ran on any rank), and .grad goes back to None, as torch leaves a
            # parameter no gradient reached, so the optimizer skips the shard (no weight decay, no
            # momentum) exactly where torch skips its parameters.
            unwritten = [u for u in self.units.units if u.grad_unwritten]
            if unwritten:
                held = [u for u in unwritten if u.unreduced]
                if held:
                    torch._foreach_zero_([u.grad_storage for u in held])
                for u in unwritten:
                    if not u.unreduced:
                        u.master.grad = None
                    u.grad_unwritten = False
            for u in self.units.units:
                if u.grad_storage is not None:  # a zero_grad from now on changes it: see begin_backward
                    u.grad_end_version = u.grad_storage._version
                if u.unreduced:
                    u.unreduced_version = u.grad_storage._version
                if u.views_until == "backward":
                    u.remove_views()
        except BaseException:
            # (a reduction that failed, say a comm hook's future: in_backward stays set, so the step
            # refuses these incomplete gradients and the next forward recovers, as after any backward
            # that raised)
            self.state.backward_pending = False
            raise
        self.state.in_backward = False
        self.state.backward_pending = False

    def recover_from_failed_backward(self) -> None:
        """Run by the next forward when a backward raised (autograd then drops its final callback,
        :meth:`_end_backward`): its reductions in flight are waited for and thrown away, every
        gradient is zeroed (every ``.grad`` still set, which over one rank the failed backward has
        partly written already: a ``zero_grad(set_to_none=True)`` since stays; under ``no_sync()``
        what the unit buffers accumulated is dropped too), and the runtime
        is reset, so the next backward starts clean and the same on every device: the step the
        failed micro-batch belonged to is lost, as after ``zero_grad()`` (the "skip the batch that ran
        out of memory" pattern). Until then the step, ``clip_grad_norm_`` and ``full_grads`` refuse
        (:func:`yashard.integrity.check_grads_reduced`). It needs every rank to have failed alike: a rank that raised
        alone leaves the others waiting in a collective."""
        logger.warning("yashard: the previous backward did not finish (it raised); every gradient is zeroed and "
                       "the runtime is reset for the next backward (the step it belonged to is lost)")
        state = self.state
        state.discard_reductions = True
        try:
            self.drain()
        finally:
            state.discard_reductions = False
            attached = [u.master.grad for u in self.units.units if u.master.grad is not None]  # (a .grad the
            # user assigned too: the failed backward may have added to it, as it may to grad_storage)
            if attached:
                torch._foreach_zero_(attached)
            for u in self.units.units:
                u.grad_unwritten = False
                u.skip_step = False
                u.grad_claimed = False
                u.reduced_in_pass = False
                u.unreduced = False  # (a no_sync() accumulation: the next backward writes afresh)
                if u.views_until == "backward":
                    u.remove_views()
                u.backward_views = None
            for slot in self.slots.values():
                slot.grad_owner = None
            state.in_backward = False
            state.backward_pending = False
            if state.step_pending:  # (step_in_backward: the units that stepped before it raised stay stepped)
                logger.warning("yashard: with step_in_backward the units whose reduction finished before the backward "
                               "raised were stepped; the others were not (restore a checkpoint for a clean state)")
                state.step_pending = False


def _in_compiled_autograd() -> bool:
    """Whether this backward is being captured by compiled autograd."""
    ca = getattr(getattr(torch, "_dynamo", None), "compiled_autograd", None)
    return bool(getattr(ca, "in_compiled_autograd_region", False))
