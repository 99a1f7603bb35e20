"""Box arithmetic of checkpoint pieces, checked exhaustively on small shapes against brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from shardwise.checkpoint.boxes import (
    Box,
    box_runs,
    first_overlap,
    flat_offset,
    flat_segments,
    intersect,
    strides,
    unravel,
)

SHAPES = [(), (1,), (5,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (0, 3)]


def _all_boxes(shape: tuple[int, ...]) -> list[Box]:
    """Every non-empty box of ``shape``."""
    per_dim = [[(o, n) for o in range(s) for n in range(1, s - o + 1)] for s in shape]
    return [Box(tuple(o for o, _ in c), tuple(n for _, n in c)) for c in itertools.product(*per_dim)]


def _cells(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))))


def _grid(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape)).reshape(shape)


def _take(grid: torch.Tensor, box: Box) -> torch.Tensor:
    return grid[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_flat_segments_tile_every_flat_range_in_order(shape: tuple[int, ...]) -> None:
    grid, n = _grid(shape), math.prod(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            segments = flat_segments(shape, start, stop)
            assert len(segments) <= max(1, 2 * len(shape) - 1)
            got: list[int] = []
            for box, offset in segments:
                assert box.inside(shape) and box.volume > 0 and offset == len(got)
                got += _take(grid, box).reshape(-1).tolist()
            assert got == list(range(start, stop)), (shape, start, stop, segments)


@pytest.mark.parametrize("shape", SHAPES[:6], ids=str)
def test_intersection_and_overlap_match_brute_force(shape: tuple[int, ...]) -> None:
    boxes = _all_boxes(shape)
    rng = random.Random(len(shape))
    pairs = [(a, b) for a in boxes for b in boxes] if len(boxes) < 200 else None
    for a, b in pairs or [(rng.choice(boxes), rng.choice(boxes)) for _ in range(3000)]:
        common = _cells(a) & _cells(b)
        got = intersect(a, b)
        assert (got is None) == (not common) and (got is None or _cells(got) == common), (a, b)
        expected = (0, 1) if common else None
        assert first_overlap([a, b]) == expected, (a, b)


def test_first_overlap_finds_the_pair_among_many() -> None:
    columns = [Box((0, c), (6, 1)) for c in range(10)]  # a tensor-parallel cut: all meet on dim 0
    assert first_overlap(columns) is None
    assert first_overlap([*columns, Box((3, 4), (1, 1))]) == (4, 10)
    assert first_overlap([Box((), ()), Box((), ())]) == (0, 1) and first_overlap([Box((), ())]) is None
    assert first_overlap([]) is None


@pytest.mark.parametrize("shape", SHAPES[:6], ids=str)
def test_box_runs_and_offsets_address_a_sub_box_inside_a_box(shape: tuple[int, ...]) -> None:
    boxes = _all_boxes(shape)
    rng = random.Random(7)
    for _ in range(400):
        outer = rng.choice(boxes)
        inner = rng.choice([b for b in boxes if _cells(b) <= _cells(outer)])
        storage = _take(_grid(shape), outer).reshape(-1).clone()  # the outer box as a piece stores it
        expected = _take(_grid(shape), inner).reshape(-1)
        starts, run = box_runs(outer, inner)
        got = torch.cat([storage[s : s + run] for s in starts.tolist()])
        assert torch.equal(got, expected), (outer, inner)
        assert starts.tolist() == sorted(starts.tolist())
        view = storage.as_strided(inner.lengths, strides(outer.lengths), flat_offset(outer, inner.offsets))
        assert torch.equal(view.reshape(-1), expected), (outer, inner)


def test_runs_merge_trailing_whole_dims() -> None:
    outer = Box((0, 0, 0), (4, 5, 6))
    assert box_runs(outer, Box((1, 0, 0), (2, 5, 6)))[0].tolist() == [30]  # a dim-0 cut: one run
    starts, run = box_runs(outer, Box((0, 1, 0), (4, 2, 6)))
    assert (starts.tolist(), run) == ([6, 36, 66, 96], 12)  # a dim-1 cut: one run per dim-0 row
    starts, run = box_runs(outer, Box((0, 0, 2), (1, 2, 3)))
    assert (starts.tolist(), run) == ([2, 8], 3)
    assert box_runs(Box((), ()), Box((), ()))[0].tolist() == [0]


def test_box_basics() -> None:
    box = Box([1, 2], [3, 4])  # lists are accepted and kept as tuples
    assert (box.offsets, box.lengths, box.stops, box.volume, box.ndim) == ((1, 2), (3, 4), (4, 6), 12, 2)
    assert str(box) == "[1:4, 2:6]" and Box.full((2, 3)) == Box((0, 0), (2, 3))
    assert box.inside((4, 6)) and not box.inside((4, 5)) and not box.inside((4, 6, 1))
    assert not Box((-1,), (2,)).inside((5,))
    assert strides((2, 3, 4)) == (12, 4, 1) and unravel(23, (2, 3, 4)) == (1, 2, 3)
    with pytest.raises(ValueError, match="2 offsets but 1 lengths"):
        Box((0, 0), (1,))
    with pytest.raises(TypeError):
        Box((0.5,), (1,))
