"""Whether the chunks of a tensor tile it exactly: every element in one chunk, none in two.

A checkpoint lists each tensor's chunks (DCP ``ChunkStorageMetadata``: offsets and sizes). Counting
elements is not enough: two chunks that overlap while others leave a gap add up to the tensor's volume,
and a load would then read the overlap twice and leave the gap as whatever the destination held. So the
chunks are also checked pairwise for a shared element, by a sweep along one dimension: chunks sorted by
their start there, each compared only with the chunks still open at its start (a heap by end). Sweeping
along the dimension with the most distinct chunk starts keeps that set small for real shardings: one
chunk for ``Shard(0)`` and ``Shard(1)`` alike, a row of the grid for 2-d shardings. A tensor with one
chunk (the common case) costs nothing beyond the bounds check.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

__all__ = ["Box", "first_overlap", "tiling_problem"]

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes), one entry per dimension


def _meet(a: Box, b: Box, skip: int) -> bool:
    """Whether boxes ``a`` and ``b`` (already known to overlap along ``skip``) share an element."""
    for d, (ao, an, bo, bn) in enumerate(zip(a[0], a[1], b[0], b[1])):
        if d != skip and (ao + an <= bo or bo + bn <= ao):
            return False
    return True


def first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Indices of two boxes that share an element, or ``None``. Empty boxes share nothing.

    O(n log n) plus, per box, the boxes open at its start along the sweep dimension.
    """
    live = [i for i, (_o, sizes) in enumerate(boxes) if all(n > 0 for n in sizes)]
    if len(live) < 2:
        return None
    ndim = len(boxes[live[0]][0])
    if ndim == 0:
        return live[0], live[1]  # two chunks of a scalar both hold its one element
    axis = max(range(ndim), key=lambda d: len({boxes[i][0][d] for i in live}))
    open_: list[tuple[int, int]] = []  # (end along axis, index)
    for i in sorted(live, key=lambda i: boxes[i][0][axis]):
        start = boxes[i][0][axis]
        while open_ and open_[0][0] <= start:
            heapq.heappop(open_)
        for _end, j in open_:
            if _meet(boxes[i], boxes[j], axis):
                return j, i
        heapq.heappush(open_, (start + boxes[i][1][axis], i))
    return None


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """What keeps ``boxes`` (all inside ``shape``: checked by the caller) from tiling ``shape``, or ``None``."""
    if len(boxes) == 1:
        offsets, sizes = boxes[0]
        return None if list(sizes) == list(shape) else _gap(shape, math.prod(sizes))
    pair = first_overlap(boxes)
    if pair is not None:
        (ao, an), (bo, bn) = boxes[pair[0]], boxes[pair[1]]
        return (
            f"chunks overlap: the chunk at {list(ao)} of size {list(an)} and the chunk at {list(bo)} of size "
            f"{list(bn)} hold the same elements"
        )
    volume = sum(math.prod(sizes) for _o, sizes in boxes)
    return None if volume == math.prod(shape) else _gap(shape, volume)


def _gap(shape: Sequence[int], volume: int) -> str:
    return f"the chunks hold {volume} of its {math.prod(shape)} elements (missing shards)"
