"""Byte runs of a slice of a row-major tensor: the one calculator every reader, writer and tool uses.

A rank loading ``Shard(0)`` of a saved chunk needs one contiguous run of bytes; ``Shard(1)`` needs one
run per row. :func:`row_major_runs` describes the runs of a box ``offsets``/``lengths`` of a row-major
tensor as a :class:`RunSet` (a start, a common length, and the counts and byte strides of the dimensions
the runs step over), listed in the box's own row-major order, so run ``i`` holds bytes
``[i * length, (i + 1) * length)`` of the box's contiguous bytes. :func:`slice_runs` and :func:`count_runs`
are its two common questions (every start; how many).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["RunSet", "count_runs", "is_row_major", "row_major_runs", "slice_runs"]


@dataclass(frozen=True)
class RunSet:
    """Equally long byte runs at ``start + sum(i_d * strides[d])`` for every ``i_d < counts[d]``.

    Offsets are relative to the first byte of the full tensor, in row-major order; run ``j`` of the
    iteration holds bytes ``[j * length, (j + 1) * length)`` of the row-major box.
    """

    start: int
    length: int
    counts: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return math.prod(self.counts) if self.length else 0

    @property
    def nbytes(self) -> int:
        return self.count * self.length

    def offsets(self) -> Iterator[int]:
        """The start of every run, in order (relative to the tensor's first byte)."""
        if not self.length:
            return
        if len(self.counts) == 1:  # a Shard(1) box of a matrix: one run per row
            yield from range(self.start, self.start + self.counts[0] * self.strides[0], self.strides[0])
            return
        for idx in itertools.product(*(range(c) for c in self.counts)):
            yield self.start + sum(i * s for i, s in zip(idx, self.strides))


def _split_dim(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """Index of the innermost dimension that is not taken whole (-1 if the slice is everything)."""
    k = len(shape) - 1
    while k >= 0 and offsets[k] == 0 and lengths[k] == shape[k]:
        k -= 1
    return k


def row_major_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int) -> RunSet:
    """The byte runs the box ``[offsets[d], offsets[d] + lengths[d])`` occupies in a row-major ``shape``.

    Raises ``ValueError`` when the box does not fit ``shape``.
    """
    ndim = len(shape)
    if len(offsets) != ndim or len(lengths) != ndim:
        raise ValueError(f"box offsets {tuple(offsets)} / sizes {tuple(lengths)} do not match shape {tuple(shape)}")
    for d, (size, off, length) in enumerate(zip(shape, offsets, lengths)):
        if off < 0 or length < 0 or off + length > size:
            raise ValueError(
                f"box offsets {tuple(offsets)} sizes {tuple(lengths)} exceed shape {tuple(shape)} "
                f"([{off}, {off + length}) along dim {d} of size {size})"
            )
    if math.prod(lengths) == 0:
        return RunSet(0, 0)
    k = _split_dim(shape, offsets, lengths)
    if k < 0:  # the whole tensor (a 0-dim one too): one run
        return RunSet(0, math.prod(shape) * itemsize)
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(ndim)]
    start = sum(o * s for o, s in zip(offsets, strides))
    # A run spans the innermost dims the box covers whole, plus the first (from inside) it does not.
    lead = [(lengths[d], strides[d]) for d in range(k) if lengths[d] != 1]
    return RunSet(start, lengths[k] * strides[k], tuple(c for c, _ in lead), tuple(s for _, s in lead))


def count_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> int:
    """How many contiguous runs :func:`slice_runs` would return."""
    return row_major_runs(shape, offsets, lengths, 1).count


def slice_runs(
    shape: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    itemsize: int,
    base: int = 0,
) -> tuple[list[int], int]:
    """Start bytes of each run and the common run length for a row-major tensor at byte ``base``."""
    runs = row_major_runs(shape, offsets, lengths, itemsize)
    return [base + start for start in runs.offsets()], runs.length


def is_row_major(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is the contiguous (C-order) stride of ``shape`` (size-1 dims may have any)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True
