"""Block-based symmetric quantization (int8, int4) for quantized communication (ZeRO++ qwZ / qgZ).

Format
------
A 1-D float tensor (fp32, bf16 or fp16) of ``n`` elements is cut into blocks of ``block`` elements
(the last one may be partial). Each block gets one fp32 scale and one code per element:

* ``scale = absmax(block) / qmax`` with ``qmax = 127`` (int8) or ``7`` (int4), computed in fp32 with
  IEEE division; ``code = round_half_to_even(clamp(x / scale, -qmax, qmax))`` (``x / 1`` for an all-zero
  block, whose scale is 0, so no NaN appears); ``dequant = code * scale`` in fp32, then cast (round to
  nearest even) to the output dtype.
* int8 codes are one byte each (two's complement). int4 codes are packed two per byte, element ``2k`` in
  the low nibble and ``2k + 1`` in the high nibble, each stored as ``code + 8`` (1..15); a missing last
  element of an odd-length tensor is stored as code 0 (nibble 8). int4 needs an even ``block``.
* A block holding an inf or a NaN gets scale NaN and codes 0, so it dequantizes to NaN everywhere
  (an overflow stays visible after communication).
* Stochastic rounding (``seed=`` an int; used for gradients by qgZ): ``code = min(floor(v + u), qmax)``
  with ``v = clamp(x / scale, -qmax, qmax)`` and ``u`` in [0, 1) drawn per element from a counter-based
  hash of (seed, element index) (:func:`uniform`), so ``E[dequant] = x`` up to fp32 rounding: rounding
  to nearest always shrinks the many elements below half a step to 0, a bias that int4 gradients
  carry into training. Same seed, same codes, on every backend.

Error bound (documented contract, tested): for a finite block with absmax ``A`` and scale ``s``, every
element satisfies ``|x - dequant_fp32(x)| <= s/2 + A * 2**-22 + 2**-140`` (``s`` instead of ``s/2``
with stochastic rounding): half a quantization step, plus
the fp32 rounding of ``x / s`` and ``code * s`` (``A * 2**-22``), plus a term below 2**-140 that only
matters when ``s`` is subnormal or zero (``A < 2**-119``); it assumes ``A * (1 + 2**-22)`` is below
the largest fp32 value: a block whose absmax lies closer to it than that (``|x| > 3.4e38``, far beyond
any gradient or weight that trains) may dequantize its largest elements to +-inf, since the product
``code * s`` can round up past it. Dequantizing into bf16/fp16 adds the
rounding of that dtype: ``|dequant_fp32| * u + eta / 2`` with ``u = 2**-8`` (bf16) or ``2**-11`` (fp16)
and ``eta`` the dtype's smallest subnormal.

Implementations
---------------
Triton kernels (:mod:`yashard.kernels.quant_triton`) for CUDA tensors, a torch implementation for
everything else (and for CUDA when triton is missing); ``backend="auto"`` picks by device. Both produce
bitwise-identical codes, scales and dequantized values (same IEEE fp32 operations in the same order, no
FMA contraction, no flush-to-zero; NaN payloads may differ). The
Triton path allocates nothing and never synchronizes the device: it runs on the current stream. The
torch path allocates temporaries (it serves CPU runs and tests).

Packed parts
------------
Communication moves codes and scales in one byte buffer. One *part* (``numel`` elements) is laid out
as ``[codes | pad to 16 | scales (fp32) | pad to 16]``, ``packed_layout(numel, bits, block).nbytes``
bytes; ``k`` parts are back to back. :func:`quantize_parts` / :func:`dequantize_parts` work on such
buffers (several parts per launch, optional slice reordering, fused reduction and requantization).
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

QMAX = {8: 127, 4: 7}
MAX_BLOCK = 32768
ALIGN = 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "triton", "torch")


# ----------------------------------------------------------------------------------------- sizes


def check_format(bits: int, block: int, default: int = 4096) -> None:
    """Raise ValueError unless ``bits`` is 8 or 4 and ``block`` is a valid block size for it
    (``default``: the caller's default block, which the message suggests)."""
    if bits not in QMAX:
        raise ValueError(f"quantization bits must be 8 or 4, got {bits!r}")
    if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"quantization block must be an int in [1, {MAX_BLOCK}], got {block!r}; "
                         f"the default is {default}")
    if bits == 4 and block % 2:
        raise ValueError(f"int4 packs two codes per byte, so the block must be even, got block={block}; "
                         f"use e.g. {default}")


