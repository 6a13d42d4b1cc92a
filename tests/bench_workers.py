"""Rank functions of tests/test_benchmark.py (importable by the harness's forkserver)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))

import bench_comm  # noqa: E402


def count_known_collectives(rank: int, world: int) -> list[tuple]:
    """Issue collectives of known sizes (Python calls, a subgroup, DDP's C++ reducer, a functional
    collective) under the counter; returns what it recorded."""
    import torch.distributed._functional_collectives as fc
    from torch.nn.parallel import DistributedDataParallel as DDP

    sub = dist.new_group([0, 1])
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(10, 10), broadcast_buffers=False)
    with bench_comm.CollectiveCounter() as c:
        dist.all_reduce(torch.ones(100))                                          # 400 B
        dist.all_gather_single(torch.empty(60 * world), torch.ones(60))           # out: 240 * world B
        dist.reduce_scatter_single(torch.empty(25), torch.ones(25 * world))       # in: 100 * world B
        dist.all_to_all_single(torch.empty(8 * world), torch.ones(8 * world))     # in: 32 * world B
        dist.broadcast(torch.ones(7, dtype=torch.bfloat16), 0, group=sub)         # 14 B, group of 2
        ddp(torch.ones(3, 10)).sum().backward()                                   # 110 fp32 = 440 B
        out = fc.wait_tensor(fc.all_reduce(torch.ones(5, dtype=torch.float64), "sum", dist.group.WORLD))  # 40 B
        assert out[0].item() == world
    return [tuple(call) for call in c.calls]
