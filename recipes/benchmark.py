"""Benchmark yashard against FSDP2, DDP and FSDP1 on one model, one data stream, one optimizer.

Run under torchrun (every engine is built in the same processes; their timed blocks alternate
round-robin so that machine drift hits every engine alike)::

    torchrun --nproc_per_node 2 recipes/benchmark.py --model small --dtype bf16 --steps 5 --repeats 3

CPU + gloo by default; CUDA + NCCL when ``torch.cuda.is_available()`` (same code). Prints one
markdown table on rank 0 (and writes it to ``--out`` when given).

What is compared, per engine:

* step time: median over ``steps * repeats`` timed steps (each step timed alone, the slowest rank
  counts), after ``--warmup`` untimed steps; ``vs DDP`` is that median over DDP's;
* tokens/s: global batch * sequence length / median step time;
* memory, as the engine's own increment (all engines live in the same process, so absolute numbers
  would include the others): *after build* is the increase from building the wrapped model and its
  optimizer; *training peak* is the increase at the highest point of training (steady state after
  warm-up, which adds optimizer state and gradients, plus the largest transient inside a timed
  block: activations, gathered weights). On CPU this is process RSS (VmHWM reset through
  /proc/self/clear_refs where the kernel allows it, and VmRSS sampled after every forward,
  backward and optimizer step); on CUDA it is ``torch.cuda.memory_allocated`` /
  ``max_memory_allocated``;
* correctness: the first step's loss (averaged over ranks and micro-batches) minus the loss of an
  unsharded fp32 copy of the model on the full global batch, computed on rank 0, and the relative
  difference of the pre-clip gradient norm of that first step.

Engines and their precision:

* ``yashard``: ``yashard.shard`` with ``ShardConfig(param_dtype, reduce_dtype=fp32)``;
* ``fsdp2``: ``fully_shard`` on every decoder layer, then the root; bf16 through
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
* ``fsdp1``: ``FullyShardedDataParallel`` wrapping every decoder layer; bf16 through
  ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``;
* ``ddp``: ``DistributedDataParallel`` with fp32 weights and gradients; with ``--dtype bf16`` the
  forward runs under ``torch.autocast(bf16)`` (which casts matmul inputs, not the whole model; norms
  and softmax stay fp32), and the gradients are all-reduced in fp32. With gradient accumulation DDP
  skips the all-reduce of all but the last micro-batch (``no_sync``); the sharded engines reduce
  every micro-batch (their default, which keeps gradients sharded).

Every engine uses AdamW (lr 1e-3, weight decay 0.1 on matrices, 0 on 1-D parameters), clips the
global gradient norm to 1.0, and sees the same global batches in the same order: rank r takes rows
[r*B/W, (r+1)*B/W) of each global batch and splits them into ``--accum`` micro-batches.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import os
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import yashard

LR, WEIGHT_DECAY, CLIP = 1e-3, 0.1, 1.0
ENGINES = ("yashard", "fsdp2", "ddp", "fsdp1")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Llama shapes. "small": about 4M parameters; "wide": about 50M parameters, short sequences (so the
# step is dominated by weight traffic rather than activations).
MODELS = {
    "small": dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4, seq=256),
    "wide": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8, seq=64),
}
COMMON = dict(vocab_size=2048, num_hidden_layers=4, tie_word_embeddings=False)


# ---------------------------------------------------------------------------------------- setup
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch, per rank")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per engine per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per engine before the first repeat (>= 1)")
    p.add_argument("--repeats", type=int, default=3, help="round-robin rounds over the engines")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list out of {','.join(ENGINES)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights (same for every engine)")
    p.add_argument("--out", default=None, help="also write the markdown table to this path")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown or not args.engines:
        p.error(f"--engines: unknown {sorted(unknown)}; choose from {','.join(ENGINES)}")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first warm-up step is the one checked against the reference)")
    if min(args.micro_batch, args.accum, args.steps, args.repeats) < 1:
        p.error("--micro-batch, --accum, --steps and --repeats must be >= 1")
    return args


def init_distributed() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return torch.device("cpu")


def build_model(name: str, seed: int):
    """A random-init HF Llama, identical on every call with the same seed (built on the CPU, fp32)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(MODELS[name])
    seq = shape.pop("seq")
    cfg = LlamaConfig(**COMMON, **shape, max_position_embeddings=seq)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).float()