def num_blocks(numel: int, block: int) -> int:
    """Number of quantization blocks (= fp32 scales) for ``numel`` elements: ceil(numel / block)."""
    return -(-numel // block)


def codes_nbytes(numel: int, bits: int) -> int:
    """Bytes of codes for ``numel`` elements: ``numel`` (int8) or ceil(numel / 2) (int4)."""
    return numel if bits == 8 else (numel + 1) // 2


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PackedLayout(NamedTuple):
    """Byte layout of one packed part of ``numel`` elements: codes at 0, scales at ``scales_offset``."""

    numel: int
    bits: int
    block: int
    codes_nbytes: int
    scales_offset: int
    num_blocks: int
    nbytes: int  # the whole part, a multiple of 16


def packed_layout(numel: int, bits: int = 8, block: int = 4096) -> PackedLayout:
    """The layout of one packed part (pure): ``[codes | pad | fp32 scales | pad]``, 16-byte aligned."""
    check_format(bits, block)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    cb, nb = codes_nbytes(numel, bits), num_blocks(numel, block)
    return PackedLayout(numel, bits, block, cb, _align(cb), nb, _align(cb) + _align(4 * nb))


def qwz_workspace_nbytes(shard_numel: int, world: int, *, bits: int = 8, block: int = 4096) -> int:
    """Bytes of the qwZ workspace: ``world`` packed parts of ``shard_numel`` elements."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return world * packed_layout(shard_numel, bits, block).nbytes


def packed_nbytes(numel: int, bits: int = 8, block: int = 4096) -> int:
    """Bytes of one packed part of ``numel`` elements (codes + scales + alignment padding)."""
    return packed_layout(numel, bits, block).nbytes


def transpose_order(rows: int, cols: int) -> list[int]:
    """``order[p]``: the piece that part ``p`` takes when ``rows * cols`` pieces, numbered row-major
    (piece ``r * cols + c``), are read column by column: ``order[p] = (p % rows) * cols + p // rows``.
    ``cols == 1`` is the identity."""
    return [(p % rows) * cols + p // rows for p in range(rows * cols)]


# -------------------------------------------------------------------------------------- backends

_TRITON = None


def _triton_module():
    """yashard.kernels.quant_triton, or None when triton cannot be imported (checked once)."""
    global _TRITON
    if _TRITON is None:
        try:
            _TRITON = importlib.import_module("yashard.kernels.quant_triton")
        except ImportError:
            _TRITON = False
    return _TRITON or None


def triton_available() -> bool:
    """True when the Triton kernels can be imported."""
    return _triton_module() is not None


def resolve_backend(device: torch.device, backend: str = "auto") -> str:
    """``"triton"`` or ``"torch"``: auto picks Triton for CUDA tensors when triton imports."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend='triton' was requested but triton cannot be imported: "
                           "pip install triton, or use backend='auto'/'torch'")
    return backend


def _p2(block: int) -> int:
    return 1 << max(block - 1, 1).bit_length()


# ----------------------------------------------------------------------------------- validation


def check_float(name: str, t: torch.Tensor, numel: int | None = None) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)} "
                         f"(contiguous={t.is_contiguous()}); pass t.reshape(-1) of a contiguous tensor")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")


def check_bytes(name: str, t: torch.Tensor, need: int) -> None:
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D torch.uint8 buffer, got dtype {t.dtype}, "
                         f"shape {tuple(t.shape)}")
    if t.numel() < need:
        raise ValueError(f"{name} holds {t.numel()} bytes but {need} are needed; size it with the "
                         f"matching *_nbytes helper")
    if t.device.type != "meta" and t.data_ptr() % ALIGN:
        raise ValueError(f"{name} must start at a {ALIGN}-byte aligned address (its scales are read as "
                         f"fp32); slice byte workspaces at multiples of {ALIGN}")


def _check_seed(seed) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31):
        raise ValueError(f"seed must be None (round to nearest) or an int in [0, 2**31), got {seed!r}; "
                         "make one with mix_seed(...)")


def _check_device(**tensors: torch.Tensor) -> torch.device:
    devs = {k: v.device for k, v in tensors.items()}
    first = next(iter(devs.values()))
    if any(d != first for d in devs.values()):
        raise ValueError(f"all tensors must be on one device, got {devs}")
    return first


