"""Check the planner's activation and peak estimates against peaks measured on CPU (issue 36, item 3).

    python recipes/plan_check.py                       # driver: every model x dtype x engine, a table
    python recipes/plan_check.py --models small --dtypes fp32 --engines yashard
    torchrun --nproc_per_node 2 recipes/plan_check.py --worker --engine fsdp2 --model small --dtype bf16

The driver launches one torchrun of 2 gloo ranks per engine, model and dtype, and prints, per run,
the measured and estimated forward-end increment and training peak, and their ratio.

How a worker measures (as ``phase_memory.py`` and the benchmark do):

- glibc serves blocks over 64 KiB with mmap and hands them back on free, so RSS follows live memory;
- one step of the unwrapped model and one collective of each kind run first, so one-time process
  costs are paid before the baseline;
- the baseline is the process's RSS before the engine is built; every figure is an increment over it;
- the peak of each phase is VmHWM, reset through ``/proc/self/clear_refs`` before the phase;
- ``--steps`` steps run; the figures are the last step's, the maximum over the 2 ranks.

The engines are built as ``bench_engines`` builds them (FSDP2: ``fully_shard`` on each decoder
layer, then on the root; ``fsdp2-titan``: as torchtitan wraps it, the embedding alone, each layer,
``[norm, lm_head]`` with ``reshard_after_forward=False``, then the root; DeepSpeed: ZeRO-3 with its defaults and ``communication_data_type`` fp32
in bf16, driven by ``engine.backward`` and ``engine.step``), with fused AdamW. DeepSpeed's one-time
costs (its imports, the process group it adds, its compiled ops: about 45 MiB) are paid before the
baseline by one step of a throwaway 1-layer engine. The estimates come from
``yashard.plan.activations`` (the activations and yashard's peak) and ``yashard.plan.peers``
(FSDP2's and ZeRO-3's). Every ratio, measured over estimated, must lie within 0.9 and 1.1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engines as be  # noqa: E402

MODELS = {"small": 4, "wide": 1}  # the benchmark's models, at their matrix micro-batch (4x1, 1x1)
# (yashard-shared: share_outer_slot=True; fsdp2: each layer, then the root; fsdp2-titan: wrapped as
# torchtitan wraps it, the embedding alone, each layer, [norm, lm_head] kept, the root empty)
ENGINES = ("yashard", "yashard-shared", "fsdp2", "fsdp2-titan", "deepspeed")
MiB = 2**20


def _prime(shape: dict, dtype: str, micro_batch: int, vocab: int, engine: str) -> None:
    """Pay the process's one-time costs before the baseline: a step of the unwrapped model in
    ``dtype`` (autograd's threads, kernels' scratch) and one collective of each kind."""
    from yashard import collectives

    model = be.build_model(shape, 0)
    ids = be.global_batch(0, micro_batch, shape["seq"], vocab)
    model(input_ids=ids, labels=ids).loss.backward()
    if dtype != "fp32":
        model.to(be.DTYPES[dtype])
        model(input_ids=ids, labels=ids).loss.backward()
    world, rank = dist.get_world_size(), dist.get_rank()
    t = torch.ones(world * 1024)
    out = torch.empty(1024)
    dist.all_reduce(t)
    collectives._all_gather(t, out)
    collectives._reduce_scatter(out, t)
    ops = [dist.P2POp(dist.isend, out, (rank + 1) % world), dist.P2POp(dist.irecv, out.clone(), (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    if engine == "deepspeed":  # its imports, its process group and its compiled ops: one step of a 1-layer model
        tiny = be.model_shape("small", layers=1, hidden=64)
        eng = be.setup_deepspeed(SimpleNamespace(dtype=dtype, seed=0, micro_batch=1, accum=1, optimizer="adamw-fused"),
                                 torch.device("cpu"), tiny)
        eng.model.backward(eng.model(input_ids=ids[:1, :8], labels=ids[:1, :8]).loss)
        eng.model.step()
        eng.model.destroy()
        del eng
    del model, ids, t, out
    gc.collect()
    dist.barrier()


def backward(eng, loss) -> None:
    """The engine's backward: DeepSpeed's through its engine (it scales, reduces and hooks there)."""
    if eng.name == "deepspeed":
        eng.model.backward(loss)
    else:
        loss.backward()


def finish(eng) -> None:
    """The engine's optimizer step: DeepSpeed's ``engine.step()`` (clip, step, zero the gradients)."""
    if eng.name == "deepspeed":
        eng.model.step()
    else:
        eng.finish()


def worker(args) -> None:
    """One engine on one model and dtype: RSS increments per phase of each step, max over ranks."""
    mem = be.start_measured_rank("plan_check")
    rank = dist.get_rank()
    shape = be.model_shape(args.model)
    vocab = be.COMMON["vocab_size"]
    _prime(shape, args.dtype, args.micro_batch, vocab, args.engine)
    base = mem.now()
    setup, kw = ((be.setup_yashard, {"share_outer": True}) if args.engine == "yashard-shared" else
                 (be.setup_fsdp2, {"titan": True}) if args.engine == "fsdp2-titan" else
                 (getattr(be, f"setup_{args.engine}"), {}))
    eng = setup(SimpleNamespace(dtype=args.dtype, seed=0, micro_batch=args.micro_batch, accum=args.accum,
                                optimizer="adamw-fused"), torch.device("cpu"), shape, **kw)
    built = mem.now() - base
    steps = []
    for step in range(args.steps):
        fwd_peak = bwd_peak = 0
        for micro in range(args.accum):  # (every engine reduces every micro-batch; the last one's figures)
            ids = be.global_batch(step * args.accum + micro, args.micro_batch * dist.get_world_size(), shape["seq"],
                                  vocab)
            ids = ids.chunk(dist.get_world_size())[rank]
            start = mem.now()
            mem.reset_peak()
            out = eng.model(input_ids=ids, labels=ids)
            fwd_end, fwd_peak = mem.current(), max(fwd_peak, mem.peak())
            mem.reset_peak()
            backward(eng, out.loss if eng.name == "deepspeed" else out.loss / args.accum)  # (DeepSpeed divides)
            del out
            bwd_end, bwd_peak = mem.current(), max(bwd_peak, mem.peak())
        mem.reset_peak()
        finish(eng)
        opt_end, opt_peak = mem.current(), mem.peak()
        steps.append([x - base for x in (start, fwd_end, fwd_peak, bwd_end, bwd_peak, opt_end, opt_peak)])
    t = torch.tensor([[built, *s] for s in steps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(engine=args.engine, model=args.model, dtype=args.dtype, micro_batch=args.micro_batch,
                           accum=args.accum,
                           seq=shape["seq"], steps=t.tolist()), f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


# The columns a worker writes per step (after the build figure), bytes over the baseline.
COLUMNS = ("start", "fwd_end", "fwd_peak", "bwd_end", "bwd_peak", "opt_end", "opt_peak")


def run_worker(engine: str, model: str, dtype: str, micro_batch: int, steps: int, accum: int = 1) -> dict:
    """Launch one worker under torchrun (2 ranks, one thread each) and return its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29500 + os.getpid() % 1000), os.path.abspath(__file__), "--worker", "--engine", engine,
               "--model", model, "--dtype", dtype, "--micro-batch", str(micro_batch), "--steps", str(steps),
               "--accum", str(accum),
               "--json", out]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def measured(res: dict) -> dict:
    """The last step's figures: forward-end increment over the step's start, and the peak."""
    row = res["steps"][-1]
    built, cols = row[0], dict(zip(COLUMNS, row[1:]))
    return dict(built=built, forward=cols["fwd_end"] - cols["start"],
                peak=max(cols["fwd_peak"], cols["bwd_peak"], cols["opt_peak"]), **cols)


