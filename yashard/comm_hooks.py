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
fill and return, so the default path allocates nothing. (Over a one-rank shard group, where the
default hook returns the buffer itself, it is allocated at the first call of ``output()``, once.) Hooks that need other buffers (the
compression hooks' low-precision copies) ask ``bucket.workspace(name, numel, dtype)``: a buffer the
runtime keeps across steps, grown to the largest request, so memory is fixed after the first
backward.

Memory known before step one: a hook that has a ``workspace_plan`` attribute,
``workspace_plan(state, comm, numel, dtype) -> [(name, numel, dtype), ...]``, says what it will ask
for on a bucket of ``numel`` elements of ``dtype`` (the name ``"output"`` standing for
``bucket.output()``); a plan that also takes a keyword ``unit`` is given the bucket's name (a hook
that treats units differently, as :func:`qgz_hook` does the norm group, plans each its own way).
``register_comm_hook`` allocates that for every unit at once, so ``memory_plan()`` lists it from
then on and the first backward allocates nothing. Every built-in has one; a hook without one gets
its buffers at its first call (listed by ``memory_plan`` from then on), and a hook that asks for
more than it planned gets it too, with a warning.

Streams (CUDA): the hook runs with the communication stream current, and the runtime consumes the
value on that stream. A :class:`WorkFuture`'s ``then`` callbacks run there too. A
``torch.futures.Future`` from NCCL (``work.get_future()``) runs its ``then`` callbacks on a side
stream and orders later users only through the tensors the callback *returns*: a callback that
writes ``bucket.output()`` must return it (``lambda f: out.copy_(f.value()[0])`` does, since
``copy_`` returns ``out``), or the runtime may read the output before the callback wrote it.

Built-ins: :func:`reduce_scatter_hook` (the default, exact), :func:`bf16_compress_hook` and
:func:`fp16_compress_hook` (the wire carries 16-bit values: each element of the result is the sum of
the W rounded inputs, rounded again: relative error <= (W + 1) * 2**-8 of the sum of magnitudes for
bf16, 2**-11 for fp16, which can also overflow above 65504), :func:`qgz_hook` (ZeRO++ qgZ: int8/int4
block quantization, hierarchical all-to-all, fp32 reduction; error bound in :mod:`yashard.zeropp`)
and :func:`noop_hook` (no communication; gradients are wrong: for measuring how much of a step is
communication).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .collectives import WorkFuture

if TYPE_CHECKING:  # pragma: no cover
    from .collectives import Comm

CommHook = Callable[[Any, "GradBucket"], Any]  # returns a future (see the module docstring)


