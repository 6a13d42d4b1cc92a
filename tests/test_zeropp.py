"""qwZ and qgZ (yashard/zeropp.py): pure helpers, and multi-process runs on gloo.

qwZ (W = 2, 3): the gathered output is bitwise the per-shard quantize/dequantize of the exact gather;
one all-gather moves codes + scales, ~1/2 (bf16) or ~1/4 (fp32) of the plain gather's bytes for int8.
qgZ (4 ranks as 2 nodes x 2, 2 ranks as 1 x 2 and 2 x 1): bitwise equal to a one-process simulation,
within the documented error bound of the exact SUM, placement identical to the plain reduce-scatter,
and the bytes of each all-to-all per group (intra vs inter) as computed here from the format.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from harness import run_distributed
from quant_checks import OUT_ROUNDING, assert_bitwise, block_absmax, qdq, simulate_qgz
from yashard import quant as Q
from yashard.zeropp import (QgzFallback, qgz_fallback_reason, qgz_group_ranks, qgz_workspace_nbytes,
                            qwz_workspace_nbytes)
from zeropp_workers import DTYPES, grad_data, run_qgz, run_qwz, shard_data


def part_nbytes(numel: int, bits: int, block: int) -> int:
    """Bytes of one packed part, from the documented format (independent of the library)."""
    a16 = lambda n: -(-n // 16) * 16  # noqa: E731
    codes = numel if bits == 8 else (numel + 1) // 2
    return a16(codes) + a16(4 * -(-numel // block))


# ---------------------------------------------------------------------------------------- pure


def test_group_ranks():
    assert qgz_group_ranks(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert qgz_group_ranks(2, 2) == ([[0, 1]], [[0], [1]])
    assert qgz_group_ranks(2, 1) == ([[0], [1]], [[0, 1]])
    assert qgz_group_ranks(6, 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    with pytest.raises(ValueError, match=r"world \(4\) must be a positive multiple of ranks_per_node \(3\)"):
        qgz_group_ranks(4, 3)


def test_fallback_condition():
    assert qgz_fallback_reason(4 * 16384, 4, 2, dtype=torch.float32) is None
    assert qgz_fallback_reason(4, 1, 1, dtype=torch.float32) == "a single rank has nothing to reduce"
    assert qgz_fallback_reason(64, 2, 1, dtype=torch.float64) == \
        "gradient dtype torch.float64 is not float32/bfloat16/float16"
    # chunks need not be multiples of the block or of anything else
    assert qgz_fallback_reason(4 * 333, 4, 2, dtype=torch.float32, bits=8, block=100) is None
    # the exact size condition: a packed chunk must be smaller than the plain chunk
    for dtype, size in [(torch.float32, 4), (torch.bfloat16, 2)]:
        for bits in (8, 4):
            for c in range(1, 200):
                reason = qgz_fallback_reason(2 * c, 2, 1, dtype=dtype, bits=bits, block=64)
                assert (reason is not None) == (part_nbytes(c, bits, 64) >= c * size), (dtype, bits, c)
    assert qgz_fallback_reason(8, 2, 2, dtype=torch.float32, bits=8) == \
        "a quantized chunk of 4 elements takes 32 bytes (codes, scales, padding), not less than the 16 " \
        "bytes of the torch.float32 chunk"
    with pytest.raises(ValueError, match=r"reduce-scatter of 10 elements over 4 ranks: numel must be a "
                                         r"non-negative multiple of the world size \(pad the flat buffer\)"):
        qgz_fallback_reason(10, 4, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"bits must be 8 or 4, got 3"):
        qgz_fallback_reason(16, 2, 1, dtype=torch.float32, bits=3)
    assert issubclass(QgzFallback, ValueError)


def test_workspace_sizes():
    assert qwz_workspace_nbytes(10000, 3) == 3 * (10000 + 16)
    assert qwz_workspace_nbytes(777, 2, bits=4, block=64) == 2 * part_nbytes(777, 4, 64)
    assert qgz_workspace_nbytes(4 * 16384, 4, bits=4, block=4096) == 2 * 4 * (8192 + 16)
    with pytest.raises(ValueError, match=r"numel \(10\) must be a multiple of world \(4\)"):
        qgz_workspace_nbytes(10, 4)
    with pytest.raises(ValueError, match=r"world must be >= 1, got 0"):
        qwz_workspace_nbytes(10, 0)


# ----------------------------------------------------------------------------------------- qwZ

QWZ_CASES = [dict(seed=1, numel=10000, dtype="bf16", bits=8, block=4096),
             dict(seed=2, numel=10000, dtype="fp32", bits=8, block=4096),
             dict(seed=3, numel=777, dtype="bf16", bits=4, block=64),
             dict(seed=4, numel=5000, dtype="fp16", bits=8, block=1000)]


@pytest.mark.parametrize("world", [2, 3])
def test_qwz_all_gather(world):
    results = run_distributed(run_qwz, world, QWZ_CASES)
    for i, case in enumerate(QWZ_CASES):
        s, bits, block = case["numel"], case["bits"], case["block"]
        plain = results[0][i]["plain"]
        assert torch.equal(plain, torch.cat([shard_data(case["seed"], r, s, case["dtype"]) for r in range(world)]))
        expected = torch.cat([qdq(plain[r * s:(r + 1) * s], bits, block)[2] for r in range(world)])
        itemsize = plain.element_size()
        P = part_nbytes(s, bits, block)
        for rank in range(world):
            res = results[rank][i]
            assert torch.equal(res["plain"], plain)
            assert_bitwise(res["out"], expected, f"W={world} case {i} rank {rank}")
            assert res["q_log"] == [("all_gather", "w", world * P, world * P)]  # one collective
            assert res["plain_log"] == [("all_gather", "w", world * s, world * s * itemsize)]
        ratio = Fraction(world * P, world * s * itemsize)
        nominal = Fraction(bits, 8 * itemsize)  # 1/2 (int8, bf16), 1/4 (int8, fp32), 1/4 (int4, bf16)
        assert ratio == Fraction(P, s * itemsize)
        assert nominal < ratio <= nominal + Fraction(4 * -(-s // block) + 31, s * itemsize)
        if s == 10000:
            assert ratio == nominal + Fraction(16, s * itemsize)  # 3 scales + padding: 16 bytes


# ----------------------------------------------------------------------------------------- qgZ


def qgz_bound(fulls, g, nodes, L, bits, block, out_dtype):
    """The documented bound of zeropp (module doc) for rank g's output, in float64, from the inputs."""
    c = fulls[0].numel() // (nodes * L)
    qmax = Q.QMAX[bits]
    per_elem = lambda v: block_absmax(v, block).repeat_interleave(block)[:c]  # noqa: E731
    xs = [f[g * c:(g + 1) * c].double() for f in fulls]
    A1 = [per_elem(x) for x in xs]
    bound = sum(a / qmax / 2 for a in A1)
    absmax_sum = sum(A1)
    if L > 1 and nodes > 1:
        for k in range(nodes):
            members = range(k * L, (k + 1) * L)
            partial = sum(xs[r] for r in members)
            err = sum(A1[r] / qmax / 2 * (1 + 2.0 ** -20) + A1[r] * 2.0 ** -20 for r in members)
            A2 = per_elem(partial) + per_elem(err)  # absmax of the dequantized partial, bounded
            bound = bound + A2 / qmax / 2
            absmax_sum = absmax_sum + A2
    bound = bound * (1 + 2.0 ** -20) + absmax_sum * 2.0 ** -20 + 2.0 ** -130
    u, eta = OUT_ROUNDING[out_dtype]
    exact = sum(xs)
    return exact, bound + (exact.abs() + bound) * u + eta / 2


