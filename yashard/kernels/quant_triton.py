"""Triton kernels for block quantization (see :mod:`yashard.quant` for the format and contracts).

Two kernels, both over a grid ``(blocks per part, parts)``, one program per quantization block:

* :func:`quantize_kernel` reads part ``p`` of the input from piece ``(p % perm_n) * perm_l + p // perm_n``
  (identity with ``perm_n = parts, perm_l = 1``; the qgZ slice reordering otherwise), and writes its
  codes and its per-block fp32 scales.
* Both round to nearest even, or stochastically with ``STOCHASTIC`` (a counter-based hash of the
  seed and the element index ``part * numel + offset``, integer arithmetic only, as the torch path).
* :func:`dequantize_kernel` sums, in fp32 and in order ``r = 0, 1, ...``, the dequantized values of
  ``nred`` quantized copies of each part and either stores the sum (cast to the output dtype) or
  quantizes it again (the fused dequantize-reduce-quantize step of qgZ).

Everything that could differ between the GPU and the CPU torch fallback is spelled out instead of
left to the compiler: division is ``div_rn`` (IEEE), rounding to nearest-even is done with integer
arithmetic, bf16 is read and written through its bit pattern (also sidesteps the interpreter, which
converts bf16 subnormals wrongly and truncates fp32 -> bf16), and launches disable fp fusion so
``acc + q * scale`` is never contracted into an FMA. With that, the codes, the scales and the
dequantized values are bitwise identical to the torch fallback (tested under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_f32(ptr, mask, X_BF16: tl.constexpr):
    if X_BF16:  # ptr is the int16 view of a bf16 tensor: bf16 bits are the top half of an fp32
        bits = tl.load(ptr, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_from_f32(ptr, v, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:  # ptr is an int16 view; round to nearest even exactly as torch does, NaN -> 0x7FC0
        bits = v.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        rounded = tl.where(v != v, 0x7FC0, rounded)
        tl.store(ptr, rounded.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nonfinite(x):
    return tl.max(((x != x) | (tl.abs(x) > 3.4028234663852886e38)).to(tl.int32), axis=0)


@triton.jit
def _scale(absmax, bad, QMAX: tl.constexpr):
    """(stored scale, scale to divide by): absmax / QMAX; NaN for a block with inf/NaN; 1 for 0."""
    scale = tl.math.div_rn(absmax, tl.full([], QMAX, tl.float32))
    safe = tl.where(scale > 0, scale, 1.0)
    nan = tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(bad > 0, nan, scale), safe


@triton.jit
def _mul32(x, c: tl.constexpr):
    """x * c mod 2**32 for int64 x in [0, 2**32), in 16-bit halves (no int64 overflow), as quant._mul32."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + ((hi * (c & 0xFFFF)) << 16)) & 0xFFFFFFFF


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _uniform(seed, idx):
    """quant.uniform: fp32 in [0, 1), 24 random bits, from the int64 element index and the seed."""
    h = _hash32(_hash32(idx.to(tl.int64) & 0xFFFFFFFF) ^ seed.to(tl.int64))
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _codes(x, safe, bad, seed, idx, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Round-half-to-even of clamp(x / safe, -QMAX, QMAX) as int32 (0 for a non-finite block); with
    STOCHASTIC, min(floor(v + uniform(seed, idx)), QMAX) instead."""
    v = tl.math.div_rn(x, safe)
    v = tl.where(bad > 0, 0.0, v)
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if STOCHASTIC:
        w = v + _uniform(seed, idx)  # one IEEE add, as in torch
        t = w.to(tl.int32)  # truncates toward zero; floor for negative non-integers is one less
        t = t - (t.to(tl.float32) > w).to(tl.int32)
        return tl.minimum(t, QMAX)
    t = v.to(tl.int32)  # truncates toward zero
    a = tl.abs(v - t.to(tl.float32))  # exact
    up = (a > 0.5) | ((a == 0.5) & ((t & 1) != 0))
    return t + tl.where(up, tl.where(v < 0, -1, 1), 0)


@triton.jit
def _quantize_block(x_e, x_o, m_e, m_o, codes_ptr, scale_ptr, j, seed, idx0,
                    QMAX: tl.constexpr, INT4: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Quantize one block and store it. int8: x_o/m_o are unused; int4: (x_e, x_o) are element pairs.
    ``idx0``: the element index (part * numel + offset) of the block's first element, for STOCHASTIC."""
    if INT4:
        absmax = tl.maximum(tl.max(tl.abs(x_e), axis=0), tl.max(tl.abs(x_o), axis=0))
        bad = tl.maximum(_nonfinite(x_e), _nonfinite(x_o))
        scale, safe = _scale(absmax, bad, QMAX)
        q_e = _codes(x_e, safe, bad, seed, idx0 + 2 * j, QMAX, STOCHASTIC)
        q_o = _codes(x_o, safe, bad, seed, idx0 + 2 * j + 1, QMAX, STOCHASTIC)
        tl.store(codes_ptr + j, ((q_e + 8) | ((q_o + 8) << 4)).to(tl.uint8), mask=m_e)
    else:
        absmax = tl.max(tl.abs(x_e), axis=0)
        bad = _nonfinite(x_e)
        scale, safe = _scale(absmax, bad, QMAX)
        q = _codes(x_e, safe, bad, seed, idx0 + j, QMAX, STOCHASTIC)
        tl.store(codes_ptr + j, q.to(tl.int8).to(tl.uint8, bitcast=True), mask=m_e)
    tl.store(scale_ptr, scale)


@triton.jit(do_not_specialize=["seed"])  # a seed of 1 must not become a compile-time constant
def quantize_kernel(x_ptr, x_part_stride, codes_ptr, codes_part_stride, scales_ptr, scales_part_stride,
                    numel, block, perm_n, perm_l, seed,
                    QMAX: tl.constexpr, INT4: tl.constexpr, X_BF16: tl.constexpr, P2: tl.constexpr,
                    STOCHASTIC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    src = (p % perm_n) * perm_l + p // perm_n
    start = b * block
    length = tl.minimum(numel - start, block)
    xb = x_ptr + src * x_part_stride + start
    scale_ptr = scales_ptr + p * scales_part_stride + b
    if INT4:
        j = tl.arange(0, P2 // 2)
        m_e = 2 * j < length
        m_o = 2 * j + 1 < length
        x_e = _load_f32(xb + 2 * j, m_e, X_BF16)
        x_o = _load_f32(xb + 2 * j + 1, m_o, X_BF16)
        _quantize_block(x_e, x_o, m_e, m_o, codes_ptr + p * codes_part_stride + start // 2, scale_ptr, j,
                        seed, p * numel + start, QMAX, INT4, STOCHASTIC)
    else:
        j = tl.arange(0, P2)
        m = j < length
        x = _load_f32(xb + j, m, X_BF16)
        _quantize_block(x, x, m, m, codes_ptr + p * codes_part_stride + start, scale_ptr, j,
                        seed, p * numel + start, QMAX, INT4, STOCHASTIC)


@triton.jit(do_not_specialize=["seed"])
def dequantize_kernel(codes_ptr, codes_part_stride, codes_red_stride,
                      scales_ptr, scales_part_stride, scales_red_stride, nred,
                      out_ptr, out_part_stride,
                      qcodes_ptr, qcodes_part_stride, qscales_ptr, qscales_part_stride,
                      numel, block, seed,
                      QMAX: tl.constexpr, INT4: tl.constexpr, OUT_BF16: tl.constexpr, REQUANT: tl.constexpr,
                      P2: tl.constexpr, STOCHASTIC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    start = b * block
    length = tl.minimum(numel - start, block)
    sp = scales_ptr + p * scales_part_stride + b
    if INT4:
        j = tl.arange(0, P2 // 2)
        m_e = 2 * j < length
        m_o = 2 * j + 1 < length
        cp = codes_ptr + p * codes_part_stride + start // 2 + j
        acc_e = tl.zeros([P2 // 2], dtype=tl.float32)
        acc_o = tl.zeros([P2 // 2], dtype=tl.float32)
        for _ in range(nred):
            byte = tl.load(cp, mask=m_e, other=0x88).to(tl.int32)
            s = tl.load(sp)
            acc_e = acc_e + ((byte & 15) - 8).to(tl.float32) * s
            acc_o = acc_o + ((byte >> 4) - 8).to(tl.float32) * s
            cp += codes_red_stride
            sp += scales_red_stride
        acc_e = tl.where(m_e, acc_e, 0.0)
        acc_o = tl.where(m_o, acc_o, 0.0)
        if REQUANT:
            _quantize_block(acc_e, acc_o, m_e, m_o, qcodes_ptr + p * qcodes_part_stride + start // 2,
                            qscales_ptr + p * qscales_part_stride + b, j, seed, p * numel + start,
                            QMAX, INT4, STOCHASTIC)
        else:
            ob = out_ptr + p * out_part_stride + start
            _store_from_f32(ob + 2 * j, acc_e, m_e, OUT_BF16)
            _store_from_f32(ob + 2 * j + 1, acc_o, m_o, OUT_BF16)
    else:
        j = tl.arange(0, P2)
        m = j < length
        cp = codes_ptr + p * codes_part_stride + start + j
        acc = tl.zeros([P2], dtype=tl.float32)
        for _ in range(nred):
            q = tl.load(cp, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            s = tl.load(sp)
            acc = acc + q * s
            cp += codes_red_stride
            sp += scales_red_stride
        acc = tl.where(m, acc, 0.0)
        if REQUANT:
            _quantize_block(acc, acc, m, m, qcodes_ptr + p * qcodes_part_stride + start,
                            qscales_ptr + p * qscales_part_stride + b, j, seed, p * numel + start,
                            QMAX, INT4, STOCHASTIC)
        else:
            _store_from_f32(out_ptr + p * out_part_stride + start + j, acc, m, OUT_BF16)


# True when TRITON_INTERPRET=1 was set when this module was imported (kernels run on the CPU).
INTERPRETED = not isinstance(quantize_kernel, triton.runtime.JITFunction)


def _launch_opts(p2: int) -> dict:
    opts = {"num_warps": 4 if p2 <= 2048 else 8 if p2 <= 8192 else 16}
    if not INTERPRETED:
        opts["enable_fp_fusion"] = False  # never contract acc + q * s into an FMA: match the CPU
    return opts


def launch_quantize(x, x_part_stride: int, codes, codes_part_stride: int, scales, scales_part_stride: int,
                    numel: int, nparts: int, block: int, qmax: int, int4: bool, perm_n: int, perm_l: int,
                    p2: int, seed: int | None = None) -> None:
    """Launch :func:`quantize_kernel` (arguments already validated by :mod:`yashard.quant`)."""
    grid = (triton.cdiv(numel, block), nparts)
    if grid[0] == 0 or nparts == 0:
        return
    x_bf16 = x.dtype == torch.bfloat16
    if x_bf16:
        x = x.view(torch.int16)
    quantize_kernel[grid](x, x_part_stride, codes, codes_part_stride, scales, scales_part_stride,
                          numel, block, perm_n, perm_l, seed or 0,
                          QMAX=qmax, INT4=int4, X_BF16=x_bf16, P2=p2, STOCHASTIC=seed is not None,
                          **_launch_opts(p2))


def launch_dequantize(codes, codes_part_stride: int, codes_red_stride: int,
                      scales, scales_part_stride: int, scales_red_stride: int, nred: int,
                      out, out_part_stride: int, qcodes, qcodes_part_stride: int, qscales, qscales_part_stride: int,
                      numel: int, nparts: int, block: int, qmax: int, int4: bool, p2: int,
                      seed: int | None = None) -> None:
    """Launch :func:`dequantize_kernel`; ``out is None`` selects the requantizing variant."""
    grid = (triton.cdiv(numel, block), nparts)
    if grid[0] == 0 or nparts == 0:
        return
    requant = out is None
    out_bf16 = (not requant) and out.dtype == torch.bfloat16
    if requant:
        out, out_part_stride = qscales, 0  # unused pointer of a valid type
    elif out_bf16:
        out = out.view(torch.int16)
    if not requant:
        qcodes, qcodes_part_stride, qscales, qscales_part_stride = codes, 0, scales, 0  # unused
    dequantize_kernel[grid](codes, codes_part_stride, codes_red_stride,
                            scales, scales_part_stride, scales_red_stride, nred,
                            out, out_part_stride, qcodes, qcodes_part_stride, qscales, qscales_part_stride,
                            numel, block, seed or 0,
                            QMAX=qmax, INT4=int4, OUT_BF16=out_bf16, REQUANT=requant, P2=p2,
                            STOCHASTIC=seed is not None, **_launch_opts(p2))

