"""Seekable stream transforms: a transform that can serve uncompressed byte ranges of a stored item.

A DCP item written through a stream extension (torch's ``_extensions``, our ``FsspecWriter(extensions=...)``)
is opaque to a reader: torch's reader, and ours by default, fetch the whole stored item and run the
extension's ``transform_from`` over it. A rank that needs only a slice of a big tensor then reads and
decodes the whole tensor.

A transform that cuts its output into independently decodable *frames* and records where each frame lies
(a seek table) lets a reader do better: fetch the index, then only the frames that cover the byte ranges
it needs. :class:`SeekableTransform` is that capability as a small Protocol, so any extension plugin
(compression, encryption with per-block nonces, ...) can offer it next to ``StreamTransformExtension``;
the reader checks for it with ``isinstance(ext, SeekableTransform)``.

Call order, as :class:`~dcp_storage.formats.dcp_native.framed_items.FramedItemLoader` uses it for one
stored item of ``stored_length`` bytes:

1. ``tail_probe_bytes(stored_length)``: how many bytes at the item's end to fetch first.
2. ``read_frame_index(tail, stored_length)``: the :class:`FrameIndex`; raises :class:`NeedMoreTail` when
   the index is longer than the tail given (the reader fetches that many and calls again).
3. ``decode_frame(frame, data, out)`` for each needed frame, possibly from several threads at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["Frame", "FrameIndex", "NeedMoreTail", "SeekableTransform"]


@dataclass(frozen=True)
class Frame:
    """One independently decodable frame: stored bytes ``[stored_start, stored_end)`` of the item (offsets
    relative to the item's first stored byte) decode to bytes ``[raw_start, raw_end)`` of the original."""

    index: int
    stored_start: int
    stored_end: int
    raw_start: int
    raw_end: int

    @property
    def stored_length(self) -> int:
        return self.stored_end - self.stored_start

    @property
    def raw_length(self) -> int:
        return self.raw_end - self.raw_start


class FrameIndex:
    """The frames of one stored item, in order, with lookups by original (raw) byte position.

    Raises ``ValueError`` if the frames do not tile both the stored and the raw bytes without gaps
    (a damaged index; the caller names the file and key).
    """

    def __init__(self, frames: Sequence[Frame], raw_size: int | None = None) -> None:
        self.frames: tuple[Frame, ...] = tuple(frames)
        stored = raw = 0
        for i, f in enumerate(self.frames):
            if f.index != i or f.stored_start != stored or f.raw_start != raw or f.stored_end < f.stored_start:
                raise ValueError(f"frame {i} does not follow frame {i - 1} ({f})")
            if f.raw_end < f.raw_start:
                raise ValueError(f"frame {i} has a negative size ({f})")
            stored, raw = f.stored_end, f.raw_end
        self.raw_size = raw if raw_size is None else raw_size
        if self.raw_size != raw:
            raise ValueError(f"frames hold {raw} bytes, the index says {self.raw_size}")
        self._raw_starts = [f.raw_start for f in self.frames]

    @classmethod
    def from_sizes(cls, sizes: Sequence[tuple[int, int]]) -> FrameIndex:
        """From ``(stored_size, raw_size)`` pairs in frame order, the first frame at stored byte 0."""
        frames = []
        stored = raw = 0
        for i, (s, r) in enumerate(sizes):
            frames.append(Frame(i, stored, stored + s, raw, raw + r))
            stored, raw = stored + s, raw + r
        return cls(frames)

    @property
    def stored_size(self) -> int:
        """Stored bytes of all frames (an index stored after them is not included)."""
        return self.frames[-1].stored_end if self.frames else 0

    def covering(self, start: int, end: int) -> list[Frame]:
        """The frames holding raw bytes ``[start, end)`` (empty for an empty range)."""
        if start < 0 or end > self.raw_size or start > end:
            raise ValueError(f"raw range [{start}, {end}) is outside the item's {self.raw_size} bytes")
        if start == end:
            return []
        first = bisect.bisect_right(self._raw_starts, start) - 1
        last = bisect.bisect_left(self._raw_starts, end) - 1
        return [f for f in self.frames[first : last + 1] if f.raw_length]

    def __len__(self) -> int:
        return len(self.frames)


class NeedMoreTail(Exception):
    """The tail given does not hold the whole index; fetch at least ``needed`` bytes from the end."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


@runtime_checkable
class SeekableTransform(Protocol):
    """A stream transform whose stored output can be decoded frame by frame (see the module docstring).

    Implementations raise ``ValueError`` (or a subclass) for bytes that do not decode: a damaged index or
    frame. The reader turns that into :class:`~dcp_storage.errors.CorruptCheckpointError` naming the file,
    the byte range and the key.
    """

    def tail_probe_bytes(self, stored_length: int) -> int:
        """Bytes at the end of a stored item to fetch first; usually enough to hold the whole index."""
        ...

    def read_frame_index(self, tail: memoryview, stored_length: int) -> FrameIndex:
        """The frame index from the last ``len(tail)`` bytes of a ``stored_length``-byte item.

        Raises :class:`NeedMoreTail` if the index does not fit in ``tail``.
        """
        ...

    def decode_frame(self, frame: Frame, data: memoryview, out: memoryview) -> None:
        """Decode ``data`` (the frame's stored bytes) into ``out`` (exactly ``frame.raw_length`` bytes).

        Called from worker threads; must not keep state between calls that would make that unsafe.
        """
        ...
