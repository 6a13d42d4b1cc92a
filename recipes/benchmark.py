"""Benchmark yashard against FSDP2, DDP, FSDP1 and DeepSpeed ZeRO-3 on one model, one data stream,
one optimizer (issue 5).

One configuration, every engine in the same processes (their timed blocks alternate round-robin so
that machine drift hits every engine alike)::

    torchrun --nproc_per_node 2 recipes/benchmark.py --model small --dtype bf16 --micro-batch 2 --accum 2

The ZeRO++ volume table (one step of yashard per mode, 4 processes acting as 2 nodes x 2 ranks)::

    torchrun --nproc_per_node 4 recipes/benchmark.py --zeropp

The driver (plain python; it launches torchrun once per configuration / world size)::

    python recipes/benchmark.py --sweep matrix  --out-dir bench_out   # fp32/bf16 x 4x1,2x2,1x4 small + wide 1x1
    python recipes/benchmark.py --sweep scaling --out-dir bench_out   # layers, hidden size, world size 1..4
    python recipes/benchmark.py --sweep zeropp  --out-dir bench_out
    python recipes/benchmark.py --sweep all     --out-dir bench_out   # all three + report.md

CPU + gloo by default; CUDA + NCCL when ``torch.cuda.is_available()`` (same code). Rank 0 prints
markdown tables (and writes them to ``--out``; ``--json`` keeps the raw numbers).

Columns of the per-engine table:

* step ms: median over ``steps * repeats`` timed steps (each step timed alone, the slowest rank
  counts), after ``--warmup`` untimed steps; *repeat spread*: (max - min) of the per-repeat medians
  over the median; *vs DDP*: median over DDP's; *tokens/s*: global batch * seq / median;
* memory, as the engine's own increment (all engines live in one process, so absolute numbers would
  include the others), max over ranks: *build peak*: highest point while building the wrapped model
  and its optimizer (every rank builds the full model before sharding it); *after build*: what is
  left once built; *training peak*: highest point of training (steady state after warm-up: optimizer
  state and gradients, plus the largest transient inside a timed block: activations, gathered
  weights); *end-of-step drift*: max - min of the memory at the end of each timed step, within a
  repeat (constant-after-step-one shows as ~0). On CPU process RSS (VmHWM reset through
  /proc/self/clear_refs, plus VmRSS sampled after every forward, backward and optimizer step), on
  CUDA ``memory_allocated`` / ``max_memory_allocated`` (and the reserved peak in the notes);
* correctness: the first step's loss (averaged over ranks and micro-batches) minus the loss of an
  unsharded fp32 copy of the model on the full global batch, computed on rank 0, and the relative
  difference of the pre-clip gradient norm of that step.

The communication table counts, per optimizer step and rank, every collective each engine issues
(one extra step after the timed ones, under ``bench_comm.CollectiveCounter``): how many, their
payload (full tensor sizes, as yashard's log counts them) and the bytes one rank sends with ring
algorithms. For yashard the count is cross-checked against its own collective log.

See ``bench_engines`` for how each engine is set up, and docs/benchmarks.md for the method.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist

import bench_comm
import bench_engines as be
import bench_report as br
from yashard import collectives

SWEEPS = ("matrix", "scaling", "zeropp", "all")
# The matrix: (model, micro-batch, accum) at the driver's world size, each in fp32 and bf16.
MATRIX = [("small", 4, 1), ("small", 2, 2), ("small", 1, 4), ("wide", 1, 1)]
ZEROPP_MODES = {
    "plain": dict(),
    "qwZ": dict(shard_kw={"quantized_weights": 8}),
    "hpZ": dict(shard_kw={"secondary_group_size": 2}),
    "qgZ": dict(qgz=True),
    "qwZ+hpZ+qgZ": dict(shard_kw={"quantized_weights": 8, "secondary_group_size": 2}, qgz=True),
}


# ---------------------------------------------------------------------------------------- CLI
def _int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate the command line (errors name the option and the fix)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(be.MODELS), default="small")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of decoder layers")
    p.add_argument("--hidden", type=int, default=None, help="override the model's hidden size (MLP scales with it)")
    p.add_argument("--dtype", choices=sorted(be.DTYPES), default="fp32")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch, per rank")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per engine per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per engine before the first repeat (>= 1)")
    p.add_argument("--repeats", type=int, default=3, help="round-robin rounds over the engines")
    p.add_argument("--engines", default=",".join(be.DEFAULT_ENGINES),
                   help=f"comma list out of {','.join(be.ENGINES)} (plain: world 1 only; default: all but plain)")
    p.add_argument("--optimizer", choices=be.OPTIMIZERS, default="adamw",
                   help="AdamW implementation of every engine: torch's default (single-tensor on CPU), foreach or fused")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile (inductor) every decoder layer of every engine (DeepSpeed is not run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights (same for every engine)")
    p.add_argument("--malloc", choices=("returning", "glibc"), default="returning",
                   help="CPU only. returning (default): glibc serves blocks over 64 KiB with fresh mmaps and returns "
                        "them on free, so RSS follows live memory (the memory columns need it), and every large "
                        "temporary pays its page faults; glibc: glibc's defaults (freed blocks stay in the heap): "
                        "times without those page faults, memory columns not comparable")
    p.add_argument("--out", default=None, help="also write the markdown to this path (rank 0)")
    p.add_argument("--json", default=None, help="also write the raw results as JSON to this path (rank 0)")
    p.add_argument("--zeropp", action="store_true", help="worker: the ZeRO++ volume table (world 4 = 2 nodes x 2)")
    p.add_argument("--sweep", choices=SWEEPS, default=None, help="driver: launch torchrun for a set of runs")
    p.add_argument("--out-dir", default="bench_out", help="driver: where the markdown, JSON and PNG go")
    p.add_argument("--nproc", type=int, default=2, help="driver: world size of the matrix sweep")
    p.add_argument("--threads", type=int, default=1, help="driver: OMP_NUM_THREADS of every rank")
    p.add_argument("--dtypes", default="fp32,bf16", help="driver: the matrix's dtypes (comma list)")
    p.add_argument("--scaling-layers", type=_int_list, default=[2, 4, 8])
    p.add_argument("--scaling-hidden", type=_int_list, default=[128, 256, 512])
    p.add_argument("--scaling-worlds", type=_int_list, default=[1, 2, 3, 4])
    p.add_argument("--scaling-engines", default="yashard,fsdp2")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(be.ENGINES)
    if unknown or not args.engines:
        p.error(f"--engines: unknown {sorted(unknown)}; choose from {','.join(be.ENGINES)}")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first warm-up step is the one checked against the reference)")
    if min(args.micro_batch, args.accum, args.steps, args.repeats, args.nproc, args.threads) < 1:
        p.error("--micro-batch, --accum, --steps, --repeats, --nproc and --threads must be >= 1")
    bad = set(args.scaling_engines.split(",")) - set(be.ENGINES)
    if bad:
        p.error(f"--scaling-engines: unknown {sorted(bad)}; choose from {','.join(be.ENGINES)}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtypes or set(args.dtypes) - set(be.DTYPES):
        p.error(f"--dtypes: unknown {sorted(set(args.dtypes) - set(be.DTYPES))}; choose from {','.join(be.DTYPES)}")
    if args.sweep and args.zeropp:
        p.error("--sweep (the driver) and --zeropp (a worker) exclude each other; --sweep zeropp launches it")
    try:
        be.model_shape(args.model, args.layers, args.hidden)
    except ValueError as exc:
        p.error(str(exc))
    return args


def init_distributed() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        # NCCL for the CUDA tensors; gloo for the few CPU ones (timings reduced over ranks, objects)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return torch.device("cpu")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---------------------------------------------------------------------------------------- compare run
def reference(shape: dict, args, vocab: int) -> tuple[float, float]:
    """Loss and pre-clip grad norm of step one: unsharded fp32 copy, full global batch, one process."""
    model = be.build_model(shape, args.seed)
    batch = be.global_batch(0, args.micro_batch * args.accum * dist.get_world_size(), shape["seq"], vocab)
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return out.loss.item(), norm.item()


def prime(shape: dict, args, device, vocab: int) -> None:
    """Pay, on every rank and before any engine is built, the one-time costs of the process that
    the first engine would otherwise be charged for (its memory is an increment of process RSS):
    a training step of the unwrapped model (autograd's threads, kernels' scratch, lazy imports)
    and each kind of collective the engines use (gloo's threads and connections). Measured without
    it on the small model: the first-built engine's training peak was ~17 MiB higher than the same
    engine's built last."""
    model = be.build_model(shape, args.seed).to(device)
    opt = be.make_adamw(be.split_params(model.parameters()), args)
    if args.compile:  # (and, with --compile, inductor's imports, caches and first compilation)
        be.compile_layers(be.Engine("prime", "", model, None, None))
    ids = be.global_batch(0, args.micro_batch, shape["seq"], vocab).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), be.CLIP)
    opt.step()
    if args.dtype != "fp32":
        # 16-bit kernels (and, with --compile, compiled 16-bit layers) are other kernels, with their
        # own one-time scratch: both ways the engines run them (16-bit weights; DDP's fp32 weights
        # under autocast). Without this the first-built engine's bf16 training peak on the small
        # model was ~17 MiB higher, its steady increment ~17 MiB above its memory plan
        with torch.autocast(device.type, dtype=be.DTYPES[args.dtype]):
            model(input_ids=ids, labels=ids).loss.backward()
        model.to(be.DTYPES[args.dtype])
        model(input_ids=ids, labels=ids).loss.backward()
    world, rank = dist.get_world_size(), dist.get_rank()
    t = torch.ones(world * 1024, device=device)
    out = torch.empty(1024, device=device)
    dist.all_reduce(t)
    # (torch >= 2.13's *_single names, or the *_tensor ones before: yashard.collectives picks)
    collectives._all_gather(t, out)
    collectives._reduce_scatter(out, t)
    dist.broadcast(t, 0)
    if world > 1:
        ops = [dist.P2POp(dist.isend, out, (rank + 1) % world), dist.P2POp(dist.irecv, out.clone(), (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    del model, opt, ids, t, out
    gc.collect()
    dist.barrier()


def plan_gap_note(planned: int, steady: int) -> str:
    """A warning for the footer when the steady increment is well above what yashard plans to hold
    (more than 4 MiB and 5%): one-time process costs charged to the engine (see :func:`prime`),
    or memory the plan does not account for. Empty otherwise."""
    gap = steady - planned
    if gap <= max(4 * 2**20, 0.05 * planned):
        return ""
    return (f"; **{br.mib(gap)} MiB above the plan**: one-time process costs charged to this engine "
            "(see prime()) or memory the plan does not account for")


def warm_up(eng: be.Engine, args, device, shape, vocab, mem: be.Memory, before_build: int) -> None:
    """Untimed steps; the first one is the correctness check, the rest settle allocations."""
    for i in range(args.warmup):
        loss, norm = be.train_step(eng, args, device, shape, vocab, mem)
        if i == 0:
            dist.all_reduce(loss)
            eng.first_loss = loss.item() / dist.get_world_size()
            eng.first_norm = float(norm)
    eng.steady_bytes = mem.now() - before_build


def timed_block(eng: be.Engine, args, device, shape, vocab, mem: be.Memory) -> None:
    dist.barrier()
    base = mem.now()
    mem.reset_peak()
    calls = mem.allocator_calls()
    times, ends = [], []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        be.train_step(eng, args, device, shape, vocab, mem)
        sync(device)
        times.append(time.perf_counter() - t0)
        ends.append(mem.current())
    if calls is not None:  # CUDA: what the caching allocator was asked for during the timed steps
        after = mem.allocator_calls()
        eng.extra["cuda_mallocs"] = eng.extra.get("cuda_mallocs", 0) + after[0] - calls[0]
        eng.extra["allocs_per_step"] = (after[1] - calls[1]) / args.steps
    eng.transient_bytes = max(eng.transient_bytes, mem.peak() - base)
    eng.times.append(times)
    eng.end_mem.append(ends)


def count_comm(eng: be.Engine, args, device, shape, vocab, mem) -> None:
    """One more step under the collective counter (and, for yashard, its own log): per-step totals."""
    log = eng.model.collective_log() if eng.name.startswith("yashard") else None
    if log is not None:
        log.clear()
        log.enabled = True
    with bench_comm.CollectiveCounter() as counter:
        be.train_step(eng, args, device, shape, vocab, mem)
    eng.comm = bench_comm.summarize(counter.calls, 1)
    if log is not None:
        log.enabled = False
        comm = eng.model.runtime.comm
        sizes = {"world": comm.world, "shard": comm.shard_world}
        eng.extra["log_comm"] = bench_comm.summarize_log(list(log.records), 1, sizes)
        log.clear()


def run_compare(args, device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mem = be.Memory(device)
    shape = be.model_shape(args.model, args.layers, args.hidden)
    probe = be.build_model(shape, args.seed)
    vocab, n_params = probe.config.vocab_size, sum(p.numel() for p in probe.parameters())
    del probe
    ref = reference(shape, args, vocab) if rank == 0 else (float("nan"), float("nan"))
    gc.collect()
    prime(shape, args, device, vocab)

    engines, skipped, footer = [], {}, []
    for name in args.engines:
        if name == "deepspeed" and be.deepspeed_missing():
            skipped[name] = be.deepspeed_missing()
            continue
        if name == "deepspeed" and args.compile:  # (refused before a ZeRO-3 engine is built for nothing)
            skipped[name] = f"not run: {be.DEEPSPEED_NOT_COMPILED}"
            continue
        dist.barrier()
        before = mem.now()
        mem.reset_peak()
        try:
            eng, error = be.SETUP[name](args, device, shape), None
            if args.compile:
                be.compile_layers(eng)
        except Exception as exc:  # noqa: BLE001 - an engine this setup cannot run is reported, not fatal
            eng, error = None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        errors = [None] * world
        dist.all_gather_object(errors, error)
        if any(errors):
            skipped[name] = f"not run: {next(e for e in errors if e)}"
            del eng
            continue
        eng.build_peak_bytes = mem.peak() - before
        eng.build_bytes = mem.now() - before
        warm_up(eng, args, device, shape, vocab, mem, before)
        engines.append(eng)

    for r in range(args.repeats):
        # Rotate the starting engine every round so no engine always runs first (or after the same one).
        order = engines[r % len(engines):] + engines[: r % len(engines)] if engines else []
        for eng in order:
            timed_block(eng, args, device, shape, vocab, mem)
    for eng in engines:
        count_comm(eng, args, device, shape, vocab, mem)

    out_engines = []
    for eng in engines:
        times = torch.tensor(eng.times, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per step, the slowest rank
        drift = max(max(block) - min(block) for block in eng.end_mem)
        build_peak, after_build, steady, peak, drift = _max_over_ranks(
            [eng.build_peak_bytes, eng.build_bytes, eng.steady_bytes, eng.steady_bytes + eng.transient_bytes, drift])
        entry = dict(name=eng.name, precision=eng.precision, notes=eng.notes, times=times.tolist(),
                     build_peak=build_peak, after_build=after_build, steady=steady, train_peak=peak,
                     end_drift=drift, first_loss=eng.first_loss, first_norm=eng.first_norm, comm=eng.comm,
                     **eng.extra)
        out_engines.append(entry)
        if "log_comm" in eng.extra:
            footer.append(f"{eng.name}: " + bench_comm.compare_with_log(eng.extra["log_comm"], eng.comm) + ".")
        if "cuda_mallocs" in eng.extra:
            footer.append(f"{eng.name}: {eng.extra['cuda_mallocs']} cudaMalloc calls during the timed steps, "
                          f"{eng.extra['allocs_per_step']:.0f} caching-allocator allocations per step.")
        if "plan_bytes" in eng.extra:
            footer.append(f"{eng.name}: memory_plan().total_bytes {br.mib(eng.extra['plan_bytes'])} MiB + AdamW state "
                          f"{br.mib(eng.extra['adamw_bytes'])} MiB (steady increment measured: {br.mib(steady)} MiB)"
                          + plan_gap_note(eng.extra["plan_bytes"] + eng.extra["adamw_bytes"], steady) + ".")
    if device.type == "cuda":
        footer.append(f"CUDA reserved peak of the process (all engines): {br.mib(be.Memory(device).reserved_peak())} MiB.")
    if device.type == "cpu" and dist.get_backend() == "gloo":
        footer.append("gloo executes a reduce-scatter as an all-reduce of the full tensor: on CPU a reduce-scatter "
                      "moves about twice the ring estimate.")

    gb = args.micro_batch * args.accum * world
    meta = dict(model=args.model, layers=shape["num_hidden_layers"], hidden=shape["hidden_size"], dtype=args.dtype,
                micro_batch=args.micro_batch, accum=args.accum, world=world, backend=str(dist.get_backend()),
                device=device.type, n_params=n_params, seq=shape["seq"], global_batch=gb, tokens=gb * shape["seq"],
                lr=be.LR, optimizer=args.optimizer, wd=be.WEIGHT_DECAY, clip=be.CLIP, warmup=args.warmup, steps=args.steps,
                repeats=args.repeats, torch=torch.__version__, threads=torch.get_num_threads(),
                ref_loss=ref[0], ref_norm=ref[1], mem_kind="alloc" if device.type == "cuda" else "RSS",
                malloc=args.malloc if device.type == "cpu" else None)
    return dict(meta=meta, engines=out_engines, skipped=skipped, footer=footer)


# ---------------------------------------------------------------------------------------- ZeRO++ volume
def run_zeropp(args, device) -> dict:
    """One logged step of yashard (bf16 params and gradients) per ZeRO++ mode; world must be a
    multiple of 2 (ranks per node)."""
    import yashard
    from yashard import comm_hooks

    world, rpn = dist.get_world_size(), 2
    if world % rpn or world < 2 * rpn:
        raise SystemExit(f"--zeropp needs a world of 2 nodes x {rpn} ranks or more (a multiple of {rpn}, >= {2 * rpn});"
                         f" got {world}: run torchrun --nproc_per_node 4")
    shape = be.model_shape(args.model, args.layers, args.hidden)
    rows, m_bytes = [], None
    for name, mode in ZEROPP_MODES.items():
        cfg = yashard.ShardConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, **mode.get("shard_kw", {}))
        model = yashard.shard(be.build_model(shape, args.seed), config=cfg)
        if mode.get("qgz"):
            model.register_comm_hook(comm_hooks.QgzState(model, ranks_per_node=rpn, bits=4), comm_hooks.qgz_hook)
        opt = be.make_adamw(model.param_groups(weight_decay=be.WEIGHT_DECAY), args)
        layers = [u for u in model.runtime.units if u.kind == "layer"]
        m = sum(u.layout.padded for u in layers) * 2
        m_bytes = m if m_bytes is None else m_bytes
        log = model.collective_log()
        records = []
        for step in range(2):  # step 0 warms up; step 1 is logged
            ids = be.global_batch(step, args.micro_batch * world, shape["seq"], be.COMMON["vocab_size"]).chunk(world)[dist.get_rank()]
            log.clear()
            log.enabled = step == 1
            out = model(input_ids=ids, labels=ids)
            records += [("fwd", *r) for r in log.records]
            log.clear()
            out.loss.backward()
            records += [("bwd", *r) for r in log.records]
            log.clear()
            model.clip_grad_norm_(be.CLIP)
            records += [("opt", *r) for r in log.records]
            log.clear()
            log.enabled = step == 0  # step 0's optimizer step gathers the first units of step 1's forward
            opt.step()
            records += [("fwd", *r) for r in log.records]
            log.enabled = False
            opt.zero_grad()
        terms = br.volume_terms(records)
        layer_bytes = sum(b for t in terms.values() for b in t.values())
        all_bytes = sum(r[4] for r in records)
        rows.append(dict(name=name, terms=terms, other_bytes=all_bytes - layer_bytes, count=len(records)))
        model.runtime.remove_hooks()
        del model, opt
        gc.collect()
    meta = dict(model=args.model, layers=shape["num_hidden_layers"], world=world, ranks_per_node=rpn, M=m_bytes)
    return dict(meta=meta, rows=rows)


# ---------------------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, worker_args: list[str], json_path: str, threads: int) -> dict:
    """Run this script under torchrun with ``worker_args`` and return the JSON rank 0 wrote."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), os.path.join(here, "benchmark.py"), *worker_args, "--json", json_path]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    root = os.path.dirname(here)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    print(f"  done in {time.time() - t0:.0f} s", flush=True)
    with open(json_path) as f:
        return json.load(f)


def _common(args) -> list[str]:
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
            "--seed", str(args.seed), "--optimizer", args.optimizer, "--malloc", args.malloc]


def sweep_matrix(args) -> str:
    runs = []
    for dtype in args.dtypes:
        for model, mb, accum in MATRIX:
            tag = f"matrix_{model}_{dtype}_{mb}x{accum}"
            runs.append(launch(args.nproc, ["--model", model, "--dtype", dtype, "--micro-batch", str(mb), "--accum",
                                            str(accum), "--engines", ",".join(args.engines), *_common(args)],
                               os.path.join(args.out_dir, tag + ".json"), args.threads))
    text = br.render_matrix(runs)
    _write(os.path.join(args.out_dir, "matrix.md"), text)
    br.plot_matrix(runs, os.path.join(args.out_dir, "matrix.png"))
    return text


def sweep_scaling(args) -> str:
    points = []
    base = ["--model", "small", "--engines", args.scaling_engines, *_common(args)]
    for sweep, values, flag in (("layers", args.scaling_layers, "--layers"), ("hidden", args.scaling_hidden, "--hidden"),
                                ("world", args.scaling_worlds, None)):
        runs = []
        for v in values:
            nproc = v if flag is None else args.nproc
            extra = [] if flag is None else [flag, str(v)]
            runs.append(launch(nproc, base + extra, os.path.join(args.out_dir, f"scaling_{sweep}_{v}.json"), args.threads))
        points += br.scaling_points(runs, sweep)
    text = br.render_scaling(points)
    _write(os.path.join(args.out_dir, "scaling.md"), text)
    return text


def sweep_zeropp(args) -> str:
    res = launch(4, ["--zeropp", "--micro-batch", "1"], os.path.join(args.out_dir, "zeropp.json"), args.threads)
    text = br.render_volume(res["rows"], res["meta"])
    _write(os.path.join(args.out_dir, "zeropp.md"), text)
    return text


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", flush=True)


def driver(args) -> None:
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    parts = []
    for name, fn in (("matrix", sweep_matrix), ("scaling", sweep_scaling), ("zeropp", sweep_zeropp)):
        if args.sweep in (name, "all"):
            parts.append(fn(args))
    text = "\n".join(parts) + f"\n_{args.sweep} sweep: {time.time() - t0:.0f} s wall, threads/rank {args.threads}._\n"
    if args.sweep == "all":
        _write(os.path.join(args.out_dir, "report.md"), text)
    print(text, flush=True)


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    args = parse_args()
    if args.sweep:
        if "RANK" in os.environ:
            raise SystemExit("--sweep is the driver: run it with plain python, not under torchrun (it launches torchrun)")
        return driver(args)
    if "RANK" not in os.environ:
        raise SystemExit("run a single configuration under torchrun (torchrun --nproc_per_node 2 recipes/benchmark.py), "
                         "or use --sweep to launch a set of them")
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated collective names
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    device = init_distributed()
    if device.type == "cpu" and args.malloc == "returning":
        be.use_returning_malloc()
    if args.zeropp:
        res = run_zeropp(args, device)
        text = br.render_volume(res["rows"], res["meta"])
    else:
        res = run_compare(args, device)
        text = br.render_run(res)
    if dist.get_rank() == 0:
        print(text, flush=True)
        if args.out:
            _write(args.out, text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