def check_qgz(world, cases, results):
    ratios = []
    for i, case in enumerate(cases):
        L, c, bits, block = case["L"], case["chunk"], case["bits"], case["block"]
        nodes, out_dtype = world // L, DTYPES[case["out"]]
        fulls = [grad_data(case["seed"], g, world, c, case["dtype"]) for g in range(world)]
        sim = simulate_qgz(fulls, nodes, L, bits, block, out_dtype=out_dtype)
        exact_chunks = sum(f.double() for f in fulls).view(world, c)
        P = part_nbytes(c, bits, block)
        inter_bytes = 0
        for g in range(world):
            res = results[g]["results"][i]
            out = res["out"]
            what = f"{nodes}x{L} case {i} rank {g}"
            assert_bitwise(out, sim[g], what)
            exact, bound = qgz_bound(fulls, g, nodes, L, bits, block, out_dtype)
            err = (out.double() - exact).abs()
            assert (err <= bound).all(), (what, (err - bound).max())
            assert err.max() > 0, what  # it is quantized: the test would see a wrong bound
            # the same against the fp32 reduce-scatter, whose own rounding is far below the bound
            plain_err = (out.double() - res["plain"].double()).abs()
            assert (plain_err <= bound + exact.abs() * 2.0 ** -20).all(), what
            # placement: chunk g, not any other chunk
            dist = ((out.double()[None, :] - exact_chunks) ** 2).sum(1).sqrt()
            assert dist.argmin().item() == g, (what, dist)
            assert dist[g] < 0.5 * dist[torch.arange(world) != g].min(), (what, dist)
            # bytes per collective and group
            expected_log = []
            if L > 1:
                expected_log.append(("all_to_all", "g/intra", world * P, world * P))
            if nodes > 1:
                expected_log.append(("all_to_all", "g/inter", nodes * P, nodes * P))
                inter_bytes += res["q_log"][-1][3]
            assert res["q_log"] == expected_log, what
            assert res["plain_log"] == [("reduce_scatter", "g", world * c, world * c * 4)], what
        if nodes > 1:
            # cross-node volume: each rank's inter all-to-all sends (nodes-1)/nodes of its buffer off
            # node; a fp32 reduce-scatter must send at least (nodes-1)/nodes of the tensor off each node.
            per_node = Fraction(inter_bytes, nodes) * Fraction(nodes - 1, nodes)
            fp32_min = Fraction(nodes - 1, nodes) * results[0]["results"][i]["plain_log"][0][3]
            ratios.append((case, per_node / fp32_min))
            assert per_node / fp32_min == Fraction(P, 4 * c)
    return ratios


