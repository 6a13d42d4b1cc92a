"""Block quantization (yashard/quant.py): format, documented error bound, Triton == torch bitwise.

The Triton kernels run on CUDA when there is a GPU, otherwise on the CPU under the Triton
interpreter (TRITON_INTERPRET=1, in a fresh process: tests/quant_checks.py);
those tests skip when triton is not importable.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from yashard import quant as Q
from yashard.zeropp import qgz_slice_order

from quant_checks import (BF16, DTYPES, FP16, FP32, block_absmax, bf16_extremes, decode, error_bound, qdq,
                          sample, split_parts)
import quant_checks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---------------------------------------------------------------------------------- pure helpers


def test_sizes_and_layout():
    assert Q.num_blocks(0, 4096) == 0 and Q.num_blocks(4096, 4096) == 1 and Q.num_blocks(4097, 4096) == 2
    assert Q.codes_nbytes(7, 8) == 7 and Q.codes_nbytes(7, 4) == 4 and Q.codes_nbytes(8, 4) == 4
    lay = Q.packed_layout(10000, 8, 4096)
    assert (lay.codes_nbytes, lay.scales_offset, lay.num_blocks, lay.nbytes) == (10000, 10000, 3, 10016)
    lay = Q.packed_layout(33, 4, 8)
    assert (lay.codes_nbytes, lay.scales_offset, lay.num_blocks, lay.nbytes) == (17, 32, 5, 64)
    assert Q.packed_nbytes(0, 8, 4096) == 0
    assert Q.packed_nbytes(8192, 4, 4096) == 4096 + 16


def test_slice_order_matches_the_paper():
    # Figure 5: 2 nodes x 2 GPUs swap slices 1 and 2.
    assert qgz_slice_order(2, 2) == [0, 2, 1, 3]
    # Eq. 2 with X GPUs per node, Y nodes: [0, X, .., (Y-1)X, 1, X+1, .., YX-1]
    for X, Y in [(2, 3), (4, 2), (3, 3), (1, 4), (4, 1)]:
        eq2 = [i + X * j for i in range(X) for j in range(Y)]
        assert qgz_slice_order(Y, X) == eq2
        assert sorted(eq2) == list(range(X * Y))
    assert Q.transpose_order(5, 1) == list(range(5))


# ------------------------------------------------------------------------------ format (torch)


def test_empty_tensors():
    for bits in (8, 4):
        codes, scales, out = qdq(torch.zeros(0), bits, 16)
        assert codes.numel() == scales.numel() == out.numel() == 0
        buf = torch.zeros(0, dtype=torch.uint8)
        Q.quantize_parts(torch.zeros(0), buf, nparts=3, bits=bits)
        Q.dequantize_parts(buf, nparts=3, numel=0, out=torch.zeros(0), bits=bits)


def test_scales_and_codes_follow_the_definition():
    x = sample(1000, FP32, seed=1)
    for bits in (8, 4):
        codes, scales, _ = qdq(x, bits, 64)
        qmax = Q.QMAX[bits]
        A = block_absmax(x, 64)
        # scale = fp32(absmax / qmax), correctly rounded (float64 quotient rounded once to fp32)
        assert torch.equal(scales, (A / qmax).float())
        q = decode(codes, x.numel(), bits).double()
        v = x.double() / scales.double().repeat_interleave(64)[: x.numel()]
        v = torch.nan_to_num(v, nan=0.0)  # all-zero block: scale 0
        assert (q - v).abs().max() <= 0.5 + 1e-5
        assert q.abs().max() == qmax


def test_round_half_to_even_and_int4_packing():
    # absmax 127 (int8) / 7 (int4) gives scale exactly 1, so x / scale = x: exact ties.
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 127.0])
    codes, scales, _ = qdq(x, 8, 8)
    assert scales.tolist() == [1.0]
    assert decode(codes, 8, 8).tolist() == [0, 2, 2, 0, -2, -2, 4, 127]
    x4 = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 7.0, -6.5, 5.0])
    codes, scales, _ = qdq(x4, 4, 10)
    assert scales.tolist() == [1.0]
    assert decode(codes, 9, 4).tolist() == [0, 2, 2, 0, -2, -2, 7, -6, 5]
    # low nibble = even element, high nibble = odd element, both stored as code + 8; the missing
    # tenth element is code 0 (nibble 8)
    assert codes.tolist() == [(0 + 8) | (2 + 8) << 4, (2 + 8) | (0 + 8) << 4, (-2 + 8) | (-2 + 8) << 4,
                              (7 + 8) | (-6 + 8) << 4, (5 + 8) | 8 << 4]


def test_zero_and_nonfinite_blocks():
    x = torch.zeros(24)
    x[8:16] = torch.randn(8)
    x[17] = float("inf")
    for bits in (8, 4):
        codes, scales, out = qdq(x, bits, 8)
        assert scales[0] == 0 and torch.equal(out[:8], torch.zeros(8))  # all-zero block: no NaN
        assert torch.isfinite(out[8:16]).all() and (out[8:16] - x[8:16]).abs().max() <= scales[1]
        assert scales[2].isnan() and out[16:].isnan().all()  # inf makes its block NaN, only that block
        assert (decode(codes, 24, bits)[16:] == 0).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_error_bound(bits, dtype):
    qmax = Q.QMAX[bits]
    for n, block in [(5000, 256), (4097, 4096), (33, 8), (1001, 100)]:
        x = sample(n, dtype, seed=n)
        if dtype == FP16:
            x = x.clamp(-6e4, 6e4)
        for out_dtype in DTYPES:
            if out_dtype == FP16 and dtype != FP16:
                continue  # fp16 cannot hold the range of the others; covered with fp16 inputs
            _, scales, out = qdq(x, bits, block, out_dtype)
            err = (out.double() - x.double()).abs()
            bound = error_bound(x, scales, block, out_dtype)
            assert (err <= bound).all(), (n, block, out_dtype, (err - bound).max())
        # the bound is tight: some element is off by nearly half a step
        _, scales, out = qdq(x, bits, block, FP32)
        s = scales.double().repeat_interleave(block)[:n]
        nz = s > 0
        assert ((out.double() - x.double()).abs()[nz] / s[nz]).max() > 0.4
        assert torch.allclose(scales.double() * qmax, block_absmax(x, block), rtol=2.0 ** -23, atol=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_extreme_values(bits):
    x = bf16_extremes()
    _, scales, out = qdq(x, bits, 8, BF16)
    err = (out.double() - x.double()).abs()
    assert (err <= error_bound(x, scales, 8, BF16)).all()
    assert scales[0] > 1e36 and 0 < scales[1] < 1.1754944e-38  # huge block; subnormal fp32 scale
    # values beyond fp16 range and below fp16's smallest subnormal survive with their magnitude
    assert out[2] > 2e38 and out[29] > 65504
    assert 1e-31 < out[16] < 1e-29 and out[8] > 1e-39


# ------------------------------------------------------------------------------------ packed parts


@pytest.mark.parametrize("bits", [8, 4])
def test_parts_follow_the_1d_format(bits):
    rows, cols, m, block = 2, 3, 150, 64
    x = sample(rows * cols * m, BF16, seed=7)
    buf = torch.zeros(rows * cols * Q.packed_nbytes(m, bits, block) + 5, dtype=torch.uint8)
    Q.quantize_parts(x, buf, nparts=rows * cols, bits=bits, block=block, transpose=(rows, cols))
    order = Q.transpose_order(rows, cols)
    parts = split_parts(buf, rows * cols, m, bits, block)
    for p, (codes, scales) in enumerate(parts):
        c, s, _ = qdq(x[order[p] * m:(order[p] + 1) * m], bits, block)
        assert torch.equal(codes, c) and torch.equal(scales, s)
    # reduce 3 copies of 2 parts (copies `stride` bytes apart): fp32 sum in copy order
    P = Q.packed_nbytes(m, bits, block)
    out = torch.empty(2 * m, dtype=FP32)
    Q.dequantize_parts(buf, nparts=2, numel=m, out=out, nreduce=3, reduce_stride=2 * P, bits=bits, block=block)
    for p in range(2):
        acc = torch.zeros(m)
        for r in range(3):
            part = torch.empty(m)
            Q.dequantize(*parts[r * 2 + p], part, bits=bits, block=block)
            acc = acc + part
        assert torch.equal(out[p * m:(p + 1) * m], acc)
    # fused requantization of the same sums
    req = torch.zeros(2 * P, dtype=torch.uint8)
    Q.dequantize_parts(buf, nparts=2, numel=m, requant=req, nreduce=3, reduce_stride=2 * P, bits=bits, block=block)
    for p, (codes, scales) in enumerate(split_parts(req, 2, m, bits, block)):
        c, s, _ = qdq(out[p * m:(p + 1) * m], bits, block)
        assert torch.equal(codes, c) and torch.equal(scales, s)


# -------------------------------------------------------------------------- triton == torch


def _lowbias32(x: int) -> int:
    """The hash, written independently of the library (Python ints)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_uniform_is_the_documented_hash():
    idx = torch.tensor([0, 1, 2, 12345, 2**32 - 1, 2**32 + 7, 3 * 2**40 + 5])
    for seed in (0, 1, 2**31 - 1):
        want = [(_lowbias32(_lowbias32(i % 2**32) ^ seed) >> 8) / 2**24 for i in idx.tolist()]
        assert Q.uniform(seed, idx).tolist() == want
    u = Q.uniform(7, torch.arange(100_000))
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.005
    assert len({Q.mix_seed(c, r) for c in range(50) for r in range(8)}) == 400  # no collisions here
    with pytest.raises(ValueError, match=r"mix_seed takes ints in \[0, 2\*\*32\), got -1"):
        Q.mix_seed(-1)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_and_bounded(bits):
    """Elements below half a step: nearest rounds them all to 0, stochastic rounding keeps their mean.
    Every code is one of the two neighbours of x / scale (error below one step), the same seed gives
    the same codes, another seed others."""
    qmax = Q.QMAX[bits]
    block = 512
    g = torch.Generator().manual_seed(3)
    x = torch.rand(8 * block, generator=g) * 0.4  # below half a step after scaling...
    x[::block] = qmax  # ...of a block whose absmax is qmax: scale exactly 1
    small = torch.ones(x.numel(), dtype=torch.bool)
    small[::block] = False
    _, _, nearest = qdq(x, bits, block)
    assert nearest[small].abs().max() == 0 and torch.equal(nearest[~small], x[~small])
    codes, scales, a = qdq(x, bits, block, seed=5)
    assert torch.equal(scales, torch.ones_like(scales))
    assert ((a == x.floor()) | (a == x.ceil())).all() and torch.equal(a[~small], x[~small])
    assert torch.equal(qdq(x, bits, block, seed=5)[0], codes)
    assert not torch.equal(qdq(x, bits, block, seed=6)[0], codes)
    mean = torch.stack([qdq(x, bits, block, seed=s)[2] for s in range(200)]).mean(0)
    err = (mean - x)[small]
    # per element, the mean of 200 draws has a standard error below 0.035 (|error| about 0.02 on
    # average); over all 4088 elements the bias is below 0.002 (nearest's is -0.2, the mean of x)
    assert err.abs().mean() < 0.03 and abs(err.mean().item()) < 0.002, (err.abs().mean(), err.mean())
    assert abs((nearest - x)[small].mean().item() + 0.2) < 0.01
    # random data of every magnitude: the error stays below one step (plus the fp32 terms)
    y = sample(3000, FP32, 11)
    _, sc, b = qdq(y, bits, 256, seed=9)
    assert ((y.double() - b.double()).abs() <= 2 * error_bound(y, sc, 256, FP32)).all()  # s + the fp32 terms


