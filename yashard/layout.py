"""Pure layout math: where every parameter lives in a flat unit, and which slice each rank owns.

Nothing here touches torch.distributed or allocates device memory; everything is integers and
tuples so it can be unit-tested in microseconds.

A *unit* is a set of parameters that is gathered and reduced together (one decoder layer, the
embedding, the lm_head, or the group of all 1-D parameters). Its parameters are laid out back to
back in a flat vector, in a fixed order::

    | p0 ........ | p1 .... | p2 ................ | pad |
    0             o1        o2                    total  padded = shard_numel * world

The flat vector is cut into ``world`` equal shards; rank ``r`` owns
``[r * shard_numel, (r + 1) * shard_numel)``. Shard boundaries may cut through a parameter, so each
rank's shard holds pieces of several parameters; :func:`shard_pieces` lists them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence


def slot_assignment(units: Sequence[str], alternate: bool, share_outer: bool = False) -> dict[str, str]:
    """Which slot each unit owns in turn, layers first (so the slots are listed layers first).

    ``units`` are unit keys: ``"layer_<i>"``, ``"embed"``, ``"lm_head"``, ``"adapters"`` (the
    adapter group), ``"small"`` (the norm group). ``alternate``
    (``ShardConfig.reshard_after_forward=True``): even and odd decoder layers share ``"layer_even"``
    / ``"layer_odd"``, the embedding and the lm_head share ``"outer"``, the adapter group and the
    norm group have a slot of their own, named after them. Otherwise every unit has a slot of its
    own, named after it. ``share_outer`` (``ShardConfig.share_outer_slot``): the embedding and the
    lm_head each get a slot of their own, which :func:`outer_arena` places inside the layer slots'
    buffer."""
    ordered = [k for k in units if k.startswith("layer_")] + [k for k in units if not k.startswith("layer_")]
    if not alternate:
        return {k: k for k in ordered}
    out = {}
    for k in ordered:
        if k.startswith("layer_"):
            out[k] = "layer_even" if int(k.split("_")[1]) % 2 == 0 else "layer_odd"
        else:
            out[k] = k if k in ("small", "adapters") or share_outer else "outer"
    return out


@dataclass(frozen=True)
class Arena:
    """One buffer that several slots are views of (``ShardConfig.share_outer_slot``): slot ``name``
    is ``[offsets[name], offsets[name] + sizes[name])`` of ``numel`` elements."""

    numel: int
    offsets: dict
    sizes: dict

    def span(self, name: str) -> tuple[int, int]:
        return self.offsets[name], self.offsets[name] + self.sizes[name]

    def overlaps(self, name: str) -> tuple[str, ...]:
        """The other slots sharing memory with slot ``name``, in the arena's order."""
        lo, hi = self.span(name)
        return tuple(o for o in self.offsets if o != name and lo < self.span(o)[1] and self.span(o)[0] < hi
                     and hi > lo and self.sizes[o] > 0)

    def draw(self, width: int = 60) -> str:
        """The slots as bars over the arena, one line each::

            layer_even  |##############################..............................|
            layer_odd   |..............................##############################|
            embed       |..................######################################|
        """
        scale = width / max(self.numel, 1)
        lines = []
        for name in self.offsets:
            lo, hi = self.span(name)
            a, b = round(lo * scale), round(hi * scale)
            lines.append(f"{name:<11} |{'.' * a}{'#' * (b - a)}{'.' * (width - b)}|")
        return "\n".join(lines)


