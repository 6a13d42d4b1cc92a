"""Pure byte-layout math for packed frozen weights: a 4-bit weight and its quantisation state as one
record of bytes.

A bitsandbytes 4-bit weight is several tensors of several dtypes: the packed codes (uint8, or
another ``quant_storage`` dtype holding the same bytes), the fp32 or uint8 block scales, and with
double quantisation a nested state (fp32 scales, an fp32 code table, an fp32 offset). A decoder
layer of such weights is a *byte unit*: its flat vector and its slot hold bytes, and each weight of
the layer is one entry of :class:`Record` bytes, its parts back to back::

    | data ............ | absmax .. | code | offset | state2.absmax | state2.code | (pad)
    0                   a1          a2     a3       a4              a5            nbytes

Every part starts at a multiple of :data:`PART_ALIGN` bytes, so a part viewed in its own dtype is
as aligned as a freshly allocated tensor. Nothing here touches torch: integers and tuples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# Every part of a record, and every record of a byte unit, starts at a multiple of this many bytes
# (what PARAM_ALIGN elements of fp32 take: 64 bytes).
PART_ALIGN = 64


@dataclass(frozen=True)
class Part:
    """One tensor of a record: its name, its element size in bytes, its shape and its byte offset."""

    name: str
    itemsize: int
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return self.itemsize * math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Record:
    """The parts of one packed weight, back to back in ``nbytes`` bytes."""

    parts: tuple[Part, ...]
    nbytes: int

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)


def record(parts: Sequence[tuple[str, int, Sequence[int]]], align: int = PART_ALIGN) -> Record:
    """Lay out ``(name, itemsize, shape)`` parts back to back, each at a multiple of ``align`` bytes
    (and of its own itemsize); the record ends at a multiple of ``align``."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    out = []
    cursor = 0
    seen = set()
    for name, itemsize, shape in parts:
        if name in seen:
            raise ValueError(f"part {name!r} appears twice in one record")
        seen.add(name)
        if itemsize < 1 or align % itemsize and itemsize % align:
            raise ValueError(f"part {name!r}: itemsize {itemsize} does not divide the alignment {align}")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"part {name!r} has a negative dimension: {shape}")
        cursor = -(-cursor // align) * align
        out.append(Part(name, int(itemsize), shape, cursor))
        cursor += out[-1].nbytes
    return Record(tuple(out), -(-cursor // align) * align)


def byte_shard_align(shard_align: int, itemsize: int = 4) -> int:
    """A byte unit's shards are a multiple of ``shard_align`` fp32 elements, in bytes: the same
    alignment the float units' shards have."""
    return max(1, shard_align) * itemsize

