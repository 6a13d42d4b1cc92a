"""User-written comm hooks driven through the bucket interface (tests/test_comm.py).

The hooks are module-level functions (picklable). :func:`run_hooked` runs the ordinary training
loop of :func:`workers.run_sharded` with one of them registered: for the duration of the run the
hook is made visible to the loop's hook lookup as ``yashard.comm_hooks.<name>_hook`` (in the rank
process only), so a scenario names it like a built-in: ``hook="recording"``, ``hook="torch_future"``,
or ``hook="qgz"`` with the recording qgZ wrapper in place of :func:`yashard.comm_hooks.qgz_hook`.
Every bucket a hook sees is appended to :data:`RECORDS` and returned with the run's results.

:func:`simulate_qgz_seeded` is ``quant_checks.simulate_qgz`` with one pair of stochastic-rounding
seeds per rank (the seeds ``qgz_hook`` derives), so a qgZ bucket can be checked bitwise.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from yashard import comm_hooks
from yashard import quant as Q

RECORDS: list[dict] = []


def recording_hook(state, bucket):
    """Delegates to the default hook and records what the bucket interface says."""
    RECORDS.append(dict(index=bucket.index, name=bucket.name, last=bucket.is_last(), slot=bucket.slot,
                        numel=bucket.buffer().numel(), shard_numel=bucket.shard_numel,
                        world=bucket.comm.shard_world))
    return comm_hooks.reduce_scatter_hook(state, bucket)


def torch_future_hook(state, bucket):
    """A reduce-scatter written with plain torch.distributed and a plain ``torch.futures.Future``:
    all-to-all of the buffer into a workspace (gloo's reduce_scatter_tensor work has no
    ``get_future``; its all_to_all_single has), then the sum of the received chunks in rank order,
    into ``bucket.output()``: the value of the chained future."""
    buf, out = bucket.buffer(), bucket.output()
    w, c = bucket.comm.shard_world, bucket.shard_numel
    recv = bucket.workspace("torch_future.recv", buf.numel(), buf.dtype)
    fut = dist.all_to_all_single(recv, buf, group=bucket.comm.shard_group, async_op=True).get_future()
    chained = fut.then(lambda f: torch.sum(recv.view(w, c), dim=0, out=out))
    RECORDS.append(dict(index=bucket.index, name=bucket.name,
                        future=isinstance(chained, torch._C.Future) and not isinstance(chained, comm_hooks.WorkFuture)))
    return chained


_qgz_hook = comm_hooks.qgz_hook


def recording_qgz_hook(state, bucket):
    """:func:`yashard.comm_hooks.qgz_hook`, recording the bucket's input, the value of the future
    it returned, and the fallbacks so far."""
    rec = dict(index=bucket.index, name=bucket.name, full=bucket.buffer().clone())
    RECORDS.append(rec)

    def keep(f):
        value = f.value()
        rec["out"] = value.clone()
        rec["fallbacks"] = dict(state.fallbacks)
        return value

    return _qgz_hook(state, bucket).then(keep)


HOOKS = {"recording": recording_hook, "torch_future": torch_future_hook}


@contextlib.contextmanager
def _hooks_visible():
    saved = {name: getattr(comm_hooks, f"{name}_hook", None) for name in HOOKS}
    for name, fn in HOOKS.items():
        setattr(comm_hooks, f"{name}_hook", fn)
    comm_hooks.qgz_hook = recording_qgz_hook
    try:
        yield
    finally:
        comm_hooks.qgz_hook = _qgz_hook
        for name, fn in saved.items():
            if fn is None:
                delattr(comm_hooks, f"{name}_hook")
            else:
                setattr(comm_hooks, f"{name}_hook", fn)


def run_hooked(rank: int, world: int, scenarios: list) -> list:
    """:func:`workers.run_many` with the hooks above available; each result gets ``buckets``."""
    from workers import run_sharded

    results = []
    for s in scenarios:
        RECORDS.clear()
        with _hooks_visible():
            res = run_sharded(rank, world, s)
        res["buckets"] = list(RECORDS)
        results.append(res)
    return results


def simulate_qgz_seeded(fulls, nodes, L, bits, block, seeds):
    """Every rank's qgZ output (fp32), in one process, as tests/quant_checks.py ``simulate_qgz``
    computes it (the library's quantize/dequantize steps, the two all-to-alls done by slicing), with
    rank ``g`` rounding step 1 with ``seeds[g][0]`` and step 3 with ``seeds[g][1]`` (None: nearest).
    Needs ``nodes > 1`` and ``L > 1``."""
    W = nodes * L
    c = fulls[0].numel() // W
    P = Q.packed_nbytes(c, bits, block)
    kw = dict(bits=bits, block=block, backend="torch")
    send = [torch.zeros(W * P, dtype=torch.uint8) for _ in range(W)]
    for g in range(W):
        Q.quantize_parts(fulls[g], send[g], nparts=W, transpose=(nodes, L), seed=seeds[g][0], **kw)
    seg = nodes * P
    # in-node all-to-all: local rank i of node n gets segment i of every member of its node
    recv = [torch.cat([send[(g // L) * L + l][(g % L) * seg:(g % L + 1) * seg] for l in range(L)]) for g in range(W)]
    send2 = [torch.zeros(seg, dtype=torch.uint8) for _ in range(W)]
    for g in range(W):
        Q.dequantize_parts(recv[g], nparts=nodes, numel=c, requant=send2[g], nreduce=L, reduce_stride=seg,
                           seed=seeds[g][1], **kw)
    outs = [torch.empty(c) for _ in range(W)]
    for g in range(W):  # cross-node all-to-all among equal local ranks: part n goes to node n
        n, i = divmod(g, L)
        recv2 = torch.cat([send2[k * L + i][n * P:(n + 1) * P] for k in range(nodes)])
        Q.dequantize_parts(recv2, nparts=1, numel=c, out=outs[g], nreduce=nodes, reduce_stride=P, **kw)
    return outs


def qgz_tensor_errors(rank: int, world: int, bits: int, block: int | None) -> dict:
    """One backward of a 3-layer tiny Llama at init through qgz_hook (2 ranks per node; ``block``
    None: QgzState's default) and through the exact default: each parameter's relative error."""
    import yashard
    from models import batches, build

    ids = batches(1, 2 * world, 16, 96)[0].chunk(world)[rank]
    grads = []
    for hook in (None, "qgz"):
        sm = yashard.shard(build(num_hidden_layers=3))
        if hook:
            sm.register_comm_hook(comm_hooks.QgzState(sm, ranks_per_node=2, bits=bits, block=block),
                                  comm_hooks.qgz_hook)
        sm(input_ids=ids, labels=ids).loss.backward()
        grads.append(sm.full_grads())
    exact, got = grads
    return {k: ((got[k] - exact[k]).norm() / exact[k].norm()).item() for k in exact if exact[k].norm() > 0}


def subgroup_grads(rank: int, world: int, modes: list[dict]) -> dict:
    """Sharding inside a data-parallel subgroup of a larger job: ranks {0, 2} and {1, 3} form the
    data-parallel groups (as if 0/1 and 2/3 were tensor-parallel peers), each with its own data.
    Every rank shards a model once per mode (a ShardConfig) and returns the full gradients of one
    backward each (its group's batch split by rank)."""
    import yashard
    from models import batches, build

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp = groups[rank % 2]
    out = {}
    ids = batches(1, 4, 8, 96, seed=1 + rank % 2)[0].chunk(2)[dist.get_group_rank(dp, rank)]
    for i, kw in enumerate(modes):
        sm = yashard.shard(build(), process_group=dp, config=yashard.ShardConfig(**kw))
        sm(input_ids=ids, labels=ids).loss.backward()
        out[i] = sm.full_grads()
    return out


def strided_sum_hook(state, bucket):
    """The exact SUM (the default hook's), handed back as a strided view."""
    fut = comm_hooks.reduce_scatter_hook(state, bucket)
    fut.wait()
    value = fut.value()
    pair = torch.stack([value, torch.zeros_like(value)], dim=1)  # every other element: stride 2
    return comm_hooks._done(pair[:, 0])


def bf16_sum_hook(state, bucket):
    """The exact SUM, rounded to bf16 (a value in another dtype than reduce_dtype)."""
    fut = comm_hooks.reduce_scatter_hook(state, bucket)
    fut.wait()
    return comm_hooks._done(fut.value().bfloat16())


def hybrid_hook_values(rank: int, world: int) -> dict:
    """Hybrid sharding (shard groups of one rank, replicas of ``world``): full gradients with the
    default hook, with a hook giving the same SUM strided, and with one giving it in bf16."""
    import yashard
    from models import batches, build

    ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
    out = {}
    for name, hook in (("default", None), ("strided", strided_sum_hook), ("bf16", bf16_sum_hook)):
        sm = yashard.shard(build(), config=yashard.ShardConfig(shard_group_size=1))
        if hook is not None:
            sm.register_comm_hook(None, hook)
        sm(input_ids=ids, labels=ids).loss.backward()
        out[name] = sm.full_grads()
    return out


def mismatched_hooks(rank: int, world: int, case: str) -> str:
    """Rank 0 registers another hook (or other QgzState settings) than the others: refused at
    registration on every rank, naming both."""
    import re

    import yashard
    from models import build

    sm = yashard.shard(build())
    if case == "hook":
        hook, state = (comm_hooks.bf16_compress_hook if rank == 0 else comm_hooks.reduce_scatter_hook), None
    else:
        hook, state = comm_hooks.qgz_hook, comm_hooks.QgzState(sm, 1, bits=8 if rank == 0 else 4)
    try:
        sm.register_comm_hook(state, hook)
    except ValueError as e:
        assert re.search(r"register_comm_hook: this rank \(rank \d\) registers hook yashard\.comm_hooks\.\w+ with "
                         r"state \w+ .*, rank \d hook .*every rank must register the same hook", str(e)), str(e)
        return "refused"
    return "accepted"


def stalled_future(rank: int, world: int) -> str:
    """A hook returning a plain torch.futures.Future that never completes on rank 0 (its peer stalls):
    the wait is bounded by collective_timeout like any other."""
    import time

    import yashard
    from models import build
    from yashard.collectives import CollectiveError

    def never(state, bucket):
        return torch.futures.Future()  # never set

    sm = yashard.shard(build(), config=yashard.ShardConfig(collective_timeout=2.0))
    sm.register_comm_hook(None, never)
    ids = torch.randint(0, 96, (2, 8))
    t0 = time.monotonic()
    try:
        sm(input_ids=ids, labels=ids).loss.backward()
    except CollectiveError as e:
        assert "not done within 2.0s" in str(e), str(e)
        return f"raised after {time.monotonic() - t0:.1f}s"
    return "returned"


def qgz_resume(rank: int, world: int, root: str, order: str = "register_then_load"):
    """qgZ int4 (stochastic rounding): 4 steps straight, against 2 steps, save_checkpoint, a fresh
    model, hook state and optimizer, load_checkpoint, 2 steps. ``order`` is when the resumed run
    registers its hook: before the load, after it, never, or a stateless hook (bf16 compression)
    after it. Returns whether the two runs end with bitwise equal parameters (the checkpoint carries
    QgzState's rounding position), the resumed state's position before its first step, and what
    yashard warned on rank 0."""
    import logging

    import yashard
    from models import batches, build

    data = batches(4, 2 * world, 8, 96)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("yashard").addHandler(handler)

    def fresh(register: bool = True):
        sm = yashard.shard(build())
        state = comm_hooks.QgzState(sm, 1, bits=4)
        if register:
            sm.register_comm_hook(state, comm_hooks.qgz_hook)
        return sm, state, torch.optim.AdamW(sm.parameters(), lr=1e-2)

    def steps(sm, opt, lo, hi):
        for ids in data[lo:hi]:
            ids = ids.chunk(world)[rank]
            sm(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    sm, _, opt = fresh()
    steps(sm, opt, 0, 2)
    yashard.save_checkpoint(root, sm, opt)
    steps(sm, opt, 2, 4)
    straight = sm.full_state_dict()
    sm, state, opt = fresh(register=order == "register_then_load")
    seen.clear()
    yashard.load_checkpoint(root, sm, opt)
    if order == "load_then_register":
        sm.register_comm_hook(state, comm_hooks.qgz_hook)
    elif order == "stateless_hook":
        sm.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    position = state.calls
    steps(sm, opt, 2, 4)
    resumed = sm.full_state_dict()
    logging.getLogger("yashard").removeHandler(handler)
    return all(torch.equal(straight[k], resumed[k]) for k in straight), position, seen


def layers_bf16_hook(state, bucket):
    """bf16 compression for decoder layers, the exact default for the rest: two dtypes of scratch."""
    hook = comm_hooks.bf16_compress_hook if bucket.name.startswith("layer_") else comm_hooks.reduce_scatter_hook
    return hook(state, bucket)


def _steps(sm, opt, rank: int, world: int, *, first: int, count: int) -> None:
    """Training steps ``first .. first + count - 1`` of a 2-sequences-per-rank run."""
    from models import batches

    for ids in batches(first + count, 2 * world, 8, 96)[first:]:
        ids = ids.chunk(world)[rank]
        sm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def mixed_hook_buffers(rank: int, world: int) -> list:
    """Data pointers of every buffer the runtime holds after each of 3 steps with a hook that mixes the
    default hook's fp32 scratch with bf16 compression (gloo at 3 ranks needs reduce-scatter scratch)."""
    import yashard
    from models import build

    sm = yashard.shard(build())
    sm.register_comm_hook(None, layers_bf16_hook)
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    seen = []
    for step in range(3):
        _steps(sm, opt, rank, world, first=step, count=1)
        held = sm.runtime.allocated_tensors()
        seen.append(({k: t.data_ptr() for k, t in held.items()},
                     sm.memory_plan().total_bytes == sum(t.numel() * t.element_size() for t in held.values())))
    return seen


def _underplanned_hook(state, bucket):
    """The default hook, plus a scratch buffer its (empty) workspace_plan does not mention."""
    bucket.workspace("unplanned", 8, torch.float32).zero_()
    return comm_hooks.reduce_scatter_hook(state, bucket)


_underplanned_hook.workspace_plan = lambda state, comm, numel, dtype: []


def planned_hook_memory(rank: int, world: int) -> dict:
    """Per hook: the memory plan's total right after ``register_comm_hook``, after two training
    steps, and the bytes the runtime then holds; the names of its rows; what was logged."""
    import logging

    import yashard
    from models import build

    class Grab(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    said: list[str] = []
    handler = Grab(level=logging.WARNING)
    logging.getLogger("yashard").addHandler(handler)
    hooks = {"default": None, "bf16_compress": comm_hooks.bf16_compress_hook,
             "fp16_compress": comm_hooks.fp16_compress_hook, "noop": comm_hooks.noop_hook,
             "qgz": comm_hooks.qgz_hook, "no_plan": layers_bf16_hook, "underplanned": _underplanned_hook}
    out = {}
    for name, hook in hooks.items():
        said.clear()
        sm = yashard.shard(build(hidden_size=64, intermediate_size=256))
        if hook is not None:
            state = comm_hooks.QgzState(sm, ranks_per_node=1, block=64) if name == "qgz" else None
            sm.register_comm_hook(state, hook)
        before = sm.memory_plan()
        _steps(sm, torch.optim.AdamW(sm.parameters(), lr=1e-3), rank, world, first=0, count=2)
        held = sm.runtime.allocated_tensors()
        out[name] = dict(before=before.total_bytes, after=sm.memory_plan().total_bytes,
                         held=sum(t.numel() * t.element_size() for t in held.values()),
                         rows=[r.name for r in before.rows], warnings=list(said))
    logging.getLogger("yashard").removeHandler(handler)
    return out


def groups_before_shard(rank: int, world: int) -> dict:
    """Process groups created before ``shard()`` that not every rank belongs to. Over the whole world
    (a ``new_group([0, 1])`` every rank called, as torch requires): hybrid sharding builds its groups
    and trains (it hung until the timeout when the members named their groups by their own group
    counts). Then over data-parallel subgroups ({0, 2}, {1, 3}), whose ranks now belong to different
    numbers of groups: refused at once, naming the counts, instead of hanging."""
    import yashard
    from models import batches, build

    dist.new_group([0, 1])
    sm = yashard.shard(build(), config=yashard.ShardConfig(shard_group_size=2))
    ids = batches(1, 4, 8, 96, seed=1)[0].chunk(world)[rank]
    sm(input_ids=ids, labels=ids).loss.backward()
    out = {"grads": sm.full_grads()}
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    try:
        yashard.shard(build(), process_group=dp, config=yashard.ShardConfig(shard_group_size=1))
        out["subgroups"] = None
    except RuntimeError as e:
        out["subgroups"] = str(e)
    return out


def shard_warnings(rank: int, world: int, config: dict) -> list[str]:
    """What ``yashard.shard`` with ``ShardConfig(**config)`` warns about on this rank."""
    import logging

    import yashard
    from models import build

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("yashard").addHandler(handler)
    try:
        yashard.shard(build(), config=yashard.ShardConfig(**config))
    finally:
        logging.getLogger("yashard").removeHandler(handler)
    return seen