# ----------------------------------------------------------------------------- random numbers

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 tensors holding uint32 values, without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + ((hi * (c & 0xFFFF)) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, "lowbias32") of uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def mix_seed(*values: int) -> int:
    """One 31-bit seed from several ints in [0, 2**32) (a call counter, a unit index, a rank, a stage)."""
    h = 0x9E3779B9
    for v in values:
        if not 0 <= v <= _M32:
            raise ValueError(f"mix_seed takes ints in [0, 2**32), got {v}")
        h = int(_hash32(torch.tensor([h ^ v], dtype=torch.int64))[0])
    return h & 0x7FFFFFFF


def uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """fp32 numbers in [0, 1) with 24 random bits, one per element index (int64 tensor):
    ``hash32(hash32(index mod 2**32) ^ seed) >> 8`` times 2**-24. A pure function of its inputs; the
    Triton kernels compute the same bits."""
    h = _hash32(_hash32(index & _M32) ^ (seed & _M32))
    return (h >> 8).to(torch.float32) * (2.0 ** -24)


# ------------------------------------------------------------------------------ torch fallback


def _torch_quantize(xs: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, qmax: int, int4: bool,
                    block: int, seed: int | None = None) -> None:
    """xs (k, m) float -> codes (k, codes_nbytes(m)) uint8 view, scales (k, nb) fp32 view; with a
    ``seed``, stochastic rounding with element ``i`` of row ``p`` drawing ``uniform(seed, p * m + i)``."""
    k, m = xs.shape
    nb = scales.shape[1]
    xf = torch.zeros(k, nb * block, dtype=torch.float32, device=xs.device)
    xf[:, :m] = xs
    xf = xf.view(k, nb, block)
    bad = ~torch.isfinite(xf).all(dim=2)
    scale = xf.abs().amax(dim=2) / torch.full((), float(qmax), device=xs.device)
    safe = torch.where(scale > 0, scale, torch.ones((), device=xs.device))
    v = xf / safe[:, :, None]
    v = torch.where(bad[:, :, None], torch.zeros((), device=xs.device), v).clamp_(-qmax, qmax)
    if seed is None:
        q = torch.round(v).to(torch.int32).view(k, nb * block)[:, :m]
    else:
        v = v.view(k, nb * block)[:, :m]
        idx = torch.arange(k, dtype=torch.int64, device=xs.device)[:, None] * m + torch.arange(m, device=xs.device)
        q = torch.floor(v + uniform(seed, idx)).clamp_(max=qmax).to(torch.int32)
    scales.copy_(torch.where(bad, torch.full((), float("nan"), device=xs.device), scale))
    if int4:
        pairs = torch.zeros(k, 2 * codes.shape[1], dtype=torch.int32, device=xs.device)
        pairs[:, :m] = q
        pairs = pairs.view(k, -1, 2) + 8
        codes.copy_((pairs[:, :, 0] | (pairs[:, :, 1] << 4)).to(torch.uint8))
    else:
        codes.copy_(q.to(torch.int8).view(torch.uint8))


def _torch_dequant(codes: torch.Tensor, scales: torch.Tensor, m: int, int4: bool, block: int) -> torch.Tensor:
    """codes (k, cb) uint8, scales (k, nb) fp32 -> values (k, m) fp32 (code * scale)."""
    k, nb = scales.shape
    if int4:
        c = codes.to(torch.int32)
        q = torch.stack([(c & 15) - 8, (c >> 4) - 8], dim=2).view(k, -1)[:, :m]
    else:
        q = codes.view(torch.int8)[:, :m].to(torch.int32)
    qf = torch.zeros(k, nb * block, dtype=torch.float32, device=codes.device)
    qf[:, :m] = q
    return (qf.view(k, nb, block) * scales[:, :, None]).view(k, nb * block)[:, :m]


def _part_views(buf: torch.Tensor, lay: PackedLayout, nparts: int, offset: int = 0):
    parts = buf[offset:offset + nparts * lay.nbytes].view(nparts, lay.nbytes)
    codes = parts[:, :lay.codes_nbytes]
    scales = parts[:, lay.scales_offset:lay.scales_offset + 4 * lay.num_blocks].view(torch.float32)
    return codes, scales