def global_batch(step: int, size: int, seq: int, vocab: int) -> torch.Tensor:
    """The global batch of training step ``step`` (same for every engine and every rank)."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, vocab, (size, seq), generator=g)


def split_params(params) -> list[dict]:
    """AdamW groups: weight decay on matrices, none on 1-D parameters (norm weights, biases)."""
    params = list(params)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


# ---------------------------------------------------------------------------------------- memory
def _use_returning_malloc() -> None:
    """Make glibc serve large blocks with mmap and hand them back on free, so that RSS follows what
    is actually live (otherwise freed tensors stay in the heap and blur every engine's increment)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
    except OSError:
        pass


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+)", f.read(), re.M).group(1))


class Memory:
    """Current and peak memory of this process: RSS on CPU, allocated bytes on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.sampled = 0
        self.hwm_resettable = False

    def now(self) -> int:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return _status_kib("VmRSS") * 1024

    def sample(self) -> None:
        if not self.cuda:
            self.sampled = max(self.sampled, _status_kib("VmRSS") * 1024)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        self.sampled = _status_kib("VmRSS") * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            self.hwm_resettable = True
        except OSError:
            self.hwm_resettable = False

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        hwm = _status_kib("VmHWM") * 1024 if self.hwm_resettable else 0
        return max(self.sampled, hwm)


# ---------------------------------------------------------------------------------------- engines
@dataclass
class Engine:
    name: str
    precision: str                                   # how the column is labelled
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    clip: Callable[[], torch.Tensor]                 # clips to CLIP, returns the pre-clip norm
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    step: int = 0                                    # optimizer steps taken (indexes the data)
    times: list[list[float]] = field(default_factory=list)   # seconds, one list per repeat
    build_bytes: int = 0
    steady_bytes: int = 0
    transient_bytes: int = 0
    first_loss: float = float("nan")
    first_norm: float = float("nan")
    notes: list[str] = field(default_factory=list)


def _local_norm(t) -> torch.Tensor:
    """A clip_grad_norm_ result as a plain tensor (FSDP2 returns a replicated DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def setup_yashard(args, device) -> Engine:
    cfg = yashard.ShardConfig(param_dtype=DTYPES[args.dtype], reduce_dtype=torch.float32)
    model = yashard.shard(build_model(args.model, args.seed), config=cfg)
    opt = torch.optim.AdamW(model.param_groups(weight_decay=WEIGHT_DECAY), lr=LR)
    precision = f"{args.dtype} compute, fp32 master + reduce"
    return Engine("yashard", precision, model, opt, clip=lambda: model.clip_grad_norm_(CLIP))


def setup_fsdp2(args, device) -> Engine:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if args.dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    model = build_model(args.model, args.seed).to(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(split_params(model.parameters()), lr=LR)
    clip = lambda: _local_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))  # noqa: E731
    return Engine("fsdp2", f"{args.dtype} compute, fp32 master + reduce", model, opt, clip)


def setup_fsdp1(args, device) -> Engine:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = build_model(args.model, args.seed)
    layer_cls = type(model.model.layers[0])
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else None
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), mixed_precision=mp,
                 device_id=device, use_orig_params=True)
    opt = torch.optim.AdamW(split_params(model.parameters()), lr=LR)
    return Engine("fsdp1", f"{args.dtype} compute, fp32 master + reduce", model, opt,
                  clip=lambda: model.clip_grad_norm_(CLIP))


def setup_ddp(args, device) -> Engine:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(args.model, args.seed).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(split_params(model.parameters()), lr=LR)
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # noqa: E731
    if args.dtype == "bf16":
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
        precision = "fp32 weights, autocast bf16, fp32 reduce"
    else:
        autocast, precision = contextlib.nullcontext, "fp32"
    eng = Engine("ddp", precision, model, opt, clip, autocast=autocast, no_sync=model.no_sync)
    if args.accum > 1:
        eng.notes.append("no_sync on all but the last micro-batch")
    return eng


