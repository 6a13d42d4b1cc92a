"""Training loops shared by the multi-process tests: a sharded run and its single-process reference.

A *scenario* is a dict; every key has a default in :data:`DEFAULTS`. The sharded run and the
reference see the same initial weights (same seed) and the same global batch per step: rank r takes
rows ``[r * B/W, (r + 1) * B/W)`` of the global batch and splits them into ``accum`` micro-batches.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import yashard
from models import batches, build

DEFAULTS = dict(
    family="llama", overrides={}, steps=10, micro=2, accum=1, seq=16, lr=1e-3, wd=0.1, clip=1.0,
    dtype="fp32", ckpt=0, grads_every_step=False, unused=None, zero_grad_none=True, seed=0,
    shard_kw={}, hook=None, hook_kw={}, log_step=None, reduce_dtype="fp32", data_cycle=None, text=False,
    mesh=None,  # rows of ranks: a 2-D (replicate, shard) DeviceMesh; one row: a 1-D mesh
    no_sync=False,  # every micro-batch but the last runs forward and backward inside sm.no_sync()
    no_grad_step=False,  # the optimizer steps under torch.no_grad() (its post-hook gathers there)
    # (what, backend): torch.compile "layers" (module.compile; "layers-fullgraph": with fullgraph=True),
    # "forwards" (each layer's forward function, fullgraph=True) or "model" (the ShardedModel)
    compile=None,
    freeze=(),  # parameters whose names contain one of these are frozen (requires_grad=False) before sharding
    # (elements of a reduction chunk over all ranks, at least per rank): layout.REDUCE_CHUNK_NUMEL and
    # REDUCE_CHUNK_MIN_PER_RANK while shard() runs, so that a tiny model's param_dtype gradient slots
    # are reduced in several chunks
    reduce_chunk=None,
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _register_hook(sm, name: str, kw: dict) -> None:
    from yashard import comm_hooks

    if name == "qgz":
        sm.register_comm_hook(comm_hooks.QgzState(sm, **kw), comm_hooks.qgz_hook)
    else:
        sm.register_comm_hook(None, getattr(comm_hooks, f"{name}_hook"))


@contextlib.contextmanager
def _reduce_chunk(sizes):
    """``layout.REDUCE_CHUNK_NUMEL`` and ``REDUCE_CHUNK_MIN_PER_RANK`` set to ``sizes`` (None: as they are)."""
    from yashard import layout

    if sizes is None:
        yield
        return
    old = layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK
    layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK = sizes
    try:
        yield
    finally:
        layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK = old


def scenario(**kw) -> dict:
    bad = set(kw) - set(DEFAULTS)
    if bad:
        raise KeyError(f"unknown scenario keys {bad}")
    return {**DEFAULTS, **kw}


def _make_unused(model, layer: int):
    """Make ``mlp.up_proj`` of one layer get no gradient: its MLP skips it."""
    mlp = model.model.layers[layer].mlp

    def forward(x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)))

    mlp.forward = forward


def _text_batches(steps: int, global_batch: int, seq: int, seed: int = 1) -> list:
    """Random windows of real text (the bytes of a standard-library module): learnable, never
    memorised to zero loss in a few hundred steps. Needs ``vocab_size >= 256``."""
    import inspect

    data = torch.tensor(list(open(inspect.__file__, "rb").read()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq, (global_batch,), generator=g)
        out.append(data[starts[:, None] + torch.arange(seq)])
    return out


def _data(s, global_batch: int, vocab: int) -> list:
    """The global batch of every step; with ``data_cycle`` the same few batches repeat (learnable)."""
    if s["text"]:
        return _text_batches(s["steps"], global_batch, s["seq"])
    n = s["data_cycle"] or s["steps"]
    data = batches(n, global_batch, s["seq"], vocab)
    return [data[i % n] for i in range(s["steps"])]


def _model(s):
    model = build(s["family"], seed=s["seed"], **s["overrides"])
    if s["unused"] is not None:
        _make_unused(model, s["unused"])
    for name, p in model.named_parameters():
        if any(f in name for f in s["freeze"]):
            p.requires_grad_(False)
    return model


def _recording_backend(backend: str, traced: dict):
    """A Dynamo backend that runs ``backend`` and, per captured graph, counts it in
    ``traced["graphs"]`` and adds the yashard functions its nodes were traced in ("file.py:function")
    to ``traced["yashard_code"]``."""
    import os

    from torch._dynamo.backends.registry import lookup_backend

    pkg = os.path.dirname(yashard.__file__) + os.sep

    def recording(gm, example_inputs):
        traced["graphs"] += 1
        for node in gm.graph.nodes:
            for line in (node.meta.get("stack_trace") or "").splitlines():
                if pkg in line:  # 'File "<pkg>/runtime.py", line 12, in _enter' -> "runtime.py:_enter"
                    where = line.split('"')[1].removeprefix(pkg) + ":" + line.rsplit(" in ", 1)[-1].strip()
                    traced["yashard_code"].add(where)
        return lookup_backend(backend)(gm, example_inputs)

    return recording


def _compile(sm, how) -> tuple:
    """``sm``'s forward under ``torch.compile`` as the scenario says, and the dict
    :func:`_recording_backend` fills as it compiles."""
    if how is None:
        return sm, {}
    what, backend = how
    torch._dynamo.reset()  # (graphs of earlier scenarios in this process)
    traced = {"graphs": 0, "yashard_code": set()}
    recording = _recording_backend(backend, traced)

    if what == "model":
        return torch.compile(sm, backend=recording), traced
    for layer in sm.model.layers:
        if what.startswith("layers"):
            layer.compile(backend=recording, fullgraph=what == "layers-fullgraph")
        else:
            layer.forward = torch.compile(layer.forward, backend=recording, fullgraph=True)
    return sm, traced


def run_sharded(rank: int, world: int, s: dict) -> dict:
    model = _model(s)
    vocab = model.config.vocab_size
    cfg = yashard.ShardConfig(param_dtype=DTYPES[s["dtype"]], reduce_dtype=DTYPES[s["reduce_dtype"]],
                              checkpoint_layers=s["ckpt"], **s["shard_kw"])
    mesh = None
    if s["mesh"] is not None:
        from torch.distributed.device_mesh import DeviceMesh

        rows = torch.tensor(s["mesh"])
        mesh = (DeviceMesh("cpu", rows[0], mesh_dim_names=("shard",)) if len(rows) == 1
                else DeviceMesh("cpu", rows, mesh_dim_names=("replicate", "shard")))
    with _reduce_chunk(s["reduce_chunk"]):
        sm = yashard.shard(model, config=cfg, mesh=mesh)
    if s["hook"] is not None:
        _register_hook(sm, s["hook"], s["hook_kw"])
    fwd, traced = _compile(sm, s["compile"])
    comm = sm.runtime.comm
    groups = {k: dist.get_process_group_ranks(g) if g is not None else None
              for k, g in (("shard", comm.shard_group), ("replica", comm.replica_group),
                           ("secondary", comm.secondary_group))}
    log, logged = sm.collective_log(), []
    opt = torch.optim.AdamW(sm.param_groups(s["wd"]), lr=s["lr"])
    global_batch = s["micro"] * s["accum"] * world
    losses, norms, grads, ptrs = [], [], [], []
    for step, batch in enumerate(_data(s, global_batch, vocab)):
        local = batch.chunk(world)[rank]
        step_loss = torch.zeros(())
        log.enabled = step == s["log_step"]
        micros = local.chunk(s["accum"])
        for i, micro in enumerate(micros):
            with sm.no_sync() if s["no_sync"] and i < len(micros) - 1 else contextlib.nullcontext():
                out = fwd(input_ids=micro, labels=micro)
                logged.extend(("fwd", *r) for r in log.records)
                log.clear()
                (out.loss / s["accum"]).backward()
            logged.extend(("bwd", *r) for r in log.records)
            log.clear()
            step_loss += out.loss.detach().float() / s["accum"]
        log.enabled = False
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
        if s["grads_every_step"] or step == 0:
            grads.append({k: v.clone() for k, v in sm.full_grads().items()})
        norms.append(sm.clip_grad_norm_(s["clip"]).item())
        log.enabled = step + 1 == s["log_step"]  # the step's post-hook gathers for the logged step
        with torch.no_grad() if s["no_grad_step"] else contextlib.nullcontext():
            opt.step()
        logged.extend(("pre", *r) for r in log.records)
        log.clear()
        log.enabled = False
        opt.zero_grad(set_to_none=s["zero_grad_none"])
        ptrs.append({k: t.data_ptr() for k, t in sm.runtime.allocated_tensors().items()})
    params = sm.full_state_dict()
    return dict(losses=losses, norms=norms, grads=grads, params=params, ptrs=ptrs, log=logged, groups=groups,
                traced={k: sorted(v) if isinstance(v, set) else v for k, v in traced.items()},
                plan=sm.memory_plan().total_bytes,
                allocated=sum(t.numel() * t.element_size() for t in sm.runtime.allocated_tensors().values()))


def run_reference(s: dict) -> dict:
    """The same training on one process, unsharded, full global batch per step, fp32."""
    model = _model(s)
    vocab = model.config.vocab_size
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s["wd"]}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=s["lr"])
    world = s.get("world", 1)
    losses, norms, grads = [], [], []
    for step, batch in enumerate(_data(s, s["micro"] * s["accum"] * world, vocab)):
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        losses.append(out.loss.item())
        if s["grads_every_step"] or step == 0:
            grads.append({k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                          for k, p in model.named_parameters(remove_duplicate=False)})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip"]).item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, norms=norms, grads=grads,
                params={k: p.detach().clone() for k, p in model.named_parameters(remove_duplicate=False)})


def run_many(rank: int, world: int, scenarios: list) -> list:
    return [run_sharded(rank, world, s) for s in scenarios]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / max(||b||, tiny)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_rel_err(a: dict, b: dict) -> tuple[float, str]:
    assert set(a) == set(b), f"names differ: {sorted(set(a) ^ set(b))}"
    worst = max(((rel_err(a[k], b[k]), k) for k in b if b[k].norm() > 0), default=(0.0, ""))
    return worst


def loss_rel_err(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def run_compiled_optimizer_step(rank: int, world: int, compiled: bool) -> dict:
    """bf16 compute, fused AdamW, its ``step`` under ``torch.compile`` (aot_eager) or not: losses,
    final masters, and the yashard functions the step's graphs were traced in."""
    torch._dynamo.reset()
    sm = yashard.shard(build("llama"), config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3, fused=True)
    traced = {"graphs": 0, "yashard_code": set()}
    step = torch.compile(opt.step, backend=_recording_backend("aot_eager", traced)) if compiled else opt.step
    losses = []
    for x in batches(4, 2 * world, 16, 96):
        x = x.chunk(world)[rank]
        out = sm(input_ids=x, labels=x)
        out.loss.backward()
        losses.append(out.loss.item())
        sm.clip_grad_norm_(1.0)
        step()
        opt.zero_grad(set_to_none=True)
    return dict(losses=losses, params=sm.full_state_dict(), traced=sorted(traced["yashard_code"]))