def outer_arena(sizes: dict[str, int], n_layers: int, align: int = 16) -> Arena:
    """Where the slots go in the one buffer they share (``ShardConfig.share_outer_slot``), for the
    weights or, with the gradient sizes, for the gradients.

    ``layer_even`` then ``layer_odd``, end to end; the buffer is as large as those two, or as the
    embedding or the lm_head if one is larger. The outer units overlap the layer slots, and each is
    placed so that it covers first the layer slot needed last around it:

    * the embedding ends where the buffer ends, over ``layer_odd`` first: its forward comes right
      before layer 0's (even), and its gradients right after layer 1's were reduced (odd), while
      layer 0's reduction may still be running;
    * the lm_head covers layer ``L-2``'s slot first: its gather can start while layer ``L-1``
      computes, and in the backward layer ``L-1``'s re-gather and gradients come right after the
      lm_head's, before ``L-2``'s.

    A slot of size 0 (no unit trains in it: gradients) takes no memory. Every slot starts at a
    multiple of ``align`` elements, as a buffer of its own would be aligned (kernels pick their
    code by the pointer's alignment)."""
    even, odd = sizes.get("layer_even", 0), sizes.get("layer_odd", 0)
    embed, head = sizes.get("embed", 0), sizes.get("lm_head", 0)
    odd_at = round_up(even, align)
    numel = round_up(max(odd_at + odd, embed, head), align)
    offsets = {"layer_even": 0, "layer_odd": odd_at}
    if "embed" in sizes:
        offsets["embed"] = (numel - embed) // align * align
    if "lm_head" in sizes:
        offsets["lm_head"] = 0 if (n_layers - 2) % 2 == 0 else (numel - head) // align * align
    return Arena(numel, offsets, {k: sizes.get(k, 0) for k in offsets})


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b for non-negative a and positive b."""
    if b <= 0:
        raise ValueError(f"ceil_div needs a positive divisor, got {b}")
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n."""
    return ceil_div(n, multiple) * multiple


@dataclass(frozen=True)
class Entry:
    """One parameter inside a flat unit."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one entry that falls inside one rank's shard.

    ``entry_start``/``entry_end`` index the entry's flattened elements; ``shard_start`` is where
    that part starts inside the rank's shard.
    """

    entry: int
    entry_start: int
    entry_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.entry_end - self.entry_start


@dataclass(frozen=True)
class FlatLayout:
    """Layout of one unit sharded over ``world`` ranks.

    Attributes:
        entries: parameters in flat order, each with its offset.
        total: end of the last entry: the entry sizes plus the alignment gaps between entries.
        shard_numel: elements per rank; ``shard_numel * world >= total``.
        world: number of ranks the unit is sharded over.
    """

    entries: tuple[Entry, ...]
    total: int
    shard_numel: int
    world: int

    @property
    def padded(self) -> int:
        """Size of the gathered flat vector, padding included."""
        return self.shard_numel * self.world

    @property
    def padding(self) -> int:
        return self.padded - self.total

    @functools.cached_property
    def signature(self) -> tuple:
        """Hashable description of which flat ranges hold parameters (used to skip re-zeroing)."""
        return (tuple((e.offset, e.numel) for e in self.entries), self.padded)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Half-open flat range ``[start, end)`` owned by ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside world size {self.world}")
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def gaps(self) -> list[tuple[int, int]]:
        """Flat ranges that belong to no parameter (alignment gaps and tail padding)."""
        out: list[tuple[int, int]] = []
        cursor = 0
        for e in self.entries:
            if e.offset > cursor:
                out.append((cursor, e.offset))
            cursor = max(cursor, e.end)
        if self.padded > cursor:
            out.append((cursor, self.padded))
        return out


def build_layout(
    named_shapes: Sequence[tuple[str, Sequence[int]]],
    world: int,
    *,
    param_align: int = 1,
    shard_align: int = 1,
) -> FlatLayout:
    """Lay parameters out back to back and split the result into ``world`` equal shards.

    Args:
        named_shapes: ``(name, shape)`` in flat order.
        world: number of ranks.
        param_align: every parameter starts at a multiple of this many elements.
        shard_align: every shard's length is a multiple of this many elements.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if param_align < 1 or shard_align < 1:
        raise ValueError(f"alignments must be >= 1, got param_align={param_align}, shard_align={shard_align}")
    if not named_shapes:
        raise ValueError("a unit needs at least one parameter")
    entries = []
    cursor = 0
    seen: set[str] = set()
    for name, shape in named_shapes:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice in one unit")
        seen.add(name)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"parameter {name!r} has a negative dimension: {shape}")
        cursor = round_up(cursor, param_align)
        entries.append(Entry(name, shape, cursor))
        cursor += math.prod(shape)
    total = cursor
    shard_numel = round_up(max(ceil_div(total, world), 1), shard_align)
    return FlatLayout(tuple(entries), total, shard_numel, world)


def shard_pieces(layout: FlatLayout, rank: int) -> list[Piece]:
    """The pieces of every entry that lie inside ``rank``'s shard, in flat order."""
    start, end = layout.shard_range(rank)
    pieces = []
    for i, e in enumerate(layout.entries):
        lo, hi = max(e.offset, start), min(e.end, end)
        if lo < hi:
            pieces.append(Piece(i, lo - e.offset, hi - e.offset, lo - start))
    return pieces


