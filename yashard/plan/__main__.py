"""``python -m yashard.plan``: the memory plan of a config or preset at a world size, printed.

    python -m yashard.plan --config llama-3-70b --world 256 --gpu-memory 80GiB
    python -m yashard.plan --config llama-3-8b --world 8 --seq-len 4096 --micro-batch 1 --checkpoint-layers 32
    python -m yashard.plan --config path/to/config.json --world 64 --shard-group-size 8
    python -m yashard.plan --config llama-3-8b --world 8 --checkpoint-layers 32 --loss chunked --step-in-backward
    python -m yashard.plan --config llama-3-70b --world 4 --qlora --seq-len 2048 --checkpoint-layers 80 --gpu-memory 24GiB

Each row of the plan is marked fixed (the slots hold whole units, whatever the world size) or 1/W
(this rank's share of the model), then the model state with AdamW against one GPU's memory. Then
the activations of one micro-batch (:mod:`yashard.plan.activations`), the peak they imply for
yashard, FSDP2 and DeepSpeed ZeRO-3 (:mod:`yashard.plan.peers`), whether it fits and the largest
micro-batch that does, and the communication of one step (:mod:`yashard.plan.comm`): bytes per
rank and kind, message sizes, and their time at ``--bandwidth`` against the compute time at
``--tflops`` and ``--mfu``, for yashard with and without ZeRO++ and hybrid sharding, and the peers.
``--loss chunked`` plans every engine with its loss in sequence chunks, ``--step-in-backward``
yashard stepping each unit in the backward, ``--fsdp2-root-group`` FSDP2's old root wrapping.
``--qlora`` plans LoRA on an NF4 base (:mod:`yashard.plan.qlora`): yashard's peak only.
"""

from __future__ import annotations

import argparse
import os
import re

import torch

from dataclasses import replace

from ..config import ShardConfig, dtype_name
from ..memory import MemoryPlan, dtype_bytes
from . import BACKENDS, grad_shard_bytes, plan
from .activations import ATTENTION, LOSSES, activations, shape_of, yashard_peak
from .comm import Qgz, cross_node_sent, peer_collectives, step_seconds, summarize, unit_sizes, yashard_collectives
from .peers import deepspeed_zero3_peak, fsdp2_peak
from .presets import PRESETS, preset_config
from .qlora import STORAGES, dequantized_bytes, qlora_activations, qlora_model

# Rows whose size does not shrink as the world grows (the slots hold whole units); the others
# hold this rank's 1/W of the model.
_FIXED_ROWS = ("slot ", "qwZ codes", "comm hook ", "reduce-scatter staging")


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


def _rate(text: str) -> int:
    """``"50GB/s"`` (or ``"50GB"``): bytes per second."""
    return _size(text[:-2] if text.endswith("/s") else text)


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
    lines.append(f"  {'+ AdamW state':<{width}}  {plan.adamw_bytes / gib:9.3f} GiB  1/W    "
                 f"{plan.adamw_formula or 'two fp32 moments per trained element'}, held by the optimizer")
    state = plan.total_bytes + plan.adamw_bytes
    lines.append(f"  {'model state':<{width}}  {state / gib:9.3f} GiB")
    if gpu_memory is not None:
        left = gpu_memory - state
        verdict = (f"leaves {left / gib:.3f} GiB of {gpu_memory / gib:.3f} GiB for activations and the "
                   "framework" if left > 0 else
                   f"does not fit: {-left / gib:.3f} GiB over {gpu_memory / gib:.3f} GiB before any activation")
        lines.append(f"model state {verdict}")
    return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def largest_micro_batch(peak_of, gpu_memory: int, limit: int = 1 << 16) -> int:
    """The largest micro-batch whose peak ``peak_of(micro_batch)`` fits ``gpu_memory`` (0: none;
    the peak grows with the micro-batch)."""
    if peak_of(1) > gpu_memory:
        return 0
    lo, hi = 1, 2
    while hi <= limit and peak_of(hi) <= gpu_memory:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak_of(mid) <= gpu_memory else (lo, mid)
    return lo


