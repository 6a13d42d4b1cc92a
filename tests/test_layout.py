"""Unit tests for the pure layout math (no torch.distributed, no device memory)."""

import math

import pytest
import torch

from yashard.layout import (build_layout, ceil_div, round_up, shard_pieces, shard_ranges_of, slot_assignment,
                            uncovered_ranges)


def test_slot_assignment_alternates_layers_or_gives_each_unit_its_own():
    units = ["embed", "layer_0", "layer_1", "layer_2", "lm_head", "small"]
    alternate = slot_assignment(units, alternate=True)
    assert alternate == {"layer_0": "layer_even", "layer_1": "layer_odd", "layer_2": "layer_even",
                         "embed": "outer", "lm_head": "outer", "small": "small"}
    assert list(dict.fromkeys(alternate.values())) == ["layer_even", "layer_odd", "outer", "small"]
    own = slot_assignment(units, alternate=False)
    assert own == {k: k for k in units} and list(own) == ["layer_0", "layer_1", "layer_2", "embed", "lm_head", "small"]
    assert slot_assignment(["embed", "lm_head"], alternate=True) == {"embed": "outer", "lm_head": "outer"}


def test_ceil_div_and_round_up():
    assert [ceil_div(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [round_up(n, 8) for n in (0, 1, 8, 9)] == [0, 8, 8, 16]
    with pytest.raises(ValueError, match="positive divisor"):
        ceil_div(3, 0)


def test_offsets_are_back_to_back_and_padding_reaches_a_multiple_of_world():
    lay = build_layout([("a", (3, 4)), ("b", (5,)), ("c", (2, 2))], world=3)
    assert [e.offset for e in lay.entries] == [0, 12, 17]
    assert lay.total == 21
    assert lay.shard_numel == 7 and lay.padded == 21 and lay.padding == 0
    lay = build_layout([("a", (10,))], world=4)
    assert lay.shard_numel == 3 and lay.padded == 12 and lay.padding == 2


def test_alignment_of_params_and_shards():
    lay = build_layout([("a", (3,)), ("b", (5,))], world=2, param_align=4, shard_align=8)
    assert [e.offset for e in lay.entries] == [0, 4]
    assert lay.total == 9
    assert lay.shard_numel == 8 and lay.padded == 16
    assert lay.gaps() == [(3, 4), (9, 16)]


def test_shard_ranges_tile_the_flat_vector():
    lay = build_layout([("a", (7, 3)), ("b", (11,))], world=4)
    ranges = [lay.shard_range(r) for r in range(4)]
    assert ranges[0][0] == 0 and ranges[-1][1] == lay.padded
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(3))
    with pytest.raises(ValueError, match="outside world size"):
        lay.shard_range(4)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shard_pieces_cover_every_element_exactly_once(world):
    shapes = [("w1", (5, 3)), ("b1", (5,)), ("w2", (4, 4)), ("n", (1,))]
    lay = build_layout(shapes, world)
    covered = {i: [] for i in range(len(shapes))}
    for r in range(world):
        pos = 0
        for pc in shard_pieces(lay, r):
            assert pc.shard_start >= pos  # flat order inside a shard
            pos = pc.shard_start + pc.numel
            assert pos <= lay.shard_numel
            covered[pc.entry].append((pc.entry_start, pc.entry_end))
    for i, e in enumerate(lay.entries):
        spans = sorted(covered[i])
        assert spans[0][0] == 0 and spans[-1][1] == e.numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_uncovered_ranges_merge_adjacent_unwritten_entries():
    lay = build_layout([("a", (2,)), ("b", (3,)), ("c", (4,)), ("d", (1,))], world=1)
    assert uncovered_ranges(lay, [True, False, False, True]) == [(2, 9)]
    assert uncovered_ranges(lay, [False, True, False, False]) == [(0, 2), (5, 10)]
    assert uncovered_ranges(lay, [True] * 4) == []
    with pytest.raises(ValueError, match="4 entries"):
        uncovered_ranges(lay, [True])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_ranges_of_selected_entries_hold_exactly_their_elements(world):
    # (the frozen parameters a rank keeps across the optimizer step)
    shapes = [("a", (2, 3)), ("b", (5,)), ("c", (4, 2)), ("d", (3,))]
    lay = build_layout(shapes, world, param_align=4)  # gaps between entries
    selected = [True, True, False, True]
    want = set()
    for i, e in enumerate(lay.entries):
        if selected[i]:
            want |= set(range(e.offset, e.end))
    got = set()
    for r in range(world):
        base = lay.shard_range(r)[0]
        ranges = shard_ranges_of(lay, r, selected)
        assert all(lo < hi <= lay.shard_numel for lo, hi in ranges)
        assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # sorted, adjacent ones merged
        for lo, hi in ranges:
            got |= set(range(base + lo, base + hi))
    assert got == want
    assert shard_ranges_of(lay, 0, [False] * 4) == []
    with pytest.raises(ValueError, match="4 entries"):
        shard_ranges_of(lay, 0, [True])


def test_signature_distinguishes_layouts():
    a = build_layout([("x", (4,)), ("y", (4,))], 2)
    b = build_layout([("p", (4,)), ("q", (4,))], 2)
    c = build_layout([("x", (8,))], 2)
    assert a.signature == b.signature  # names do not matter, ranges do
    assert a.signature != c.signature


@pytest.mark.parametrize(
    "args, message",
    [
        (([], 2), "at least one parameter"),
        (([("a", (2,))], 0), "world size must be >= 1"),
        (([("a", (2,)), ("a", (3,))], 2), "appears twice"),
        (([("a", (-1,))], 2), "negative dimension"),
    ],
)
def test_layout_errors(args, message):
    with pytest.raises(ValueError, match=message):
        build_layout(*args)


def test_alignment_error():
    with pytest.raises(ValueError, match="alignments must be >= 1"):
        build_layout([("a", (2,))], 2, shard_align=0)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 1, 6), (2, 3, 4, 5), (5, 0), ()])
def test_flat_range_boxes_tile_every_range_in_order(shape):
    from yashard.layout import flat_range_boxes

    total = math.prod(shape)
    flat = torch.arange(total).view(shape)
    for lo in range(total + 1):
        for hi in range(lo, total + 1):
            boxes = flat_range_boxes(shape, lo, hi)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            covered = lo
            for offsets, sizes, start in boxes:
                assert start == covered and len(offsets) == len(sizes) == len(shape)
                block = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert torch.equal(block.reshape(-1), torch.arange(start, start + block.numel()))  # contiguous, in order
                covered += block.numel()
            assert covered == hi
    with pytest.raises(ValueError, match=r"range \[0, 9\) is outside a tensor of shape \(2, 4\) \(8 elements\)"):
        flat_range_boxes((2, 4), 0, 9)
