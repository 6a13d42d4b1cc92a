"""The training peak of yashard with the fused chunked loss against the HF loss, measured on CPU, W=2.

    python recipes/fused_loss_memory.py                  # driver: both benchmark models, fp32 and bf16, a table
    python recipes/fused_loss_memory.py --models small --dtypes bf16
    torchrun --nproc_per_node 2 recipes/fused_loss_memory.py --worker --model small --dtype bf16 --loss hf

Each worker measures as ``plan_check.py`` does: RSS increments over the baseline taken before the
model is sharded, glibc handing freed blocks back, the peak of each phase as VmHWM reset through
``/proc/self/clear_refs``, one primed step of the unwrapped model first, the last of ``--steps``
steps, the maximum over the 2 ranks. The engine is ``bench_engines``' yashard with fused AdamW and
clipping; only ``ShardConfig(loss=...)`` and ``loss_chunk_tokens`` change between the runs.
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

MODELS = {"small": 4, "wide": 1}  # the benchmark's models, at their matrix micro-batch (as plan_check.py)
LOSSES = (("hf", 0), ("chunked", 1024), ("chunked", 256))
MiB = 2**20


def worker(args) -> None:
    mem = be.start_measured_rank("fused_loss_memory")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = be.model_shape(args.model)
    vocab = be.COMMON["vocab_size"]
    model = be.build_model(shape, 0)  # (the process's one-time costs, paid before the baseline)
    ids = be.global_batch(0, args.micro_batch, shape["seq"], vocab)
    model(input_ids=ids, labels=ids).loss.backward()
    if args.dtype != "fp32":
        model.to(be.DTYPES[args.dtype])
        model(input_ids=ids, labels=ids).loss.backward()
    t = torch.ones(world * 1024)
    dist.all_reduce(t)
    del model, ids, t
    gc.collect()
    dist.barrier()
    base = mem.now()
    kw = {"loss": args.loss} if args.loss == "hf" else {"loss": "chunked", "loss_chunk_tokens": args.chunk}
    eng = be.setup_yashard(SimpleNamespace(dtype=args.dtype, seed=0, micro_batch=args.micro_batch, accum=1,
                                           optimizer="adamw-fused"), torch.device("cpu"), shape, loss_kw=kw)
    peaks = []
    for step in range(args.steps):
        ids = be.global_batch(step, args.micro_batch * world, shape["seq"], vocab).chunk(world)[rank]
        start = mem.now()
        mem.reset_peak()
        out = eng.model(input_ids=ids, labels=ids)
        fwd_end, fwd_peak = mem.current(), mem.peak()
        mem.reset_peak()
        out.loss.backward()
        del out
        bwd_peak = mem.peak()
        mem.reset_peak()
        eng.finish()
        opt_peak = mem.peak()
        peaks.append([x - base for x in (start, fwd_end, fwd_peak, bwd_peak, opt_peak)])
    t = torch.tensor(peaks, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(dict(steps=t.tolist()), f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run_worker(model: str, dtype: str, loss: str, chunk: int, steps: int) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29500 + os.getpid() % 1000), os.path.abspath(__file__), "--worker", "--model", model,
               "--dtype", dtype, "--loss", loss, "--chunk", str(chunk), "--micro-batch", str(MODELS[model]),
               "--steps", str(steps), "--json", out]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["steps"][-1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--model", default="small")
    p.add_argument("--models", default="small,wide")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--loss", default="chunked")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    print("| model | dtype | loss | tokens per rank | forward end MiB | training peak MiB | peak against hf |")
    print("|---|---|---|---:|---:|---:|---:|")
    for model in args.models.split(","):
        tokens = MODELS[model] * be.model_shape(model)["seq"]
        for dtype in args.dtypes.split(","):
            hf_peak = None
            for loss, chunk in LOSSES:
                start, fwd_end, fwd_peak, bwd_peak, opt_peak = run_worker(model, dtype, loss, chunk, args.steps)
                peak = max(fwd_peak, bwd_peak, opt_peak)
                hf_peak = peak if loss == "hf" else hf_peak
                name = "hf" if loss == "hf" else f"chunked, {chunk} tokens"
                print(f"| {model} | {dtype} | {name} | {tokens} | {(fwd_end - start) / MiB:.1f} | {peak / MiB:.1f} | "
                      f"{peak / hf_peak:.3f} |", flush=True)


if __name__ == "__main__":
    main()