def peaks_report(model, result: MemoryPlan, config: ShardConfig, world: int, *, seq: int, micro_batch: int,
                 checkpoint: int, attention: str, gpu_memory: int | None, backend: str = "nccl",
                 grad_accum: int = 1, loss: str = "hf", step_in_backward: bool = False,
                 fsdp2_root_group: bool = False, qlora=None) -> str:
    """The activation estimate and the peaks of yashard, FSDP2 and ZeRO-3, with the largest
    micro-batch that fits ``gpu_memory``. The peers shard over all ``world`` ranks. With
    ``grad_accum`` micro-batches a step, FSDP2's peak is that of the second and later ones, which
    start with the gradient shards of the earlier ones (yashard's and ZeRO-3's hold theirs anyway).
    ``loss``: ``"hf"`` (the model's own) or ``"chunked"`` (every engine, as torchtitan ships it).
    ``step_in_backward``: yashard steps each unit in the backward, without its fp32 gradient shards.
    ``fsdp2_root_group``: FSDP2 with the root holding the embedding, the norm and the lm_head,
    instead of torchtitan's wrapping. ``qlora``: the QLoRA model ``result`` is the plan of
    (:func:`yashard.plan.qlora.qlora_model`; ``model`` is then its unquantised base): yashard alone."""
    shape = shape_of(model)
    p = dtype_bytes(config.param_dtype)
    r = dtype_bytes(config.wire_dtype)
    state = result.total_bytes + result.adamw_bytes
    # (a plan of ShardConfig(step_in_backward=True) has no gradient shards left to remove)
    saves = grad_shard_bytes(result) if step_in_backward else 0
    less = _step_in_backward_saves(qlora or model, result, config, world, backend) if step_in_backward else 0

    def acts_of(mb: int):
        acts = activations(shape, seq=seq, micro_batch=mb, param_bytes=p, checkpoint_layers=checkpoint,
                           attention=attention, loss=loss)
        return acts if qlora is None else qlora_activations(acts, shape, qlora, p)

    engines = {
        "yashard": lambda mb: yashard_peak(state, shape, acts_of(mb), step_in_backward_saves=saves,
                                           head_trains=qlora is None, loss_chunk_tokens=config.loss_chunk_tokens),
        "FSDP2": lambda mb: fsdp2_peak(shape, acts_of(mb), world=world, param_bytes=p, reduce_bytes=r,
                                       backend=backend, accumulating=grad_accum > 1, root_group=fsdp2_root_group),
        "DeepSpeed ZeRO-3": lambda mb: deepspeed_zero3_peak(shape, acts_of(mb), world=world, param_bytes=p,
                                                            reduce_bytes=r, backend=backend),
    }
    if qlora is not None:
        del engines["FSDP2"], engines["DeepSpeed ZeRO-3"]
    acts = acts_of(micro_batch)
    loss_line = (f"the loss runs in {acts.loss_chunks} sequence chunks, one chunk's logits and CE gradients "
                 f"{_gib(acts.loss_chunk)} GiB" if acts.chunked else f"the loss's backward adds {_gib(acts.loss_backward)}")
    lines = [f"activations, micro-batch {micro_batch} x {seq} tokens, {checkpoint} checkpointed layers, {attention}, "
             f"{loss} loss:",
             f"  per layer {_gib(acts.layer)} GiB, per checkpointed layer {_gib(acts.checkpointed)} GiB, "
             f"head {_gib(acts.head)} GiB, logits {_gib(acts.logits)} GiB",
             f"  at the forward's end {_gib(acts.forward_end)} GiB; {loss_line}, "
             f"a layer's weight gradients {_gib(acts.layer_grads)}",
             "  (yashard: autograd computes all of a layer's weight gradients before Narrow copies them into the "
             "gradient slot, so for a moment they exist outside the plan: in the peaks below)",
             *([f"  QLoRA: a layer's weight gradients are its adapters'; the lm_head is frozen; one 4-bit weight "
                f"dequantised, {_gib(dequantized_bytes(qlora, p))} GiB at most, in the MLP's backward; each LoRA "
                "module keeps its r-wide hidden"] if qlora is not None else []),
             "peak per rank (GiB):",
             f"  {'engine':<17} {'state':>8} {'peak':>8}  {'at':<40}" + ("  fits  largest micro-batch" if gpu_memory else "")]
    for name, peak_of in engines.items():
        peak = peak_of(micro_batch)
        line = f"  {name:<17} {_gib(peak.state):>8} {_gib(peak.bytes):>8}  {peak.at:<40}"
        if gpu_memory:
            line += f"  {'yes' if peak.bytes <= gpu_memory else 'no':<4}  {largest_micro_batch(lambda mb: peak_of(mb).bytes, gpu_memory)}"
        lines.append(line)
    if qlora is not None:
        lines.append("  FSDP2 and DeepSpeed ZeRO-3: not modelled for QLoRA (--qlora); no peak is printed for them")
        lines.append("  state: held between steps, the plan + AdamW")
        if step_in_backward:
            lines.append(f"  yashard steps each unit in the backward (--step-in-backward): no fp32 gradient shards, "
                         f"{_gib(less)} GiB less")
        return "\n".join(lines)
    lines.append("  state: held between steps (yashard: plan + AdamW; FSDP2: fp32 shards + AdamW; ZeRO-3: its "
                 "partitions, fp32 masters, gradient partitions, AdamW, persistent parameters and gradient bucket)")
    if loss == "hf":
        lines.append("  loss: every engine computes the HF loss (yashard's default, ShardConfig(loss='chunked'), "
                     "is --loss chunked)")
    lines.append("  FSDP2: " + ("the root holds the embedding, the final norm and the lm_head (--fsdp2-root-group)"
                                if fsdp2_root_group else "wrapped as torchtitan does: the embedding alone, each layer, "
                                "[norm, lm_head] kept gathered (--fsdp2-root-group: the old root wrapping)"))
    if step_in_backward:
        lines.append(f"  yashard steps each unit in the backward (--step-in-backward): no fp32 gradient shards, "
                     f"{_gib(less)} GiB less; the peers step after the backward")
    lines.append(f"  {grad_accum} micro-batch{'es' if grad_accum > 1 else ''} a step: " + (
        f"FSDP2's peak is a later micro-batch's, with its fp32 gradient shards ({_gib(4 * shape.total_numel // world)}"
        " GiB) held from the first" if grad_accum > 1 else
        "FSDP2 holds no gradient shards before its first reduction (--grad-accum N: more micro-batches)"))
    return "\n".join(lines)


