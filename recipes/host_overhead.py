"""yashard's host time per training step against the unwrapped model, on one process: where the
host sets the pace (a small model, few tokens), every microsecond the per-layer hooks spend is a
microsecond of step time. Prints, per number of layers, the median step of each engine and the
difference, then the fitted overhead per layer and per step.

    python recipes/host_overhead.py                       # CPU (gloo, one rank) or the current GPU
    python recipes/host_overhead.py --layers 4,8,16 --breakdown

Both engines train the same random-init Llama (hidden ``--hidden``, ``--tokens`` tokens per step)
with AdamW and ``clip_grad_norm_(1.0)``; blocks of ``--steps`` steps alternate between the engines
(``--repeats`` each) so machine drift cancels. ``--breakdown`` also times yashard's hooks (inclusive
microseconds per step, so nested hooks count in their callers too), at the largest layer count.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist

import bench_engines as be
import benchmark
import yashard
import yashard.backward
import yashard.forward
import yashard.guards
import yashard.runtime
import yashard.unit

# (owner, method) pairs timed by --breakdown
HOOKS = [
    (yashard.forward.ForwardSchedule, "root_pre_forward"), (yashard.forward.ForwardSchedule, "pre_forward"),
    (yashard.unit.Unit, "install_views"), (yashard.forward.ForwardSchedule, "post_forward"),
    (yashard.backward.BackwardSchedule, "on_unit_backward_start"), (yashard.unit.Unit, "write_grad"),
    (yashard.backward.BackwardSchedule, "on_unit_grads_complete"), (yashard.backward.BackwardSchedule, "_end_backward"),
    (yashard.runtime.Runtime, "clip_grad_norm_"), (yashard.runtime.Runtime, "check_no_new_parameters"),
    (yashard.guards, "step_checks"), (yashard.runtime.Runtime, "after_optimizer_step"),
]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="4,8,16", help="comma-separated numbers of decoder layers")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="tokens per step (one sequence)")
    p.add_argument("--steps", type=int, default=30, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per engine and layer count")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--breakdown", action="store_true")
    return p.parse_args(argv)


def make_step(kind: str, layers: int, args, device):
    """One training step of engine ``kind`` ("plain" or "yashard") as a closure."""
    shape = be.model_shape("small", layers=layers, hidden=args.hidden)
    shape["seq"] = args.tokens
    model = be.build_model(shape, seed=0).to(device)
    if kind == "yashard":
        model = yashard.shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = be.global_batch(0, 1, args.tokens, be.COMMON["vocab_size"]).to(device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return step


def time_block(step, steps: int, device) -> float:
    benchmark.sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    benchmark.sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


def breakdown(layers: int, args, device) -> list[tuple[str, float, float]]:
    """(hook, inclusive us per step, calls per step) of a yashard model of ``layers`` layers built
    with the hooks timed (the runtime binds them when it shards the model)."""
    spent, calls = collections.Counter(), collections.Counter()
    saved = []
    for owner, name in HOOKS:
        raw = owner.__dict__[name]
        key = f"{getattr(owner, '__name__', owner)}.{name}".replace("yashard.", "")

        def timed(*a, _raw=raw, _key=key, **k):
            t = time.perf_counter_ns()
            try:
                return _raw(*a, **k)
            finally:
                spent[_key] += time.perf_counter_ns() - t
                calls[_key] += 1
        saved.append((owner, name, raw))
        setattr(owner, name, functools.wraps(raw)(timed))
    try:
        step = make_step("yashard", layers, args, device)
        time_block(step, 5, device)
        spent.clear()
        calls.clear()
        time_block(step, args.steps, device)
    finally:
        for owner, name, raw in saved:
            setattr(owner, name, raw)
    return [(k, v / args.steps / 1e3, calls[k] / args.steps) for k, v in spent.most_common()]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if "RANK" not in os.environ:  # plain `python recipes/host_overhead.py`: a one-rank group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(benchmark._free_port()))
    device = benchmark.init_distributed()
    if dist.get_world_size() != 1:
        raise SystemExit(f"host_overhead.py runs on one process; got world size {dist.get_world_size()}")
    layer_counts = [int(x) for x in args.layers.split(",")]
    rows = []
    for layers in layer_counts:
        steps = {k: make_step(k, layers, args, device) for k in ("plain", "yashard")}
        for s in steps.values():
            time_block(s, 5, device)  # warm-up
        got = {k: [] for k in steps}
        for _ in range(args.repeats):
            for k, s in steps.items():
                got[k].append(time_block(s, args.steps, device))
        plain, ours = statistics.median(got["plain"]), statistics.median(got["yashard"])
        rows.append((layers, plain, ours))
    print(f"device {device.type}, torch {torch.__version__}, hidden {args.hidden}, {args.tokens} tokens/step, "
          f"median of {args.repeats} blocks of {args.steps} steps")
    print("| layers | plain ms | yashard ms | overhead ms | overhead |")
    print("|---:|---:|---:|---:|---:|")
    for layers, plain, ours in rows:
        print(f"| {layers} | {plain:.2f} | {ours:.2f} | {ours - plain:+.2f} | {(ours / plain - 1) * 100:+.1f}% |")
    if len(rows) > 1:
        a, b = fit([r[0] for r in rows], [r[2] - r[1] for r in rows])
        print(f"fitted overhead: {b * 1e3:.0f} us per layer + {a * 1e3:.0f} us per step")
    if args.breakdown:
        print(f"\nyashard hooks at {layer_counts[-1]} layers (inclusive us per step):")
        print("| hook | us/step | calls/step |")
        print("|---|---:|---:|")
        for key, us, n in breakdown(layer_counts[-1], args, device):
            print(f"| {key} | {us:.0f} | {n:g} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
