"""Every torch.distributed call yashard makes goes through this module.

Keeping them in one place lets us follow torch's API renames (``all_gather_into_tensor`` ->
``all_gather_single`` in torch 2.13) in one spot, and lets tests read a log of every collective a
rank issued, in order, with its size.

All collectives here are asynchronous: they return a work handle. ``work.wait()`` on NCCL makes the
*current* stream wait (the host does not block); on gloo it blocks the host until the data landed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_to_all = dist.all_to_all_single


@dataclass
class CollectiveLog:
    """Ordered record of the collectives one rank issued: ``(op, unit, numel, bytes)``."""

    enabled: bool = False
    records: list[tuple[str, str, int, int]] = field(default_factory=list)

    def add(self, op: str, unit: str, t: torch.Tensor) -> None:
        if self.enabled:
            self.records.append((op, unit, t.numel(), t.numel() * t.element_size()))

    def clear(self) -> None:
        self.records.clear()


class Comm:
    """The process group plus the collectives the runtime needs, each logged."""

    def __init__(self, group: dist.ProcessGroup | None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "yashard.shard needs an initialised process group: call "
                "torch.distributed.init_process_group() first (torchrun sets the environment; "
                "use backend='gloo' on CPU, 'nccl' on CUDA)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.backend = str(dist.get_backend(self.group))
        self.log = CollectiveLog()
        # Sharding coordinates. Units are laid out and sharded over the *shard group* (``shard_world``
        # ranks, this rank is ``shard_rank`` in it); ``replica_world`` shard groups hold identical
        # copies (hybrid sharding). Without hybrid sharding the shard group is the whole group.
        self.shard_rank, self.shard_world = self.rank, self.world
        self.replica_rank, self.replica_world = 0, 1

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, unit: str):
        """Gather every rank's ``shard`` into ``out`` (``out.numel() == world * shard.numel()``)."""
        self.log.add("all_gather", unit, out)
        return _all_gather(out, shard, group=self.group, async_op=True)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, unit: str):
        """SUM ``full`` across ranks and leave this rank's chunk in ``out``."""
        self.log.add("reduce_scatter", unit, full)
        return _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_reduce_sum(self, t: torch.Tensor, unit: str) -> None:
        """In-place blocking SUM all-reduce (small tensors: norms, checksums)."""
        self.log.add("all_reduce", unit, t)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def broadcast(self, t: torch.Tensor, src_rank: int, unit: str) -> None:
        """Blocking broadcast from group rank ``src_rank``."""
        self.log.add("broadcast", unit, t)
        dist.broadcast(t, src=dist.get_global_rank(self.group, src_rank), group=self.group)

    # -- explicit-group collectives (quantized communication, yashard/zeropp.py) -------------------

    def group_rank_size(self, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
        """``(this rank's index in group, group size)``; ``None`` means ``self.group``. Local query."""
        g = self.group if group is None else group
        return dist.get_rank(g), dist.get_world_size(g)

    def group_members(self, group: dist.ProcessGroup) -> list[int]:
        """The ranks of ``self.group`` that form ``group``, in ``group``-rank order. Local query."""
        return [dist.get_group_rank(self.group, r) for r in dist.get_process_group_ranks(group)]

    def all_gather_in(self, out: torch.Tensor, shard: torch.Tensor, unit: str, group: dist.ProcessGroup | None):
        """Gather every member's ``shard`` into ``out`` over ``group`` (``None``: ``self.group``); ``shard``
        may be this rank's slot of ``out`` (in place). Logged as ``all_gather`` with ``out``'s size."""
        self.log.add("all_gather", unit, out)
        return _all_gather(out, shard, group=self.group if group is None else group, async_op=True)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, unit: str, group: dist.ProcessGroup | None):
        """``all_to_all_single`` over ``group`` (``None``: ``self.group``): ``inp`` is cut into group-size
        equal segments, segment ``i`` goes to member ``i``; ``out`` receives member ``i``'s segment for this
        rank at segment ``i``. Logged as ``all_to_all`` with ``inp``'s size (= what this rank sends,
        its own segment included)."""
        self.log.add("all_to_all", unit, inp)
        return _all_to_all(out, inp, group=self.group if group is None else group, async_op=True)

    def new_subgroups(self, rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
        """Create one process group per list of ``self.group`` ranks, in order (every rank of
        ``self.group`` must call this with the same lists: group creation is collective), and return
        the group this rank belongs to (``None`` if none)."""
        mine = None
        for ranks in rank_lists:
            g = dist.new_group([dist.get_global_rank(self.group, r) for r in ranks])
            if self.rank in ranks:
                mine = g
        return mine

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out
