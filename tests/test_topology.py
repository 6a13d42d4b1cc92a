"""Rank arithmetic of shard / replica / secondary groups (pure) and the config checks behind it."""

import pytest
import torch

import yashard
from yashard.topology import Topology, blocks, mesh_shard_groups


def test_blocks():
    assert blocks(6, 2) == [[0, 1], [2, 3], [4, 5]]
    assert blocks(4, 4) == [[0, 1, 2, 3]]
    assert Topology(6, 0, shard_size=2).replica_groups == [[0, 2, 4], [1, 3, 5]]
    assert Topology(4, 0, shard_size=4).replica_groups == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match=r"group size 4 does not divide world size 6"):
        blocks(6, 4)


def test_mesh_shard_groups():
    assert mesh_shard_groups([[0, 1], [2, 3]]) == [[0, 1], [2, 3]]
    assert mesh_shard_groups([[0, 2], [1, 3]]) == [[0, 2], [1, 3]]
    # rows need not be ascending, as long as each column's ranks sit at one sorted position
    assert mesh_shard_groups([[2, 0], [3, 1]]) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"mesh column \[1, 2\] \(a replicate group\) pairs ranks that hold different "
                                         r"shards: their positions in their shard groups \[\[0, 1\], \[2, 3\]\] are \[1, 0\]"):
        mesh_shard_groups([[1, 0], [2, 3]])
    with pytest.raises(ValueError, match=r"names a rank twice"):
        mesh_shard_groups([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"rows of equal, non-zero length"):
        mesh_shard_groups([[0, 1], [2]])


def test_topology_from_explicit_groups():
    """Shard groups [0 2 4 6] and [1 3 5 7] (a transposed mesh): replicas pair equal positions,
    secondary groups take consecutive positions of one shard group."""
    groups = ((0, 2, 4, 6), (1, 3, 5, 7))
    for rank in range(8):
        t = Topology(8, rank, shard_size=4, secondary_size=2, groups=groups)
        assert (t.replica_rank, t.shard_rank, t.replica_world) == (rank % 2, rank // 2, 2)
        assert t.replica_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert t.secondary_groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
        assert rank in t.secondary_groups[2 * t.replica_rank + t.shard_rank // 2]
        assert t.secondary_rank == t.shard_rank % 2
    with pytest.raises(ValueError, match=r"shard groups \[\[0, 2\], \[1, 2\]\] must hold each of the 4 ranks once, "
                                         r"2 per group"):
        Topology(4, 0, shard_size=2, groups=((0, 2), (1, 2)))


def test_topology_of_every_rank():
    for rank in range(8):
        t = Topology(8, rank, shard_size=4, secondary_size=2)
        assert t.shard_rank == rank % 4 and t.replica_rank == rank // 4 and t.replica_world == 2
        assert rank in t.shard_groups[t.replica_rank] and t.shard_groups[t.replica_rank][t.shard_rank] == rank
        assert t.replica_groups[t.shard_rank][t.replica_rank] == rank
        assert t.secondary_groups[rank // 2][t.secondary_rank] == rank
    # every rank is in exactly one group of each kind
    t = Topology(8, 0, shard_size=4, secondary_size=2)
    for groups in (t.shard_groups, t.replica_groups, t.secondary_groups):
        assert sorted(r for g in groups for r in g) == list(range(8))
    plain = Topology(4, 3, shard_size=4)
    assert (plain.shard_rank, plain.replica_rank, plain.replica_world, plain.secondary_groups) == (3, 0, 1, [])


def test_topology_errors():
    with pytest.raises(ValueError, match=r"shard_group_size=3 does not divide the world size 4; use a divisor of 4"):
        Topology(4, 0, shard_size=3)
    with pytest.raises(ValueError, match=r"secondary_group_size=3 does not divide the shard group size 4"):
        Topology(8, 0, shard_size=4, secondary_size=3)
    with pytest.raises(ValueError, match=r"rank 4 is outside world size 4"):
        Topology(4, 4, shard_size=4)
    with pytest.raises(ValueError, match=r"no secondary partition"):
        Topology(4, 0, shard_size=4).secondary_rank


@pytest.mark.parametrize("field,value,pattern", [
    ("shard_group_size", 0, r"ShardConfig\.shard_group_size must be a positive int \(ranks per group\) or None, got 0"),
    ("secondary_group_size", 2.0, r"ShardConfig\.secondary_group_size must be a positive int .* got 2\.0"),
    ("quantized_weights", 16, r"ShardConfig\.quantized_weights=16 is not supported; use 8 \(int8\), 4 \(int4\) or None"),
    ("quantized_weights", True, r"ShardConfig\.quantized_weights=True is not supported"),
    ("quant_block", 63, r"ShardConfig\.quant_block must be an even int in \[2, 32768\], got 63"),
])
def test_config_communication_fields(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        yashard.ShardConfig(**{field: value})
    assert yashard.ShardConfig(param_dtype=torch.bfloat16, shard_group_size=2, secondary_group_size=1,
                               quantized_weights=8, quant_block=256).quant_block == 256