def test_triton_matches_torch_bitwise():
    """Codes, scales, dequantized values (every dtype), packed parts with reordering, reduction and
    requantization, and a whole simulated qgZ: Triton vs torch, bitwise (tests/quant_checks.py). On
    CPU the kernels run under TRITON_INTERPRET=1, which must be set before triton is imported, hence
    the fresh process."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        quant_checks.run_triton_checks("cuda")
        return
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, os.path.join(HERE, "quant_checks.py")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "all triton checks passed (interpreted)" in r.stdout, r.stdout


def test_kernels_compile_for_h100_with_ieee_arithmetic():
    """Compile (no GPU needed) for sm_90 and check the PTX for what the bitwise agreement with the
    CPU relies on: IEEE division (div.rn), no FMA contraction, no flush-to-zero of subnormals."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("kernels are interpreted in this process")
    ptx = quant_checks.compile_sm90_ptx()
    assert "div.rn.f32" in ptx["quant int8 fp32"] and "div.rn.f32" in ptx["dequant-requant int4"]
    assert "cvt.rn.f16" in ptx["dequant int4 -> fp16"]  # round to nearest even (f16 or f16x2)
    for name, text in ptx.items():
        assert "fma.rn.f32" not in text and ".ftz" not in text and "div.full" not in text \
            and "div.approx" not in text, name


