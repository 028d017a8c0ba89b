"""Block checksums on read and write, and the notes a verified load leaves.

Checking a slice read by the checksums that cover it: record blocks, or the zip CRC-32 of a whole tensor.

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

Checking records against their recorded checksums while a reader loads them.

A reader with ``verify`` fetches every record it touches whole (the resharding path would read only
slices, which cannot be checked), hashes it, and decodes from those same bytes, so what lands in the
destination is exactly what was checked. Records are fetched in batches of at most ``budget`` bytes (the
loader's staging limit, or one record if larger), so memory stays bounded however much a rank loads.

Carrying each record's checksum from the rank that wrote it to the coordinator's ``finish``.

``WriteResult.storage_data`` travels to the coordinator by pickle; :class:`ChecksummedStorage` wraps
torch's ``_StorageInfo`` with the record's checksum on the way and is unwrapped in ``finish``, so
``.metadata`` holds plain ``_StorageInfo`` objects that torch's readers (and its allow-list) accept.

Provenance of a checkpoint for ``inspect``: format, writer, extensions and checksum algorithm.

What every format's checksum checks share: the piece size they read in, and the note for no checksums.

A deep check reads each file sequentially in pieces of at most :data:`PIECE_BYTES`, so memory stays
bounded whatever the file size; a checkpoint whose writer recorded no checksums gets one note saying that
bit flips in its tensor data cannot be detected (naming the writer when the checkpoint says who it was).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.integrity.checksums import Hasher, checksum, crc32, mismatch, new_hasher, one_shot
from dcp_storage.integrity.manifest import Manifest

__all__ = [
    "BlockCover",
    "BlockRun",
    "ChecksummedStorage",
    "Cover",
    "DataCrc",
    "FIX",
    "PIECE_BYTES",
    "RecordVerifier",
    "batches_by_bytes",
    "key_name",
    "manifest_provenance",
    "no_checksums_note",
    "unwrap_results",
]


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

    def whole_blocks(self, lo: int, hi: int) -> tuple[int, int]:
        """``[first, last)``: the whole blocks inside ``[lo, hi)`` (``first >= last`` when there is none)."""
        s, e = self._bounds(self._index(lo))
        first = lo if s == lo else e
        s, e = self._bounds(self._index(hi - 1))
        last = hi if e == hi else s
        return first, last

    def run_end(self, pos: int, limit: int) -> int:
        """The last block boundary at most ``limit`` after the block boundary ``pos``, or the end of the block
        at ``pos`` when that block is longer."""
        s, e = self._bounds(self._index(limit - 1))
        end = e if e <= limit else s
        return end if end > pos else self._bounds(self._index(pos))[1]

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

    def check_blocks(self, lo: int, data: memoryview) -> None:
        """Check the consecutive whole blocks that fill ``data`` (bytes), the first starting at ``lo``: one
        one-shot hash and one string comparison per block, in the thread the bytes landed in."""
        digest, digests = self._digest, self.digests
        index = self._index(lo)
        pos, n = 0, data.nbytes
        while pos < n:
            a, b = self._bounds(index)
            end = pos + (b - a)
            if end > n:
                raise ValueError(f"{self.where}: the bytes end inside block {index}")
            got = digest(data[pos:end])
            if got != digests[index]:
                self._compare(index, got)
            pos, index = end, index + 1

    @cached_property
    def _digest(self) -> Callable[[Any], str]:
        return one_shot(self.algorithm)

    def run(self, lo: int, hi: int) -> BlockRun:
        """A check of the whole blocks ``[lo, hi)`` fed as their bytes land (:class:`BlockRun`)."""
        return BlockRun(self, lo, hi)

    def _compare(self, index: int, got: str) -> None:
        recorded = self.digests[index]
        if got != recorded:
            lo, hi = self._bounds(index)
            raise CorruptCheckpointError(
                f"{self.where}: bytes [{lo}, {hi}) (block {index} of the record): {mismatch(self.algorithm, recorded)}; "
                f"the bytes read are not those written; {FIX}"
            )


# A piece up to this long (a local read's hot piece, just read, in cache) is hashed block by block with one C call
# each, the GIL held (~6 us per 256 KiB); a longer one (an object store's whole segment, out of cache) through a
# hasher that releases the GIL while it hashes, so the store's other threads go on meanwhile.
ONE_CALL_BYTES = 1 << 20


class BlockRun:
    """Checks the whole blocks ``[lo, hi)`` of a :class:`BlockCover` as their bytes land, piece by piece.

    :meth:`piece` (a read's ``on_piece``) hashes each piece in the worker thread that just read it, while it
    is in the CPU's cache: a block that is one piece by one one-shot hash, a block over several pieces
    incrementally. :meth:`complete` (``on_complete``, with all the bytes) checks whatever the pieces did not
    cover (a transport that never called :meth:`piece`, or pieces out of order), so every byte is checked
    once whichever way the bytes came.
    """

    __slots__ = ("_block_end", "_cover", "_hasher", "_index", "_pos", "_record_end", "hi", "lo")

    def __init__(self, cover: BlockCover, lo: int, hi: int) -> None:
        self._cover = cover
        self.lo, self.hi = lo, hi
        self._pos = lo  # the next byte the pieces must start at; -1 once they came out of order
        self._index = cover._index(lo)
        self._block_end = cover._bounds(self._index)[1]
        self._record_end = cover.start + cover.length
        self._hasher: Hasher | None = None

    def piece(self, offset: int, view: memoryview) -> None:
        """Hash ``view``, the bytes from ``offset``; compare each block it completes."""
        n = view.nbytes
        cover = self._cover
        end = offset + n
        if offset == self._pos and end == self._block_end <= self.hi and self._hasher is None and n <= ONE_CALL_BYTES:
            got = cover._digest(view)  # the common case: the piece is one whole block
            if got != cover.digests[self._index]:
                cover._compare(self._index, got)
            self._index += 1
            self._block_end = min(end + cover.block_size, self._record_end)
            self._pos = end
            return
        if offset != self._pos or offset + n > self.hi:  # not the next bytes: complete() checks everything
            self._pos = -1
            return
        one_call = n <= ONE_CALL_BYTES
        at, pos = offset, 0
        while pos < n:
            take = min(n - pos, self._block_end - at)
            hasher = self._hasher
            if one_call and hasher is None and at + take == self._block_end:  # the whole block here: one call
                got = cover._digest(view[pos : pos + take])
            else:
                if hasher is None:
                    hasher = self._hasher = new_hasher(cover.algorithm)
                hasher.update(view[pos : pos + take])
                if at + take < self._block_end:  # the block goes on in the next piece
                    at += take
                    break
                got, self._hasher = hasher.hexdigest(), None
            if got != cover.digests[self._index]:
                cover._compare(self._index, got)
            at += take
            pos += take
            self._index += 1
            self._block_end = min(self._block_end + cover.block_size, self._record_end)  # the next block's end
        self._pos = offset + n

    __call__ = piece  # it is the request's ``on_piece`` (a :class:`~dcp_storage.transports.ranges.Crc32Pieces`)

    def crc32_blocks(self, offset: int, nbytes: int) -> tuple[int, int] | None:
        """With CRC-32 digests, for all of ``[lo, hi)`` from the start: ``(first block's length, block length)``
        (a transport then reads and hashes in one native loop, :meth:`crc32_digested`); else ``None``."""
        cover = self._cover
        if cover.algorithm != "crc32" or offset != self._pos or offset != self.lo or offset + nbytes != self.hi:
            return None
        return self._block_end - offset, cover.block_size

    def crc32_digested(self, offset: int, nbytes: int, crcs: Sequence[int]) -> None:
        """The CRC-32 of each block of ``[lo, hi)``, as :meth:`crc32_blocks` laid them out: compare them all."""
        cover = self._cover
        if (
            offset != self._pos
            or offset + nbytes != self.hi
            or self._index + len(crcs) != cover._index(self.hi - 1) + 1
        ):
            self._pos = -1  # not what was asked for: complete() checks every block from the bytes
            return
        digests, index = cover.digests, self._index
        for value in crcs:
            if f"{value:08x}" != digests[index]:
                cover._compare(index, f"{value:08x}")
            index += 1
        self._index, self._pos = index, self.hi

    def complete(self, data: memoryview) -> None:
        """With all of ``[lo, hi)`` in ``data``: check the blocks the pieces did not (all, unless they came in
        order up to ``hi``)."""
        if self._pos != self.hi:
            self._cover.check_blocks(self.lo, data)


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

    def check(self, start: int, pieces: Sequence[Any], data_crc: int | None = None) -> None:
        """``data_crc``: the tensor's CRC-32 if computed already (by the worker thread that landed its bytes,
        while other reads still ran: after every read, the caller's CRCs were most of a load's tail)."""
        if len(pieces) == 1:  # the covering range in one buffer
            buf = memoryview(pieces[0]).cast("B")
            at = self.data_start - start
            data, tail = buf[at : at + self.nbytes], buf[at + self.nbytes :]
        else:  # (bytes before the tensor, the tensor, the bytes after it)
            data, tail = (memoryview(p).cast("B") for p in pieces[1:3])
        recorded = _descriptor_crc(bytes(tail), self.nbytes)
        if recorded is None:  # no descriptor: the CRC is in the headers we did not parse; nothing to check
            return
        if (crc32(data) if data_crc is None else data_crc) != recorded:
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


_MAX_KEYS_NAMED = 5


def key_name(index: Any) -> str:
    """``'fqn'``, or ``'fqn' (chunk at [o, ...])`` for a shard that does not start at the origin."""
    offsets = [int(o) for o in (index.offset or ())]
    return repr(index.fqn) + (f" (chunk at {offsets})" if any(offsets) else "")


def _keys(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_MAX_KEYS_NAMED])
    return shown + (f" and {len(keys) - _MAX_KEYS_NAMED} more" if len(keys) > _MAX_KEYS_NAMED else "")


class RecordVerifier:
    """Checks whole records ``(file, offset, length)`` against a manifest's checksums.

    ``keys`` maps a record to the state-dict keys stored there (for the error); ``url_of`` turns a
    checkpoint-relative file name into the URL to report.
    """

    def __init__(self, manifest: Manifest, url_of: Callable[[str], str], keys: dict[tuple[str, int, int], list[str]]):
        if manifest.algorithm is None:
            raise ValueError("RecordVerifier needs a manifest with checksums")
        self.manifest = manifest
        self.algorithm = manifest.algorithm
        self.url_of = url_of
        self.keys = keys
        self.checked = 0
        self.checked_bytes = 0

    @classmethod
    def for_storage(cls, manifest: Manifest, url_of: Callable[[str], str], storage: dict[Any, Any]) -> RecordVerifier:
        keys: dict[tuple[str, int, int], list[str]] = {}
        for index, info in storage.items():
            rec = (info.relative_path, int(info.offset), int(info.length))
            keys.setdefault(rec, []).append(key_name(index))
        return cls(manifest, url_of, keys)

    def check(self, file: str, offset: int, length: int, data: Any) -> None:
        """Raise :class:`CorruptCheckpointError` (URL, file, byte range, keys) unless ``data`` matches."""
        self.check_digest(file, offset, length, checksum(data, self.algorithm))

    def hasher(self) -> Hasher:
        """A fresh incremental hasher of the manifest's algorithm (to hash a record read in pieces)."""
        return new_hasher(self.algorithm)

    def check_digest(self, file: str, offset: int, length: int, got: str) -> None:
        """Like :meth:`check`, for a record the caller hashed (in pieces): ``got`` is its hex digest."""
        where = f"{self.url_of(file)} bytes [{offset}, {offset + length})"
        keys = _keys(self.keys.get((file, offset, length), []))
        expected = self.manifest.item(file, offset, length)
        if expected is None:
            raise CorruptCheckpointError(
                f"{where} (holding {keys or 'unknown keys'}): the manifest records no checksum for this record; the "
                "metadata and the manifest disagree"
            )
        if got != expected.digest:
            raise CorruptCheckpointError(
                f"{where} (holding {keys or 'unknown keys'}): {mismatch(self.algorithm, expected.digest)}: the stored "
                f"bytes changed after they were written, or the storage returned other bytes; {FIX}"
            )
        self.checked += 1
        self.checked_bytes += length


def batches_by_bytes(items: Iterable[Any], size_of: Callable[[Any], int], budget: int) -> Iterator[list[Any]]:
    """Consecutive groups of ``items`` whose sizes add up to at most ``budget`` (or a single larger item)."""
    batch: list[Any] = []
    total = 0
    for item in items:
        n = size_of(item)
        if batch and total + n > budget:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch


@dataclass(frozen=True)
class ChecksummedStorage:
    """A record's ``_StorageInfo`` plus ``(algorithm, digest)`` of its stored bytes, and its block digests."""

    info: Any
    algorithm: str
    digest: str
    blocks: tuple[str, ...] = ()
    first_block: int = 0  # the length of a short first block (the record's header), 0 for none
    block_size: int = 0  # of its blocks (0: the manifest's)


def unwrap_results(
    results: Iterable[Iterable[Any]],
) -> tuple[dict[Any, Any], list[tuple[Any, ...]], set[str]]:
    """``{index: _StorageInfo}``, the ``(file, offset, length, digest, blocks, first_block)`` records and the algorithms seen."""
    storage: dict[Any, Any] = {}
    records: list[tuple[Any, ...]] = []
    algorithms: set[str] = set()
    for rank_results in results:
        for wr in rank_results:
            data = wr.storage_data
            if isinstance(data, ChecksummedStorage):
                info = data.info
                blocks = getattr(data, "blocks", ())  # pickled by an older dcp-storage: none
                first, size = getattr(data, "first_block", 0), getattr(data, "block_size", 0)
                records.append(
                    (info.relative_path, int(info.offset), int(info.length), data.digest, blocks, first, size)
                )
                algorithms.add(data.algorithm)
                data = info
            storage[wr.index] = data
    return storage, records, algorithms


def manifest_provenance(manifest: Manifest | None) -> dict[str, Any]:
    """A JSON-ready summary of ``manifest`` (empty when there is none)."""
    if manifest is None:
        return {}
    return {
        "format": manifest.format,
        "writer": manifest.writer,
        "extensions": [
            {"descriptor": e.descriptor, "distribution": e.distribution, "version": e.version}
            for e in manifest.extensions
        ],
        "checksums": manifest.algorithm,
        "checksummed_records": sum(len(f.items) for f in manifest.files.values()),
    }


PIECE_BYTES = 16 * 1024 * 1024


def no_checksums_note(writer: str | None, zip_crcs: bool = False) -> str:
    """The note for a checkpoint without checksums of ours; ``zip_crcs``: its records carry zip CRC-32s."""
    who = f"its writer ({writer})" if writer else "its writer (not dcp-storage, e.g. torch's)"
    if zip_crcs:
        return (
            f"no checksums recorded: {who} recorded none; the zip CRC-32 of each record is checked by --deep and by "
            "loads that read a whole tensor or record, but a slice read alone (resharding) is not checked"
        )
    return (
        f"no checksums recorded: {who} recorded none, and the format carries none: bit flips inside tensor data "
        "cannot be detected (loads check the header only)"
    )
