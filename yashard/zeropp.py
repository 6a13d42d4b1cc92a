"""ZeRO++ quantized communication primitives: qwZ (quantized weight all-gather) and qgZ (quantized
gradient reduce-scatter by hierarchical all-to-all). Quantization format: :mod:`yashard.quant`.

Both functions take every buffer they use (output, byte workspace) as arguments; the ``*_nbytes``
helpers say how large the workspace must be. On CUDA the quantization kernels and the collectives
run on the current stream (``work.wait()`` orders the stream, the host does not block); on CPU
(gloo, torch fallback) the host blocks between steps. All collectives go through
:class:`yashard.collectives.Comm` (logged: ``all_gather`` / ``all_to_all`` with the bytes sent).

qwZ
---
Each rank quantizes its param-dtype shard into its slot of a byte workspace (codes and scales packed
in one part, so ONE all-gather moves everything), gathers the workspace in place, and dequantizes
every rank's part into the flat output in rank order. Bytes on the wire per rank: one packed part,
``packed_nbytes(shard_numel)`` = ``shard_numel`` (int8) or ``ceil(shard_numel / 2)`` (int4) + 4 bytes
per block, each rounded up to 16; i.e. ~1/2 (bf16) or ~1/4 (fp32) of the plain gather for int8.

qgZ
---
The shard group of ``W = nodes * L`` ranks (``L`` ranks per node, node ``n`` holds shard ranks
``n*L .. n*L + L - 1``) replaces ``reduce_scatter(out, full, SUM)`` (rank ``g`` ends with chunk ``g``
of ``c = full.numel() / W`` elements) by:

1. quantize ``full`` per chunk into ``W`` packed parts, reordered so that part ``i * nodes + j`` holds
   chunk ``j * L + i`` (:func:`qgz_slice_order`, the paper's tensor-slice reordering);
2. all-to-all inside the node: local rank ``i`` receives parts ``i*nodes .. i*nodes + nodes - 1`` from
   every rank of its node;
3. dequantize, sum the ``L`` copies in fp32 and quantize again (one fused kernel): ``nodes`` parts, part
   ``j`` = the node's partial sum of chunk ``j * L + i``;
4. all-to-all across nodes among ranks with the same local rank: part ``j`` goes to node ``j``;
5. dequantize and sum the ``nodes`` copies in fp32 into ``out``: chunk ``g = node * L + i``, exactly the
   plain reduce-scatter placement. One node skips steps 3-4 (step 5 sums the ``L`` intra copies); one
   rank per node skips steps 2-3.

Error bound (tested): for every element of ``out``,
``|out - exact_sum| <= sum_r s1_r / 2 + sum_k s2_k / 2 + 2**-20 * (sum_r A1_r + sum_k A2_k) + 2**-130``
(+ the rounding of ``out.dtype`` when it is not fp32), where ``s1_r = A1_r / qmax`` is rank ``r``'s
block scale of that element in step 1 and ``s2_k = A2_k / qmax`` node ``k``'s block scale in step 3
(``A`` the block absmax); the ``2**-20`` term covers fp32 rounding in the quantizers and the sums.
With stochastic rounding (``seed=``) a step's error is below ``s`` instead of ``s / 2`` (the
single-quantization bound is tested in tests/test_quant.py), and unbiased.
"""

from __future__ import annotations

import torch

from .collectives import Comm
from .quant import (FLOAT_DTYPES, check_format, dequantize_parts, mix_seed, packed_layout, quantize_parts,
                    transpose_order, check_bytes, check_float, qwz_workspace_nbytes)  # (the last: sized here)


class QgzFallback(ValueError):
    """Raised by :func:`qgz_reduce_scatter` when qgZ does not apply (the message says why, see
    :func:`qgz_fallback_reason`); the caller should use the plain reduce-scatter instead. Raised
    before any communication, identically on every rank (it depends on sizes only)."""


# ------------------------------------------------------------------------------------------ qwZ