def _f32_view(buf: torch.Tensor) -> torch.Tensor:
    """The fp32 view of a uint8 buffer's first multiple-of-4 bytes (for scale pointers)."""
    return buf[: buf.numel() // 4 * 4].view(torch.float32)


# ------------------------------------------------------------------------------------- 1-D API


def _check_codes_scales(codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int, block: int) -> None:
    """Raise ValueError unless ``codes``/``scales`` are the contiguous 1-D buffers for ``n`` elements."""
    if codes.dtype not in (torch.uint8, torch.int8) or codes.dim() != 1 or not codes.is_contiguous():
        raise ValueError(f"codes must be a contiguous 1-D uint8/int8 tensor, got {codes.dtype} "
                         f"shape {tuple(codes.shape)}")
    if codes.numel() != codes_nbytes(n, bits):
        raise ValueError(f"codes has {codes.numel()} bytes, expected codes_nbytes({n}, bits={bits}) = "
                         f"{codes_nbytes(n, bits)}")
    if scales.dtype != torch.float32 or scales.dim() != 1 or not scales.is_contiguous():
        raise ValueError(f"scales must be a contiguous 1-D float32 tensor, got {scales.dtype} "
                         f"shape {tuple(scales.shape)}")
    if scales.numel() != num_blocks(n, block):
        raise ValueError(f"scales has {scales.numel()} elements, expected num_blocks({n}, block={block}) = "
                         f"{num_blocks(n, block)}")


def quantize(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, bits: int = 8,
             block: int = 4096, seed: int | None = None, backend: str = "auto") -> None:
    """Quantize ``x`` (contiguous 1-D fp32/bf16/fp16) into ``codes`` and ``scales`` (see module doc);
    ``seed``: None rounds to nearest even, an int rounds stochastically (element ``i`` draws
    ``uniform(seed, i)``).

    ``codes``: contiguous 1-D uint8 or int8 with ``codes_nbytes(x.numel(), bits)`` elements.
    ``scales``: contiguous 1-D fp32 with ``num_blocks(x.numel(), block)`` elements. Nothing is allocated
    on the Triton path; all three tensors must share one device."""
    check_format(bits, block)
    check_float("x", x)
    n = x.numel()
    _check_codes_scales(codes, scales, n, bits, block)
    device = _check_device(x=x, codes=codes, scales=scales)
    _check_seed(seed)
    codes = codes.view(torch.uint8)
    if resolve_backend(device, backend) == "triton":
        _triton_module().launch_quantize(x, n, codes, 0, scales, 0, n, 1, block, QMAX[bits], bits == 4,
                                         1, 1, _p2(block), seed)
    else:
        _torch_quantize(x.view(1, n), codes.view(1, -1), scales.view(1, -1), QMAX[bits], bits == 4, block, seed)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bits: int = 8,
               block: int = 4096, backend: str = "auto") -> None:
    """Write ``code * scale`` (fp32, then cast to ``out.dtype``) into ``out`` (contiguous 1-D fp32/bf16/
    fp16 with as many elements as were quantized). ``codes``/``scales`` as produced by :func:`quantize`."""
    check_format(bits, block)
    check_float("out", out)
    n = out.numel()
    _check_codes_scales(codes, scales, n, bits, block)
    device = _check_device(codes=codes, scales=scales, out=out)
    codes = codes.view(torch.uint8)
    if resolve_backend(device, backend) == "triton":
        _triton_module().launch_dequantize(codes, 0, 0, scales, 0, 0, 1, out, 0, None, 0, None, 0,
                                           n, 1, block, QMAX[bits], bits == 4, _p2(block))
    else:
        out.copy_(_torch_dequant(codes.view(1, -1), scales.view(1, -1), n, bits == 4, block).view(n))


# ---------------------------------------------------------------------------------- packed parts


