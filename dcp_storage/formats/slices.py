"""Byte runs of a slice of a row-major tensor.

A rank loading ``Shard(0)`` of a saved chunk needs one contiguous run of bytes; ``Shard(1)`` needs one
run per row. :func:`slice_runs` lists the runs in the slice's own row-major order, so run ``i`` fills
bytes ``[i * run_bytes, (i + 1) * run_bytes)`` of a contiguous destination.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = ["count_runs", "is_row_major", "slice_runs"]


def _split_dim(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """Index of the innermost dimension that is not taken whole (-1 if the slice is everything)."""
    k = len(shape) - 1
    while k >= 0 and offsets[k] == 0 and lengths[k] == shape[k]:
        k -= 1
    return k


def count_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """How many contiguous runs :func:`slice_runs` would return."""
    if math.prod(lengths) == 0:
        return 0
    k = _split_dim(shape, offsets, lengths)
    return math.prod(lengths[:k]) if k > 0 else 1


def slice_runs(
    shape: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    itemsize: int,
    base: int = 0,
) -> tuple[list[int], int]:
    """Start bytes of each run and the common run length for a row-major tensor at byte ``base``.

    ``offsets``/``lengths`` select ``[offsets[d], offsets[d] + lengths[d])`` along each dimension.
    """
    if not (len(shape) == len(offsets) == len(lengths)):
        raise ValueError(f"rank mismatch: shape {tuple(shape)}, offsets {tuple(offsets)}, lengths {tuple(lengths)}")
    for d, (size, off, length) in enumerate(zip(shape, offsets, lengths)):
        if off < 0 or length < 0 or off + length > size:
            raise ValueError(f"slice [{off}, {off + length}) out of bounds for dim {d} of size {size}")
    if math.prod(lengths) == 0:
        return [], 0
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    k = _split_dim(shape, offsets, lengths)
    if k < 0:
        return [base], math.prod(shape) * itemsize
    run_bytes = lengths[k] * strides[k] * itemsize
    inner = offsets[k] * strides[k]
    outer_ranges = [range(offsets[d], offsets[d] + lengths[d]) for d in range(k)]
    starts = [
        base + (sum(i * s for i, s in zip(idx, strides)) + inner) * itemsize for idx in itertools.product(*outer_ranges)
    ]
    return starts, run_bytes


def is_row_major(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is the contiguous (C-order) stride of ``shape`` (size-1 dims may have any)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True
