"""Gradient reduction: each unit's gradients reduced over the ranks into its fp32 ``master.grad``.

A unit's reduction starts once its gradients are complete (events rule R3: the backward schedule
calls :meth:`Reducer.reduce`). The comm hook (:mod:`yashard.comm_hooks`; by default a SUM
reduce-scatter) returns a future of this rank's shard of the sum; under hybrid sharding the shard
is then all-reduced over the replicas, and it is post-divided by the data-parallel world and
added, in fp32, to the persistent gradient. All reductions share one output buffer, so each starts
after the previous one finished (R6). Comm hooks' scratch buffers are persistent too
(:meth:`Reducer.workspace`), allocated from the hook's ``workspace_plan`` before step one.
With 16-bit gradient slots (:func:`yashard.build.compact_grads`) no hook is called: the default
hook's reduce-scatter runs a chunk at a time through one ``reduce_dtype`` staging buffer
(:meth:`Reducer._reduce_chunked`).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from .buffers import Slot
from .collectives import Comm, WorkFuture
from .comm_hooks import GradBucket, reduce_scatter_hook
from .config import ShardConfig
from .events import Pending, Streams, labelled
from .layout import chunk_bounds
from .pass_state import PassState, What
from .unit import Unit

logger = logging.getLogger("yashard")


class Reducer:
    """Issues the reductions, holds what they write through, and waits for them."""

    def __init__(self, comm: Comm, config: ShardConfig, streams: Streams, state: PassState,
                 reduce_out_numel: int, device: torch.device, chunk: int = 0):
        self.comm = comm
        self.config = config
        self.streams = streams
        self.state = state
        self.device = device
        self.dp_world = comm.world  # the post-divide factor
        self.comm_hook = reduce_scatter_hook   # how each unit's gradients are reduced (comm_hooks.py)
        self.comm_hook_state = None
        self.op_name = f"gradient reduction ({reduce_scatter_hook.__name__})"  # (named in collective errors)
        self.hint: str | None = None  # what a reduction's error advises, for a user's comm hook
        self.workspaces: dict[str, torch.Tensor] = {}   # comm hooks' persistent scratch buffers
        self.hook_planned = False  # the comm hook's workspace_plan was allocated (more is warned about)
        self.bucket_index = 0      # the next bucket's index in this backward
        self.pending: list[Pending] = []
        # ShardConfig.step_in_backward: steps a unit on its reduced, post-divided gradient shard
        # (yashard.step_in_backward.OptimizerInBackward.step_unit), in the reduction's follow-up (R7)
        self.step_unit = None
        self._last: Pending | None = None  # R6: the reduction writing reduce_out
        # One reduce-scatter output for every slot: reductions run one after the other (R6). Over one
        # rank the default hook's sum is the gradient buffer itself: allocated only if a hook asks.
        self._reduce_out_numel = reduce_out_numel
        self.reduce_out: torch.Tensor | None = None
        if comm.shard_world > 1:
            self.reduce_output(0)
        # Gradient slots in param_dtype (build.compact_grads): each unit's gradients are widened
        # into this staging buffer ``chunk`` elements per rank at a time, and every chunk is
        # reduce-scattered on its own (:meth:`_reduce_chunked`). None: the comm hook reduces the
        # slots' reduce_dtype buffers whole.
        self.chunk = chunk
        self.staging: torch.Tensor | None = None
        if chunk:
            self.staging = torch.empty(comm.shard_world * chunk, dtype=config.wire_dtype, device=device)

    def reduce(self, unit: Unit) -> None:
        """Reduce ``unit``'s gradients, now complete in its grad slot (R3), into ``master.grad``."""
        slot = unit.slot
        ready = self.streams.record(self.streams.compute)
        n = unit.layout.shard_numel
        if self._last is not None:
            self._last.finish()  # R6: it may still be reading the shared output buffer
        bucket = GradBucket(self.bucket_index, unit.name, unit.name == "small", self.comm, slot.name,
                            unit.flat_grads(), self.reduce_output, self.workspace, n)
        self.bucket_index += 1
        what = What(self.op_name, unit.name, self.state.phase(), self.hint)
        with torch.no_grad(), self.streams.comm_context(), labelled(unit.reduce_label), self.comm.issuing(what):
            self.streams.comm.wait_event(ready)
            if self.staging is not None:
                work = self._reduce_chunked(unit, what)
            else:
                work = self.comm_hook(self.comm_hook_state, bucket)
        if not callable(getattr(work, "wait", None)):
            raise TypeError(
                f"comm hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} returned "
                f"{type(work).__name__} for {unit.name}; a hook returns a future (torch.futures.Future or "
                "yashard.comm_hooks.WorkFuture) of this rank's reduced shard"
            )
        pending = Pending(self.streams, work, functools.partial(self._accumulate, unit),
                          functools.partial(self.comm.wait, what=what))
        slot.grad_busy = pending
        self._last = pending
        self.pending.append(pending)

    def _reduce_chunked(self, unit: Unit, what: What) -> WorkFuture:
        """The default hook's SUM reduce-scatter of ``unit``'s ``param_dtype`` gradients, a chunk at a
        time: rank ``r``'s part ``[lo, lo + k)`` of each rank's shard range is widened into the staging
        buffer (exactly: every 16-bit value is an fp32 value), which is reduce-scattered into
        ``[lo, lo + k)`` of the output. The next chunk overwrites the staging buffer once the previous
        one's reduce-scatter finished (on CUDA the communication stream waits; the host does not).
        The last chunk is in flight when this returns; the next reduction waits for it (R6)."""
        comm = self.comm
        w, n = comm.shard_world, unit.layout.shard_numel
        rows = unit.flat_grads().view(w, n)
        out = self.reduce_output(n)
        wire = self.config.wire_dtype
        scratch = comm.reduce_scatter_needs_scratch()
        fut = None
        for lo, k in chunk_bounds(n, self.chunk):
            if fut is not None:
                comm.wait(fut, what)  # (its reduce-scatter still reads the staging buffer)
            stage = self.staging.narrow(0, 0, w * k)
            stage.view(w, k).copy_(rows.narrow(1, lo, k))
            fut = comm.reduce_scatter(out.narrow(0, lo, k), stage, unit.name,
                                      scratch=self.workspace("reduce_scatter", w * k, wire) if scratch else None)
        if fut is None:  # (an empty shard: nothing to reduce)
            fut = torch.futures.Future()
            fut.set_result(out)
        return WorkFuture(fut, lambda: out)

    def drop_staging(self) -> None:
        """A comm hook was registered: the slots get ``reduce_dtype`` gradient buffers, which the
        hook reduces whole; the staging buffer goes."""
        self.staging, self.chunk = None, 0

    def _accumulate(self, unit: Unit, value) -> None:
        """Hybrid all-reduce, then post-divide, in fp32, into the persistent grad."""
        n = unit.layout.shard_numel
        if not isinstance(value, torch.Tensor) or value.shape != (n,) or not value.is_floating_point():
            raise ValueError(
                f"comm hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} gave "
                + (f"a {tuple(value.shape)} {value.dtype} tensor" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
                + f" for {unit.name}; its future must hold this rank's shard of the SUM: a 1-D floating "
                f"tensor of {n} elements"
            )
        master = unit.master
        with labelled(unit.post_divide_label):
            replicas = self.comm.replica_group
            if replicas is not None:
                # (a hook's own value, in another dtype or strided: the replica sum in reduce_dtype, dense)
                if value.dtype != self.config.wire_dtype or not value.is_contiguous():
                    value = value.to(self.config.wire_dtype).contiguous()
                self.comm.all_reduce(value, unit.name, replicas)
            if self.state.discard_reductions:  # a failed backward's, waited for by the next forward
                return
            scale = 1.0 / self.dp_world
            if self.config.step_in_backward:
                # R7: step from the output buffer itself, post-divided in place (value * scale, as the
                # ordinary path's mul gives), before the next reduction writes it (R6 orders that one
                # after this follow-up). On CUDA this runs on the communication stream.
                if not master.requires_grad or unit.skip_step:  # (turned off since its forward, or no
                    unit.skip_step = False                    # rank's loss reached it: no step, as torch)
                    return
                value.mul_(scale)
                self.step_unit(unit, value)
                return
            if master.grad is None or not master.requires_grad:  # turned off since its forward: as
                return               # torch, which accumulates no gradient into such a parameter
            if not unit.grad_unwritten:
                master.grad.add_(value, alpha=scale)
            elif value.dtype == torch.float32:  # = 0 + scale * value, as add_ would give
                torch.mul(value, scale, out=master.grad)
            else:  # widen first: a product in value's dtype would round
                master.grad.copy_(value).mul_(scale)
            unit.grad_unwritten = False

    def wait_all(self, slots: dict[str, Slot]) -> None:
        """Wait for every reduction in flight; a failed backward's (``discard_reductions``) are
        thrown away, their errors logged."""
        while self.pending:
            p = self.pending.pop(0)  # (off the list first: a failed reduction is not waited for twice)
            if self.state.discard_reductions and p.failed is not None:
                continue  # (its error is the one the backward raised)
            try:
                p.wait()
            except BaseException as e:
                if not self.state.discard_reductions:
                    raise  # (the backward raises: the next forward recovers, waiting for the rest)
                logger.warning("yashard: a reduction of the backward that raised failed too, and is "
                               "thrown away: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        self._last = None
        for slot in slots.values():
            slot.grad_busy = None

    def reduce_output(self, n: int) -> torch.Tensor:
        """The first ``n`` elements of the reduce-scatter output shared by every bucket (R6)."""
        if self.reduce_out is None:
            self.reduce_out = torch.empty(self._reduce_out_numel, dtype=self.config.wire_dtype, device=self.device)
        return self.reduce_out.narrow(0, 0, n)

    def workspace(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A comm hook's persistent scratch buffer (see ``GradBucket.workspace``): one per name and
        dtype (hooks that mix dtypes under one name, say the default hook's fp32 scratch beside a
        16-bit one, get one buffer each, so memory stays fixed), grown to the largest request."""
        first = self.workspaces.get(name)
        key = name if first is None or first.dtype == dtype else f"{name}[{str(dtype).replace('torch.', '')}]"
        buf = self.workspaces.get(key)
        if buf is None or buf.numel() < numel:
            if self.hook_planned:
                logger.warning("yashard: comm hook %s asked for workspace %r of %d %s, more than its workspace_plan "
                               "said; allocated now (memory_plan() lists it from here on). Fix the hook's plan",
                               getattr(self.comm_hook, "__name__", self.comm_hook), key, numel, dtype)
            buf = self.workspaces[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf.narrow(0, 0, numel)

    def plan_workspaces(self, units: list[Unit]) -> None:
        """Allocate what the comm hook says it will ask for (its ``workspace_plan``, see
        :mod:`yashard.comm_hooks`) on every unit's bucket, so the memory plan holds it before step
        one and the first backward allocates nothing. A hook without a plan allocates at its first call."""
        self.hook_planned = False
        if self.staging is not None:  # the chunked reduction: the default hook's needs for one chunk
            for name, numel, dtype in reduce_scatter_hook.workspace_plan(None, self.comm, self.staging.numel(),
                                                                         self.config.wire_dtype):
                self.workspace(name, numel, dtype)
            self.hook_planned = True
            return
        plan = getattr(self.comm_hook, "workspace_plan", None)
        if plan is None:
            return
        by_unit = _takes_keyword(plan, "unit")  # (a plan that treats units differently: see comm_hooks)
        for u in units:
            if not u.trains:  # (never reduced: all its parameters frozen)
                continue
            args = (self.comm_hook_state, self.comm, u.layout.padded, self.config.wire_dtype)
            for name, numel, dtype in plan(*args, unit=u.name) if by_unit else plan(*args):
                if name == "output":
                    self.reduce_output(0)
                else:
                    self.workspace(name, numel, dtype)
        self.hook_planned = True


def _takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (False when its signature is unreadable)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params and params[name].kind in (inspect.Parameter.KEYWORD_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD) \
        or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
