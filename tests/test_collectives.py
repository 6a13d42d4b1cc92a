"""``Comm``'s gloo all-gather (sends and receives straight into the output) and reduce-scatter:
exact results at 2, 3 and 4 ranks, in subgroups, with the shard inside the output, with several
collectives in flight at once, and without a staging buffer the size of the output."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from harness import run_distributed

pytestmark = pytest.mark.slow

C = 7  # elements per shard: odd, so a chunk boundary off by one shows


def _shard(rank: int, dtype) -> torch.Tensor:
    return (torch.arange(C) * 3 + 100 * rank + 1).to(dtype)


def _gathers(rank: int, world: int) -> dict:
    from yashard.collectives import Comm

    comm = Comm(None)
    got = {}
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        out = torch.full((world * C,), 0, dtype=dtype)
        comm.wait(comm.all_gather(out, _shard(rank, dtype), "unit"), "all_gather")
        got[f"{dtype}"] = out
        inplace = torch.zeros(world * C, dtype=dtype)  # the shard is this rank's slice of the output
        mine = inplace.narrow(0, rank * C, C)
        mine.copy_(_shard(rank, dtype))
        comm.wait(comm.all_gather(inplace, mine, "unit"), "all_gather")
        got[f"{dtype} in place"] = inplace
    # Several in flight before any wait, interleaved with a reduce-scatter (the runtime prefetches
    # one unit while the previous one's gradients are reduced): every pair must match in order.
    a, b = torch.zeros(world * C), torch.zeros(world * C)
    full = torch.arange(world * C, dtype=torch.float32) * (rank + 1)
    red = torch.zeros(C)
    scratch = torch.empty(world * C) if comm.reduce_scatter_needs_scratch() else None
    w1 = comm.all_gather(a, _shard(rank, torch.float32), "a")
    w2 = comm.reduce_scatter(red, full, "r", scratch=scratch)
    w3 = comm.all_gather(b, _shard(rank, torch.float32) * -1, "b")
    for w in (w3, w1, w2):
        comm.wait(w, "in flight")
    got.update(a=a, b=b, reduced=red)
    # The user's own point-to-point traffic (tag 0, the default) next to a gather in flight, as after
    # an optimizer step (the next forward's first units are gathered then), in a different order on
    # the two ranks: rank 0 sends before issuing the gather, rank 1 receives after issuing it. Each
    # receive must match only its own kind of message.
    import torch.distributed as dist

    ahead = torch.zeros(world * C)
    theirs = torch.zeros(C + 1)  # another size than a shard
    req = None
    if rank == 0 and world > 1:
        req = dist.isend(torch.full((C + 1,), 42.0), 1)
    work = comm.all_gather(ahead, _shard(rank, torch.float32) + 0.5, "ahead")
    if rank == 1:
        req = dist.irecv(theirs, 0)
    elif world == 1:
        theirs.fill_(42.0)  # nobody to exchange with
    if req is not None:
        req.wait()
    comm.wait(work, "ahead")
    got.update(ahead=ahead, user=theirs)
    if world == 4:  # a subgroup whose group ranks are not the global ranks: [1, 3] and [0, 2]
        sub = comm.new_subgroups([[1, 3], [0, 2]])
        out = torch.zeros(2 * C)
        comm.wait(comm.all_gather(out, _shard(rank, torch.float32), "unit", sub), "all_gather")
        got["subgroup"] = out
    return {k: v.tolist() for k, v in got.items()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gloo_all_gather_and_reduce_scatter_are_exact(world):
    results = run_distributed(_gathers, world)
    for rank, got in enumerate(results):
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            want = torch.cat([_shard(r, dtype) for r in range(world)]).tolist()
            assert got[f"{dtype}"] == want, (rank, dtype)
            assert got[f"{dtype} in place"] == want, (rank, dtype)
        assert got["a"] == torch.cat([_shard(r, torch.float32) for r in range(world)]).tolist()
        assert got["b"] == torch.cat([-_shard(r, torch.float32) for r in range(world)]).tolist()
        assert got["ahead"] == torch.cat([_shard(r, torch.float32) + 0.5 for r in range(world)]).tolist()
        assert got["user"] == ([42.0] if rank == 1 or world == 1 else [0.0]) * (C + 1)
        total = sum(r + 1 for r in range(world))
        assert got["reduced"] == (torch.arange(rank * C, (rank + 1) * C, dtype=torch.float32) * total).tolist()
        if world == 4:
            members = [1, 3] if rank in (1, 3) else [0, 2]
            assert got["subgroup"] == torch.cat([_shard(r, torch.float32) for r in members]).tolist()


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+)", f.read(), re.M).group(1))


def _gather_peak(rank: int, world: int, numel: int) -> float | None:
    """Peak RSS growth (MiB) while all-gathering ``numel`` fp32 elements into a touched output."""
    from yashard.collectives import Comm

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: a staging buffer is a fresh mmap
    comm = Comm(None)
    out = torch.zeros(numel)
    shard = torch.ones(numel // world) * rank
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        return None
    before = _status_kib("VmRSS")
    comm.wait(comm.all_gather(out, shard, "unit"), "all_gather")
    assert out.view(world, -1)[:, 0].tolist() == list(range(world))
    return (_status_kib("VmHWM") - before) / 1024


def test_gloo_all_gather_needs_no_staging_buffer():
    # gloo's own all_gather_into_tensor stages the whole output in a temporary (+32 MiB here).
    peaks = run_distributed(_gather_peak, 2, 8 * 2**20)
    if None in peaks:
        pytest.skip("/proc/self/clear_refs is not writable here: the peak cannot be reset")
    assert max(peaks) < 8, f"all-gather of a 32 MiB output raised the peak RSS by {peaks} MiB"


def test_all_gather_names_a_size_or_dtype_mismatch(pg):
    from yashard.collectives import Comm

    comm = Comm(None)
    comm.log.enabled = True
    with pytest.raises(ValueError, match=r"all_gather of unit: the output has 5 torch.float32 elements, the "
                                         r"shard 2 torch.float32 elements over 1 ranks"):
        comm.all_gather(torch.zeros(5), torch.zeros(2), "unit")
    with pytest.raises(ValueError, match=r"the output has 2 torch.bfloat16 elements, the shard 2 torch.float32"):
        comm.all_gather(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2), "unit")
    assert comm.log.records == []  # a refused call is not logged (nor counted by the order guard)


def test_a_backend_error_at_the_issue_is_a_collective_error_naming_the_collective(pg):
    """gloo raises when a send is issued to a dead peer ("Connection closed by peer"), before any
    wait: the runtime issues inside Comm.issuing, which turns that into the CollectiveError a failed
    wait gives; a caller's mistake (ValueError) passes unchanged."""
    from yashard.collectives import CollectiveError, Comm

    comm = Comm(None)
    with pytest.raises(CollectiveError, match=r"^yashard: all_gather of layer_3 \(forward #3\) on rank 0 of 1 failed: "
                                              r"\[pair\.cc:553\] Connection closed by peer \[127\.0\.0\.1\]:1234\. A peer rank died") as got:
        with comm.issuing("all_gather of layer_3 (forward #3)"):
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234\nmore")
    assert isinstance(got.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="^mistake$"):
        with comm.issuing("all_gather of layer_3"):
            raise ValueError("mistake")
    with comm.issuing("nothing wrong"):
        pass


def test_backend_for_a_device_reads_mixed_backends():
    from yashard.collectives import backend_for

    assert backend_for("gloo", "cpu") == "gloo"
    assert backend_for("nccl", "cuda") == "nccl"
    assert backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl"   # a CUDA run on a mixed group: NCCL
    assert backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
