"""Helpers shared by the quantization tests, and the Triton-vs-torch checks.

Run as a script (``TRITON_INTERPRET=1 python tests/quant_checks.py``) it runs every Triton check on the
CPU through the Triton interpreter, which has to be enabled before triton is first imported, hence a
separate process (tests/test_quant.py launches it). On a GPU, ``run_triton_checks("cuda")`` runs the
same checks in-process against the CUDA kernels.
"""

from __future__ import annotations

import os
import sys

import torch

from yashard import quant as Q

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [FP32, BF16, FP16]
# unit roundoff and smallest subnormal of each output dtype (fp32 rounding is inside the base bound)
OUT_ROUNDING = {FP32: (0.0, 0.0), BF16: (2.0 ** -8, 2.0 ** -133), FP16: (2.0 ** -11, 2.0 ** -24)}


def qdq(x, bits, block, out_dtype=None, backend="torch", seed=None):
    """(codes, scales, dequantized) of the 1-D API (stochastic rounding with an int ``seed``)."""
    n = x.numel()
    codes = torch.empty(Q.codes_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(Q.num_blocks(n, block), dtype=torch.float32, device=x.device)
    out = torch.empty(n, dtype=out_dtype or x.dtype, device=x.device)
    Q.quantize(x, codes, scales, bits=bits, block=block, seed=seed, backend=backend)
    Q.dequantize(codes, scales, out, bits=bits, block=block, backend=backend)
    return codes, scales, out


def decode(codes, n, bits):
    """Integer codes from the byte format, written independently of the library."""
    c = codes.to(torch.int64)
    if bits == 8:
        return torch.where(c > 127, c - 256, c)[:n]
    return torch.stack([(c & 15) - 8, (c >> 4) - 8], dim=1).reshape(-1)[:n]


def block_absmax(x, block):
    """Per-block absmax in float64."""
    x64 = x.double()
    n = x64.numel()
    nb = -(-n // block)
    pad = torch.zeros(nb * block, dtype=torch.float64)
    pad[:n] = x64.abs().cpu()
    return pad.view(nb, block).amax(1)


def error_bound(x, scales, block, out_dtype):
    """The documented per-element bound of yashard.quant, in float64."""
    n = x.numel()
    A = block_absmax(x, block).repeat_interleave(block)[:n]
    s = scales.double().cpu().repeat_interleave(block)[:n]
    b = s / 2 + A * 2.0 ** -22 + 2.0 ** -140
    u, eta = OUT_ROUNDING[out_dtype]
    return b + (x.double().abs().cpu() + b) * u + eta / 2


def sample(n, dtype, seed=0):
    """Random values of widely varied magnitude, the first 7 zero (an all-zero block when small)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    x[: min(n, 7)] = 0.0
    return x.to(dtype)


def bf16_extremes():
    """bf16 values a bf16-read-as-fp16 bug would get wrong: beyond fp16 range, tiny exponents,
    bf16 subnormals; blocks of 8 so one block is all tiny (subnormal fp32 scale)."""
    vals = [7.0e4, -1.0e5, 3.0e38, -2.5e30, 1.0, -65504.0, 123456.0, 1.0e10,  # huge block
            1.0e-38, -3.0e-38, 2.0e-39, 9.0e-41, -1.0e-40, 5.0e-39, 0.0, 1.2e-38,  # tiny block
            1.0e-30, -7.0e-31, 3.0e-32, 1.0e-33, 0.0, 2.0e-30, -1.0e-29, 4.0e-31,
            1.0e-4, 2.0e-5, -3.0e-6, 65504.0, -0.5, 70000.0, 1e-20, 0.0]
    return torch.tensor(vals, dtype=torch.float32).to(BF16)


def split_parts(buf, nparts, numel, bits, block):
    """[(codes, scales)] views of the packed parts of ``buf`` (layout read off packed_layout)."""
    lay = Q.packed_layout(numel, bits, block)
    parts = buf[: nparts * lay.nbytes].view(nparts, lay.nbytes)
    return [(parts[p, : lay.codes_nbytes], parts[p, lay.scales_offset: lay.scales_offset + 4 * lay.num_blocks]
             .view(torch.float32)) for p in range(nparts)]


def simulate_qgz(fulls, nodes, L, bits, block, out_dtype=FP32, backend="torch", device="cpu", seed=None):
    """Every rank's qgZ output, in one process: the library's quantize/dequantize steps with the two
    all-to-alls done by slicing (all_to_all_single semantics: segment ``i`` of rank ``a``'s input
    lands in segment ``a`` of member ``i``'s output). With an int ``seed``, rank ``g`` rounds its
    first quantization with seed ``seed + 2g`` and its requantization with ``seed + 2g + 1``."""
    def sd(g, stage):
        return None if seed is None else seed + 2 * g + stage

    W = nodes * L
    c = fulls[0].numel() // W
    P = Q.packed_nbytes(c, bits, block)
    kw = dict(bits=bits, block=block, backend=backend)
    send = [torch.zeros(W * P, dtype=torch.uint8, device=device) for _ in range(W)]
    for g in range(W):
        Q.quantize_parts(fulls[g].to(device), send[g], nparts=W, transpose=(nodes, L), seed=sd(g, 0), **kw)
    outs = [torch.empty(c, dtype=out_dtype, device=device) for _ in range(W)]
    if L > 1:
        seg = nodes * P
        recv = [torch.cat([send[(g // L) * L + l][(g % L) * seg:(g % L + 1) * seg] for l in range(L)])
                for g in range(W)]
        if nodes == 1:
            for g in range(W):
                Q.dequantize_parts(recv[g], nparts=1, numel=c, out=outs[g], nreduce=L, reduce_stride=P, **kw)
            return outs
        send2 = [torch.zeros(seg, dtype=torch.uint8, device=device) for _ in range(W)]
        for g in range(W):
            Q.dequantize_parts(recv[g], nparts=nodes, numel=c, requant=send2[g], nreduce=L, reduce_stride=seg,
                               seed=sd(g, 1), **kw)
    else:
        send2 = [s[: nodes * P] for s in send]
    for g in range(W):
        n, i = divmod(g, L)
        recv2 = torch.cat([send2[k * L + i][n * P:(n + 1) * P] for k in range(nodes)])
        Q.dequantize_parts(recv2, nparts=1, numel=c, out=outs[g], nreduce=nodes, reduce_stride=P, **kw)
    return outs


# ------------------------------------------------------------------------ triton == torch checks


def bits_of(t):
    t = t.detach().cpu()
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16) if t.element_size() == 2 else t


def assert_bitwise(a, b, what):
    """Same bits, except that any NaN equals any NaN (NaN payloads carry no meaning here, and torch's
    own fp32 -> bf16 cast writes 0xFFFF or 0x7FC0 for NaN depending on its vectorization)."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    differ = bits_of(a) != bits_of(b)
    if a.is_floating_point():
        differ &= ~(a.isnan() & b.isnan())
    diff = differ.nonzero().flatten()
    assert diff.numel() == 0, f"{what}: {diff.numel()} values differ, first at {diff[:5].tolist()}: " \
                              f"{a[diff[:5]].tolist()} vs {b[diff[:5]].tolist()}"


def agreement_cases():
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5, 7.0])
    nonfinite = torch.randn(40, generator=torch.Generator().manual_seed(9))
    nonfinite[3], nonfinite[25] = float("nan"), float("-inf")
    return [("random", sample(1500, FP32, 2), 256), ("odd-n", sample(501, FP32, 3), 100),
            ("partial", sample(4097, FP32, 4), 4096), ("ties", ties, 8), ("bf16-extremes", bf16_extremes(), 8),
            ("bf16", sample(999, BF16, 5), 256), ("fp16", sample(999, FP32, 6).clamp(-6e4, 6e4).to(FP16), 256),
            ("zeros", torch.zeros(50), 16), ("nonfinite", nonfinite, 8), ("block-1", sample(20, FP32, 7), 1),
            ("empty", torch.zeros(0), 16)]


def check_1d(dev, bits):
    n = 0
    for name, x, block in agreement_cases():
        if bits == 4 and block % 2:
            continue
        for seed in (None, 1, 12345):  # 1: Triton would specialize it unless told not to
            ref = qdq(x, bits, block, backend="torch", seed=seed)
            got = qdq(x.to(dev), bits, block, backend="triton", seed=seed)
            for what, a, b in zip(("codes", "scales", "dequant"), ref, got):
                assert_bitwise(a, b, f"int{bits} {name} {what} seed {seed}")
        for out_dtype in DTYPES:
            ref_o = torch.empty(x.numel(), dtype=out_dtype)
            got_o = torch.empty(x.numel(), dtype=out_dtype, device=dev)
            Q.dequantize(ref[0], ref[1], ref_o, bits=bits, block=block, backend="torch")
            Q.dequantize(ref[0].to(dev), ref[1].to(dev), got_o, bits=bits, block=block, backend="triton")
            assert_bitwise(ref_o, got_o, f"int{bits} {name} dequant to {out_dtype}")
        n += 1
    return n


def check_parts(dev, bits):
    rows, cols, m, block = 3, 2, 301 if bits == 8 else 302, 128
    x = sample(rows * cols * m, FP32, seed=8)
    P = Q.packed_nbytes(m, bits, block)
    for seed in (None, 777):
        res = {}
        for backend, d in (("torch", "cpu"), ("triton", dev)):
            kw = dict(bits=bits, block=block, backend=backend)
            buf = torch.zeros(rows * cols * P, dtype=torch.uint8, device=d)
            Q.quantize_parts(x.to(d), buf, nparts=6, transpose=(rows, cols), seed=seed, **kw)
            out = torch.empty(3 * m, dtype=BF16, device=d)
            Q.dequantize_parts(buf, nparts=3, numel=m, out=out, nreduce=2, **kw)
            req = torch.zeros(3 * P, dtype=torch.uint8, device=d)
            Q.dequantize_parts(buf, nparts=3, numel=m, requant=req, nreduce=2, seed=seed, **kw)
            res[backend] = (buf, out, req)
        for what, a, b in zip(("quantize_parts", "reduce", "requant"), res["torch"], res["triton"]):
            assert_bitwise(a, b, f"int{bits} {what} seed {seed}")
    return 6


def check_qgz_simulation(dev, bits):
    n = 0
    for nodes, L, c, block in [(2, 2, 300, 128), (1, 3, 130, 128), (3, 1, 130, 128), (2, 3, 64, 64)]:
        fulls = [sample(nodes * L * c, BF16, seed=100 + g) for g in range(nodes * L)]
        for seed in (None, 99):
            ref = simulate_qgz(fulls, nodes, L, bits, block, out_dtype=FP32, backend="torch", seed=seed)
            got = simulate_qgz(fulls, nodes, L, bits, block, out_dtype=FP32, backend="triton", device=dev, seed=seed)
            for g, (a, b) in enumerate(zip(ref, got)):
                assert_bitwise(a, b, f"int{bits} qgZ {nodes}x{L} rank {g} seed {seed}")
            n += 1
    return n


def compile_sm90_ptx() -> dict:
    """PTX of representative kernel variants compiled for an H100 (sm_90) without a GPU: the compiled
    (not interpreted) kernels type-check, and the PTX shows what bitwise agreement relies on."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    K = Q._triton_module()
    i64 = "i64"
    qsig = dict(x_ptr=None, x_part_stride=i64, codes_ptr="*u8", codes_part_stride=i64, scales_ptr="*fp32",
                scales_part_stride=i64, numel=i64, block="i32", perm_n="i32", perm_l="i32", seed="i32",
                QMAX="constexpr", INT4="constexpr", X_BF16="constexpr", P2="constexpr", STOCHASTIC="constexpr")
    dsig = dict(codes_ptr="*u8", codes_part_stride=i64, codes_red_stride=i64, scales_ptr="*fp32",
                scales_part_stride=i64, scales_red_stride=i64, nred="i32", out_ptr=None, out_part_stride=i64,
                qcodes_ptr="*u8", qcodes_part_stride=i64, qscales_ptr="*fp32", qscales_part_stride=i64, numel=i64,
                block="i32", seed="i32", QMAX="constexpr", INT4="constexpr", OUT_BF16="constexpr",
                REQUANT="constexpr", P2="constexpr", STOCHASTIC="constexpr")
    variants = {
        "quant int8 fp32": (K.quantize_kernel, {**qsig, "x_ptr": "*fp32"}, dict(QMAX=127, INT4=False, X_BF16=False)),
        "quant int4 bf16": (K.quantize_kernel, {**qsig, "x_ptr": "*i16"}, dict(QMAX=7, INT4=True, X_BF16=True)),
        "dequant int8 -> bf16": (K.dequantize_kernel, {**dsig, "out_ptr": "*i16"},
                                 dict(QMAX=127, INT4=False, OUT_BF16=True, REQUANT=False)),
        "dequant int4 -> fp16": (K.dequantize_kernel, {**dsig, "out_ptr": "*fp16"},
                                 dict(QMAX=7, INT4=True, OUT_BF16=False, REQUANT=False)),
        "dequant-requant int4": (K.dequantize_kernel, {**dsig, "out_ptr": "*fp32"},
                                 dict(QMAX=7, INT4=True, OUT_BF16=False, REQUANT=True)),
        "quant int4 fp32 stochastic": (K.quantize_kernel, {**qsig, "x_ptr": "*fp32"},
                                       dict(QMAX=7, INT4=True, X_BF16=False, STOCHASTIC=True)),
        "dequant-requant int8 stochastic": (K.dequantize_kernel, {**dsig, "out_ptr": "*fp32"},
                                            dict(QMAX=127, INT4=False, OUT_BF16=False, REQUANT=True, STOCHASTIC=True)),
    }
    ptx = {}
    for name, (fn, sig, constexprs) in variants.items():
        src = ASTSource(fn, sig, constexprs={"STOCHASTIC": False, **constexprs, "P2": 4096})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=8, enable_fp_fusion=False))
        ptx[name] = compiled.asm["ptx"]
    return ptx


def run_triton_checks(dev):
    """Every Triton-vs-torch check on ``dev`` ("cuda", or "cpu" under TRITON_INTERPRET=1)."""
    total = 0
    for bits in (8, 4):
        total += check_1d(dev, bits) + check_parts(dev, bits) + check_qgz_simulation(dev, bits)
    return total


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the Triton interpreter runs the kernels on the CPU)")
    kernels = Q._triton_module()
    assert kernels is not None, "triton does not import"
    assert kernels.INTERPRETED, "triton kernels were not created by the interpreter"
    count = run_triton_checks("cpu")
    print(f"{count} case groups: all triton checks passed (interpreted)")