def qwz_all_gather(comm: Comm, out: torch.Tensor, shard: torch.Tensor, workspace: torch.Tensor, *,
                   bits: int = 8, block: int = 4096, group=None, unit: str = "qwz",
                   backend: str = "auto") -> None:
    """Quantized all-gather: ``out[r*s:(r+1)*s] = dequant(quant(shard of rank r))`` for every rank ``r``
    of ``group`` (``None``: the shard group), ``s = shard.numel()``.

    ``shard``: contiguous 1-D fp32/bf16/fp16 (the param-dtype copy; the master is never quantized).
    ``out``: contiguous 1-D fp32/bf16/fp16 of ``world * s`` elements (may contain ``shard`` as this
    rank's slot). ``workspace``: contiguous uint8, at least ``qwz_workspace_nbytes(s, world, bits=,
    block=)`` bytes; this rank's part is quantized into its slot and the workspace is gathered in
    place (one collective). Every rank must pass the same ``s``, ``bits``, ``block``."""
    rank, world = comm.group_rank_size(group)
    check_float("shard", shard)
    s = shard.numel()
    check_float("out", out, world * s)
    lay = packed_layout(s, bits, block)
    check_bytes("workspace", workspace, world * lay.nbytes)
    ws = workspace[: world * lay.nbytes]
    mine = ws[rank * lay.nbytes:(rank + 1) * lay.nbytes]
    quantize_parts(shard, mine, nparts=1, bits=bits, block=block, backend=backend)
    comm.wait(comm.all_gather(ws, mine, unit, group), f"all_gather of {unit} (qwZ)")
    dequantize_parts(ws, nparts=world, numel=s, out=out, bits=bits, block=block, backend=backend)


# ------------------------------------------------------------------------------------------ qgZ


def qgz_group_ranks(world: int, ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(intra, inter)`` rank lists (shard-group ranks) for ``world = nodes * ranks_per_node``:
    ``intra[n]`` = the ranks of node ``n`` (``n*L .. n*L + L - 1``), ``inter[i]`` = the ranks with local
    rank ``i`` (``i, L + i, 2L + i, ...``). Create them with ``comm.new_shard_subgroups(intra)`` then
    ``comm.new_shard_subgroups(inter)`` on every rank."""
    if world < 1 or ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"world ({world}) must be a positive multiple of ranks_per_node ({ranks_per_node})")
    L, nodes = ranks_per_node, world // ranks_per_node
    return ([[n * L + i for i in range(L)] for n in range(nodes)],
            [[n * L + i for n in range(nodes)] for i in range(L)])


def qgz_slice_order(nodes: int, ranks_per_node: int) -> list[int]:
    """Tensor-slice reordering before the intra-node all-to-all: ``order[p]`` is the chunk that slot
    ``p`` of the send buffer holds. With ``X = ranks_per_node``, ``Y = nodes``:
    ``[0, X, 2X, .., (Y-1)X, 1, X+1, .., YX-1]`` (slot ``i*Y + j`` holds chunk ``j*X + i``), so that
    local rank ``i`` receives the chunks ``i, X+i, ..`` it forwards to nodes ``0, 1, ..``."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes and ranks_per_node must be >= 1, got {nodes}, {ranks_per_node}")
    return transpose_order(nodes, ranks_per_node)


def qgz_fallback_reason(numel: int, world: int, ranks_per_node: int, *, dtype: torch.dtype,
                        bits: int = 4, block: int = 4096) -> str | None:
    """``None`` when qgZ applies to a reduce-scatter of ``numel`` elements of ``dtype`` over ``world``
    ranks, else why not (then use the plain reduce-scatter). Pure. qgZ applies exactly when:
    ``world > 1``, ``dtype`` is fp32/bf16/fp16, and one quantized chunk (``packed_nbytes(numel // world)``:
    codes + scales + 16-byte padding) is smaller than the chunk itself (``numel // world * itemsize``).
    Chunks need not be multiples of the block (blocks never straddle chunks; the last one is partial)
    nor of anything else. Raises ValueError for inputs no reduce-scatter accepts (``numel`` not a
    multiple of ``world``, ``world`` not a multiple of ``ranks_per_node``, bad bits/block)."""
    check_format(bits, block)
    qgz_group_ranks(world, ranks_per_node)
    if numel < 0 or numel % world:
        raise ValueError(f"reduce-scatter of {numel} elements over {world} ranks: numel must be a "
                         f"non-negative multiple of the world size (pad the flat buffer)")
    if world == 1:
        return "a single rank has nothing to reduce"
    if dtype not in FLOAT_DTYPES:
        return f"gradient dtype {dtype} is not float32/bfloat16/float16"
    c = numel // world
    packed, plain = packed_layout(c, bits, block).nbytes, c * torch.empty((), dtype=dtype).element_size()
    if packed >= plain:
        return (f"a quantized chunk of {c} elements takes {packed} bytes (codes, scales, padding), "
                f"not less than the {plain} bytes of the {dtype} chunk")
    return None


