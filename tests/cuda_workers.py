"""Rank functions of the multi-GPU CUDA tests (tests/test_cuda.py), run by tests/harness.py on NCCL."""

from __future__ import annotations

import torch

import yashard
from models import build


def _overlapped(intervals, others) -> float:
    """Total time of ``intervals`` during which at least one of ``others`` runs (both lists of (start, end))."""
    total = 0.0
    for a0, a1 in intervals:
        cuts = sorted((max(a0, b0), min(a1, b1)) for b0, b1 in others if b0 < a1 and a0 < b1)
        end = a0
        for c0, c1 in cuts:
            if c1 > end:
                total += c1 - max(c0, end)
                end = c1
    return total


def _profiled_gpu_work(dev: torch.device, batch: int, seq: int, seed: int, steps: int = 2) -> list:
    """Train a bf16 8-layer Llama (hidden 1024) on ``dev``: 2 steps, then ``steps`` under the
    profiler; returns the profiled GPU activities (kernels, copies, memsets) as profiler events."""
    from torch.profiler import ProfilerActivity, profile

    model = build("llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=4096)
    sm = yashard.shard(model, config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3, fused=True)
    ids = torch.randint(0, 4096, (batch, seq), device=dev, generator=torch.Generator(dev).manual_seed(seed))

    def step():
        sm(input_ids=ids, labels=ids).loss.backward()
        sm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(dev)
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def collective_overlap(rank: int, world: int) -> dict:
    """Train a bf16 8-layer Llama for 2 steps under the profiler; per kind of NCCL kernel (all-gather,
    reduce-scatter), its total time and the part of it during which a compute kernel ran."""
    kernels = _profiled_gpu_work(torch.device("cuda", rank), 4, 512, seed=rank)
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    out = {}
    for kind in ("allgather", "reducescatter"):
        comm = [(e.time_range.start, e.time_range.end) for e in kernels
                if "nccl" in e.name.lower() and kind in e.name.lower().replace("_", "")]
        out[kind] = dict(count=len(comm), total=sum(b - a for a, b in comm), overlapped=_overlapped(comm, compute))
    return out


def stream_overlap(dev: torch.device, steps: int = 2, batch: int = 32, seq: int = 1024) -> dict:
    """Train a bf16 8-layer Llama under the profiler on one device; split its GPU activity (kernels,
    copies) into the compute stream (the stream with the most busy time) and every other stream.
    Returns both totals (us), the side streams' count, and the part of their time during which a
    compute-stream kernel ran. The batch is large enough for the GPU, not the host, to set the pace:
    in a host-bound step (seen on an H100 with 8 x 1024 tokens) the compute stream idles at every
    layer boundary while the host runs the hooks, and the copies issued there run in that gap."""
    gpu = _profiled_gpu_work(dev, batch, seq, seed=0, steps=steps)
    by_stream: dict[int, list[tuple[float, float]]] = {}
    for e in gpu:
        by_stream.setdefault(e.device_resource_id, []).append((e.time_range.start, e.time_range.end))
    busy = {s: sum(b - a for a, b in iv) for s, iv in by_stream.items()}
    compute_stream = max(busy, key=busy.get)
    side = [iv for s, ivs in by_stream.items() if s != compute_stream for iv in ivs]
    names = sorted({e.name for e in gpu if e.device_resource_id != compute_stream})
    return dict(streams=len(by_stream), compute=busy[compute_stream], side_count=len(side),
                side=sum(b - a for a, b in side), overlapped=_overlapped(side, by_stream[compute_stream]),
                side_names=names[:8])
