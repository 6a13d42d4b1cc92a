"""Gathers: a unit's weights into its slot (events rules R1 and R2), and the sources they read.

Forward gathers read the primary shards over the shard group (quantized with qwZ); with hpZ a
grad-enabled forward also keeps this rank's secondary slice, and backward re-gathers read the
secondary slices over the (node-local) secondary group. A direct slot (shard world 1) shows the
unit's own shard instead: no collective, no copy, nothing to wait for.

A gather is used only while the masters keep the version it was gathered at
(``unit.gathered_version``): a unit whose masters changed is gathered again. With a 16-bit
``param_dtype`` a gather first casts this rank's fp32 master into its own chunk of the slot, on the
communication stream, and gathers in place: no cast copy of the masters is kept. Only direct slots
keep one, the ``param_dtype`` source the views read, recast from the masters when they changed
(:meth:`Gathers.refresh_sources`). A frozen unit's master is in ``param_dtype`` already
(:func:`yashard.build.master_dtype`): it is gathered, or shown, as it is.
"""

from __future__ import annotations

import functools

import torch

from .buffers import Slot
from .collectives import Comm
from .config import ShardConfig
from .errors import OrderError
from .events import IN_PLACE, Completed, Pending, Streams, labelled
from .pass_state import PassState, What
from .unit import Unit
from .zeropp import qwz_all_gather, qwz_workspace_nbytes


