"""Reading parts of tensors from safetensors files without loading whole tensors.

safetensors files hold no code: reading one never runs anything, unlike a pickle. The format is an
8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}``
and the raw little-endian data. :class:`SafetensorsFile` reads a flat element range of a tensor
with one ``pread`` straight into a fresh tensor: no memory map, so a rank's memory grows only by
what it asked for (a memory-mapped read would keep every touched page of the file resident).
"""

from __future__ import annotations

import json
import math
import os

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
                     ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("C64", "complex64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

MAX_HEADER_BYTES = 100 * 2**20


class SafetensorsError(ValueError):
    """A file is not a valid safetensors file (truncated, garbage, inconsistent header)."""


def rows_covering(shape: tuple[int, ...], lo: int, hi: int) -> tuple[int, int, int]:
    """Rows ``[r0, r1)`` of a tensor of ``shape`` whose flattened elements cover ``[lo, hi)``.

    Returns ``(r0, r1, skip)`` where ``skip`` is how many leading elements of row ``r0`` lie before
    ``lo``. A 0-d or 1-D tensor has rows of one element.
    """
    numel = math.prod(shape)
    if not 0 <= lo <= hi <= numel:
        raise ValueError(f"flat range [{lo}, {hi}) is outside a tensor of shape {tuple(shape)} ({numel} elements)")
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    r0 = lo // row
    r1 = -(-hi // row)
    return r0, r1, lo - r0 * row


def read_flat_range(handle, name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened tensor ``name`` from an open ``safe_open`` handle.

    Reads only the rows that cover the range; returns a 1-D tensor in the file's dtype.
    """
    if hi <= lo:
        return torch.empty(0)
    if len(shape) == 0:
        return handle.get_tensor(name).reshape(1)[lo:hi]
    r0, r1, skip = rows_covering(tuple(shape), lo, hi)
    part = handle.get_slice(name)[r0:r1]
    return part.reshape(-1).narrow(0, skip, hi - lo)


class SafetensorsFile:
    """One safetensors file, header parsed and validated; tensors read by flat element range.

    Contract: the constructor reads only the header and raises :class:`SafetensorsError` naming the
    file when it is truncated, not safetensors, or inconsistent (offsets outside the data, sizes
    that do not match dtype x shape, overlapping tensors). ``read`` returns a new 1-D tensor.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{self.path}: {size} bytes, too short for a safetensors header")
            n = int.from_bytes(head, "little")
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise SafetensorsError(f"{self.path}: header length {n} does not fit the file ({size} bytes); "
                                       "the file is truncated or not safetensors")
            raw = f.read(n)
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise TypeError("header is not a JSON object")
        except (ValueError, TypeError) as e:
            raise SafetensorsError(f"{self.path}: the header is not valid JSON ({e}); not a safetensors file") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        data_size = size - self.data_start
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        spans = []
        self.unreadable: dict[str, str] = {}  # name -> a dtype this torch has no type for (never read)
        for name, info in header.items():
            try:
                code = info["dtype"]
                shape = tuple(int(s) for s in info["shape"])
                start, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise SafetensorsError(f"{self.path}: bad header entry for {name!r} ({e!r})") from None
            dtype = _DTYPES.get(code)
            if dtype is None:  # a valid file may hold tensors of it: refused only if one is read
                if not 0 <= start <= end <= data_size:
                    raise SafetensorsError(f"{self.path}: tensor {name!r} claims bytes [{start}, {end}) but the data "
                                           f"section holds {data_size} bytes; the file is truncated or corrupt")
                self.unreadable[name] = str(code)
                spans.append((start, end, name))
                continue
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if not 0 <= start <= end <= data_size or end - start != nbytes:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} claims bytes [{start}, {end}) but the data section holds "
                    f"{data_size} bytes and dtype x shape needs {nbytes}; the file is truncated or corrupt"
                )
            self.tensors[name] = (dtype, shape, start)
            spans.append((start, end, name))
        spans.sort()
        for (s0, e0, a), (s1, _, b) in zip(spans, spans[1:]):
            if s1 < e0:
                raise SafetensorsError(f"{self.path}: tensors {a!r} and {b!r} overlap; the file is corrupt")

    def keys(self):
        return self.tensors.keys() | self.unreadable.keys()

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        if name in self.unreadable:
            raise SafetensorsError(f"{self.path}: tensor {name!r} is stored as {self.unreadable[name]}, a dtype this "
                                   f"torch ({torch.__version__}) has no type for; yashard loads float weights only")
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[0]

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor ``name`` (all of it by default), 1-D."""
        dtype, shape, start = self._entry(name)
        numel = math.prod(shape)
        hi = numel if hi is None else hi
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"flat range [{lo}, {hi}) is outside {name} of shape {list(shape)} in {self.path}")
        esize = torch.empty((), dtype=dtype).element_size()
        out = torch.empty(hi - lo, dtype=dtype)
        if hi == lo:
            return out
        view = memoryview(out.view(torch.uint8).numpy())
        got = 0
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + start + lo * esize)
            while got < len(view):  # one read() moves at most ~2 GiB on Linux
                n = f.readinto(view[got:])
                if not n:
                    raise SafetensorsError(f"{self.path}: short read of {name} ({got} of {len(view)} bytes); "
                                           "the file is truncated")
                got += n
        return out
