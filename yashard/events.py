"""Streams and events: how compute and communication are sequenced.

There are two streams per device: the *compute* stream (whatever stream is current when the forward
starts) and one *communication* stream that yashard owns. Every collective is issued from the
communication stream; compute only ever waits on events, never on the host.

Rules (each one is enforced at exactly one place, named in brackets):

  R1 gather-after-release   A weight slot is gathered into only after the compute stream recorded
                            the release of the slot's previous owner, and of the owner of every
                            slot sharing its memory (``share_outer_slot``); never while compute may
                            still read one of those (it raises; a prefetch waits for the unit's
                            own turn instead). [gathers.Gathers.gather]
  R2 compute-after-gather   A unit computes only after its gather landed (compute waits ``gathered``).
                            [gathers.Gathers.ensure]
  R3 reduce-after-grads     A unit's reduce-scatter starts only after compute recorded that the
                            unit's gradients are complete (its GateGradFlow backward).
                            [reduction.Reducer.reduce]
  R4 write-after-reduce     A gradient slot is written by a new owner only after the previous
                            owner's reduce-scatter (and its fp32 accumulation) finished, and those
                            of every slot sharing its gradient memory (``share_outer_slot``).
                            [backward.BackwardSchedule.claim_grad_slot]
  R5 gather-before-reduce   Gathers are issued one unit ahead (explicit prefetch), so the gather the
                            compute stream needs next is always already queued before any
                            reduce-scatter that is issued while it waits. [gathers.Gathers.prefetch,
                            called by the forward and backward schedules one unit ahead]
  R6 reduce-after-reduce    A reduction starts only after the previous one (and its accumulation)
                            finished: they share one output buffer. On CUDA the communication stream
                            orders them already; on CPU the host finishes the previous one first
                            (it was issued a whole layer's backward earlier, so this rarely waits).
                            [reduction.Reducer.reduce]
  R7 step-after-reduce      With ``step_in_backward``, a unit's optimizer step runs inside its
                            reduction's follow-up, on the communication stream, after the hybrid
                            all-reduce and the in-place post-divide of the output buffer, and
                            before the next reduction writes that buffer (R6 starts it only after
                            this follow-up). Later readers of the masters are ordered after it: the
                            gathers run on the same stream, and compute waits for the follow-up's
                            event at the end-of-backward drain. [reduction.Reducer._accumulate]

Forward, layers i-1, i, i+1 (slots alternate A/B by layer parity)::

    compute : ..[ fwd i-1 (A) ]rel(i-1)  wait(ag i)[ fwd i (B) ]rel(i)  wait(ag i+1)[ fwd i+1 (A) ]
                                  |                   ^                     |               ^
                                  v (R1)              | (R2)                v (R1)          | (R2)
    comm    : ...[ AG i (B) ]---ag(i)  wait(rel i-1)[ AG i+1 (A) ]----ag(i+1)  wait(rel i)[ AG i+2 (B) ]
              (AG i+1 is issued from layer i's pre-forward, so it overlaps fwd i)

Backward, layer i (the last two layers are still resident from the forward)::

    compute : wait(ag i)[ bwd i: Narrow writes grads -> grad slot ]gate(i): rel(i), ready(i)  wait(ag i-1)[ bwd i-1 ...
                                                                     |         |
                                                                     v (R1)    v (R3)
    comm    : [ AG i-1 into slot of i+1 ]  ...   wait(ready i)[ RS i ][ acc i: master.grad += chunk / W ]red(i)
                                                                                                   |
    compute (layer i-2, first gradient write into the same grad slot) : wait(red i) (R4) ----------+

Over one rank (direct slots and ``PassState.direct_grads``) nothing is gathered or reduced: the
views read the shards and ``Narrow`` adds the gradients to ``master.grad`` on the compute stream,
so nothing reaches the communication stream, and the end of a backward makes the caller's stream
wait for the compute stream (:meth:`Streams.current_waits_for_backward`).

With ``ShardConfig(share_outer_slot=True)`` the embedding's and the lm_head's slots overlap the
layer slots (:func:`yashard.layout.outer_arena`). The same rules then cost a few waits per step
that the default overlaps: layer 0's gather after the embedding's forward when they overlap, the
lm_head's after layer L-1's forward, layer L-1's backward re-gather after the lm_head's backward,
and the embedding's first gradient write after the reduction of the layer slot it covers.

On CPU, ``torch.cpu`` streams and events are no-ops and kernels run in program order on the host,
so R1-R4 hold by construction; gloo collectives run on gloo's worker threads and the host waits on
their work handles only when a result is needed (:meth:`Pending.wait`). One code path serves both.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch

_UNLABELLED = contextlib.nullcontext()
# Label every phase, whether or not a profiler records on this thread: for tools that observe
# RecordFunction globally (a standalone ExecutionTraceObserver, on-demand Kineto tracing).
ALWAYS_LABEL = os.environ.get("YASHARD_ALWAYS_LABEL", "0") not in ("", "0")


def labelled(name: str):
    """``torch.profiler.record_function(name)`` while a profiler records on this thread
    (``torch.profiler.profile``, ``torch.autograd.profiler``, ``emit_itt``/``emit_nvtx``; the trace
    then shows yashard's phases under ``yashard::...`` names), a shared no-op context otherwise: a
    label costs microseconds of host time per call even when nothing records, and the hooks set
    several per layer. ``YASHARD_ALWAYS_LABEL=1`` labels always, for observers this check cannot
    see (a standalone ``ExecutionTraceObserver``, on-demand Kineto tracing)."""
    if ALWAYS_LABEL or torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _UNLABELLED


class Streams:
    """The compute/communication stream pair of one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.mod = torch.get_device_module(device)
        # On CPU, collectives complete on gloo's threads; finishing them eagerly would block the
        # host at issue time and kill the overlap, so CPU finishes lazily (at first use).
        self.eager_finish = device.type != "cpu"
        if device.type == "cuda":
            self.comm = torch.cuda.Stream(device=device, priority=-1)
        else:
            self.comm = self.mod.Stream()
        self.compute = self.mod.current_stream(self.device)

    def capture_compute(self) -> None:
        """Take the current stream as the compute stream (called at every forward start)."""
        self.compute = self.mod.current_stream(self.device)

    def record(self, stream) -> object:
        """Record an event on ``stream`` and return it."""
        ev = self.mod.Event()
        ev.record(stream)
        return ev

    def comm_context(self):
        return self.mod.stream(self.comm)

    def share_with_comm(self, tensors) -> None:
        """Mark persistent buffers (allocated on the compute stream, written by collectives too) as
        used by the communication stream: if they are ever freed (the model is dropped), the caching
        allocator hands their memory out again only after what that stream queued has run, such as
        a prefetch no forward waited for. CPU frees synchronously: nothing to do."""
        if self.device.type == "cuda":
            for t in tensors:
                if t.numel():
                    t.record_stream(self.comm)

    def current_waits_for_backward(self) -> None:
        """End of a backward: make the stream current now (the one ``backward()`` was called on,
        which need not be the forward's compute stream) wait for everything queued on the
        communication stream (the reductions into ``master.grad``) and on the compute stream (the
        backward's kernels ran there, and over one rank ``Narrow`` wrote ``master.grad`` itself:
        autograd syncs the caller only with streams that produced leaf gradients)."""
        current = self.mod.current_stream(self.device)
        current.wait_stream(self.comm)
        if current != self.compute:
            current.wait_stream(self.compute)


class Completed:
    """A work handle for something that already finished on the issuing stream (a synchronous
    quantized gather): waiting on it orders nothing more."""

    def wait(self) -> None:
        return None


class InPlace:
    """Stands for a gather that was not needed: a direct slot shows the unit's own shard (shard
    world 1, :class:`yashard.buffers.Slot`), which compute wrote on its own stream. Waiting for it
    orders nothing, so compute is never made to wait behind communication in flight (a hybrid
    all-reduce) for weights that were never on the communication stream."""

    done = True

    def finish(self) -> None:
        return None

    def wait(self) -> None:
        return None


IN_PLACE = InPlace()


class Pending:
    """One collective in flight, plus the follow-up work to run on the comm stream once it lands.

    ``work`` is a c10d work handle or a future (a comm hook's result); ``on_done`` receives what
    waiting for it returns (the future's value; ignore it for work handles). ``waiter(work)`` does
    the waiting (the runtime's bounds it in time and names the collective in errors); by default
    ``work.wait()``.

    Contract: :meth:`wait` makes the current (compute) stream wait until the collective and its
    ``on_done`` have finished; it is idempotent, and ``on_done`` runs exactly once. On devices with
    real streams the follow-up is enqueued right away (the host never blocks); on CPU it runs at the
    first :meth:`wait` (the host blocks there, and only there). If waiting or ``on_done`` raises,
    the collective is over for good: ``failed`` holds the error, and every later :meth:`wait` or
    :meth:`finish` raises it again at once (never waits a second time).
    """

    __slots__ = ("_work", "_on_done", "_waiter", "_streams", "_event", "done", "failed")

    def __init__(self, streams: Streams, work, on_done: Callable[[object], None] | None = None,
                 waiter: Callable[[object], object] | None = None):
        self._streams = streams
        self._work = work
        self._on_done = on_done
        self._waiter = waiter
        self._event = None
        self.done = False
        self.failed: BaseException | None = None
        if streams.eager_finish:
            self._finish()

    def _finish(self) -> None:
        try:
            with self._streams.comm_context():
                result = self._work.wait() if self._waiter is None else self._waiter(self._work)
                if self._on_done is not None:
                    self._on_done(result)
                self._event = self._streams.record(self._streams.comm)
        except BaseException as e:
            self.failed = e
            raise
        finally:
            self.done = True
            self._work = self._on_done = self._waiter = None

    def finish(self) -> None:
        """Complete the collective and its ``on_done`` on the communication stream, without
        making the compute stream wait (on CUDA this already happened at construction)."""
        if self.failed is not None:
            raise self.failed
        if not self.done:
            with labelled("yashard::wait_collective"):
                self._finish()

    def wait(self) -> None:
        self.finish()
        self._streams.compute.wait_event(self._event)
