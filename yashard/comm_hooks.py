"""Pluggable gradient reduction: how each unit's gradients travel, modelled on DDP comm hooks.

A hook is ``hook(state, bucket) -> future``, registered with
``ShardedModel.register_comm_hook(state, hook)`` before the first forward. It is called once per unit
per backward, on the communication stream, as soon as the unit's gradients are complete (the
GateGradFlow point; the norm group's bucket comes last, at the end of the backward).

The future is a ``torch.futures.Future`` or a :class:`WorkFuture` (anything whose ``wait()`` returns
the value). Contract of that value: this rank's chunk of the **SUM** over the shard group of every
rank's ``bucket.buffer()``, i.e. ``bucket.shard_numel`` elements, any float dtype. The runtime then,
in fp32 and on the shard: all-reduces it over the replica group (hybrid sharding), divides by the
data-parallel world size (post-divide), and adds it to the master gradient. A hook therefore never
divides, and the same hook works with and without hybrid sharding or accumulation.

``bucket.output()`` is a preallocated tensor of exactly that size (``reduce_dtype``) the hook may
fill and return, so the default path allocates nothing. Hooks that need other buffers (the
compression hooks' low-precision copies) ask ``bucket.workspace(name, numel, dtype)``: a buffer the
runtime keeps across steps, grown to the largest request, so memory is still fixed after the first
backward (these buffers are listed by ``memory_plan`` once allocated).

Built-ins: :func:`reduce_scatter_hook` (the default, exact), :func:`bf16_compress_hook` and
:func:`fp16_compress_hook` (the wire carries 16-bit values: each element of the result is the sum of
the W rounded inputs, rounded again: relative error <= (W + 1) * 2**-8 of the sum of magnitudes for
bf16, 2**-11 for fp16, which can also overflow above 65504), :func:`qgz_hook` (ZeRO++ qgZ: int8/int4
block quantization, hierarchical all-to-all, fp32 reduction; error bound in :mod:`yashard.zeropp`)
and :func:`noop_hook` (no communication; gradients are wrong: for measuring how much of a step is
communication).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from .collectives import Comm

CommHook = Callable[[Any, "GradBucket"], Any]  # returns a future (see the module docstring)


@dataclass
class GradBucket:
    """The gradients of one unit, ready to be reduced.

    Attributes:
        index: position of this bucket in this backward's reduction order (0, 1, ...).
        name: the unit (``"layer_3"``, ``"embed"``, ``"lm_head"``, ``"small"`` for the norm group).
        last: True for the last bucket of the backward (the norm group, or the last unit reduced).
        comm: the :class:`~yashard.collectives.Comm` (groups and logged collectives); the shard
            group is ``comm.shard_group``.
    """

    index: int
    name: str
    last: bool
    comm: "Comm"
    _buffer: torch.Tensor = field(repr=False)
    _output: torch.Tensor = field(repr=False)
    _workspace: Callable[[str, int, torch.dtype], torch.Tensor] = field(repr=False)

    def buffer(self) -> torch.Tensor:
        """The unit's flat, padded gradient (``shard_world * shard_numel`` elements, reduce dtype).
        Read it; do not keep it: the slot is reused by another unit after the reduction."""
        return self._buffer

    def output(self) -> torch.Tensor:
        """Preallocated result tensor (``shard_numel`` elements, reduce dtype)."""
        return self._output

    def workspace(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A persistent 1-D buffer of at least ``numel`` elements of ``dtype`` on the gradients'
        device, private to ``name``; contents are undefined. Allocated on first request, reused
        (and grown only if a larger request comes) afterwards."""
        return self._workspace(name, numel, dtype)

    @property
    def shard_numel(self) -> int:
        return self._output.numel()

    def is_last(self) -> bool:
        return self.last


class WorkFuture:
    """A future of the value ``value_fn()`` computes once the c10d ``work`` handle finished.

    gloo's reduce-scatter has no ``get_future``, so the built-in hooks return this instead of a
    ``torch.futures.Future``; it has the part of that interface the runtime uses: ``wait()``
    (waits for the work, computes and returns the value, once), ``value()``, ``done()`` and
    ``then(callback)`` (callback receives this future, as torch's does; it runs inside ``wait()``,
    on the stream that waits: the communication stream).
    """

    __slots__ = ("_work", "_value_fn", "_value", "_done")

    def __init__(self, work, value_fn: Callable[[], Any]):
        self._work, self._value_fn, self._value, self._done = work, value_fn, None, False

    def wait(self, timeout: float | None = None):
        """Wait (at most ``timeout`` seconds where the work supports it), then compute the value."""
        if not self._done:
            if timeout is not None and isinstance(self._work, (dist.Work, WorkFuture)):
                self._work.wait(timeout=datetime.timedelta(seconds=timeout) if isinstance(self._work, dist.Work)
                                else timeout)
            else:
                self._work.wait()
            self._value = self._value_fn()
            self._done = True
            self._work = self._value_fn = None
        return self._value

    def value(self):
        if not self._done:
            raise RuntimeError("WorkFuture.value() before wait()")
        return self._value

    def done(self) -> bool:
        return self._done

    def then(self, callback: Callable[["WorkFuture"], Any]) -> "WorkFuture":
        return WorkFuture(self, lambda: callback(self))


