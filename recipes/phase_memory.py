"""Where an engine's memory peak sits: RSS per phase of a training step (CPU).

    torchrun --nproc_per_node 2 recipes/phase_memory.py --engine yashard --model wide
    torchrun --nproc_per_node 2 recipes/phase_memory.py --engine fsdp2 --model wide

One engine per run (``recipes/bench_engines.py`` builds it exactly as the benchmark does), one
micro-batch per step. For each step rank 0 prints, per phase (forward, backward, clip + optimizer
step + zero_grad), the RSS increment at the end of the phase and the peak inside it, both over the
process's RSS before the engine was built: VmHWM is reset through ``/proc/self/clear_refs`` before
each phase, and glibc is told to serve blocks over 64 KiB with mmap so freed tensors leave RSS. The
benchmark's "training peak" is the maximum of these; this shows which phase it comes from.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

import bench_engines as be

PHASES = ("forward", "backward", "clip+step+zero_grad")
MiB = 2**20


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="yashard", choices=("yashard", "fsdp2", "fsdp1", "ddp"))
    p.add_argument("--model", default="small", choices=sorted(be.MODELS))
    p.add_argument("--dtype", default="fp32", choices=sorted(be.DTYPES))
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--optimizer", default="adamw", choices=be.OPTIMIZERS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    mem = be.start_measured_rank("phase_memory")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = be.model_shape(args.model)
    base = mem.now()
    eng = getattr(be, f"setup_{args.engine}")(
        SimpleNamespace(dtype=args.dtype, seed=args.seed, micro_batch=args.micro_batch, accum=1,
                        optimizer=args.optimizer),
        torch.device("cpu"), shape)
    if rank == 0:
        print(f"{args.engine} {args.model} {args.dtype} {args.optimizer}, world {world}, micro-batch {args.micro_batch}: "
              f"RSS increment in MiB over the process before the build; after build {(mem.now() - base) / MiB:.1f}")
        print("| step | " + " | ".join(f"{ph} end (peak)" for ph in PHASES) + " |")
        print("|---:|" + "---:|" * len(PHASES))
    vocab = be.COMMON["vocab_size"]
    for step in range(args.steps):
        batch = be.global_batch(step, args.micro_batch * world, shape["seq"], vocab)
        ids = batch.chunk(world)[rank]
        mem.reset_peak()
        out = eng.model(input_ids=ids, labels=ids)
        cells = [(mem.current(), mem.peak())]
        mem.reset_peak()
        out.loss.backward()
        del out
        cells.append((mem.current(), mem.peak()))
        mem.reset_peak()
        eng.finish()
        cells.append((mem.current(), mem.peak()))
        if rank == 0:
            print(f"| {step} | " + " | ".join(f"{(e - base) / MiB:.0f} ({(h - base) / MiB:.0f})" for e, h in cells)
                  + " |", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
