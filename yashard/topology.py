"""Pure rank arithmetic: which ranks shard together, which replicate, which form a node.

All ranks here are ranks of the data-parallel group yashard was given (0 .. world-1). By default
groups are blocks of consecutive ranks, the way launchers number GPUs within a node::

    world 8, shard_group_size 4, secondary_group_size 2

    shard groups      [0 1 2 3] [4 5 6 7]          units are sharded over these (layout world 4)
    replica groups    [0 4] [1 5] [2 6] [3 7]      same shard_rank: identical shards (hybrid)
    secondary groups  [0 1] [2 3] [4 5] [6 7]      hpZ: backward gathers stay inside these

A 2-D ``(replicate, shard)`` device mesh gives the shard groups explicitly instead (its rows, see
:func:`mesh_shard_groups`); replica and secondary groups follow from them by the same rules:
a replica group takes the ranks at one position of every shard group, a secondary group
consecutive positions of one shard group.

Nothing here touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def blocks(world: int, size: int) -> list[list[int]]:
    """``world`` ranks cut into consecutive blocks of ``size``: ``[[0..size-1], [size..2size-1], ...]``."""
    if size < 1 or world % size:
        raise ValueError(f"group size {size} does not divide world size {world}")
    return [list(range(start, start + size)) for start in range(0, world, size)]


def mesh_shard_groups(rows: list[list[int]]) -> list[list[int]]:
    """The shard groups of a ``(replicate, shard)`` mesh given as its rows of ranks.

    A process group orders its members by rank, so each shard group is its row sorted, and a rank's
    shard (``shard_rank``) is its position in that order. The mesh's columns are its replicate
    groups: the ranks of one column must hold the same shard, i.e. sit at the same sorted position
    of their rows, or replicas would average different shards. ``arange(W).view(R, S)`` (shard
    within consecutive ranks) and its transpose's layout ``arange(W).view(S, R).T`` both qualify.
    """
    if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(f"a (replicate, shard) mesh needs rows of equal, non-zero length, got {rows}")
    flat = [r for row in rows for r in row]
    if len(set(flat)) != len(flat):
        raise ValueError(f"the mesh {rows} names a rank twice")
    table = [sorted(row) for row in rows]
    for j in range(len(rows[0])):
        column = [row[j] for row in rows]
        positions = [table[i].index(rows[i][j]) for i in range(len(rows))]
        if len(set(positions)) > 1:
            raise ValueError(
                f"mesh column {column} (a replicate group) pairs ranks that hold different shards: their "
                f"positions in their shard groups {table} are {positions}. Order the mesh so that each "
                "column's ranks sit at the same position of their (sorted) rows, e.g. "
                "torch.arange(world).view(replicas, shard_size)"
            )
    return table


@dataclass(frozen=True)
class Topology:
    """The groups one rank belongs to.

    Attributes:
        world: data-parallel world size.
        rank: this rank.
        shard_size: ranks per shard group (the layout's world); ``world`` unless hybrid sharding.
        secondary_size: ranks per hpZ secondary group (divides ``shard_size``), or None.
        groups: the shard groups, when given explicitly (from a mesh): every list holds
            ``shard_size`` ranks in shard-rank order, and together they hold each rank once.
            None: consecutive blocks.
    """

    world: int
    rank: int
    shard_size: int
    secondary_size: int | None = None
    groups: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside world size {self.world}")
        if self.world % self.shard_size:
            raise ValueError(
                f"shard_group_size={self.shard_size} does not divide the world size {self.world}; "
                f"use a divisor of {self.world} (the ranks of one node, typically)"
            )
        if self.secondary_size is not None and self.shard_size % self.secondary_size:
            raise ValueError(
                f"secondary_group_size={self.secondary_size} does not divide the shard group size "
                f"{self.shard_size}; use a divisor of {self.shard_size} (the ranks of one node, typically)"
            )

        if self.groups is not None:
            if sorted(r for g in self.groups for r in g) != list(range(self.world)) or any(
                    len(g) != self.shard_size for g in self.groups):
                raise ValueError(
                    f"shard groups {[list(g) for g in self.groups]} must hold each of the {self.world} ranks "
                    f"once, {self.shard_size} per group"
                )

    @property
    def shard_groups(self) -> list[list[int]]:
        if self.groups is not None:
            return [list(g) for g in self.groups]
        return blocks(self.world, self.shard_size)

    @property
    def replica_groups(self) -> list[list[int]]:
        """Group ``i`` holds position ``i`` of every shard group (the ranks with identical shards)."""
        return [list(col) for col in zip(*self.shard_groups)]

    @property
    def secondary_groups(self) -> list[list[int]]:
        """Consecutive positions of each shard group, ``secondary_size`` at a time."""
        h = self.secondary_size
        if not h:
            return []
        return [g[j:j + h] for g in self.shard_groups for j in range(0, self.shard_size, h)]

    @cached_property  # read on the hpZ gather path (secondary_rank): computed once
    def shard_rank(self) -> int:
        return self.shard_groups[self.replica_rank].index(self.rank)

    @cached_property
    def replica_rank(self) -> int:
        return next(i for i, g in enumerate(self.shard_groups) if self.rank in g)

    @property
    def replica_world(self) -> int:
        return self.world // self.shard_size

    @property
    def secondary_rank(self) -> int:
        """Position inside the secondary group (= which secondary slice of a unit this rank keeps)."""
        if not self.secondary_size:
            raise ValueError("no secondary partition (secondary_group_size is None)")
        return self.shard_rank % self.secondary_size