def qgz_workspace_nbytes(numel: int, world: int, *, bits: int = 4, block: int = 4096) -> int:
    """Bytes of the qgZ workspace: a send and a receive buffer of ``world`` packed parts of
    ``numel // world`` elements each (the inter-node hop reuses their first ``nodes`` parts)."""
    if world < 1 or numel % world:
        raise ValueError(f"numel ({numel}) must be a multiple of world ({world})")
    return 2 * world * packed_layout(numel // world, bits, block).nbytes


def _coords(comm: Comm, group) -> tuple[int, int, list[int]]:
    if group is None:
        return 0, 1, [comm.shard_rank]
    rank, size = comm.group_rank_size(group)
    return rank, size, comm.group_members(group)


def qgz_reduce_scatter(comm: Comm, out: torch.Tensor, full: torch.Tensor, workspace: torch.Tensor, *,
                       intra_group, inter_group, bits: int = 4, block: int = 4096, unit: str = "qgz",
                       seed: int | None = None, backend: str = "auto") -> None:
    """Quantized reduce-scatter with SUM semantics and the plain placement: ``out`` = chunk ``g`` (this
    rank's shard rank) of the sum over the shard group of every rank's ``full`` (module doc, steps 1-5).

    ``full``: contiguous 1-D fp32/bf16/fp16 gradient, ``W * out.numel()`` elements; not modified.
    ``out``: contiguous 1-D float (any of the three; the sum is fp32 until the final cast).
    ``workspace``: contiguous uint8, at least ``qgz_workspace_nbytes(full.numel(), W, bits=, block=)``.
    ``intra_group`` / ``inter_group``: this rank's groups from :func:`qgz_group_ranks` (``None`` for a
    size-1 group: one rank per node, or one node). Together they must tile the shard group exactly as
    ``qgz_group_ranks(W, L)`` says, else ValueError (raised before any communication).
    ``seed``: None rounds to nearest; an int rounds both quantizations (steps 1 and 3) stochastically,
    with seeds derived from it (give every rank and every call its own, see :func:`yashard.quant.mix_seed`).
    Raises :class:`QgzFallback` (before any communication, on every rank alike) when
    :func:`qgz_fallback_reason` gives a reason: call the plain reduce-scatter then."""
    _, L, intra = _coords(comm, intra_group)
    _, nodes, inter = _coords(comm, inter_group)
    W = nodes * L
    if W != comm.shard_world:
        raise ValueError(f"intra_group ({L} ranks) x inter_group ({nodes} ranks) tile {W} ranks but the shard "
                         f"group has {comm.shard_world}; build the groups from qgz_group_ranks(world, "
                         f"ranks_per_node) with comm.new_shard_subgroups")
    want_intra, want_inter = qgz_group_ranks(W, L)
    node, local = divmod(comm.shard_rank, L)
    if intra != want_intra[node] or inter != want_inter[local]:
        raise ValueError(f"shard rank {comm.shard_rank} got intra_group ranks {intra} and inter_group ranks "
                         f"{inter}, but qgz_group_ranks({W}, {L}) gives it {want_intra[node]} and "
                         f"{want_inter[local]}; pass this rank's groups from comm.new_shard_subgroups(intra) / "
                         f"comm.new_shard_subgroups(inter)")
    check_float("full", full)
    check_float("out", out)
    if full.numel() != W * out.numel():
        raise ValueError(f"full has {full.numel()} elements and out {out.numel()}: full must hold "
                         f"world ({W}) x out.numel() elements")
    reason = qgz_fallback_reason(full.numel(), W, L, dtype=full.dtype, bits=bits, block=block)
    if reason is not None:
        raise QgzFallback(f"qgZ does not apply: {reason}; use the plain reduce-scatter")
    c = out.numel()
    P = packed_layout(c, bits, block).nbytes
    check_bytes("workspace", workspace, 2 * W * P)
    send, recv = workspace[: W * P], workspace[W * P: 2 * W * P]
    kw = dict(bits=bits, block=block, backend=backend)
    seeds = (None, None) if seed is None else (mix_seed(seed, 1), mix_seed(seed, 3))
    quantize_parts(full, send, nparts=W, transpose=(nodes, L), seed=seeds[0], **kw)  # step 1
    if L > 1:
        comm.wait(comm.all_to_all(recv, send, f"{unit}/intra", intra_group), f"all_to_all of {unit} (qgZ, in-node)")  # 2
        if nodes == 1:
            dequantize_parts(recv, nparts=1, numel=c, out=out, nreduce=L, reduce_stride=P, **kw)
            return
        # step 3: recv holds L segments (one per local source) of `nodes` parts; sum them, requantize.
        dequantize_parts(recv, nparts=nodes, numel=c, requant=send[: nodes * P], nreduce=L,
                         reduce_stride=nodes * P, seed=seeds[1], **kw)
    comm.wait(comm.all_to_all(recv[: nodes * P], send[: nodes * P], f"{unit}/inter", inter_group),
              f"all_to_all of {unit} (qgZ, across nodes)")  # step 4
    dequantize_parts(recv[: nodes * P], nparts=1, numel=c, out=out, nreduce=nodes, reduce_stride=P, **kw)  # 5