def _step_in_backward_saves(model, result: MemoryPlan, config: ShardConfig, world: int, backend: str) -> int:
    """The bytes the step in backward removes from ``result``: its fp32 gradient shards, or, where
    ``config`` already steps in backward, what the ordinary plan holds beyond it."""
    if not config.step_in_backward:
        return grad_shard_bytes(result)
    ordinary = plan(model, world_size=world, config=replace(config, step_in_backward=False), backend=backend)
    return ordinary.total_bytes - result.total_bytes


def comm_report(model, config: ShardConfig, world: int, *, tokens: int, checkpoint: int, bandwidth: float,
                node_bandwidth: float, ranks_per_node: int, tflops: float, mfu: float, micro_batches: int = 1) -> str:
    """The collectives of one step of ``micro_batches`` micro-batches of ``tokens`` tokens by kind
    for ``config``, then the bytes and times of the variants (every engine reduces every micro-batch)."""
    shape = shape_of(model)
    p, r = dtype_bytes(config.param_dtype), dtype_bytes(config.wire_dtype)
    compute = step_seconds(shape, tokens=tokens * micro_batches, tflops=tflops, mfu=mfu, checkpoint_layers=checkpoint)

    def ours(cfg: ShardConfig, qgz: Qgz | None = None):
        return yashard_collectives(unit_sizes(model, cfg, cfg.shard_group_size or world), world=world, config=cfg,
                                   qgz=qgz, micro_batches=micro_batches)

    step = f"{tokens} tokens" if micro_batches == 1 else f"{micro_batches} micro-batches of {tokens} tokens"
    lines = [f"communication per rank and step, {step} (logged: full tensor sizes; sent: ring, "
             "(g-1)/g of it, twice for an all-reduce):",
             f"  {'kind':<15} {'count':>6} {'logged GB':>10} {'sent GB':>9} {'smallest MB':>12} {'largest MB':>11}"]
    for s in summarize(ours(config)):
        lines.append(f"  {s.kind:<15} {s.count:>6} {s.nbytes / 1e9:>10.2f} {s.sent / 1e9:>9.2f} "
                     f"{s.smallest / 1e6:>12.2f} {s.largest / 1e6:>11.2f}")
    variants: dict[str, tuple] = {"yashard": ours(config)}
    h = min(ranks_per_node, world)
    if world > 1:
        variants["+ qwZ int8"] = ours(replace(config, quantized_weights=8))
        if config.reshard_after_forward and h < (config.shard_group_size or world) and (config.shard_group_size or world) % h == 0:
            variants[f"+ hpZ {h}"] = ours(replace(config, secondary_group_size=h))
        if world % h == 0:
            variants[f"+ qgZ int4, {h}/node"] = ours(config, Qgz(h, 4, 64))
        if world % h == 0 and h < world and config.shard_group_size is None:
            variants[f"hybrid, shard groups of {h}"] = ours(replace(config, shard_group_size=h))
        if world % h == 0 and config.secondary_group_size is None:
            hpz = h if h < world and config.reshard_after_forward else None
            variants["qwZ + hpZ + qgZ" if hpz else "qwZ + qgZ"] = ours(
                replace(config, quantized_weights=8, secondary_group_size=hpz), Qgz(h, 4, 64))
    variants["FSDP2"] = peer_collectives(shape, world=world, param_bytes=p, reduce_bytes=r) * micro_batches
    variants["DeepSpeed ZeRO-3"] = peer_collectives(shape, world=world, param_bytes=p, reduce_bytes=r,
                                                    engine="deepspeed-zero3") * micro_batches
    bw, nbw = bandwidth, node_bandwidth
    lines.append(f"time at {bw / 1e9:g} GB/s across nodes, {nbw / 1e9:g} GB/s inside ({ranks_per_node} ranks a node), "
                 f"against {compute:.2f} s of compute ({tflops:g} TFLOP/s x {mfu:g}):")
    lines.append(f"  {'variant':<26} {'gather GB':>9} {'reduce GB':>9} {'cross-node GB':>13} {'comm s':>7}  vs compute")
    for name, cs in variants.items():
        kinds = {s.kind: s.sent for s in summarize(cs)}
        cross = cross_node_sent(cs, ranks_per_node, world)
        seconds = cross / bw + (sum(kinds.values()) - cross) / nbw
        gathers = kinds.get("all_gather", 0)
        reduces = sum(kinds.get(k, 0) for k in ("reduce_scatter", "all_reduce", "all_to_all"))
        bound = "communication-bound" if seconds > compute else "compute-bound"
        lines.append(f"  {name:<26} {gathers / 1e9:>9.2f} {reduces / 1e9:>9.2f} {cross / 1e9:>13.2f} {seconds:>7.2f}  "
                     f"{bound}")
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
    p.add_argument("--share-outer-slot", action="store_true",
                   help="share_outer_slot=True: the embedding and the lm_head in the layer slots' buffer")
    p.add_argument("--backend", choices=BACKENDS, default="nccl")
    p.add_argument("--gpu-memory", type=_size, default=None, help="memory of one GPU, e.g. 80GiB")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch, per rank")
    p.add_argument("--checkpoint-layers", type=int, default=0, help="ShardConfig.checkpoint_layers")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--attention", choices=ATTENTION, default="sdpa", help="the model's attention implementation")
    p.add_argument("--loss", choices=LOSSES, default="hf",
                   help="hf: the model computes its loss on the full logits; chunked: every engine runs the lm_head "
                        "and the loss in sequence chunks (torchtitan's default; yashard's fused loss)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="yashard steps each unit's optimizer in the backward: no fp32 gradient shards")
    p.add_argument("--fsdp2-root-group", action="store_true",
                   help="FSDP2 with the old root wrapping (embedding, norm and lm_head in the root), not torchtitan's")
    p.add_argument("--qlora", action="store_true",
                   help="plan LoRA on an NF4 4-bit base: the decoder's linear layers 4-bit, LoRA on --lora-targets")
    p.add_argument("--lora-rank", type=int, default=None, help="with --qlora: LoRA's r (default 16)")
    p.add_argument("--lora-targets", default=None,
                   help="with --qlora: all-linear (default) or comma-separated module names, e.g. q_proj,v_proj")
    p.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=None,
                   help="with --qlora: double quantisation of the absmax (default on)")
    p.add_argument("--quant-storage", choices=STORAGES, default=None,
                   help="with --qlora: the dtype holding the packed codes (default uint8)")
    p.add_argument("--bandwidth", type=_rate, default=parse_bytes("50GB"),
                   help="bytes per second one rank sends across nodes, e.g. 50GB/s")
    p.add_argument("--node-bandwidth", type=_rate, default=None,
                   help="bytes per second inside a node (default: --bandwidth)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="for hpZ, qgZ, hybrid and cross-node bytes")
    p.add_argument("--tflops", type=float, default=400.0, help="peak TFLOP/s of one GPU in the compute dtype")
    p.add_argument("--mfu", type=float, default=0.45, help="the fraction of --tflops a step reaches")
    args = p.parse_args(argv)
    if min(args.seq_len, args.micro_batch, args.ranks_per_node, args.grad_accum) < 1 or args.checkpoint_layers < 0:
        p.error("--seq-len, --micro-batch, --grad-accum and --ranks-per-node must be >= 1, --checkpoint-layers >= 0")
    if args.step_in_backward and args.grad_accum > 1:
        p.error(f"--step-in-backward with --grad-accum {args.grad_accum}: the step in backward consumes each "
                "gradient as it is reduced, so it cannot accumulate micro-batches; use --grad-accum 1 or drop "
                "--step-in-backward")
    if not (0 < args.mfu <= 1) or args.tflops <= 0:
        p.error("--tflops must be > 0 and --mfu in (0, 1]")
    if args.config not in PRESETS and not os.path.exists(args.config):
        p.error(f"--config {args.config}: neither a preset ({', '.join(PRESETS)}) nor an existing config.json or "
                "folder")
    if args.world < 1:
        p.error(f"--world {args.world}: the number of data-parallel ranks, use 1 or more")
    _check_qlora_flags(p, args)
    try:
        source = preset_config(args.config) if args.config in PRESETS else args.config
        model = _meta_model(source)
    except (ValueError, OSError) as e:
        p.error(f"--config {args.config}: {_one_line(e)}")
    planned = model
    if args.qlora:
        try:
            targets = args.lora_targets or "all-linear"
            planned = qlora_model(model.config, rank=args.lora_rank or 16, double_quant=args.double_quant is not False,
                                  targets=targets if targets == "all-linear" else targets.split(","),
                                  quant_storage=STORAGES[args.quant_storage or "uint8"],
                                  param_dtype=dtypes[args.param_dtype])
        except ValueError as e:
            p.error(f"--lora-targets {args.lora_targets}: {_one_line(e)}")
    layers = getattr(model.config, "num_hidden_layers", None)
    if layers is not None and args.checkpoint_layers > layers:
        p.error(f"--checkpoint-layers {args.checkpoint_layers}: the model has {layers} decoder layers; use a value "
                f"between 0 and {layers}")
    try:
        config = ShardConfig(param_dtype=dtypes[args.param_dtype], reduce_dtype=dtypes[args.reduce_dtype],
                             shard_group_size=args.shard_group_size, secondary_group_size=args.secondary_group_size,
                             quantized_weights=args.quantized_weights, reshard_after_forward=not args.no_reshard,
                             share_outer_slot=args.share_outer_slot, checkpoint_layers=args.checkpoint_layers,
                             step_in_backward=args.step_in_backward)
        result = plan(planned, world_size=args.world, config=config, backend=args.backend)
        # (refuses a model family the activation estimate cannot model)
        activations(shape_of(model), seq=args.seq_len, micro_batch=args.micro_batch,
                    param_bytes=dtype_bytes(config.param_dtype), checkpoint_layers=args.checkpoint_layers,
                    attention=args.attention)
    except ValueError as e:
        p.error(_as_flags(_one_line(e)))
    print(f"{args.config}: param_dtype {dtype_name(config.param_dtype)}, reduce_dtype "
          f"{dtype_name(config.wire_dtype)}, backend {args.backend}" + (
              f"; QLoRA: NF4{' with double quantisation' if args.double_quant is not False else ''}, "
              f"{args.quant_storage or 'uint8'} storage, LoRA r={args.lora_rank or 16} on "
              f"{args.lora_targets or 'all-linear'}" if args.qlora else ""))
    print(report(result, args.gpu_memory))
    hint = _shared_outer_hint(planned, result, config, args.world, args.backend)
    if hint:
        print(hint)
    if args.step_in_backward:
        saved = _step_in_backward_saves(planned, result, config, args.world, args.backend)
        print(f"  with --step-in-backward: no fp32 grad shards, model state "
              f"{(result.total_bytes + result.adamw_bytes) / 2**30:.3f} GiB, {saved / 2**30:.3f} GiB less "
              "(each unit steps from its reduce-scatter output)")
    print(peaks_report(model, result, config, args.world, seq=args.seq_len, micro_batch=args.micro_batch,
                       checkpoint=args.checkpoint_layers, attention=args.attention, gpu_memory=args.gpu_memory,
                       backend=args.backend, grad_accum=args.grad_accum, loss=args.loss,
                       step_in_backward=args.step_in_backward, fsdp2_root_group=args.fsdp2_root_group,
                       qlora=planned if args.qlora else None))
    if args.qlora:
        print("communication: not modelled for --qlora (a 4-bit layer gathers its packed bytes: docs/benchmarks.md)")
        return 0
    print(comm_report(model, config, args.world, tokens=args.seq_len * args.micro_batch, checkpoint=args.checkpoint_layers,
                      bandwidth=args.bandwidth, node_bandwidth=args.node_bandwidth or args.bandwidth,
                      ranks_per_node=args.ranks_per_node, tflops=args.tflops, mfu=args.mfu,
                      micro_batches=args.grad_accum))
    return 0


_QLORA_FLAGS = ("lora_rank", "lora_targets", "double_quant", "quant_storage")


def _check_qlora_flags(p: argparse.ArgumentParser, args) -> None:
    """The QLoRA flags need --qlora; a rank is >= 1; qwZ does not apply to 4-bit layers."""
    given = [f for f in _QLORA_FLAGS if getattr(args, f) is not None]
    if given and not args.qlora:
        flag = "--" + given[0].replace("_", "-")
        p.error(f"{flag} plans a QLoRA run: add --qlora, or drop {flag}")
    if args.lora_rank is not None and args.lora_rank < 1:
        p.error(f"--lora-rank {args.lora_rank}: LoRA's rank, use 1 or more")
    if args.qlora and args.quantized_weights is not None:
        p.error(f"--quantized-weights {args.quantized_weights} with --qlora: the 4-bit layers already gather packed "
                "bytes; drop --quantized-weights")


# ShardConfig's fields as the command line names them, for its error messages.
_FLAGS = {"Use share_outer_slot=False (the default)": "Drop --share-outer-slot (it is off by default)",
          "checkpoint_layers": "--checkpoint-layers", "shard_group_size": "--shard-group-size",
          "secondary_group_size": "--secondary-group-size", "quantized_weights": "--quantized-weights",
          "param_dtype": "--param-dtype", "reduce_dtype": "--reduce-dtype", "reshard_after_forward=False": "--no-reshard",
          "share_outer_slot=True": "--share-outer-slot", "share_outer_slot=False (the default)": "no --share-outer-slot",
          "share_outer_slot": "--share-outer-slot"}


def _shared_outer_hint(model, result: MemoryPlan, config: ShardConfig, world: int, backend: str) -> str | None:
    """What ``--share-outer-slot`` would save, when it is not on and the model allows it."""
    if config.share_outer_slot or not config.reshard_after_forward:
        return None
    try:
        shared = plan(model, world_size=world, config=replace(config, share_outer_slot=True),
                      backend=backend)
    except ValueError:  # (tied embeddings)
        return None
    saved = result.total_bytes - shared.total_bytes
    if saved <= 0:
        return None
    return (f"  with --share-outer-slot: yashard total {shared.total_bytes / 2**30:.3f} GiB, {saved / 2**30:.3f} GiB "
            "less (the embedding and the lm_head gather into the layer slots' buffer)")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def _as_flags(message: str) -> str:
    """A ShardConfig or plan error with its fields named as the command line's flags."""
    message = message.replace("ShardConfig.", "")
    for field, flag in _FLAGS.items():
        # (a word boundary only where the field starts or ends with a word character)
        pattern = (r"\b" if field[0].isalnum() else "") + re.escape(field) + (r"\b" if field[-1].isalnum() else "")
        message = re.sub(pattern, flag, message)
    return message


def _meta_model(source):
    """The model of a config or a config.json path, on the meta device (nothing is allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(source) if isinstance(source, str) else source
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