QGZ_2X2 = [dict(seed=1, L=2, chunk=8192, bits=4, block=2048, dtype="fp32", out="fp32"),
           dict(seed=2, L=2, chunk=8192, bits=8, block=2048, dtype="fp32", out="fp32"),
           dict(seed=3, L=2, chunk=1000, bits=4, block=256, dtype="bf16", out="bf16"),
           dict(seed=4, L=2, chunk=333, bits=8, block=100, dtype="fp16", out="fp32")]


def test_qgz_two_nodes_of_two():
    results = run_distributed(run_qgz, 4, QGZ_2X2, True)
    ratios = check_qgz(4, QGZ_2X2, results)
    # int4 vs fp32: 1/8 of the bytes plus one fp32 scale per 2048-element block; int8: 1/4 + the same
    assert ratios[0][1] == Fraction(1, 8) + Fraction(1, 2048)
    assert ratios[1][1] == Fraction(1, 4) + Fraction(1, 2048)
    errors = [r["errors"] for r in results]
    for rank, e in enumerate(errors):
        assert e["swapped"] == (
            f"ValueError: shard rank {rank} got intra_group ranks {[[0, 2], [1, 3]][rank % 2]} and inter_group ranks "
            f"{[[0, 1], [2, 3]][rank // 2]}, but qgz_group_ranks(4, 2) gives it {[[0, 1], [2, 3]][rank // 2]} and "
            f"{[[0, 2], [1, 3]][rank % 2]}; pass this rank's groups from comm.new_shard_subgroups(intra) / "
            f"comm.new_shard_subgroups(inter)")
        assert e["too_few"] == ("ValueError: intra_group (1 ranks) x inter_group (1 ranks) tile 1 ranks but the "
                                "shard group has 4; build the groups from qgz_group_ranks(world, ranks_per_node) "
                                "with comm.new_shard_subgroups")
        assert e["sizes"] == ("ValueError: full has 1024 elements and out 255: full must hold world (4) x "
                              "out.numel() elements")
        assert e["workspace"].startswith("ValueError: workspace holds 100 bytes but ")
        assert e["fallback"] == ("qgZ does not apply: a quantized chunk of 4 elements takes 32 bytes (codes, "
                                 "scales, padding), not less than the 16 bytes of the torch.float32 chunk; use the "
                                 "plain reduce-scatter")
        expected = sum(x["fallback_full"] for x in errors)[rank * 4:(rank + 1) * 4]
        assert torch.allclose(e["fallback_out"], expected, rtol=1e-6, atol=1e-6)
        assert e["qwz_out"] == "ValueError: out has 5 elements, expected 12"


QGZ_W2 = [dict(seed=5, L=2, chunk=4096, bits=4, block=1024, dtype="fp32", out="fp32"),  # 1 node x 2
          dict(seed=6, L=1, chunk=4096, bits=4, block=1024, dtype="fp32", out="fp32"),  # 2 nodes x 1
          dict(seed=7, L=2, chunk=999, bits=8, block=64, dtype="bf16", out="bf16", none_for_size_1=True),
          dict(seed=8, L=1, chunk=998, bits=4, block=64, dtype="bf16", out="fp32", none_for_size_1=True)]


def test_qgz_one_node_and_one_rank_per_node():
    results = run_distributed(run_qgz, 2, QGZ_W2)
    ratios = check_qgz(2, QGZ_W2, results)
    assert [r for _, r in ratios] == [Fraction(1, 8) + Fraction(1, 1024), Fraction(part_nbytes(998, 4, 64), 4 * 998)]
