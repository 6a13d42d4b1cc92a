"""Pure rank arithmetic: which ranks shard together, which replicate, which form a node.

All ranks here are ranks of the data-parallel group yashard was given (0 .. world-1). Groups are
blocks of consecutive ranks, the way launchers number GPUs within a node::

    world 8, shard_group_size 4, secondary_group_size 2

    shard groups      [0 1 2 3] [4 5 6 7]          units are sharded over these (layout world 4)
    replica groups    [0 4] [1 5] [2 6] [3 7]      same shard_rank: identical shards (hybrid)
    secondary groups  [0 1] [2 3] [4 5] [6 7]      hpZ: backward gathers stay inside these

Nothing here touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass


def blocks(world: int, size: int) -> list[list[int]]:
    """``world`` ranks cut into consecutive blocks of ``size``: ``[[0..size-1], [size..2size-1], ...]``."""
    if size < 1 or world % size:
        raise ValueError(f"group size {size} does not divide world size {world}")
    return [list(range(start, start + size)) for start in range(0, world, size)]


def strided(world: int, size: int) -> list[list[int]]:
    """The ranks with the same position in every block of ``size``: ``[[0, size, 2size, ...], [1, ...], ...]``."""
    if size < 1 or world % size:
        raise ValueError(f"group size {size} does not divide world size {world}")
    return [list(range(pos, world, size)) for pos in range(size)]


@dataclass(frozen=True)
class Topology:
    """The groups one rank belongs to.

    Attributes:
        world: data-parallel world size.
        rank: this rank.
        shard_size: ranks per shard group (the layout's world); ``world`` unless hybrid sharding.
        secondary_size: ranks per hpZ secondary group (divides ``shard_size``), or None.
    """

    world: int
    rank: int
    shard_size: int
    secondary_size: int | None = None

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

    @property
    def shard_groups(self) -> list[list[int]]:
        return blocks(self.world, self.shard_size)

    @property
    def replica_groups(self) -> list[list[int]]:
        return strided(self.world, self.shard_size)

    @property
    def secondary_groups(self) -> list[list[int]]:
        return blocks(self.world, self.secondary_size) if self.secondary_size else []

    @property
    def shard_rank(self) -> int:
        return self.rank % self.shard_size

    @property
    def replica_rank(self) -> int:
        return self.rank // self.shard_size

    @property
    def replica_world(self) -> int:
        return self.world // self.shard_size

    @property
    def secondary_rank(self) -> int:
        """Position inside the secondary group (= which secondary slice of a unit this rank keeps)."""
        if not self.secondary_size:
            raise ValueError("no secondary partition (secondary_group_size is None)")
        return self.rank % self.secondary_size
