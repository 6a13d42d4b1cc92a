"""The engines the benchmark compares, the model they train, and the process memory meter.

Every engine trains the same random-init HF Llama (same seed), with AdamW (lr 1e-3, weight decay
0.1 on matrices, 0 on 1-D parameters; the implementation chosen by ``--optimizer``, :func:`make_adamw`), clipping the global gradient norm to 1.0, on the same
global batches in the same order. Each is set up the way its documentation shows:

* ``yashard``: ``yashard.shard`` with ``ShardConfig(param_dtype, reduce_dtype=fp32)``;
* ``fsdp2``: ``fully_shard`` on every decoder layer, then on the root; bf16 through
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
* ``fsdp1``: ``FullyShardedDataParallel`` auto-wrapping every decoder layer,
  ``use_orig_params=True``; bf16 through ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``;
* ``ddp``: ``DistributedDataParallel``, fp32 weights and gradients; with bf16 the forward runs under
  ``torch.autocast(bf16)``; accumulation micro-batches but the last run under ``no_sync``;
* ``deepspeed``: ZeRO stage 3 through ``deepspeed.initialize`` with a client ``torch.optim.AdamW``
  (``zero_allow_untested_optimizer``), ``gradient_clipping`` 1.0, bf16 through its ``bf16`` config
  with ``communication_data_type`` fp32 (the others reduce in fp32 too), stage-3 defaults otherwise;
  its own ``engine.backward`` and ``engine.step`` after every micro-batch;
* ``yashard-noreshard``: ``yashard`` with ``ShardConfig(reshard_after_forward=False)`` (every unit
  keeps its own weight and gradient buffers: weights gathered once per optimizer step) and, with
  accumulation, ``model.no_sync()`` on all but the last micro-batch, as DDP runs;
* ``yashard-noop`` / ``ddp-noop``: the same as ``yashard`` / ``ddp`` with a comm hook that does not
  communicate gradients (``yashard.comm_hooks.noop_hook``; torch's ``ddp_comm_hooks.debugging_hooks.noop_hook``), to
  measure how much of a step is exposed gradient communication. Their gradients are wrong.
* ``yashard-nocomm``: ``yashard-noop`` whose weight all-gathers also send nothing (each rank copies
  its own shard into its slice of the weight buffer and leaves the others' slices as they were):
  yashard with every gather and reduction of weights and gradients gone, its runtime work (hooks,
  copies, casts, the post-divide, the optimizer step on shards) kept. ``1 - t(nocomm) / t(yashard)``
  is the exposed share of all its communication. Weights and gradients are wrong; not run by default.

The sharded engines (DeepSpeed included) reduce gradients after every micro-batch (their default;
it keeps gradients sharded); DDP and ``yashard-noreshard`` reduce once per optimizer step.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import yashard

LR, WEIGHT_DECAY, CLIP = 1e-3, 0.1, 1.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ENGINES = ("yashard", "fsdp2", "ddp", "fsdp1", "deepspeed", "yashard-noop", "ddp-noop", "yashard-noreshard", "plain",
           "yashard-nocomm")
# "plain" (the model itself, no wrapper: world 1 only) is the baseline of the world-1 overhead
# comparison; the default engine list leaves it out, since the matrix runs at world 2, and leaves
# out "yashard-nocomm" (a headroom measurement asked for by name, like plain).
DEFAULT_ENGINES = tuple(e for e in ENGINES if e not in ("plain", "yashard-nocomm"))

# Llama shapes. "small": 3.95M parameters, seq 256; "wide": 67.1M parameters, seq 64 (with a batch
# of one sequence per rank the step is dominated by moving the weights, not by activations); "gpu"
# (below) is sized for one GPU.
MODELS = {
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, seq=256),
    "wide": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=8, seq=64),
    # for one GPU: 386M parameters (47M per layer), seq 1024; five engines' fp32 AdamW states fit in 80 GB
    "gpu": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=8, seq=1024),
}
COMMON = dict(vocab_size=2048, tie_word_embeddings=False)


def model_shape(name: str, layers: int | None = None, hidden: int | None = None) -> dict:
    """The Llama config keywords (plus ``seq``) of model ``name``, with the number of layers and the
    hidden size overridden when given; the MLP width scales with the hidden size, the head count
    stays, so ``hidden`` must be a multiple of ``2 * num_attention_heads`` (rotary needs an even
    head dimension)."""
    shape = dict(MODELS[name])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        shape["num_hidden_layers"] = layers
    if hidden is not None:
        heads = shape["num_attention_heads"]
        if hidden < 1 or hidden % (2 * heads):
            raise ValueError(f"--hidden {hidden} must be a positive multiple of {2 * heads} "
                             f"(model {name!r} has {heads} heads and rotary needs an even head dim)")
        shape["intermediate_size"] = shape["intermediate_size"] * hidden // shape["hidden_size"]
        shape["hidden_size"] = hidden
    return shape


def build_model(shape: dict, seed: int):
    """A random-init HF Llama of ``shape`` (see :func:`model_shape`), identical on every call with
    the same seed (built on the CPU, fp32, sdpa attention)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(shape)
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


OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused")


def make_adamw(groups, args) -> torch.optim.AdamW:
    """Every engine's optimizer: torch's AdamW at lr ``LR``, in the implementation ``args.optimizer``
    names (``adamw``: torch's default for the device, single-tensor on CPU; ``adamw-foreach``;
    ``adamw-fused``: one kernel per tensor, no temporaries)."""
    kind = getattr(args, "optimizer", "adamw")
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}; choose from {', '.join(OPTIMIZERS)}")
    kw = {"adamw": {}, "adamw-foreach": {"foreach": True}, "adamw-fused": {"fused": True}}[kind]
    return torch.optim.AdamW(groups, lr=LR, **kw)


def deepspeed_missing() -> str | None:
    """None when deepspeed can be imported here, else why not ("not installed")."""
    return None if importlib.util.find_spec("deepspeed") is not None else "not installed"


# ---------------------------------------------------------------------------------------- memory
def use_returning_malloc() -> None:
    """Make glibc serve large blocks with mmap and hand them back on free, so that RSS follows what
    is actually live (otherwise freed tensors stay in the heap and blur every engine's increment)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
    except OSError:
        pass


def start_measured_rank(what: str) -> "Memory":
    """A torchrun rank whose RSS peaks can be measured: the peak reset (Linux's clear_refs), glibc
    returning freed blocks, a gloo group, one thread. ``what`` names the recipe in the error."""
    import torch.distributed as dist

    mem = Memory(torch.device("cpu"))
    mem.reset_peak()
    if not mem.hwm_resettable:
        raise SystemExit(f"{what} needs a writable /proc/self/clear_refs to reset the peak")
    use_returning_malloc()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return mem


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+)", f.read(), re.M).group(1))


class Memory:
    """Current and peak memory of this process: RSS on CPU, allocated bytes on CUDA.

    On CPU the peak is the larger of VmHWM (reset through /proc/self/clear_refs where the kernel
    allows it) and VmRSS sampled at the points the training loop calls :meth:`sample` (after every
    forward, backward and optimizer step)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.sampled = 0
        self.hwm_resettable = False

    def now(self) -> int:
        """Memory in use after a garbage collection (bytes)."""
        gc.collect()
        return self.current()

    def current(self) -> int:
        """Memory in use, without collecting (cheap; bytes)."""
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

    def allocator_calls(self) -> tuple[int, int] | None:
        """CUDA only: (cudaMalloc calls, caching-allocator allocations) so far; None on CPU."""
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        return stats["segment.all.allocated"], stats["allocation.all.allocated"]

    def reserved_peak(self) -> int:
        """CUDA only: the caching allocator's peak reserved bytes (absolute, all engines); 0 on CPU."""
        return torch.cuda.max_memory_reserved() if self.cuda else 0


# ---------------------------------------------------------------------------------------- engines
@dataclass
class Engine:
    """One engine: ``micro(ids, last, sample)`` runs forward and backward of one micro-batch
    (``last``: the last of the step; ``sample``: call after the forward to sample memory) and
    returns its detached fp32 loss; ``finish()`` clips, steps the optimizer, zeroes the gradients
    and returns the pre-clip global gradient norm."""

    name: str
    precision: str
    model: torch.nn.Module
    micro: Callable[[torch.Tensor, bool, Callable[[], None]], torch.Tensor]
    finish: Callable[[], torch.Tensor]
    notes: list[str] = field(default_factory=list)
    step: int = 0                                            # optimizer steps taken (indexes the data)
    times: list[list[float]] = field(default_factory=list)   # seconds, one list per repeat
    end_mem: list[list[int]] = field(default_factory=list)   # memory at the end of each timed step
    build_bytes: int = 0
    build_peak_bytes: int = 0
    steady_bytes: int = 0
    transient_bytes: int = 0
    first_loss: float = float("nan")
    first_norm: float = float("nan")
    comm: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def _local_norm(t) -> torch.Tensor:
    """A clip_grad_norm_ result as a plain tensor (FSDP2 returns a replicated DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _torch_engine(name, precision, model, opt, clip, accum, *, autocast=contextlib.nullcontext,
                  no_sync=contextlib.nullcontext) -> Engine:
    """An engine driven the plain-PyTorch way: loss / accum, backward, clip, step, zero_grad."""

    def micro(ids, last, sample):
        with contextlib.nullcontext() if last else no_sync():
            with autocast():
                out = model(input_ids=ids, labels=ids)
            sample()
            (out.loss / accum).backward()
        return out.loss.detach().float()

    def finish():
        norm = clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return norm

    return Engine(name, precision, model, micro, finish)


def _local_weight_gathers(model) -> None:
    """Make ``model``'s weight all-gathers send nothing (benchmark only, through the runtime's
    private ``Comm``): each rank copies its own shard into its slice of the output and leaves the
    other slices as they were (weights a real gather put there before, so the arithmetic stays on
    ordinary values). Nothing is logged or dispatched."""
    from yashard.collectives import _Works

    comm = model.runtime.comm

    def all_gather(out, shard, unit, group=None):
        g = comm.shard_group if group is None else group
        c = shard.numel()
        own = out.narrow(0, dist.get_rank(g) * c, c)
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        return _Works([])  # (what a one-rank gather returns: nothing to wait for)

    comm.all_gather = all_gather


def setup_yashard(args, device, shape, *, noop: bool = False, reshard: bool = True, nocomm: bool = False,
                  share_outer: bool = False, loss_kw: dict | None = None) -> Engine:
    # (the HF loss, as the peers compute it, unless loss_kw asks for the fused one: fused_loss_memory.py)
    cfg = yashard.ShardConfig(param_dtype=DTYPES[args.dtype], reduce_dtype=torch.float32,
                              reshard_after_forward=reshard, on_nonfinite="ignore" if nocomm else "raise",
                              share_outer_slot=share_outer, **(loss_kw or {"loss": "hf"}))
    model = yashard.shard(build_model(shape, args.seed), config=cfg)
    noop = noop or nocomm
    if noop:
        from yashard import comm_hooks

        model.register_comm_hook(None, comm_hooks.noop_hook)
    opt = make_adamw(model.param_groups(weight_decay=WEIGHT_DECAY), args)
    if nocomm:  # after one real step, so every buffer holds gathered weights (see _local_weight_gathers)
        ids = torch.zeros(1, 8, dtype=torch.long, device=device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.zero_grad(set_to_none=True)
        _local_weight_gathers(model)
    name = ("yashard-nocomm" if nocomm else "yashard-noop" if noop else "yashard-shared" if share_outer
            else "yashard" if reshard else "yashard-noreshard")
    eng = _torch_engine(name, f"{args.dtype} compute, fp32 master + reduce", model, opt,
                        lambda: model.clip_grad_norm_(CLIP), args.accum,
                        no_sync=contextlib.nullcontext if reshard else model.no_sync)
    if nocomm:
        eng.notes.append("noop_hook and all-gathers that copy the own shard only: no weight or gradient communicated")
    elif noop:
        eng.notes.append("noop_hook: gradients not communicated")
    if not reshard:
        eng.notes.append("reshard_after_forward=False" + (", no_sync on all but the last micro-batch"
                                                          if args.accum > 1 else ""))
    plan = model.memory_plan()
    eng.extra["plan_bytes"], eng.extra["adamw_bytes"] = plan.total_bytes, plan.adamw_bytes
    return eng


def setup_fsdp2(args, device, shape, *, titan: bool = False) -> Engine:
    """FSDP2: ``fully_shard`` on each decoder layer, then on the root (which then holds the
    embedding, the final norm and the lm_head). ``titan``: wrapped as torchtitan wraps it
    (``torchtitan/distributed/fsdp.py:252-265``): the embedding alone, each layer, ``[norm,
    lm_head]`` one group with ``reshard_after_forward=False``, then the root, which owns nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if args.dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    model = build_model(shape, args.seed).to(device)
    if titan:
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp)
        fully_shard([model.model.norm, model.lm_head], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = make_adamw(split_params(model.parameters()), args)
    clip = lambda: _local_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))  # noqa: E731
    return _torch_engine("fsdp2", f"{args.dtype} compute, fp32 master + reduce", model, opt, clip, args.accum)