def quantize_parts(x: torch.Tensor, buf: torch.Tensor, *, nparts: int, bits: int = 8, block: int = 4096,
                   transpose: tuple[int, int] | None = None, seed: int | None = None,
                   backend: str = "auto") -> None:
    """Quantize ``x`` (contiguous 1-D float, ``nparts * m`` elements: pieces of ``m`` elements) into the
    first ``nparts * packed_nbytes(m, bits, block)`` bytes of ``buf`` (contiguous uint8), one packed
    part per piece; blocks never straddle pieces.

    ``transpose=(rows, cols)`` (``rows * cols == nparts``) reorders on the fly: part ``p`` holds piece
    ``transpose_order(rows, cols)[p]``; ``None`` keeps the order. ``seed``: stochastic rounding, element
    ``i`` of part ``p`` drawing ``uniform(seed, p * m + i)``; None rounds to nearest even."""
    check_format(bits, block)
    check_float("x", x)
    if nparts < 1 or x.numel() % nparts:
        raise ValueError(f"x has {x.numel()} elements, not a multiple of nparts={nparts}")
    rows, cols = transpose if transpose is not None else (nparts, 1)
    if rows < 1 or cols < 1 or rows * cols != nparts:
        raise ValueError(f"transpose={transpose} must be (rows, cols) with rows * cols == nparts={nparts}")
    _check_seed(seed)
    m = x.numel() // nparts
    lay = packed_layout(m, bits, block)
    check_bytes("buf", buf, nparts * lay.nbytes)
    device = _check_device(x=x, buf=buf)
    if m == 0:
        return
    if resolve_backend(device, backend) == "triton":
        sc = _f32_view(buf)[lay.scales_offset // 4:]
        _triton_module().launch_quantize(x, m, buf, lay.nbytes, sc, lay.nbytes // 4, m, nparts, block,
                                         QMAX[bits], bits == 4, rows, cols, _p2(block), seed)
    else:
        # piece r * cols + c goes to part c * rows + r (transpose_order), as a view: no index tensor
        xs = x.view(rows, cols, m).transpose(0, 1).reshape(nparts, m)
        codes, scales = _part_views(buf, lay, nparts)
        _torch_quantize(xs, codes, scales, QMAX[bits], bits == 4, block, seed)


def dequantize_parts(buf: torch.Tensor, *, nparts: int, numel: int, out: torch.Tensor | None = None,
                     requant: torch.Tensor | None = None, nreduce: int = 1, reduce_stride: int | None = None,
                     bits: int = 8, block: int = 4096, seed: int | None = None, backend: str = "auto") -> None:
    """Dequantize ``nparts`` packed parts of ``numel`` elements each, summing ``nreduce`` copies.

    Copy ``r`` of part ``p`` starts at byte ``r * reduce_stride + p * packed_nbytes(numel)`` of ``buf``
    (``reduce_stride`` defaults to ``nparts * packed_nbytes(numel)``, i.e. copies back to back; it must
    be a multiple of 16). The sum is taken in fp32 in order ``r = 0, 1, ...`` starting from +0.0.
    Exactly one destination: ``out`` (contiguous 1-D float, ``nparts * numel`` elements, part ``p`` at
    ``p * numel``) receives the sum cast to its dtype; or ``requant`` (contiguous uint8, at least
    ``nparts * packed_nbytes(numel)`` bytes, must not overlap the parts read) receives the sum quantized
    again in the same format (the fused dequantize-reduce-quantize step of qgZ), rounded stochastically
    when ``seed`` is an int (as :func:`quantize_parts`; ``seed`` needs ``requant``)."""
    check_format(bits, block)
    if (out is None) == (requant is None):
        raise ValueError("dequantize_parts needs exactly one of out= (values) or requant= (a packed buffer)")
    _check_seed(seed)
    if seed is not None and requant is None:
        raise ValueError("seed= sets how dequantize_parts rounds when it quantizes again: pass requant=, or no seed")
    lay = packed_layout(numel, bits, block)
    if nparts < 1 or nreduce < 1:
        raise ValueError(f"nparts and nreduce must be >= 1, got nparts={nparts}, nreduce={nreduce}")
    stride = nparts * lay.nbytes if reduce_stride is None else reduce_stride
    if stride % ALIGN or stride < 0:
        raise ValueError(f"reduce_stride must be a non-negative multiple of {ALIGN} bytes, got {stride}")
    check_bytes("buf", buf, (nreduce - 1) * stride + nparts * lay.nbytes)
    if out is not None:
        check_float("out", out, nparts * numel)
        device = _check_device(buf=buf, out=out)
    else:
        check_bytes("requant", requant, nparts * lay.nbytes)
        device = _check_device(buf=buf, requant=requant)
    qmax, int4 = QMAX[bits], bits == 4
    if numel == 0:
        return
    if resolve_backend(device, backend) == "triton":
        sc = _f32_view(buf)[lay.scales_offset // 4:]
        qsc = None if requant is None else _f32_view(requant)[lay.scales_offset // 4:]
        _triton_module().launch_dequantize(buf, lay.nbytes, stride, sc, lay.nbytes // 4, stride // 4, nreduce,
                                           out, numel, requant, lay.nbytes, qsc, lay.nbytes // 4,
                                           numel, nparts, block, qmax, int4, _p2(block), seed)
        return
    acc = torch.zeros(nparts, numel, dtype=torch.float32, device=device)
    for r in range(nreduce):
        codes, scales = _part_views(buf, lay, nparts, offset=r * stride)
        acc = acc + _torch_dequant(codes, scales, numel, int4, block)
    if out is not None:
        out.view(nparts, numel).copy_(acc)
    else:
        codes, scales = _part_views(requant, lay, nparts)
        _torch_quantize(acc, codes, scales, qmax, int4, block, seed)
