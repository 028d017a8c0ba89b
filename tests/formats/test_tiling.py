"""Chunk sets that must tile their tensor exactly: the sweep agrees with brute force on random box sets."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_storage.formats.reading import first_overlap, tiling_problem


def _cells(box: tuple[list[int], list[int]]) -> set[tuple[int, ...]]:
    offsets, sizes = box
    return set(itertools.product(*(range(o, o + n) for o, n in zip(offsets, sizes))))


@st.composite
def boxes_in(draw: st.DrawFn) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
    n = draw(st.integers(0, 6))
    boxes = []
    for _ in range(n):
        offsets = [draw(st.integers(0, s - 1)) for s in shape]
        sizes = [draw(st.integers(0, s - o)) for o, s in zip(offsets, shape)]
        boxes.append((offsets, sizes))
    return shape, boxes


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=boxes_in())
def test_sweep_agrees_with_brute_force(case: tuple[list[int], list[tuple[list[int], list[int]]]]) -> None:
    shape, boxes = case
    pairs = [(i, j) for i, j in itertools.combinations(range(len(boxes)), 2) if _cells(boxes[i]) & _cells(boxes[j])]
    found = first_overlap(boxes)
    assert (found is None) == (not pairs)
    if found is not None:
        assert _cells(boxes[found[0]]) & _cells(boxes[found[1]])
    covered = set().union(*(_cells(b) for b in boxes)) if boxes else set()
    tiles = not pairs and len(covered) == math.prod(shape)
    assert (tiling_problem(shape, boxes) is None) == tiles


def test_overlap_with_the_right_volume_is_named() -> None:
    problem = tiling_problem([16, 8], [([0, 0], [12, 8]), ([4, 0], [4, 8])])
    assert problem is not None and "[0, 0] of size [12, 8]" in problem and "[4, 0] of size [4, 8]" in problem


def test_real_shardings_tile() -> None:
    rows = [([r * 4, 0], [4, 4096]) for r in range(1024)]  # Shard(0) over 1024 ranks
    cols = [([0, c * 4], [4096, 4]) for c in range(1024)]  # Shard(1): the sweep runs along dim 1
    grid = [([r * 128, c * 128], [128, 128]) for r in range(32) for c in range(32)]  # 2-d sharding
    uneven = [([0], [3]), ([3], [0]), ([3], [5])]  # an empty chunk shares nothing
    assert tiling_problem([4096, 4096], rows) is None
    assert tiling_problem([4096, 4096], cols) is None
    assert tiling_problem([4096, 4096], grid) is None
    assert tiling_problem([8], uneven) is None
    assert tiling_problem([], [([], [])]) is None and tiling_problem([], [([], []), ([], [])]) is not None
    assert "missing shards" in (tiling_problem([4096, 4096], grid[:-1]) or "")