def _future_of(work, value: torch.Tensor) -> WorkFuture:
    """A future of ``value`` that completes with ``work``."""
    return WorkFuture(work, lambda: value)


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def reduce_scatter_hook(state: Any, bucket: GradBucket) -> WorkFuture:
    """Default: SUM reduce-scatter over the shard group into ``bucket.output()`` (exact)."""
    out = bucket.output()
    work = bucket.comm.reduce_scatter(out, bucket.buffer(), bucket.name)
    return _future_of(work, out)


def noop_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """No communication: returns this rank's own, unreduced chunk. Gradients are WRONG (each rank
    trains on its own data only): use it to measure the communication share of a step."""
    n = bucket.shard_numel
    rank = bucket.comm.shard_rank
    return _done(bucket.buffer().narrow(0, rank * n, n))


def _compress_hook(dtype: torch.dtype):
    def hook(state: Any, bucket: GradBucket) -> WorkFuture:
        buf, out = bucket.buffer(), bucket.output()
        if buf.dtype == dtype:
            return reduce_scatter_hook(state, bucket)
        tag = str(dtype).replace("torch.", "")
        low = bucket.workspace(f"{tag}_compress.in", buf.numel(), dtype)
        low_out = bucket.workspace(f"{tag}_compress.out", out.numel(), dtype)
        low.copy_(buf)
        work = bucket.comm.reduce_scatter(low_out, low, bucket.name)

        def widen():
            out.copy_(low_out)
            return out

        return WorkFuture(work, widen)

    hook.__name__ = f"{str(dtype).replace('torch.', '')}_compress_hook"
    hook.__doc__ = (f"Reduce-scatter in {dtype} (half the bytes of fp32), result widened into "
                    "``bucket.output()`` (two workspace buffers, allocated once).")
    return hook


bf16_compress_hook = _compress_hook(torch.bfloat16)
fp16_compress_hook = _compress_hook(torch.float16)


class QgzState:
    """State of :func:`qgz_hook`: the node groups (created here: call on every rank, after
    ``yashard.shard`` and before the first forward) and the quantization format.

    ``ranks_per_node`` consecutive shard ranks form a node; ``bits`` is 4 or 8; ``block`` elements
    share one fp32 scale. ``fallbacks`` maps each unit that took the exact reduce-scatter (quantizing
    it would not save bytes: tiny units such as the norm group) to the reason.
    """

    def __init__(self, model, ranks_per_node: int, *, bits: int = 4, block: int = 4096):
        from .quant import check_format
        from .zeropp import qgz_group_ranks

        comm = model.runtime.comm
        check_format(bits, block)
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or comm.shard_world % ranks_per_node:
            raise ValueError(
                f"QgzState: ranks_per_node={ranks_per_node!r} must be a positive divisor of the shard group "
                f"size {comm.shard_world}"
            )
        intra, inter = qgz_group_ranks(comm.shard_world, ranks_per_node)
        self.ranks_per_node, self.bits, self.block = ranks_per_node, bits, block
        self.intra = comm.new_shard_subgroups(intra) if ranks_per_node > 1 else None
        self.inter = comm.new_shard_subgroups(inter) if len(intra) > 1 else None
        for g, label in ((self.intra, "node"), (self.inter, "cross_node")):
            if g is not None:
                comm.label(g, label)
        self.fallbacks: dict[str, str] = {}


def qgz_hook(state: QgzState, bucket: GradBucket):
    """ZeRO++ qgZ: quantize, all-to-all inside the node, reduce in fp32, requantize, all-to-all
    across nodes, reduce in fp32 (:func:`yashard.zeropp.qgz_reduce_scatter`); same placement and SUM
    semantics as the default hook. Runs synchronously on the communication stream (on CPU the host
    waits for it). Buckets too small to gain from quantization use the exact reduce-scatter."""
    from .zeropp import qgz_fallback_reason, qgz_reduce_scatter, qgz_workspace_nbytes

    if not isinstance(state, QgzState):
        raise TypeError(f"qgz_hook needs a yashard.comm_hooks.QgzState as its state, got {type(state).__name__}")
    comm, buf, out = bucket.comm, bucket.buffer(), bucket.output()
    w = comm.shard_world
    reason = qgz_fallback_reason(buf.numel(), w, state.ranks_per_node, dtype=buf.dtype, bits=state.bits,
                                 block=state.block)
    if reason is not None:
        state.fallbacks[bucket.name] = reason
        return reduce_scatter_hook(state, bucket)
    ws = bucket.workspace("qgz", qgz_workspace_nbytes(buf.numel(), w, bits=state.bits, block=state.block), torch.uint8)
    qgz_reduce_scatter(comm, out, buf, ws, intra_group=state.intra, inter_group=state.inter, bits=state.bits,
                       block=state.block, unit=bucket.name)
    return _done(out)