def run_no_gradient_warning(rank: int, world: int, unused_on: str, optimizers: int = 1,
                            state_dict_first: bool = False) -> list[str]:
    """Three AdamW steps with layer 1's ``up_proj`` left out of the MLP on every rank
    (``unused_on="every"``), on rank 0 only (``"one"``: the rank that logs) or nowhere (``"none"``),
    by one optimizer or by two (one per param group, stepped one after the other), optionally with
    ``sharded_optim_state_dict`` called on the fresh optimizer first (its zero-gradient step creates
    the state); rank 0's warnings that name a parameter without a gradient."""
    import logging

    model = build("llama", seed=0)
    if unused_on == "every" or (unused_on == "one" and rank == 0):
        _make_unused(model, 1)
    sm = yashard.shard(model)
    groups = sm.param_groups(0.1)
    opts = [torch.optim.AdamW(groups, lr=1e-3)] if optimizers == 1 else [torch.optim.AdamW([g], lr=1e-3) for g in groups]
    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logging.getLogger("yashard").addHandler(handler)
    try:
        if state_dict_first:
            for opt in opts:
                sm.sharded_optim_state_dict(opt)
        for batch in batches(3, 2 * world, 16, model.config.vocab_size):
            micro = batch.chunk(world)[rank]
            sm(input_ids=micro, labels=micro).loss.backward()
            for opt in opts:
                opt.step()
            for opt in opts:
                opt.zero_grad()
    finally:
        logging.getLogger("yashard").removeHandler(handler)
    return [r.getMessage() for r in records if "got no gradient" in r.getMessage()]