def estimate(engine: str, model: str, dtype: str, micro_batch: int, accum: int = 1) -> dict:
    """The planner's figures for one run: the forward-end increment, the peak and where it sits."""
    import yashard
    from transformers import LlamaConfig
    from yashard.plan.activations import activations, shape_of, yashard_peak
    from yashard.plan.peers import deepspeed_forward_end, deepspeed_zero3_peak, fsdp2_forward_end, fsdp2_peak

    fields = dict(be.model_shape(model))
    seq = fields.pop("seq")
    cfg = LlamaConfig(**be.COMMON, **fields, max_position_embeddings=seq)
    shape, p = shape_of(cfg), 4 if dtype == "fp32" else 2
    acts = activations(shape, seq=seq, micro_batch=micro_batch, param_bytes=p)
    if engine in ("yashard", "yashard-shared"):
        plan = yashard.plan(cfg, world_size=2, backend="gloo", config=yashard.ShardConfig(
            param_dtype=be.DTYPES[dtype], share_outer_slot=engine == "yashard-shared"))
        return dict(forward=acts.forward_end, peak=yashard_peak(plan.total_bytes + plan.adamw_bytes, shape, acts))
    if engine == "deepspeed":  # communication_data_type fp32, as bench_engines configures it
        return dict(forward=deepspeed_forward_end(shape, acts, param_bytes=p),
                    peak=deepspeed_zero3_peak(shape, acts, world=2, param_bytes=p, reduce_bytes=4, backend="gloo"))
    root = engine == "fsdp2"
    return dict(forward=fsdp2_forward_end(shape, acts, param_bytes=p, root_group=root),
                peak=fsdp2_peak(shape, acts, world=2, param_bytes=p, backend="gloo", accumulating=accum > 1,
                                root_group=root))


