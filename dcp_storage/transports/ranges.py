"""Planning byte-range reads: sort, coalesce near ranges, split large ones.

A checkpoint load asks for many ``(path, start, end)`` ranges. Fetching each one alone costs a request
(a ranged GET, a syscall) per item; fetching whole files wastes bytes when a rank needs only its slice.
:func:`plan_fetches` turns requests into *fetch groups*: one storage request each, covering requests whose
gap is at most ``coalesce_gap`` bytes, never longer than ``max_request_bytes`` unless one request alone is
(then it is split into parts that run concurrently).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["FetchGroup", "RangeRequest", "Segment", "plan_fetches"]


@dataclass
class RangeRequest:
    """Read bytes ``[start, end)`` of ``path``.

    ``into``: a writable buffer of exactly ``end - start`` bytes to fill (for example the memory of the
    destination tensor, so the bytes land without an extra copy). Without it the transport allocates one.
    ``on_complete``: called with the filled buffer in a worker thread as soon as this request's bytes are
    all in place; with it, the transport drops its reference afterwards, which keeps memory bounded.
    """

    path: str
    start: int
    end: int
    into: memoryview | None = None
    on_complete: Callable[[memoryview], None] | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid byte range [{self.start}, {self.end}) for {self.path}")
        if self.into is not None:
            view = memoryview(self.into).cast("B") if memoryview(self.into).format != "B" else memoryview(self.into)
            if view.readonly:
                raise ValueError(f"RangeRequest.into for {self.path} must be writable")
            if view.nbytes != self.end - self.start:
                raise ValueError(
                    f"RangeRequest.into for {self.path} [{self.start}, {self.end}) holds {view.nbytes} bytes, "
                    f"expected {self.end - self.start}"
                )
            self.into = view

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class Segment:
    """The part ``[start, end)`` of request ``index`` served by one fetch group."""

    index: int
    start: int
    end: int


@dataclass
class FetchGroup:
    """One storage request: bytes ``[start, end)`` of ``path``, feeding ``segments`` in file order."""

    path: str
    start: int
    end: int
    segments: list[Segment] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start


def _split(index: int, req: RangeRequest, max_request_bytes: int) -> list[Segment]:
    if req.length <= max_request_bytes:
        return [Segment(index, req.start, req.end)]
    return [
        Segment(index, pos, min(pos + max_request_bytes, req.end))
        for pos in range(req.start, req.end, max_request_bytes)
    ]


def plan_fetches(requests: Sequence[RangeRequest], coalesce_gap: int, max_request_bytes: int) -> list[FetchGroup]:
    """Group ``requests`` into storage requests.

    Ranges of the same path are merged when the gap between them is at most ``coalesce_gap`` and the
    merged request stays within ``max_request_bytes``; overlapping ranges start a new group (a group's
    segments never overlap, so they can be filled by one vectored read).
    """
    if coalesce_gap < 0 or max_request_bytes <= 0:
        raise ValueError("coalesce_gap must be >= 0 and max_request_bytes > 0")
    pieces = [seg for i, req in enumerate(requests) if req.length > 0 for seg in _split(i, req, max_request_bytes)]
    pieces.sort(key=lambda s: (requests[s.index].path, s.start, s.end))
    groups: list[FetchGroup] = []
    for seg in pieces:
        path = requests[seg.index].path
        last = groups[-1] if groups else None
        if (
            last is not None
            and last.path == path
            and last.end <= seg.start
            and seg.start - last.end <= coalesce_gap
            and seg.end - last.start <= max_request_bytes
        ):
            last.segments.append(seg)
            last.end = seg.end
        else:
            groups.append(FetchGroup(path, seg.start, seg.end, [seg]))
    return groups
