"""Reading parts of tensors from safetensors files without loading whole tensors.

safetensors files are memory-mapped and hold no code: opening one never runs anything, unlike a
pickle. A rank that owns the flat range ``[lo, hi)`` of a parameter reads only the rows that cover
that range.
"""

from __future__ import annotations

import math

import torch


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