SETUP = {"yashard": setup_yashard, "fsdp2": setup_fsdp2, "fsdp1": setup_fsdp1, "ddp": setup_ddp}


# ---------------------------------------------------------------------------------------- training
def train_step(eng: Engine, args, device, vocab: int, seq: int, mem: Memory) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of ``eng``; returns (this rank's mean loss, pre-clip global grad norm)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batch(eng.step, args.micro_batch * args.accum * world, seq, vocab)
    local = batch.chunk(world)[rank].to(device)
    loss = torch.zeros((), device=device)
    for i, micro in enumerate(local.chunk(args.accum)):
        last = i == args.accum - 1
        with (contextlib.nullcontext() if last else eng.no_sync()):
            with eng.autocast():
                out = eng.model(input_ids=micro, labels=micro)
            mem.sample()
            (out.loss / args.accum).backward()
        loss += out.loss.detach().float() / args.accum
        mem.sample()
    norm = eng.clip()
    eng.opt.step()
    eng.opt.zero_grad(set_to_none=True)
    mem.sample()
    eng.step += 1
    return loss, norm


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def warm_up(eng: Engine, args, device, vocab, seq, mem: Memory, before_build: int) -> None:
    """Untimed steps; the first one is the correctness check, the rest settle allocations."""
    for i in range(args.warmup):
        loss, norm = train_step(eng, args, device, vocab, seq, mem)
        if i == 0:
            dist.all_reduce(loss)
            eng.first_loss = loss.item() / dist.get_world_size()
            eng.first_norm = float(norm)
    eng.steady_bytes = mem.now() - before_build


def timed_block(eng: Engine, args, device, vocab, seq, mem: Memory) -> list[float]:
    dist.barrier()
    base = mem.now()
    mem.reset_peak()
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        train_step(eng, args, device, vocab, seq, mem)
        sync(device)
        times.append(time.perf_counter() - t0)
    eng.transient_bytes = max(eng.transient_bytes, mem.peak() - base)
    return times


def reference(args, vocab: int, seq: int) -> tuple[float, float]:
    """Loss and pre-clip grad norm of step one: unsharded fp32 copy, full global batch, one process."""
    model = build_model(args.model, args.seed)
    batch = global_batch(0, args.micro_batch * args.accum * dist.get_world_size(), seq, vocab)
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return out.loss.item(), norm.item()


# ---------------------------------------------------------------------------------------- report
def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def human(b: float) -> str:
    return f"{b / 2**20:.2f} MiB" if b >= 2**17 else f"{b:g} B"


def yashard_comm(eng: Engine, args, vocab, seq, device, mem) -> list[str]:
    """Collectives of one yashard rank per step, from its collective log (over ``--steps`` steps)."""
    log = eng.model.collective_log()
    log.clear()
    log.enabled = True
    for _ in range(args.steps):
        train_step(eng, args, device, vocab, seq, mem)
    log.enabled = False
    recs = list(log.records)
    log.clear()
    n = args.steps
    count, nbytes = Counter(), Counter()
    for op, _unit, _numel, b, _group in recs:
        count[op] += 1
        nbytes[op] += b
    per_op = ", ".join(f"{op} {count[op] / n:g} x, {human(nbytes[op] / n)}" for op in sorted(count))
    plan = eng.model.memory_plan()
    return [
        f"yashard per step and rank: {len(recs) / n:g} collectives, {human(sum(nbytes.values()) / n)} "
        f"of collective tensors ({per_op}); sizes are the full (gathered / pre-reduce) tensors, a ring "
        f"moves (W-1)/W of that per rank",
        f"yashard memory_plan().total_bytes: {mib(plan.total_bytes)} MiB "
        f"(+ AdamW state {mib(plan.adamw_bytes)} MiB held by the optimizer)",
    ]


def render(args, engines: list[Engine], ref: tuple[float, float], header: list[str], footer: list[str], device) -> str:
    tokens = args.micro_batch * args.accum * dist.get_world_size() * MODELS[args.model]["seq"]
    medians = {e.name: statistics.median(t for block in e.times for t in block) for e in engines}
    mem_kind = "alloc" if device.type == "cuda" else "RSS"
    lines = header + [
        "",
        f"| engine | precision | step ms (median) | repeat spread | vs DDP | tokens/s | {mem_kind} after build MiB "
        f"| {mem_kind} training peak MiB | step-1 loss - ref | step-1 grad-norm rel diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in engines:
        med = medians[e.name]
        per_repeat = [statistics.median(block) for block in e.times]
        spread = (max(per_repeat) - min(per_repeat)) / med
        ratio = f"{med / medians['ddp']:.2f}x" if "ddp" in medians else "-"
        precision = e.precision + "".join(f"; {n}" for n in e.notes)
        lines.append(
            f"| {e.name} | {precision} | {med * 1e3:.1f} | {spread:.0%} | {ratio} | {tokens / med:,.0f} "
            f"| {mib(e.build_bytes)} | {mib(e.steady_bytes + e.transient_bytes)} "
            f"| {e.first_loss - ref[0]:+.2e} | {abs(e.first_norm - ref[1]) / ref[1]:.1e} |"
        )
    return "\n".join(lines + [""] + footer) + "\n"


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    args = parse_args()
    device = init_distributed()
    if device.type == "cpu":
        _use_returning_malloc()
    rank, world = dist.get_rank(), dist.get_world_size()
    mem = Memory(device)
    seq = MODELS[args.model]["seq"]
    probe = build_model(args.model, args.seed)
    vocab, n_params = probe.config.vocab_size, sum(p.numel() for p in probe.parameters())
    del probe

    ref = reference(args, vocab, seq) if rank == 0 else (float("nan"), float("nan"))
    gc.collect()

    engines, footer = [], []
    for name in args.engines:
        dist.barrier()
        before = mem.now()
        try:
            eng, error = SETUP[name](args, device), None
        except Exception as exc:  # noqa: BLE001 - an engine this torch cannot run is reported, not fatal
            eng, error = None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        errors = [None] * world
        dist.all_gather_object(errors, error)
        if any(errors):
            footer.append(f"{name}: not run ({next(e for e in errors if e)})")
            del eng
            continue
        eng.build_bytes = mem.now() - before
        warm_up(eng, args, device, vocab, seq, mem, before)
        engines.append(eng)

    for r in range(args.repeats):
        # Rotate the starting engine every round so no engine always runs first (or after the same one).
        order = engines[r % len(engines):] + engines[: r % len(engines)]
        for eng in order:
            eng.times.append(timed_block(eng, args, device, vocab, seq, mem))

    # Per-step times as seen by the slowest rank.
    for eng in engines:
        t = torch.tensor(eng.times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        eng.times = t.tolist()
    for eng in engines:
        if eng.name == "yashard":
            footer = yashard_comm(eng, args, vocab, seq, device, mem) + footer

    if rank == 0:
        gb = args.micro_batch * args.accum * world
        header = [
            f"## {args.model} Llama ({n_params / 1e6:.2f}M params), {args.dtype}, world {world} "
            f"({dist.get_backend()}, {device.type})",
            "",
            f"global batch {gb} x seq {seq} = {gb * seq} tokens/step (per rank {args.micro_batch} x "
            f"{args.accum} accum); AdamW lr {LR} wd {WEIGHT_DECAY}, clip {CLIP}; {args.warmup} warm-up, "
            f"{args.steps} timed steps x {args.repeats} round-robin repeats; torch {torch.__version__}, "
            f"threads/rank {torch.get_num_threads()}. Reference: fp32 unsharded, loss {ref[0]:.6f}, "
            f"grad norm {ref[1]:.6f}. Memory: this engine's increment of process {('RSS' if device.type == 'cpu' else 'allocated bytes')}.",
        ]
        table = render(args, engines, ref, header, footer, device)
        print(table, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(table)

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
