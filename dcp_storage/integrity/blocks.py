"""Checking a slice read by the checksums that cover it: record blocks, or the zip CRC-32 of a whole tensor.

A rank that reads only its slice of a record cannot check the record's checksum, which covers all of it.
Our writers also record a digest per block of :data:`~.checksums.BLOCK_SIZE` bytes from each record's start
(:mod:`.manifest`); a slice read is widened to the blocks that cover it (:meth:`Cover.covering`, at most a
block more on each side, often coalesced with a neighbour's read anyway), and every covering block is
hashed before the slice is delivered. A record of one block is its own block: its digest is the record's.

A checkpoint without block digests (torch's writer, an older dcp-storage) still carries the zip CRC-32 of
each tensor's storage in the data descriptor that follows it: a rank that reads a whole tensor reads those
16-24 bytes too and checks the CRC (:class:`DataCrc`). A slice of such a checkpoint has nothing covering
it and is delivered unchecked (the load's debug log says so).

Every mismatch raises :class:`~dcp_storage.errors.CorruptCheckpointError` naming the file, the byte
range, the keys stored there and what to do, before any byte reaches the destination's owner.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.integrity.checksums import crc32, mismatch, new_hasher

__all__ = ["FIX", "BlockCover", "Cover", "DataCrc"]

FIX = (
    "restore the file from a good copy or re-save the checkpoint; if the storage returned wrong bytes, retry the "
    "load (verify=False loads it unchecked, which is not advised)"
)


class Cover(Protocol):
    """What checks a slice read: the byte range to read around ``[lo, hi)``, and the check of those bytes."""

    def covering(self, lo: int, hi: int) -> tuple[int, int]: ...

    def check(self, start: int, pieces: Sequence[Any]) -> None: ...


@dataclass(frozen=True)
class BlockCover:
    """The blocks of one record ``[start, start + length)`` of a file, and their recorded digests.

    Blocks are ``block_size`` bytes from the record's start, or, with ``first``, a first block of ``first``
    bytes (the record's header) and ``block_size`` blocks after it (aligned to the tensor's elements).
    """

    start: int  # the record's first byte in its file
    length: int
    block_size: int
    digests: tuple[str, ...]
    algorithm: str
    where: str  # the file's URL and the keys the record holds, for errors
    first: int = 0

    def _index(self, pos: int) -> int:
        rel = pos - self.start
        if self.first:
            return 0 if rel < self.first else 1 + (rel - self.first) // self.block_size
        return rel // self.block_size

    def _bounds(self, index: int) -> tuple[int, int]:
        """The absolute byte range of block ``index``."""
        if self.first:
            lo = 0 if index == 0 else self.first + (index - 1) * self.block_size
            hi = self.first if index == 0 else lo + self.block_size
        else:
            lo = index * self.block_size
            hi = lo + self.block_size
        return self.start + lo, self.start + min(hi, self.length)

    def covering(self, lo: int, hi: int) -> tuple[int, int]:
        """The absolute byte range of the blocks that cover ``[lo, hi)``."""
        return self._bounds(self._index(lo))[0], self._bounds(self._index(hi - 1))[1]

    def block_ends(self, lo: int, hi: int) -> list[tuple[int, int, bool]]:
        """``[lo, hi)`` cut at block boundaries: ``(start, end, whole)``, ``whole`` when the piece is a block."""
        out = []
        pos = lo
        while pos < hi:
            block_lo, block_hi = self._bounds(self._index(pos))
            end = min(block_hi, hi)
            out.append((pos, end, pos == block_lo and end == block_hi))
            pos = end
        return out

    def check(self, start: int, pieces: Sequence[Any]) -> None:
        """Hash the consecutive ``pieces`` that tile whole blocks from ``start`` (a block boundary)."""
        index = self._index(start)
        hasher, left = None, 0
        for piece in pieces:
            view = memoryview(piece).cast("B")
            pos = 0
            while pos < view.nbytes:
                if hasher is None:
                    hasher = new_hasher(self.algorithm)
                    lo, hi = self._bounds(index)
                    left = hi - lo
                n = min(left, view.nbytes - pos)
                hasher.update(view[pos : pos + n])
                pos += n
                left -= n
                if left == 0:
                    self._compare(index, hasher.hexdigest())
                    hasher, index = None, index + 1
        if hasher is not None:
            raise ValueError(f"{self.where}: the pieces end inside block {index}")

    def check_block(self, lo: int, data: Any) -> None:
        """Check the one whole block that starts at ``lo`` (run where its bytes land, while in cache)."""
        hasher = new_hasher(self.algorithm)
        hasher.update(data)
        self._compare(self._index(lo), hasher.hexdigest())

    def _compare(self, index: int, got: str) -> None:
        recorded = self.digests[index]
        if got != recorded:
            lo, hi = self._bounds(index)
            raise CorruptCheckpointError(
                f"{self.where}: bytes [{lo}, {hi}) (block {index} of the record): {mismatch(self.algorithm, recorded)}; "
                f"the bytes read are not those written; {FIX}"
            )


_DESCRIPTOR = b"PK\x07\x08"
DESCRIPTOR_BYTES = 24  # signature, CRC-32 and two 8-byte sizes (zip64); 16 with 4-byte sizes


@dataclass(frozen=True)
class DataCrc:
    """The zip CRC-32 of a tensor's whole storage entry ``[data_start, data_start + nbytes)`` in its file,
    read from the data descriptor that follows it (torch's zip writer streams its entries)."""

    data_start: int
    nbytes: int
    record_end: int
    where: str

    def covering(self, lo: int, hi: int) -> tuple[int, int]:
        return lo, min(hi + DESCRIPTOR_BYTES, self.record_end)

    def check(self, start: int, pieces: Sequence[Any]) -> None:
        if len(pieces) == 1:  # the covering range in one buffer
            buf = memoryview(pieces[0]).cast("B")
            at = self.data_start - start
            data, tail = buf[at : at + self.nbytes], buf[at + self.nbytes :]
        else:  # (bytes before the tensor, the tensor, the bytes after it)
            data, tail = (memoryview(p).cast("B") for p in pieces[1:3])
        recorded = _descriptor_crc(bytes(tail), self.nbytes)
        if recorded is None:  # no descriptor: the CRC is in the headers we did not parse; nothing to check
            return
        if crc32(data) != recorded:
            raise CorruptCheckpointError(
                f"{self.where}: the tensor's bytes [{self.data_start}, {self.data_start + self.nbytes}) fail their zip "
                f"CRC-32 (recorded {recorded:08x}): the bytes read are not those written; {FIX}"
            )


def _descriptor_crc(tail: bytes, nbytes: int) -> int | None:
    """The CRC-32 of a data descriptor at the start of ``tail`` for an entry of ``nbytes``, if it is one."""
    if tail[:4] != _DESCRIPTOR:
        return None
    for fmt in ("<QQ", "<II"):
        end = 8 + struct.calcsize(fmt)
        if len(tail) >= end and struct.unpack_from(fmt, tail, 8) == (nbytes, nbytes):
            return int(struct.unpack_from("<I", tail, 4)[0])
    return None