def shard_ranges_of(layout: FlatLayout, rank: int, selected: Sequence[bool]) -> list[tuple[int, int]]:
    """Ranges ``[lo, hi)`` of ``rank``'s shard (shard-local offsets) that hold elements of the
    entries whose flag in ``selected`` is True, merged where adjacent (alignment gaps and padding
    between them are not included)."""
    if len(selected) != len(layout.entries):
        raise ValueError(f"{len(selected)} flags for {len(layout.entries)} entries")
    out: list[tuple[int, int]] = []
    for pc in shard_pieces(layout, rank):
        if not selected[pc.entry]:
            continue
        lo, hi = pc.shard_start, pc.shard_start + pc.numel
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def uncovered_ranges(layout: FlatLayout, written: Sequence[bool]) -> list[tuple[int, int]]:
    """Flat ranges of entries whose flag in ``written`` is False, merged where adjacent."""
    if len(written) != len(layout.entries):
        raise ValueError(f"{len(written)} flags for {len(layout.entries)} entries")
    out: list[tuple[int, int]] = []
    for e, w in zip(layout.entries, written):
        if w or e.numel == 0:
            continue
        if out and out[-1][1] == e.offset:
            out[-1] = (out[-1][0], e.end)
        else:
            out.append((e.offset, e.end))
    return out


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Cut elements ``[lo, hi)`` of a row-major tensor of ``shape`` into rectangular boxes.

    Returns ``(offsets, sizes, flat_start)`` per box, in flat order: the box covers
    ``tensor[offsets[0]:offsets[0] + sizes[0], ...]`` and is the contiguous flat range that starts at
    ``flat_start``. At most ``2 * ndim - 1`` boxes: a partial leading row, a block of whole rows and a
    partial trailing row, each cut the same way one dimension down. A 0-d tensor is one box.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= lo <= hi <= total:
        raise ValueError(f"range [{lo}, {hi}) is outside a tensor of shape {shape} ({total} elements)")
    if lo == hi:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)]
    inner = total // shape[0]
    rest = shape[1:]

    def in_row(row: int, a: int, b: int):
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_range_boxes(rest, a, b)]

    r0, r1 = lo // inner, hi // inner
    if r0 == r1:
        return in_row(r0, lo - r0 * inner, hi - r0 * inner)
    out = []
    if lo % inner:
        out += in_row(r0, lo % inner, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * len(rest), (r1 - r0, *rest), r0 * inner))
    if hi % inner:
        out += in_row(r1, 0, hi % inner)
    return out


# Chunked reduction of 16-bit gradient slots (``build.compact_grads``): a unit's gradients wait in
# its slot in ``param_dtype`` and are widened to ``reduce_dtype`` one chunk at a time, into one
# staging buffer of ``world * reduce_chunk(...)`` elements, each chunk reduce-scattered on its own.
# A chunk covers at most REDUCE_CHUNK_NUMEL elements over all ranks (256 MiB in fp32), and each
# rank's part of it at least REDUCE_CHUNK_MIN_PER_RANK elements (1 MiB in fp32), so that a large
# world still sends messages a collective moves at full speed. Read at call time: tests lower them.
REDUCE_CHUNK_NUMEL = 1 << 26
REDUCE_CHUNK_MIN_PER_RANK = 1 << 18


def reduce_chunk(largest_shard: int, world: int, align: int) -> int:
    """Elements of each rank's part of one reduction chunk: ``REDUCE_CHUNK_NUMEL / world``, at
    least ``REDUCE_CHUNK_MIN_PER_RANK``, a multiple of ``align``, and no more than the largest
    shard that is reduced (``largest_shard``; 0: nothing is)."""
    b = max(REDUCE_CHUNK_NUMEL // world, REDUCE_CHUNK_MIN_PER_RANK)
    b = max(align, b // align * align)
    return min(b, largest_shard)


def chunk_bounds(shard_numel: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of a shard of ``shard_numel`` elements, in order: every
    chunk ``chunk`` long but the last."""
    if shard_numel and chunk <= 0:
        raise ValueError(f"chunk_bounds needs a positive chunk, got {chunk}")
    return [(lo, min(chunk, shard_numel - lo)) for lo in range(0, shard_numel, chunk or 1)]
