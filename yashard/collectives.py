"""Every torch.distributed call yashard makes goes through this module.

Keeping them in one place lets us follow torch's API renames (``all_gather_into_tensor`` ->
``all_gather_single`` in torch 2.13) in one spot, and lets tests read a log of every collective a
rank issued, in order, with its size and group.

The asynchronous collectives return a work handle. ``work.wait()`` on NCCL makes the *current*
stream wait (the host does not block); on gloo it blocks the host until the data landed.

Groups (see :mod:`yashard.topology`): ``group`` is the data-parallel group yashard was given;
units are sharded over ``shard_group`` (all of ``group`` unless hybrid sharding), identical shards
live on the ranks of ``replica_group`` (hybrid sharding), and hpZ's backward gathers stay inside
``secondary_group``.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .topology import Topology, mesh_shard_groups

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# Tags of the point-to-point messages yashard's gloo collectives are made of. Not 0 (the default
# of dist.send / recv / send_object_list): user traffic in the same group never matches ours, and
# a rank issuing an all-gather where its peer issued a reduce-scatter waits (and times out)
# instead of receiving the wrong tensor.
TAG_ALL_GATHER = 0x79610001
TAG_REDUCE_SCATTER = 0x79610002


def backend_for(backend: str, device_type: str) -> str:
    """The backend that serves ``device_type`` tensors in a group whose backend string is
    ``backend``: ``"gloo"``, ``"nccl"``, or one entry of a mixed ``"cpu:gloo,cuda:nccl"``."""
    if ":" not in backend:
        return backend
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return per_device.get(device_type, backend)


def group_backend(group) -> str:
    """The backend string of ``group``: ``"gloo"``, ``"nccl"`` or a mixed ``"cpu:gloo,cuda:nccl"``.
    A group made by ``init_process_group()`` without a backend reports ``"undefined"`` through
    ``get_backend`` and its per-device backends through ``get_backend_config``."""
    backend = str(dist.get_backend(group))
    return str(dist.get_backend_config(group)) if backend == "undefined" else backend


def group_store(group):
    """The key-value store ``group`` was created with (its keys prefixed for that group), or None."""
    get = getattr(dist.distributed_c10d, "_get_process_group_store", None)
    try:
        return get(group) if get is not None else None
    except (RuntimeError, ValueError, KeyError):
        return None


def needs_reduce_scatter_scratch(gloo: bool, size: int) -> bool:
    """Whether a reduce-scatter over ``size`` ranks wants a receive buffer: on gloo over more than two
    ranks it runs as an all-to-all into one, then a local sum (:meth:`Comm.reduce_scatter`)."""
    return gloo and size > 2


class CollectiveError(RuntimeError):
    """A collective failed or did not finish in time; the message names the layer and phase."""


def wait_timeout(device_type: str, timeout: float | None, host: bool) -> float | None:
    """The timeout to pass to a wait (see :meth:`Comm.wait`): none for a wait on a CUDA
    collective that only orders streams, ``timeout`` otherwise."""
    return None if device_type == "cuda" and not host else timeout


def _wait(work, timeout: float | None):
    """``work.wait()``, bounded by ``timeout`` seconds: c10d work handles take a timedelta,
    :class:`WorkFuture` and :class:`_Works` take seconds, a ``torch.futures.Future`` is waited for
    through a done-callback (it has no timed wait)."""
    if timeout is None:
        return work.wait()
    if isinstance(work, dist.Work):
        return work.wait(timeout=datetime.timedelta(seconds=timeout))
    if isinstance(work, (WorkFuture, _Works)):
        return work.wait(timeout=timeout)
    if isinstance(work, torch.futures.Future) and work.done():  # (a comm hook's, already complete)
        return work.wait()
    if callable(getattr(work, "add_done_callback", None)):  # a torch.futures.Future (a comm hook's)
        landed = threading.Event()
        work.add_done_callback(lambda _: landed.set())  # (runs at once if it is done already)
        if not landed.wait(timeout):
            raise TimeoutError(f"not done within {timeout}s")
    return work.wait()


def wait_work(work, what, timeout: float | None, where: tuple[int, int] | None = None):
    """Wait for ``work`` (a c10d work handle or a future), at most ``timeout`` seconds where the
    handle supports it; any failure becomes a :class:`CollectiveError` naming ``what`` (op, unit,
    phase; any object, formatted only then) and ``where`` (rank, world size). Returns what
    ``wait()`` returned."""
    try:
        return _wait(work, timeout)
    except CollectiveError:
        raise
    except Exception as e:  # gloo/NCCL report timeouts and dead peers as RuntimeError
        raise collective_failure(what, e, where) from e


def collective_failure(what, e: BaseException, where: tuple[int, int] | None) -> CollectiveError:
    """The :class:`CollectiveError` for collective ``what`` (op, unit, phase) that failed with ``e``
    on rank ``where`` = (rank, world size), at its issue or its wait. ``what.hint``, where set (a
    user's comm hook reduced it), replaces the advice about peers."""
    cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    at = f" on rank {where[0]} of {where[1]}" if where is not None else ""
    advice = getattr(what, "hint", None) or (
        "A peer rank died, stalled, or issued a different sequence of "
        "collectives (a rank that ran more or fewer forward passes or layers). Look for the first error "
        "on the other ranks and compare the collective, layer and phase each rank names here (a rank that "
        "waits in another phase, e.g. another forward, ran a different number of micro-batches); "
        "ShardConfig(debug_collectives=True) finds a divergence that does not hang, at the next optimizer "
        "step; ShardConfig(collective_timeout=...) bounds the wait")
    return CollectiveError(f"yashard: {what}{at} failed: {cause}. {advice}")


class _Issuing:
    """See :meth:`Comm.issuing` (a class, not a generator: it wraps every gather and reduction)."""

    __slots__ = ("what", "where")

    def __init__(self, what, where: tuple[int, int]):
        self.what, self.where = what, where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        # (gloo/NCCL errors are RuntimeErrors; a ValueError is a caller's mistake and stays as it is)
        if e is not None and isinstance(e, RuntimeError) and not isinstance(e, CollectiveError):
            raise collective_failure(self.what, e, self.where) from e
        return False


class WorkFuture:
    """A future of the value ``value_fn()`` computes once the c10d ``work`` handle finished.

    gloo's point-to-point works and its reduce-scatter have no ``get_future`` ("Work::getFuture not
    implemented"), so :meth:`Comm.reduce_scatter` and the built-in comm hooks return this instead of
    a ``torch.futures.Future`` (a hook may return either); it has the part of that interface the
    runtime uses: ``wait()``
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
            _wait(self._work, timeout)
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


class _Works:
    """Several work handles waited as one (a batch of point-to-point sends and receives)."""

    __slots__ = ("works",)

    def __init__(self, works):
        self.works = works

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every handle; ``timeout`` (seconds) bounds the whole batch, not each handle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self.works:
            _wait(w, None if deadline is None else max(deadline - time.monotonic(), 1e-3))
        return True


class Record(NamedTuple):
    """One logged collective: ``nbytes`` is the size of the tensor named in each method's docstring."""

    op: str
    unit: str
    numel: int
    nbytes: int
    group: str


@dataclass
class CollectiveLog:
    """Ordered record of the collectives one rank issued (``enabled``), and, for the
    collective-order guard (``track``), a running CRC32 of ``(op, unit, numel, nbytes, group)`` with the
    records since the last :meth:`reset_sequence` (deterministic across processes, unlike ``hash``)."""

    enabled: bool = False
    records: list[Record] = field(default_factory=list)
    track: bool = False
    sequence: list[tuple] = field(default_factory=list)
    crc: int = 0

    def add(self, op: str, unit: str, t: torch.Tensor, group: str) -> None:
        if self.enabled:
            self.records.append(Record(op, unit, t.numel(), t.numel() * t.element_size(), group))
        if self.track:
            key = (op, unit, t.numel(), t.numel() * t.element_size(), group)
            self.sequence.append(key)
            self.crc = zlib.crc32(repr(key).encode(), self.crc)

    def clear(self) -> None:
        self.records.clear()

    def reset_sequence(self) -> None:
        self.sequence.clear()
        self.crc = 0


class Comm:
    """The process groups plus the collectives the runtime needs, each logged.

    Creating subgroups is collective: every rank of ``group`` constructs its ``Comm`` with the same
    sizes, in the same order relative to other group creations.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, shard_group_size: int | None = None,
                 secondary_group_size: int | None = None, timeout: float | None = None, mesh=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "yashard.shard needs an initialised process group: call "
                "torch.distributed.init_process_group() first (torchrun sets the environment; "
                "use backend='gloo' on CPU, 'nccl' on CUDA)"
            )
        if mesh is not None and mesh.ndim == 1:  # FSDP2's fully_shard(mesh=1-D): the mesh is the group
            if group is not None:
                raise ValueError("pass the data-parallel ranks once: process_group= or a 1-D mesh=, not both")
            group = mesh.get_group(0)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.backend = group_backend(self.group)
        # where the collectives' tensors live; yashard.shard sets it to the device it picked
        self.device_type = "cuda" if "nccl" in self.backend and torch.cuda.is_available() else "cpu"
        self.log = CollectiveLog()
        self.timeout = timeout  # seconds a wait may take before it raises (None: the group's own timeout)
        self._gloo: dict[tuple[int, str], bool] = {}
        self._sizes: dict[int, int] = {}
        groups = None
        if mesh is not None and mesh.ndim != 1:
            groups = self._mesh_shard_groups(mesh, shard_group_size)
            shard_group_size = len(groups[0])
        self.topology = topo = Topology(self.world, self.rank, shard_group_size or self.world, secondary_group_size,
                                        groups=groups)
        # Units are laid out and sharded over the shard group (this rank is ``shard_rank`` of
        # ``shard_world``); ``replica_world`` shard groups hold identical copies (hybrid sharding).
        self.shard_rank, self.shard_world = topo.shard_rank, topo.shard_size
        self.replica_rank, self.replica_world = topo.replica_rank, topo.replica_world
        if groups is not None:  # the mesh's own groups: its shard dim, then its replicate dim
            self.shard_group = mesh.get_group(1)
            self.replica_group = mesh.get_group(0) if topo.replica_world > 1 else None
            self._check_mesh_group_order(mesh)
        else:
            self.shard_group = self.group if topo.shard_size == self.world else self.new_subgroups(topo.shard_groups)
            self.replica_group = self.new_subgroups(topo.replica_groups) if topo.replica_world > 1 else None
        self.secondary_group = None
        if topo.secondary_size is not None:
            self.secondary_group = (self.shard_group if topo.secondary_size == topo.shard_size
                                    else self.new_subgroups(topo.secondary_groups))
        self._names = {id(self.shard_group): "shard", id(self.group): "world"}  # "world" if they are one
        if self.replica_group is not None:
            self._names.setdefault(id(self.replica_group), "replica")
        if self.secondary_group is not None:
            self._names.setdefault(id(self.secondary_group), "secondary")

    # ---- groups ---------------------------------------------------------------------------------
    def _mesh_shard_groups(self, mesh, shard_group_size: int | None) -> tuple[tuple[int, ...], ...]:
        """The shard groups (ranks of ``self.group``) of a 2-D ``(replicate, shard)`` device mesh."""
        names = getattr(mesh, "mesh_dim_names", None)
        if mesh.ndim != 2:
            raise ValueError(
                f"yashard takes a 1-D (shard) or 2-D (replicate, shard) device mesh, got a {mesh.ndim}-D mesh "
                f"with dims {names}; pass the data-parallel dims only, e.g. mesh['dp_replicate', 'dp_shard']"
            )
        if shard_group_size is not None:
            raise ValueError(
                f"ShardConfig(shard_group_size={shard_group_size}) and the 2-D mesh (shape "
                f"{tuple(mesh.mesh.shape)}, dims {names}) both set the shard groups; pass one of them "
                f"(the mesh's shard dim makes groups of {mesh.mesh.shape[1]})"
            )
        members = dist.get_process_group_ranks(self.group)
        rows = mesh.mesh.tolist()
        if sorted(r for row in rows for r in row) != sorted(members):
            raise ValueError(
                f"the mesh covers ranks {sorted(r for row in rows for r in row)} but the process group has "
                f"ranks {sorted(members)}; pass process_group= a group of exactly the mesh's ranks (or a "
                "mesh over the whole world)"
            )
        return tuple(tuple(g) for g in mesh_shard_groups([[members.index(r) for r in row] for row in rows]))

    def _check_mesh_group_order(self, mesh) -> None:
        """The mesh's groups must order their ranks as the topology does (process groups sort by rank)."""
        members = dist.get_process_group_ranks(self.group)
        topo = self.topology
        checks = [("shard", self.shard_group, topo.shard_groups[topo.replica_rank])]
        if self.replica_group is not None:
            checks.append(("replicate", self.replica_group, topo.replica_groups[topo.shard_rank]))
        for what, group, want in checks:
            got = dist.get_process_group_ranks(group)
            if got != [members[r] for r in want]:
                raise RuntimeError(
                    f"the mesh's {what} group orders its ranks {got}, yashard expects {[members[r] for r in want]}; "
                    "build the mesh with torch.distributed.device_mesh.init_device_mesh or DeviceMesh(...) "
                    "so that its groups come from the mesh's rows and columns"
                )

    def new_subgroups(self, rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
        """Create one process group per list of ``group`` ranks, in order, and return the one this
        rank belongs to (None if none). Collective over ``group`` only: every rank of it calls it with
        the same lists, and ranks outside it never need to (``group`` may be a data-parallel subgroup
        of a larger job: its tensor-parallel peers shard other models, or none).

        Over the whole world every rank creates every group (``new_group``'s default protocol: the
        names come from a count every rank advances alike). Over a subgroup the members of each new
        group synchronise among themselves (``use_local_synchronization``), whose names hash the
        ranks with the number of groups this rank belongs to: ranks that belong to different numbers
        of groups (an earlier ``new_group`` not every rank is in) would wait for each other under
        different names until the timeout, so that is checked first and refused, naming the counts."""
        members = [dist.get_global_rank(self.group, r) for r in range(self.world)]
        if self.world == dist.get_world_size():
            mine = None
            for ranks in rank_lists:
                g = dist.new_group([members[r] for r in ranks])
                if self.rank in ranks:
                    mine = g
            return mine
        from torch.distributed import distributed_c10d as c10d

        counts = self.all_gather_object(len(c10d._world.pg_names), "process group count (creating subgroups)")
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"the ranks of the data-parallel group {members} belong to different numbers of process groups "
                f"({', '.join(f'rank {m}: {n}' for m, n in zip(members, counts))}): torch names the subgroups "
                "yashard creates over a group that is not the whole world by those counts, so the ranks would wait "
                "for each other under different names until the timeout. Create every process group on every rank "
                "of this group (and in the same order), or create yashard's groups yourself and pass a 2-D mesh"
            )
        mine = None
        for ranks in rank_lists:
            if self.rank in ranks:  # (members synchronise among themselves: names hash the ranks)
                mine = dist.new_group([members[r] for r in ranks], use_local_synchronization=True)
        return mine

    def new_shard_subgroups(self, rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
        """Like :meth:`new_subgroups` with lists of *shard* ranks: the same structure is created
        inside every shard group (hybrid sharding has several); returns this rank's group."""
        mine = None
        for g, members in enumerate(self.topology.shard_groups):
            got = self.new_subgroups([[members[r] for r in ranks] for ranks in rank_lists])
            if g == self.replica_rank:
                mine = got
        return mine

    def group_members(self, group: dist.ProcessGroup) -> list[int]:
        """The shard ranks of ``group``'s members (a subgroup of this rank's shard group), in order."""
        return [dist.get_group_rank(self.shard_group, r) for r in dist.get_process_group_ranks(group)]

    def group_rank_size(self, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
        """``(this rank's index in group, group size)``; ``None`` means the shard group."""
        g = self.shard_group if group is None else group
        return dist.get_rank(g), dist.get_world_size(g)

    def name(self, group: dist.ProcessGroup) -> str:
        """The label logged with ``group``'s collectives ("world", "shard", "replica", ...)."""
        return self._names.get(id(group), "other")

    def label(self, group: dist.ProcessGroup, name: str) -> None:
        """Log ``group``'s collectives under ``name`` (groups the caller created)."""
        self._names[id(group)] = name

    # ---- collectives ------------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, unit: str, group: dist.ProcessGroup | None = None):
        """Async: gather every member's ``shard`` into ``out`` over ``group`` (default: the shard
        group); ``out.numel() == group size * shard.numel()``, and ``shard`` may be this rank's slice
        of ``out``. Logged with ``out``'s size."""
        g = self.shard_group if group is None else group
        size = dist.get_world_size(g)
        if out.numel() != size * shard.numel() or out.dtype != shard.dtype:
            raise ValueError(
                f"all_gather of {unit}: the output has {out.numel()} {out.dtype} elements, the shard "
                f"{shard.numel()} {shard.dtype} elements over {size} ranks; the output must hold {size} x "
                f"{shard.numel()} elements of the shard's dtype"
            )
        self.log.add("all_gather", unit, out, self.name(g))
        if self._is_gloo(g):
            return self._p2p_all_gather(out, shard, g)
        return _all_gather(out, shard, group=g, async_op=True)

    @staticmethod
    def _p2p_all_gather(out: torch.Tensor, shard: torch.Tensor, g: dist.ProcessGroup) -> "_Works":
        """gloo's all-gather into a tensor stages the whole output in a temporary (as large as
        ``out``) and copies it over, which is slow and makes a CPU run's peak memory depend on the
        largest unit. Here every rank sends its shard to each peer and receives each peer's shard
        straight into its chunk of ``out`` (the same bytes on the wire, no staging buffer). Pairs
        exchange in the same order on every rank: to ``rank + k``, from ``rank - k``."""
        rank, size = dist.get_rank(g), dist.get_world_size(g)
        c = shard.numel()
        own = out.narrow(0, rank * c, c)
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        if size == 1:
            return _Works([])
        ops = []
        for k in range(1, size):
            to, frm = (rank + k) % size, (rank - k) % size
            ops.append(dist.P2POp(dist.isend, shard, dist.get_global_rank(g, to), g, TAG_ALL_GATHER))
            ops.append(dist.P2POp(dist.irecv, out.narrow(0, frm * c, c), dist.get_global_rank(g, frm), g,
                                  TAG_ALL_GATHER))
        return _Works(dist.batch_isend_irecv(ops))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, unit: str, group: dist.ProcessGroup | None = None,
                       *, scratch: torch.Tensor | None = None) -> WorkFuture:
        """Async: SUM ``full`` over ``group`` (default: the shard group) into this rank's chunk
        ``out``; returns a :class:`WorkFuture` of ``out``. Logged with ``full``'s size.

        gloo runs its reduce-scatter as a full all-reduce (twice the bytes, and slow), so on gloo
        one rank copies, two ranks exchange their halves point to point (received straight into ``out``, then the
        own half is added), and more ranks all-to-all into ``scratch`` (``full``'s size, see
        :meth:`reduce_scatter_needs_scratch`) and sum the chunks in rank order. Sums are exact
        SUMs in ``full``'s dtype; every rank adds in the same order (bitwise-reproducible runs).
        ``full`` must not change until the future is waited."""
        g = self.shard_group if group is None else group
        self.log.add("reduce_scatter", unit, full, self.name(g))
        if self._is_gloo(g):
            rank, size = dist.get_rank(g), dist.get_world_size(g)
            c = out.numel()
            if size == 1:  # the sum over one rank is a copy (gloo would all-reduce into a temporary)
                out.copy_(full)
                return WorkFuture(_Works([]), lambda: out)
            if size == 2:
                peer = 1 - rank
                dst = dist.get_global_rank(g, peer)
                works = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, full.narrow(0, peer * c, c), dst, g, TAG_REDUCE_SCATTER),
                    dist.P2POp(dist.irecv, out, dst, g, TAG_REDUCE_SCATTER)])
                return WorkFuture(_Works(works), lambda: out.add_(full.narrow(0, rank * c, c)))
            if scratch is not None and size > 2:
                work = dist.all_to_all_single(scratch, full, group=g, async_op=True)
                return WorkFuture(work, lambda: torch.sum(scratch.view(size, c), dim=0, out=out))
        return WorkFuture(_reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=g, async_op=True), lambda: out)

    def reduce_scatter_needs_scratch(self, group: dist.ProcessGroup | None = None) -> bool:
        """Whether :meth:`reduce_scatter` over ``group`` wants a ``scratch`` buffer (gloo, > 2 ranks)."""
        g = self.shard_group if group is None else group
        return needs_reduce_scatter_scratch(self._is_gloo(g), dist.get_world_size(g))

    def _size(self, group: dist.ProcessGroup) -> int:
        """``group``'s world size (looked up once per group)."""
        size = self._sizes.get(id(group))
        if size is None:
            size = self._sizes[id(group)] = dist.get_world_size(group)
        return size

    def _is_gloo(self, group: dist.ProcessGroup) -> bool:
        """Whether gloo carries this rank's tensors in ``group`` (a mixed ``"cpu:gloo,cuda:nccl"``
        group uses NCCL on CUDA)."""
        key = (id(group), self.device_type)
        if key not in self._gloo:
            self._gloo[key] = backend_for(group_backend(group), self.device_type) == "gloo"
        return self._gloo[key]

    def all_reduce(self, t: torch.Tensor, unit: str, group: dist.ProcessGroup | None = None, *,
                   op: str = "sum", async_op: bool = False):
        """In-place all-reduce of ``t`` over ``group`` (default: the shard group) with ``op`` in
        {"sum", "max"}; returns the work handle when ``async_op``, else waits (bounded by
        ``timeout``). Logged with ``t``'s size."""
        g = self.shard_group if group is None else group
        self.log.add("all_reduce", unit, t, self.name(g))
        if self._size(g) == 1 and not async_op:  # (a sum or max over one rank is t itself: nothing to wait for)
            return None
        work = dist.all_reduce(t, op=_OPS[op], group=g, async_op=True)
        if async_op:
            return work
        self.wait(work, f"all_reduce of {unit}")
        return None

    def issuing(self, what) -> "_Issuing":
        """Context around issuing collective ``what``: a backend error raised already at the issue
        (gloo raises there when a peer's connection is closed: the peer died) becomes the same
        :class:`CollectiveError` a failed wait gives."""
        return _Issuing(what, (self.rank, self.world))

    def wait(self, work, what: str, *, host: bool = False):
        """:func:`wait_work` with this rank's coordinates and the timeout that applies.

        Stream rule: on CUDA (NCCL), ``work.wait()`` only makes the current stream wait, but
        ``work.wait(timeout)`` blocks the host until the collective finished, which would stop the
        host from queuing compute while communication runs. So on CUDA ``collective_timeout``
        bounds only waits the host makes anyway (``host=True``: checks, checkpoints, exports);
        the others rely on the process group's own timeout (NCCL's watchdog). On CPU (gloo) every
        wait blocks the host and every wait is bounded."""
        return wait_work(work, what, wait_timeout(self.device_type, self.timeout, host), (self.rank, self.world))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, unit: str, group: dist.ProcessGroup | None = None):
        """Async ``all_to_all_single`` over ``group`` (default: the shard group): ``inp`` is cut into
        group-size equal segments, segment ``i`` goes to member ``i``; ``out`` receives member ``i``'s
        segment at segment ``i``. Logged with ``inp``'s size (what this rank sends, its own included)."""
        g = self.shard_group if group is None else group
        self.log.add("all_to_all", unit, inp, self.name(g))
        return dist.all_to_all_single(out, inp, group=g, async_op=True)

    def broadcast(self, t: torch.Tensor, src_rank: int, unit: str) -> None:
        """Blocking broadcast over the whole data-parallel group from its rank ``src_rank``."""
        self.log.add("broadcast", unit, t, "world")
        work = dist.broadcast(t, src=dist.get_global_rank(self.group, src_rank), group=self.group, async_op=True)
        self.wait(work, f"broadcast of {unit} (yashard.shard)")

    def all_gather_tensor(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's ``t`` (whole data-parallel group) stacked along a new first dimension;
        blocking, bounded by ``timeout``. Not logged: for the runtime's own checks."""
        if self.world == 1:
            return t.reshape(1, *t.shape)
        out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        self.wait(_all_gather(out, t.reshape(-1), group=self.group, async_op=True), what, host=True)
        return out.view(self.world, *t.shape)

    def all_gather_object(self, obj, what: str = "all_gather_object") -> list:
        """Every rank's picklable ``obj`` (whole data-parallel group), for small metadata only;
        blocking and bounded by ``timeout`` (``dist.all_gather_object`` has no timeout). Not
        logged. The ranks of one job trust each other: the payloads are pickles."""
        dev = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        sizes = self.all_gather_tensor(size, f"{what} (sizes)").view(-1).tolist()
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        got = self.all_gather_tensor(buf.to(dev), what).cpu()
        return [pickle.loads(got[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]