@dataclass
class GradBucket:
    """The gradients of one unit, ready to be reduced.

    Attributes:
        index: position of this bucket in this backward's reduction order (0, 1, ...).
        name: the unit (``"layer_3"``, ``"embed"``, ``"lm_head"``, ``"small"`` for the norm group).
        last: True for the norm group's bucket, the last of every backward (unless every
            parameter of the norm group is frozen: it is then never reduced, and no bucket is last).
        slot: the gradient buffer the bucket lives in (``"layer_even"``, ``"layer_odd"``, ``"outer"``,
            ``"small"``; with ``reshard_after_forward=False`` the unit's own, named after it). A
            reduction starts only after the previous one finished (rule R6), so one scratch
            buffer per purpose is never shared by two reductions in flight.
        comm: the :class:`~yashard.collectives.Comm` (groups and logged collectives); the shard
            group is ``comm.shard_group``.
    """

    index: int
    name: str
    last: bool
    comm: "Comm"
    slot: str
    _buffer: torch.Tensor = field(repr=False)
    _output: Callable[[int], torch.Tensor] = field(repr=False)
    _workspace: Callable[[str, int, torch.dtype], torch.Tensor] = field(repr=False)
    _shard_numel: int = field(repr=False)

    def buffer(self) -> torch.Tensor:
        """The unit's flat, padded gradient (``shard_world * shard_numel`` elements, reduce dtype).
        Read it; do not keep it: the slot is reused by another unit after the reduction."""
        return self._buffer

    def output(self) -> torch.Tensor:
        """Preallocated result tensor (``shard_numel`` elements, reduce dtype)."""
        return self._output(self._shard_numel)

    def workspace(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A persistent 1-D buffer of at least ``numel`` elements of ``dtype`` on the gradients'
        device, private to ``name``; contents are undefined. Allocated on first request, reused
        (and grown only if a larger request comes) afterwards."""
        return self._workspace(name, numel, dtype)

    @property
    def shard_numel(self) -> int:
        return self._shard_numel

    def is_last(self) -> bool:
        return self.last


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def reduce_scatter_hook(state: Any, bucket: GradBucket) -> WorkFuture | torch.futures.Future:
    """Default: SUM reduce-scatter over the shard group into ``bucket.output()`` (exact). Over a
    one-rank shard group the sum is the buffer itself, and the future holds it (no copy; logged as
    the reduce-scatter it stands for)."""
    comm = bucket.comm
    if comm.shard_world == 1:
        comm.log.add("reduce_scatter", bucket.name, bucket.buffer(), comm.name(comm.shard_group))
        return _done(bucket.buffer())
    return bucket.comm.reduce_scatter(bucket.output(), bucket.buffer(), bucket.name,
                                      scratch=_scratch(bucket, bucket.buffer().dtype))


def _reduce_scatter_plan(state: Any, comm: "Comm", numel: int, dtype: torch.dtype) -> list[tuple[str, int, torch.dtype]]:
    """What :func:`reduce_scatter_hook` asks for: the receive buffer of :func:`_scratch` only."""
    if comm.shard_world > 1 and comm.reduce_scatter_needs_scratch():
        return [("reduce_scatter", numel, dtype)]
    return []


reduce_scatter_hook.workspace_plan = _reduce_scatter_plan


def _scratch(bucket: GradBucket, dtype: torch.dtype) -> torch.Tensor | None:
    """The receive buffer ``Comm.reduce_scatter`` needs on this backend (gloo, > 2 ranks), one for
    every bucket: a reduction starts only after the previous one finished (rule R6)."""
    if not bucket.comm.reduce_scatter_needs_scratch():
        return None
    return bucket.workspace("reduce_scatter", bucket.buffer().numel(), dtype)


def noop_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """No communication in the shard group: returns this rank's own, unreduced chunk. Gradients are
    WRONG (each rank trains on its own data only): use it to measure the communication share of a
    step. (With hybrid sharding the runtime's all-reduce over the replica group still runs.)"""
    n = bucket.shard_numel
    rank = bucket.comm.shard_rank
    return _done(bucket.buffer().narrow(0, rank * n, n))


noop_hook.workspace_plan = lambda state, comm, numel, dtype: []


def _compress_hook(dtype: torch.dtype):
    def hook(state: Any, bucket: GradBucket) -> WorkFuture:
        buf = bucket.buffer()
        if buf.dtype == dtype:
            return reduce_scatter_hook(state, bucket)
        out = bucket.output()  # (not before: over one rank the default hook needs none)
        tag = str(dtype).replace("torch.", "")
        # One pair for every bucket: the previous reduction finished before this hook runs (R6).
        low = bucket.workspace(f"{tag}_compress.in", buf.numel(), dtype)
        low_out = bucket.workspace(f"{tag}_compress.out", out.numel(), dtype)
        low.copy_(buf)
        reduced = bucket.comm.reduce_scatter(low_out, low, bucket.name, scratch=_scratch(bucket, dtype))
        return reduced.then(lambda f: out.copy_(f.value()))

    def plan(state: Any, comm: "Comm", numel: int, buf_dtype: torch.dtype) -> list[tuple[str, int, torch.dtype]]:
        if buf_dtype == dtype:
            return _reduce_scatter_plan(state, comm, numel, buf_dtype)
        tag = str(dtype).replace("torch.", "")
        return [("output", numel // comm.shard_world, buf_dtype), (f"{tag}_compress.in", numel, dtype),
                (f"{tag}_compress.out", numel // comm.shard_world, dtype)] + _reduce_scatter_plan(state, comm, numel, dtype)

    hook.workspace_plan = plan
    hook.__name__ = f"{str(dtype).replace('torch.', '')}_compress_hook"
    hook.__doc__ = (f"Reduce-scatter in {dtype} (half the bytes of fp32), result widened into "
                    "``bucket.output()`` (two workspace buffers, allocated once).")
    return hook


bf16_compress_hook = _compress_hook(torch.bfloat16)
fp16_compress_hook = _compress_hook(torch.float16)


NORM_GROUP_EXACT = ("the norm group (every layer's 1-D weights in one bucket, so a block can mix several "
                    "layers' gradients of very different scales) is reduced exactly, as qwZ gathers it exactly: "
                    "a small share of the bytes")
"""Why :func:`qgz_hook` never quantizes the norm group's bucket (``QgzState.fallbacks["small"]``)."""

QGZ_DEFAULT_BLOCK = {4: 64, 8: 256}
"""Elements per fp32 scale that :class:`QgzState` uses when no ``block`` is given, by bits."""


class QgzState:
    """State of :func:`qgz_hook`: the node groups (created here: call on every rank, after
    ``yashard.shard`` and before the first forward) and the quantization format.

    ``ranks_per_node`` consecutive shard ranks form a node; ``bits`` is 4 or 8; ``block`` elements
    share one fp32 scale (default :data:`QGZ_DEFAULT_BLOCK`: 64 for int4, 256 for int8). Small
    blocks cost bytes (a 4-byte scale per 64 int4 elements is 12.5% on top of the codes, per 256
    int8 elements 1.6%) and buy precision: the step is absmax / 7 (int8: / 127), and the absmax of
    fewer elements sits closer to the typical gradient. Rounding to nearest zeroes elements below
    half a step, so a parameter with small gradients sharing a large block with large ones loses
    them: with int8 blocks of 4096, a tiny Llama's q/k projections at init came out with relative
    errors above 1 (tests/test_comm.py), with 256 every parameter within 1.5% on five variants of
    it (3 and 4 layers, hidden 32 and 64; the bound depends on the model: before the norm group was
    exempted, its norm weights reached 13% on one of them).
    ``rounding``: ``"stochastic"`` rounds each gradient element up or down with the
    probabilities that make the quantized value unbiased (a fresh draw per call and rank, from
    ``seed``: reproducible); ``"nearest"`` rounds to nearest, which zeroes every element below half a
    step, a bias that grows with the block. ``"auto"`` (default): stochastic for int4, nearest for
    int8 (step = absmax / 127, little to zero).
    Measured on a tiny model, 200 steps at lr 1e-3, final loss against the exact path's (seeds 0-7):
    int4 stochastic block 64 -0.46% to +0.25% (mean -0.06%), block 128 +0.12% to +0.64%, block 256
    +0.63% to +1.35%; int8 nearest -0.03% (tests/test_comm.py, docs/benchmarks.md).
    The norm group (``"small"``: every layer's 1-D weights in one bucket) is always reduced exactly:
    quantized, a block mixed several layers' norm gradients of very different scales, and on a
    tiny model (hidden size 32, where one 256-element block spans 8 norm weights) single norm
    weights came out 10-30% off with int8 (Llama, Gemma) and up to 130% off with int4, where the
    layers' worst was 1.7%; it is a small share of the bytes (2 * layers * hidden elements, about
    0.004% of a 7B Llama's gradient). qwZ likewise gathers it exact.
    ``fallbacks`` maps each unit that took the exact reduce-scatter to the reason: the norm group,
    and any unit whose quantized chunk would not be smaller (a few elements per rank with 16-bit
    gradients; with fp32 gradients and the default ``shard_align`` none is).
    """

    def __init__(self, model, ranks_per_node: int, *, bits: int = 4, block: int | None = None,
                 rounding: str = "auto", seed: int = 0):
        from .quant import check_format
        from .zeropp import qgz_group_ranks

        runtime = getattr(model, "runtime", None)
        if runtime is None:
            raise TypeError(f"QgzState needs the model yashard.shard returned, got a {type(model).__name__} that "
                            "is not sharded: model = yashard.shard(model) first")
        comm = runtime.comm
        default = QGZ_DEFAULT_BLOCK.get(bits, 4096)  # (an invalid bits is reported by check_format)
        check_format(bits, default if block is None else block, default=default)
        if block is None:
            block = default
        if rounding not in ("auto", "stochastic", "nearest"):
            raise ValueError(f"QgzState: rounding must be 'auto', 'stochastic' or 'nearest', got {rounding!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"QgzState: seed must be an int in [0, 2**32), got {seed!r}")
        if rounding == "auto":
            rounding = "stochastic" if bits == 4 else "nearest"
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or comm.shard_world % ranks_per_node:
            raise ValueError(
                f"QgzState: ranks_per_node={ranks_per_node!r} must be a positive divisor of the shard group "
                f"size {comm.shard_world}"
            )
        intra, inter = qgz_group_ranks(comm.shard_world, ranks_per_node)
        self.ranks_per_node, self.bits, self.block, self.rounding = ranks_per_node, bits, block, rounding
        self.rank, self.seed = comm.rank, seed
        self.comm = comm  # (the model's: a state serves the model it was built for)
        self.calls = 0  # quantized reductions so far: with the seed and the rank, the next one's seed
        self.intra = comm.new_shard_subgroups(intra) if ranks_per_node > 1 else None
        self.inter = comm.new_shard_subgroups(inter) if len(intra) > 1 else None
        for g, label in ((self.intra, "node"), (self.inter, "cross_node")):
            if g is not None:
                comm.label(g, label)
        self.fallbacks: dict[str, str] = {}

    def settings(self) -> tuple:
        """What every rank must agree on (``register_comm_hook`` compares it across ranks)."""
        return (self.ranks_per_node, self.bits, self.block, self.rounding, self.seed)

    def state_dict(self) -> dict:
        """The stochastic-rounding position, saved by ``yashard.save_checkpoint`` so that a resumed
        run draws what the uninterrupted one would have."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])


def qgz_hook(state: QgzState, bucket: GradBucket):
    """ZeRO++ qgZ: quantize, all-to-all inside the node, reduce in fp32, requantize, all-to-all
    across nodes, reduce in fp32 (:func:`yashard.zeropp.qgz_reduce_scatter`); same placement and SUM
    semantics as the default hook. Runs synchronously on the communication stream (on CPU the host
    waits for it). Buckets too small to gain from quantization use the exact reduce-scatter."""
    from .zeropp import qgz_fallback_reason, qgz_reduce_scatter, qgz_workspace_nbytes

    if not isinstance(state, QgzState):
        raise TypeError(f"qgz_hook needs a yashard.comm_hooks.QgzState as its state, got {type(state).__name__}")
    if state.comm is not bucket.comm:
        raise ValueError("qgz_hook: this QgzState was built for another sharded model (its node groups are that "
                         "model's); build one per model: QgzState(model, ranks_per_node)")
    comm, buf = bucket.comm, bucket.buffer()
    w = comm.shard_world
    reason = NORM_GROUP_EXACT if bucket.name == "small" else qgz_fallback_reason(
        buf.numel(), w, state.ranks_per_node, dtype=buf.dtype, bits=state.bits, block=state.block)
    if reason is not None:
        state.fallbacks[bucket.name] = reason
        return reduce_scatter_hook(state, bucket)
    out = bucket.output()  # (not before the fallback: over one rank it would be allocated for nothing)
    ws = bucket.workspace("qgz", qgz_workspace_nbytes(buf.numel(), w, bits=state.bits, block=state.block), torch.uint8)
    seed = None
    if state.rounding == "stochastic":
        from .quant import mix_seed

        seed = mix_seed(state.seed, state.calls, state.rank)
        state.calls += 1
    qgz_reduce_scatter(comm, out, buf, ws, intra_group=state.intra, inter_group=state.inter, bits=state.bits,
                       block=state.block, unit=bucket.name, seed=seed)
    return _done(out)


def _qgz_plan(state: Any, comm: "Comm", numel: int, dtype: torch.dtype, *,
              unit: str | None = None) -> list[tuple[str, int, torch.dtype]]:
    """What :func:`qgz_hook` asks for on the bucket of ``unit``: its byte workspace where qgZ
    applies, else what the exact reduce-scatter it falls back to asks for (nothing is planned for a
    wrong state: the hook refuses it at its first call)."""
    from .zeropp import qgz_fallback_reason, qgz_workspace_nbytes

    if not isinstance(state, QgzState) or state.comm is not comm:
        return []
    w = comm.shard_world
    if unit == "small" or qgz_fallback_reason(numel, w, state.ranks_per_node, dtype=dtype, bits=state.bits,
                                              block=state.block) is not None:
        return _reduce_scatter_plan(state, comm, numel, dtype)
    return [("output", numel // w, dtype), ("qgz", qgz_workspace_nbytes(numel, w, bits=state.bits, block=state.block),
                                              torch.uint8)]


qgz_hook.workspace_plan = _qgz_plan
