"""Per-rank bodies of the qwZ / qgZ multi-process tests (run through tests/harness.py on gloo).

Inputs are generated from (seed, rank) so the parent process can rebuild every rank's data.
Workspaces are ``torch.empty`` on purpose: nothing may depend on their initial content.
"""

from __future__ import annotations

import torch

from yashard.collectives import Comm
from yashard.zeropp import (QgzFallback, qgz_group_ranks, qgz_reduce_scatter, qgz_workspace_nbytes,
                            qwz_all_gather, qwz_workspace_nbytes)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard_data(seed: int, rank: int, numel: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
    return x.to(DTYPES[dtype])


def grad_data(seed: int, rank: int, world: int, chunk: int, dtype: str) -> torch.Tensor:
    """Every chunk of every rank independently random, so chunk sums are far apart from each other
    compared with the quantization error (placement is identifiable)."""
    return torch.cat([shard_data(seed * 100 + k, rank, chunk, dtype) for k in range(world)])


def run_qwz(rank: int, world: int, cases: list[dict]) -> list[dict]:
    comm = Comm(None)
    comm.log.enabled = True
    results = []
    for case in cases:
        s, bits, block = case["numel"], case["bits"], case["block"]
        shard = shard_data(case["seed"], rank, s, case["dtype"])
        out = torch.empty(world * s, dtype=shard.dtype)
        ws = torch.empty(qwz_workspace_nbytes(s, world, bits=bits, block=block), dtype=torch.uint8)
        comm.log.clear()
        qwz_all_gather(comm, out, shard, ws, bits=bits, block=block, unit="w")
        q_log = [tuple(r[:4]) for r in comm.log.records]
        comm.log.clear()
        plain = torch.empty(world * s, dtype=shard.dtype)
        comm.all_gather(plain, shard, "w").wait()
        results.append(dict(out=out, plain=plain, q_log=q_log, plain_log=[tuple(r[:4]) for r in comm.log.records]))
    return results


def make_groups(comm: Comm, world: int, ranks_per_node: list[int]) -> dict:
    """{L: (intra, inter)}: every rank creates every group, in the same order."""
    groups = {}
    for L in ranks_per_node:
        intra, inter = qgz_group_ranks(world, L)
        groups[L] = (comm.new_shard_subgroups(intra), comm.new_shard_subgroups(inter))
    return groups


def run_qgz(rank: int, world: int, cases: list[dict], errors: bool = False) -> dict:
    comm = Comm(None)
    comm.log.enabled = True
    groups = make_groups(comm, world, sorted({c["L"] for c in cases} | ({2} if errors else set())))
    results = []
    for case in cases:
        L, c, bits, block = case["L"], case["chunk"], case["bits"], case["block"]
        full = grad_data(case["seed"], rank, world, c, case["dtype"])
        out = torch.empty(c, dtype=DTYPES[case["out"]])
        ws = torch.empty(qgz_workspace_nbytes(full.numel(), world, bits=bits, block=block), dtype=torch.uint8)
        intra, inter = groups[L]
        if case.get("none_for_size_1"):
            intra = None if L == 1 else intra
            inter = None if L == world else inter
        comm.log.clear()
        qgz_reduce_scatter(comm, out, full, ws, intra_group=intra, inter_group=inter, bits=bits, block=block,
                           unit="g")
        q_log = [tuple(r[:4]) for r in comm.log.records]
        comm.log.clear()
        plain = torch.empty(c)
        comm.reduce_scatter(plain, full.float(), "g").wait()
        results.append(dict(out=out, plain=plain, q_log=q_log, plain_log=[tuple(r[:4]) for r in comm.log.records]))
    res = dict(results=results)
    if errors:
        res["errors"] = error_cases(comm, rank, world, groups)
    return res


def _message(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:  # QgzFallback is a ValueError
        return f"{type(e).__name__}: {e}"
    return "no error"


def error_cases(comm: Comm, rank: int, world: int, groups: dict) -> dict:
    """Each raises before any communication, on every rank alike (so catching it cannot hang).
    Needs the 2 x 2 groups (world 4)."""
    c = 256
    full = grad_data(0, rank, world, c, "fp32")
    out = torch.empty(c)
    ws = torch.empty(qgz_workspace_nbytes(world * c, world), dtype=torch.uint8)
    intra, inter = groups[2]
    msgs = {}
    msgs["swapped"] = _message(lambda: qgz_reduce_scatter(comm, out, full, ws, intra_group=inter, inter_group=intra))
    msgs["too_few"] = _message(lambda: qgz_reduce_scatter(comm, out, full, ws, intra_group=None, inter_group=None))
    msgs["sizes"] = _message(lambda: qgz_reduce_scatter(comm, out[:-1], full, ws, intra_group=intra,
                                                        inter_group=inter))
    msgs["workspace"] = _message(lambda: qgz_reduce_scatter(comm, out, full, ws[:100], intra_group=intra,
                                                            inter_group=inter))
    tiny_full, tiny_out = torch.randn(world * 4), torch.empty(4)
    try:  # the documented fallback pattern
        qgz_reduce_scatter(comm, tiny_out, tiny_full, ws, intra_group=intra, inter_group=inter)
        msgs["fallback"] = "no error"
    except QgzFallback as e:
        msgs["fallback"] = str(e)
        comm.reduce_scatter(tiny_out, tiny_full, "g").wait()
    msgs["fallback_out"] = tiny_out
    msgs["fallback_full"] = tiny_full
    msgs["qwz_out"] = _message(lambda: qwz_all_gather(comm, torch.empty(5), torch.randn(3), ws))
    return msgs