def table(rows: list[tuple]) -> str:
    """The markdown table of measured / estimated figures, MiB."""
    out = ["| model | dtype | engine | forward end: measured / estimated MiB | ratio | peak: measured / estimated MiB "
           "| ratio | estimated peak at |", "|---|---|---|---:|---:|---:|---:|---|"]
    for model, dtype, engine, m, e in rows:
        pk = e["peak"]
        out.append(f"| {model} | {dtype} | {engine} | {m['forward'] / MiB:.1f} / {e['forward'] / MiB:.1f} | "
                   f"{m['forward'] / e['forward']:.3f} | {m['peak'] / MiB:.1f} / {pk.bytes / MiB:.1f} | "
                   f"{m['peak'] / pk.bytes:.3f} | {pk.at} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help="run one engine (under torchrun)")
    p.add_argument("--engine", choices=ENGINES, default="yashard")
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--dtype", choices=sorted(be.DTYPES), default="fp32")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the benchmark matrix's")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step, each reduced")
    p.add_argument("--json", default=None)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--engines", default=",".join(ENGINES))
    args = p.parse_args(argv)
    if args.worker:
        args.micro_batch = args.micro_batch or MODELS[args.model]
        worker(args)
        return
    rows = []
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for engine in args.engines.split(","):
                if engine == "deepspeed" and be.deepspeed_missing():
                    print(f"deepspeed {model} {dtype}: skipped, {be.deepspeed_missing()}", flush=True)
                    continue
                micro_batch = args.micro_batch or MODELS[model]
                m = measured(run_worker(engine, model, dtype, micro_batch, args.steps, args.accum))
                e = estimate(engine, model, dtype, micro_batch, args.accum)
                rows.append((model, dtype, engine, m, e))
                print(f"{engine} {model} {dtype}: forward end {m['forward'] / MiB:.1f} MiB (estimated "
                      f"{e['forward'] / MiB:.1f}), peak {m['peak'] / MiB:.1f} MiB (estimated {e['peak'].bytes / MiB:.1f})",
                      flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
