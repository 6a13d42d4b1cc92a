"""Where each engine's step time goes, on one process: wall and device-busy time per step and the
operators with the most self device time, engine by engine, under torch.profiler.

    torchrun --nproc_per_node 1 recipes/profile_engines.py --model gpu --dtype bf16
    torchrun --nproc_per_node 1 recipes/profile_engines.py --engines yashard --force-gather --trace-dir out

Engines, model shapes, data and optimizer are recipes/benchmark.py's (same options). ``--force-gather``
makes yashard's slots gather at world 1 as they do at world > 1 (NCCL's one-rank all-gather is a copy
on its own stream), instead of showing the shards in place: the stream schedule of a sharded run,
on one GPU. ``--trace-dir`` also writes each engine's Chrome trace (gzipped), for Perfetto.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import os
import shutil
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import bench_engines as be
import benchmark
import trace_stats


def parse(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="plain,yashard")
    p.add_argument("--profiled-steps", type=int, default=3)
    p.add_argument("--timed-steps", type=int, default=5, help="steps per timed block (3 rotating blocks per engine)")
    p.add_argument("--top", type=int, default=12, help="operators listed per engine")
    p.add_argument("--force-gather", action="store_true", help="yashard's slots gather at world 1 (see above)")
    p.add_argument("--trace-dir", default=None)
    ours, rest = p.parse_known_args(argv)
    return ours, benchmark.parse_args(rest)


def _device_self_us(evt) -> float:
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)


def _cpu_self_us(evt) -> float:
    return evt.self_cpu_time_total


def _busy_us(prof) -> float:
    """Time at least one kernel, copy or memset ran on the GPU (any stream): the union of their intervals."""
    return trace_stats.length((e.time_range.start, e.time_range.end) for e in prof.events()
                              if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None) -> None:
    ours, args = parse(argv)
    device = benchmark.init_distributed()
    if dist.get_world_size() != 1:
        raise SystemExit(f"profile_engines.py compares engines on one process; got world size {dist.get_world_size()}")
    if ours.force_gather:
        import yashard.build

        yashard.build.direct_slots = lambda shard_world, config: False
    shape = be.model_shape(args.model, args.layers, args.hidden)
    vocab = be.COMMON["vocab_size"]
    mem = be.Memory(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    names = ours.engines.split(",")
    engines = {name: be.SETUP[name](args, device, shape) for name in names}
    for eng in engines.values():
        for _ in range(args.warmup):
            be.train_step(eng, args, device, shape, vocab, mem)
    # Every engine is timed before any is profiled: once the profiler has run, the process's kernel
    # launches stay slower (seen on an H100: +20-30% on a host-bound step), which would bias the
    # engines profiled first against the later ones. Blocks rotate so drift spreads over engines.
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(3):
        for name in names[r % len(names):] + names[: r % len(names)]:
            benchmark.sync(device)
            for _ in range(ours.timed_steps):
                t0 = time.perf_counter()
                be.train_step(engines[name], args, device, shape, vocab, mem)
                benchmark.sync(device)
                times[name].append(time.perf_counter() - t0)
    rows = []
    for name in names:
        eng = engines.pop(name)
        with profile(activities=acts) as prof:
            for _ in range(ours.profiled_steps):
                be.train_step(eng, args, device, shape, vocab, mem)
            benchmark.sync(device)
        ka = prof.key_averages()
        self_us = _device_self_us if device.type == "cuda" else _cpu_self_us  # (CPU: the operators' own time)
        busy = (_busy_us(prof) if device.type == "cuda" else sum(self_us(e) for e in ka)) / ours.profiled_steps / 1e3
        wall = sorted(times[name])[len(times[name]) // 2] * 1e3
        rows.append((name, wall, busy))
        what = "GPU busy" if device.type == "cuda" else "cpu self time"
        print(f"\n== {name}: median step {wall:.2f} ms (unprofiled, 3 x {ours.timed_steps} steps); "
              f"{what} {busy:.2f} ms/step (profiled)")
        top = sorted(ka, key=self_us, reverse=True)[: ours.top]
        print(f"{'operator':70s} {'calls/step':>10s} {'self ms/step':>12s}")
        for e in top:
            print(f"{e.key[:70]:70s} {e.count / ours.profiled_steps:10.1f} {self_us(e) / ours.profiled_steps / 1e3:12.3f}")
        if ours.trace_dir:
            os.makedirs(ours.trace_dir, exist_ok=True)
            tag = "_gather" if ours.force_gather and name.startswith("yashard") else ""
            path = os.path.join(ours.trace_dir, f"trace_{name}{tag}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                shutil.copyfileobj(f, g)
            os.remove(path)
        del eng, prof, ka
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'engine':20s} {'step ms':>9s} {'GPU busy ms' if device.type == 'cuda' else 'cpu self ms':>15s}")
    for name, wall, busy in rows:
        print(f"{name:20s} {wall:9.2f} {busy:15.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
