"""Rank arithmetic of shard / replica / secondary groups (pure) and the config checks behind it."""

import pytest
import torch

import yashard
from yashard.topology import Topology, blocks, strided


def test_blocks_and_strided():
    assert blocks(6, 2) == [[0, 1], [2, 3], [4, 5]]
    assert strided(6, 2) == [[0, 2, 4], [1, 3, 5]]
    assert blocks(4, 4) == [[0, 1, 2, 3]] and strided(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match=r"group size 4 does not divide world size 6"):
        blocks(6, 4)


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