# ---------------------------------------------------------------------------------------- errors


def test_errors_name_the_problem_and_the_fix():
    x = torch.randn(10)
    c8, s = torch.empty(10, dtype=torch.uint8), torch.empty(1)
    with pytest.raises(ValueError, match=r"bits must be 8 or 4, got 2"):
        Q.quantize(x, c8, s, bits=2)
    with pytest.raises(ValueError, match=r"block must be an int in \[1, 32768\], got 0; the default is 4096"):
        Q.quantize(x, c8, s, block=0)
    with pytest.raises(ValueError, match=r"block must be an int in \[1, 32768\], got 65536"):
        Q.packed_nbytes(10, 8, 65536)
    with pytest.raises(ValueError, match=r"int4 packs two codes per byte, so the block must be even, got block=9"):
        Q.quantize(x, c8, s, bits=4, block=9)
    with pytest.raises(TypeError, match=r"x must be float32, bfloat16 or float16, got torch.float64"):
        Q.quantize(x.double(), c8, s, block=16)
    with pytest.raises(ValueError, match=r"x must be a contiguous 1-D tensor, got shape \(2, 5\)"):
        Q.quantize(x.view(2, 5), c8, s, block=16)
    with pytest.raises(ValueError, match=r"codes has 10 bytes, expected codes_nbytes\(10, bits=4\) = 5"):
        Q.quantize(x, c8, s, bits=4, block=16)
    with pytest.raises(ValueError, match=r"codes must be a contiguous 1-D uint8/int8 tensor, got torch.float32"):
        Q.quantize(x, x, s, block=16)
    with pytest.raises(ValueError, match=r"scales has 1 elements, expected num_blocks\(10, block=4\) = 3"):
        Q.quantize(x, c8, s, block=4)
    with pytest.raises(ValueError, match=r"scales must be a contiguous 1-D float32 tensor, got torch.float16"):
        Q.quantize(x, c8, s.half(), block=16)
    with pytest.raises(ValueError, match=r"codes has 10 bytes, expected codes_nbytes\(12, bits=8\) = 12"):
        Q.dequantize(c8, s, torch.empty(12), block=16)
    with pytest.raises(ValueError, match=r"scales has 1 elements, expected num_blocks\(10, block=4\) = 3"):
        Q.dequantize(c8, s, torch.empty(10), block=4)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch'\), got 'cuda'"):
        Q.quantize(x, c8, s, block=16, backend="cuda")
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"x has 10 elements, not a multiple of nparts=3"):
        Q.quantize_parts(x, buf, nparts=3)
    with pytest.raises(ValueError, match=r"transpose=\(2, 2\) must be \(rows, cols\) with rows \* cols == nparts=2"):
        Q.quantize_parts(x, buf, nparts=2, transpose=(2, 2))
    with pytest.raises(ValueError, match=r"buf holds 64 bytes but 256 are needed; size it with the matching \*_nbytes"):
        Q.quantize_parts(torch.randn(200), buf, nparts=2)
    with pytest.raises(ValueError, match=r"buf must be a contiguous 1-D torch.uint8 buffer, got dtype torch.int8"):
        Q.quantize_parts(x, buf.view(torch.int8), nparts=1)
    with pytest.raises(ValueError, match=r"buf must start at a 16-byte aligned address \(its scales are read as fp32\); "
                                         r"slice byte workspaces at multiples of 16"):
        Q.quantize_parts(x, torch.zeros(100, dtype=torch.uint8)[3:], nparts=1, block=16)
    with pytest.raises(ValueError, match=r"needs exactly one of out= \(values\) or requant= \(a packed buffer\)"):
        Q.dequantize_parts(buf, nparts=1, numel=10)
    with pytest.raises(ValueError, match=r"reduce_stride must be a non-negative multiple of 16 bytes, got 8"):
        Q.dequantize_parts(buf, nparts=1, numel=10, out=torch.empty(10), nreduce=2, reduce_stride=8)
    with pytest.raises(ValueError, match=r"out has 11 elements, expected 10"):
        Q.dequantize_parts(buf, nparts=1, numel=10, out=torch.empty(11))
    with pytest.raises(ValueError, match=r"all tensors must be on one device"):
        Q.quantize(x, c8, torch.empty(1, device="meta"), block=16)


def test_triton_backend_without_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(Q, "_TRITON", False)
    with pytest.raises(RuntimeError, match=r"backend='triton' was requested but triton cannot be imported: pip install triton"):
        Q.quantize(torch.randn(4), torch.empty(4, dtype=torch.uint8), torch.empty(1), block=16, backend="triton")
    assert Q.resolve_backend(torch.device("cpu")) == "torch"