def setup_fsdp1(args, device, shape) -> Engine:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = build_model(shape, args.seed)
    layer_cls = type(model.model.layers[0])
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.dtype == "bf16" else None
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), mixed_precision=mp,
                 device_id=device, use_orig_params=True)
    opt = make_adamw(split_params(model.parameters()), args)
    return _torch_engine("fsdp1", f"{args.dtype} compute, fp32 master + reduce", model, opt,
                         lambda: model.clip_grad_norm_(CLIP), args.accum)


def _replicated_engine(name, args, device, model, reduce_note: str, **kw) -> Engine:
    """An engine over a whole-model copy (DDP, plain): fp32 weights, with bf16 through autocast."""
    opt = make_adamw(split_params(model.parameters()), args)
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # noqa: E731
    if args.dtype == "bf16":
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
        precision = "fp32 weights, autocast bf16" + reduce_note
    else:
        autocast, precision = contextlib.nullcontext, "fp32"
    return _torch_engine(name, precision, model, opt, clip, args.accum, autocast=autocast, **kw)


def setup_ddp(args, device, shape, *, noop: bool = False) -> Engine:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(shape, args.seed).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if noop:
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        model.register_comm_hook(None, noop_hook)
    eng = _replicated_engine("ddp-noop" if noop else "ddp", args, device, model, ", fp32 reduce",
                             no_sync=model.no_sync)
    if noop:
        eng.notes.append("noop_hook: gradients not communicated")
    if args.accum > 1:
        eng.notes.append("no_sync on all but the last micro-batch")
    return eng


