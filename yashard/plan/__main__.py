"""``python -m yashard.plan``: the memory plan of a config or preset at a world size, printed.

    python -m yashard.plan --config llama-3-70b --world 256 --gpu-memory 80GiB
    python -m yashard.plan --config path/to/config.json --world 64 --shard-group-size 8

Each row of the plan is marked fixed (the slots hold whole units, whatever the world size) or 1/W
(this rank's share of the model), then the model state with AdamW against one GPU's memory.
"""

from __future__ import annotations

import argparse
import os
import re

import torch

from ..config import ShardConfig, dtype_name
from ..memory import MemoryPlan
from . import BACKENDS, plan
from .presets import PRESETS, preset_config

# Rows whose size does not shrink as the world grows (the slots hold whole units); the others
# hold this rank's 1/W of the model.
_FIXED_ROWS = ("slot ", "qwZ codes", "comm hook ")


_SIZES = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"141GB"``, ``"1024"``: a number of bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZES:
        raise ValueError(f"{text!r} is not a size: write a number with an optional unit (80GiB, 141GB, 1024)")
    return int(float(m.group(1)) * _SIZES[m.group(2).lower()])


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def report(plan: MemoryPlan, gpu_memory: int | None = None) -> str:
    """The plan's rows marked fixed or 1/W, the totals, and the model state against ``gpu_memory``."""
    gib = 2**30
    fixed = sum(r.bytes for r in plan.rows if r.name.startswith(_FIXED_ROWS))
    shrinking = plan.total_bytes - fixed
    width = max(len(r.name) for r in plan.rows)
    lines = [f"memory per rank, world size {plan.world}:"]
    for r in plan.rows:
        kind = "fixed" if r.name.startswith(_FIXED_ROWS) else "1/W"
        lines.append(f"  {r.name:<{width}}  {r.bytes / gib:9.3f} GiB  {kind:<5}  {r.formula}")
    lines.append(f"  {'yashard total':<{width}}  {plan.total_bytes / gib:9.3f} GiB         "
                 f"fixed {fixed / gib:.3f} GiB + 1/W {shrinking / gib:.3f} GiB")
    lines.append(f"  {'+ AdamW state':<{width}}  {plan.adamw_bytes / gib:9.3f} GiB  1/W    two fp32 moments per "
                 "trained element, held by the optimizer")
    state = plan.total_bytes + plan.adamw_bytes
    lines.append(f"  {'model state':<{width}}  {state / gib:9.3f} GiB")
    if gpu_memory is not None:
        left = gpu_memory - state
        verdict = (f"leaves {left / gib:.3f} GiB of {gpu_memory / gib:.3f} GiB for activations and the "
                   "framework" if left > 0 else
                   f"does not fit: {-left / gib:.3f} GiB over {gpu_memory / gib:.3f} GiB before any activation")
        lines.append(f"model state {verdict}")
    lines.append("activations, communication and peers are not estimated here yet")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m yashard.plan``: the plan of a config or preset at a world size, printed."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    p = argparse.ArgumentParser(prog="python -m yashard.plan", description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("--config", required=True, help=f"a config.json, a folder holding one, or a preset: "
                                                   f"{', '.join(PRESETS)}")
    p.add_argument("--world", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--param-dtype", choices=dtypes, default="bf16", help="compute dtype (masters are fp32)")
    p.add_argument("--reduce-dtype", choices=dtypes, default="fp32", help="gradient reduction dtype")
    p.add_argument("--shard-group-size", type=int, default=None, help="hybrid sharding: ranks per shard group")
    p.add_argument("--secondary-group-size", type=int, default=None, help="hpZ: ranks per secondary group")
    p.add_argument("--quantized-weights", type=int, choices=(4, 8), default=None, help="qwZ: bits per weight")
    p.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False")
    p.add_argument("--backend", choices=BACKENDS, default="nccl")
    p.add_argument("--gpu-memory", type=_size, default=None, help="memory of one GPU, e.g. 80GiB")
    args = p.parse_args(argv)
    if args.config not in PRESETS and not os.path.exists(args.config):
        p.error(f"--config {args.config}: neither a preset ({', '.join(PRESETS)}) nor an existing config.json or "
                "folder")
    source = preset_config(args.config) if args.config in PRESETS else args.config
    config = ShardConfig(param_dtype=dtypes[args.param_dtype], reduce_dtype=dtypes[args.reduce_dtype],
                         shard_group_size=args.shard_group_size, secondary_group_size=args.secondary_group_size,
                         quantized_weights=args.quantized_weights, reshard_after_forward=not args.no_reshard)
    result = plan(source, world_size=args.world, config=config, backend=args.backend)
    print(f"{args.config}: param_dtype {dtype_name(config.param_dtype)}, reduce_dtype "
          f"{dtype_name(config.wire_dtype)}, backend {args.backend}")
    print(report(result, args.gpu_memory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