class Gathers:
    """Issues and waits for the all-gathers of units into their slots."""

    def __init__(self, comm: Comm, config: ShardConfig, streams: Streams, state: PassState,
                 slots: dict[str, Slot], device: torch.device):
        self.comm = comm
        self.config = config
        self.streams = streams
        self.state = state
        self._cast_versions: tuple | None = None   # master versions the param_dtype shards were cast at
        # qwZ: codes + scales of every rank's shard, gathered in one collective. One workspace serves
        # every slot: a quantized gather has dequantized into its slot before the next one quantizes
        # (on the communication stream, in issue order).
        self.qwz_workspace = None
        if config.quantized_weights:
            w = comm.shard_world
            nbytes = max(qwz_workspace_nbytes(s.numel // w, w, bits=config.quantized_weights, block=config.quant_block)
                         for s in slots.values() if s.name != "small")
            self.qwz_workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def gather(self, unit: Unit) -> None:
        """Issue the all-gather of ``unit`` into its slot (R1: after the previous owner's release)."""
        slot = unit.slot
        if slot.direct:  # shard world 1: the unit's shard is all of it, shown in place (no collective)
            slot.show(unit.direct_source)
            unit.gathered_version = unit.master._version
            unit.gathered = IN_PLACE
            slot.owner = unit
            return
        busy = [s.owner for s in slot.overlaps if s.reading and s.owner is not None]
        if busy:  # (R1 would wait on an older release: the reads still to come would see this gather)
            raise OrderError(
                f"{unit.name} needs its weights while {busy[0].name}'s, which share its buffer "
                "(ShardConfig.share_outer_slot=True), are still being read; yashard runs the embedding, the "
                "layers and the lm_head one after another, in the model's order: call the model as a whole, or "
                "use share_outer_slot=False")
        prevs = [s.owner for s in (slot, *slot.overlaps)  # (a shared buffer: every slot this gather writes over)
                 if s.owner is not None and s.owner is not unit]
        for prev in prevs:
            if prev.gathered is not None and not prev.gathered.done:
                prev.gathered.wait()  # an unused prefetch still writing into the slot (CPU: gloo thread)
        comm = self.comm
        on_done = None
        training = torch.is_grad_enabled() and not self.state.in_backward  # (a training forward's gather)
        # (no_grad: a c10d op has no autograd kernel, so an fp32 master as its input would give
        # the slot an autograd history through torch's fallback)
        what = What("all_gather", unit.name, self.state.phase())
        with torch.no_grad(), self.streams.comm_context(), labelled(unit.gather_label), comm.issuing(what):
            for s in (slot, *slot.overlaps):
                if s.release is not None:
                    self.streams.comm.wait_event(s.release)
            out = slot.weights_io.narrow(0, 0, unit.layout.padded)
            if self.state.in_backward and unit.secondary is not None and unit.secondary_version == unit.master._version:
                work = comm.all_gather(out, unit.secondary, unit.name, comm.secondary_group)
            else:
                shard = self._source(unit, out)
                if unit.kind != "small" and self.config.quantized_weights:
                    qwz_all_gather(comm, out, shard, self.qwz_workspace, bits=self.config.quantized_weights,
                                   block=self.config.quant_block, unit=unit.name)
                    work = Completed()
                else:
                    work = comm.all_gather(out, shard, unit.name)
                if unit.secondary is not None and training:
                    secondary, h = unit.secondary, comm.topology.secondary_rank
                    on_done = functools.partial(_keep_secondary, secondary, out, h)
                    unit.secondary_version = unit.master._version
        unit.gathered_version = unit.master._version
        unit.gathered = Pending(self.streams, work, on_done,
                                functools.partial(comm.wait, what=what))
        slot.owner = unit
        slot.fresh = True
        for s in slot.overlaps:  # their owners' weights are overwritten: gathered again when needed
            s.owner = None
            s.fresh = False

    def _source(self, unit: Unit, out: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``unit``'s gather into ``out``: its master when that is in ``out``'s
        dtype, else the master cast into this rank's own chunk of ``out``, which the all-gather then
        leaves in place (gloo's sends read it there, NCCL gathers in place). The cast runs where the
        gather does, after the slot's release (R1), and reads the masters as they are now."""
        src = unit.gather_src
        if src.dtype == out.dtype:
            return src
        n = src.numel()
        own = out.narrow(0, self.comm.shard_rank * n, n)
        own.copy_(src.detach())
        return own

    def release(self, slot: Slot) -> None:
        """Compute has issued its last read of ``slot``'s weights: record the event a gather into it
        waits for (R1). A direct slot is never gathered into (it shows a shard in place): none."""
        slot.reading = False
        if not slot.direct:
            slot.release = self.streams.record(self.streams.compute)

    def ensure(self, unit: Unit) -> None:
        """``unit``'s weights are in its slot, and compute waits for them (R2). Compute may read
        them until the slot's :meth:`release`."""
        slot = unit.slot
        if slot.owner is not unit or unit.gathered is None:
            self.gather(unit)
        slot.reading = True
        slot.fresh = False
        unit.gathered.wait()  # R2

    def prefetch(self, unit: Unit | None) -> None:
        """Issue ``unit``'s gather unless its slot holds (or is receiving) its weights already, or
        it would overwrite weights that compute still reads, or a gather no compute used yet, in
        memory its slot shares with others (``ShardConfig.share_outer_slot``: the gather waits,
        unprefetched, for the unit's :meth:`ensure`)."""
        if unit is not None and (unit.slot.owner is not unit or unit.gathered is None):
            if any(s.owner is not None and (s.reading or s.fresh) for s in unit.slot.overlaps):
                return
            self.gather(unit)

    @staticmethod
    def settle(slots) -> None:
        """A forward or a backward starts: no compute reads a slot yet. A pass that raised left its
        marks, and the views its unit installed: those come off (a slot others write into next would
        show their weights under its names; a read raises instead, and its next pass puts them back)."""
        for s in slots:
            if s.reading and s.owner is not None and s.owner.views_until is not None:
                s.owner.remove_views()
            s.reading = False

    @staticmethod
    def forget_stale(units: list[Unit]) -> None:
        """A unit whose slot was reused, or whose masters changed since its gather (an optimizer
        step, a load), is gathered again when next needed."""
        for u in units:
            if u.slot.owner is not u or u.gathered_version != u.master._version:
                u.gathered = None

    def wait_all(self, units: list[Unit]) -> None:
        """Wait for every gather in flight (on CUDA a gather is ``done`` from its issue on: compute
        waits for it where the weights are used)."""
        for u in units:
            if u.gathered is not None and not u.gathered.done:
                u.gathered.wait()

    def forget_casts(self) -> None:
        """The param_dtype sources are cast from the masters again at the next refresh."""
        self._cast_versions = None

    def refresh_sources(self, units: list[Unit]) -> None:
        """Recast the param_dtype shards of direct slots if the masters changed, and order every
        gather issued from now on after what compute did so far (the casts, the optimizer step,
        which the gathers' own casts read, the previous backward's last reads of the resident norm
        group: R1)."""
        versions = tuple(u.master._version for u in units)
        if versions != self._cast_versions:
            # masters changed (optimizer step, load): refresh those cast shards (frozen ones stay)
            old = self._cast_versions or (None,) * len(versions)
            changed = [u for u, v, was in zip(units, versions, old) if v != was and u.gather_src is not u.master]
            if changed:
                with torch.no_grad():
                    torch._foreach_copy_([u.gather_src for u in changed], [u.master for u in changed])
            self._cast_versions = versions
        self.streams.comm.wait_event(self.streams.record(self.streams.compute))


def _keep_secondary(secondary: torch.Tensor, gathered: torch.Tensor, position: int, _result=None) -> None:
    """hpZ: keep slice ``position`` of a freshly gathered unit for the backward re-gather."""
    m = secondary.numel()
    secondary.copy_(gathered.narrow(0, position * m, m))