def setup_plain(args, device, shape) -> Engine:
    """The unwrapped model trained on one process: what a data-parallel runtime costs at world 1."""
    world = dist.get_world_size()
    if world != 1:
        raise ValueError(f"the plain engine trains the unwrapped model on one process, but the world has {world} "
                         f"ranks: run it with torchrun --nproc_per_node 1")
    return _replicated_engine("plain", args, device, build_model(shape, args.seed).to(device), "")


def deepspeed_config(args, world: int) -> dict:
    """The DeepSpeed config of the ``deepspeed`` engine (ZeRO-3, same batch, clip and precision)."""
    cfg = {
        "train_batch_size": args.micro_batch * args.accum * world,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["communication_data_type"] = "fp32"
    return cfg


def setup_deepspeed(args, device, shape) -> Engine:
    import logging

    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    model = build_model(shape, args.seed)
    opt = make_adamw(split_params(model.parameters()), args)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=deepspeed_config(args, dist.get_world_size()))

    def micro(ids, last, sample):
        out = engine(input_ids=ids, labels=ids)
        sample()
        engine.backward(out.loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        engine.step()              # a no-op but at the accumulation boundary
        return out.loss.detach().float()

    def finish():
        return torch.tensor(float(engine.get_global_grad_norm()))

    precision = ("bf16 params + compute, fp32 master + reduce" if args.dtype == "bf16" else "fp32")
    eng = Engine("deepspeed", precision + f"; ZeRO-3 (deepspeed {deepspeed.__version__})", engine, micro, finish)
    eng.notes.append("stage-3 defaults: params < 1e5 elements stay unpartitioned")
    return eng


DEEPSPEED_NOT_COMPILED = "--compile: DeepSpeed ZeRO-3 compiles through engine.compile(), not set up here"


def compile_layers(eng: Engine) -> None:
    """``torch.compile`` (inductor) on every decoder layer of ``eng``'s model, the way torchtitan
    compiles FSDP2's blocks; each engine's hooks stay where they are (yashard's and FSDP2's run
    outside the graphs, DDP's and FSDP1's are outside the layers). DeepSpeed ZeRO-3 hooks every
    submodule and compiles through its own ``engine.compile()``, so it is refused here."""
    if eng.name == "deepspeed":
        raise ValueError(DEEPSPEED_NOT_COMPILED)
    import torch._dynamo

    # every engine compiles the same layer code in this one process, each with its own guards
    # (the limits' names before torch 2.7; later releases keep them as aliases)
    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(cfg.cache_size_limit, 64)
    cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 512)
    layers = [m for m in eng.model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(f"--compile: no decoder layer found in {eng.name}'s model")
    for layer in layers:
        layer.compile()
    eng.notes.append("decoder layers under torch.compile (inductor)")


SETUP = {
    "yashard": setup_yashard,
    "fsdp2": setup_fsdp2,
    "fsdp1": setup_fsdp1,
    "ddp": setup_ddp,
    "deepspeed": setup_deepspeed,
    "yashard-noop": lambda args, device, shape: setup_yashard(args, device, shape, noop=True),
    "ddp-noop": lambda args, device, shape: setup_ddp(args, device, shape, noop=True),
    "yashard-noreshard": lambda args, device, shape: setup_yashard(args, device, shape, reshard=False),
    "plain": setup_plain,
    "yashard-nocomm": lambda args, device, shape: setup_yashard(args, device, shape, nocomm=True),
}


def train_step(eng: Engine, args, device, shape: dict, vocab: int, mem: Memory) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of ``eng``; returns (this rank's mean loss, pre-clip global grad norm)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batch(eng.step, args.micro_batch * args.accum * world, shape["seq"], vocab)
    local = batch.chunk(world)[rank].to(device)
    loss = torch.zeros((), device=device)
    for i, ids in enumerate(local.chunk(args.accum)):
        loss += eng.micro(ids, i == args.accum - 1, mem.sample) / args.accum
        mem.sample()
    norm = eng.finish()
    mem.sample()
    eng.step += 1
    return loss, norm
