"""How a rank's save is laid out in data files, how its write errors are reported, and its records written.

Write errors as a save reports them: the storage's own error, naming the path, not what torch made of it.

``torch.save`` into a Python stream swallows the stream's ``OSError`` and fails later with ``RuntimeError:
[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598``, which names neither the cause nor
the file. :class:`RecordingWriter` sits between the serializer and the file and keeps the first ``OSError``
the file raised; :func:`write_error` turns a failed write into the error to raise: a full disk or quota
(``ENOSPC``, ``EDQUOT``) as :class:`~dcp_storage.errors.StorageFullError` naming the path and the bytes the
file needed, any other storage error as itself (with the path), anything else unchanged.

How a rank's save is laid out in data files, and how many are written at once.

Local disks: ``thread_count`` files per rank, one thread each (torch's ``FileSystemWriter`` layout and
split, so either side reads the other's output the same way). Object stores: a request costs a round
trip and a multipart upload costs three requests more than a PUT, while a store spreads concurrent
requests over its servers, so a rank's items are split into at least ``thread_count`` objects of about
one upload part (``part_size``) each: such an object is built in memory and sent by one PUT, and several
are in flight at once, within the transport's in-flight byte budget. An item larger than a part gets an
object of its own, sent as a multipart upload whose parts go up concurrently.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_storage._torch import SAVE_WITHOUT_CRC, item_size, save_without_crc, split_by_size_and_type
from dcp_storage.errors import DcpStorageError, StorageFullError

try:  # ISA-L's CRC-32 (zip's polynomial); zlib's where no wheel exists
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency
    from zlib import crc32 as _crc32

__all__ = [
    "FULL_ERRNOS",
    "ZipCrcFiller",
    "ZipLayoutError",
    "save_record",
    "MemoryFile",
    "RECORD_OVERHEAD",
    "RecordingWriter",
    "estimated_bytes",
    "group_items",
    "write_error",
]


FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)


class RecordingWriter:
    """A pass-through writer that remembers the first ``OSError`` its file raised (``error``)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._raw.write(data)  # type: ignore[no-any-return]
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:  # tell, writable, ... of the file
        return getattr(self._raw, name)


def _os_error(exc: BaseException, recorded: OSError | None) -> OSError | None:
    """The storage's error behind ``exc``: the recorded one, else the first ``OSError`` in its chain."""
    if recorded is not None:
        return recorded
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def write_error(
    exc: BaseException, url: str, needed: int | None = None, recorded: OSError | None = None
) -> BaseException:
    """The error to raise for ``exc``, raised while writing ``url`` (a file of about ``needed`` bytes)."""
    if isinstance(exc, StorageFullError):
        return exc
    cause = _os_error(exc, recorded)
    if cause is None:
        return exc
    if cause.errno in FULL_ERRNOS:
        return StorageFullError(url, needed, cause.errno, cause.strerror or str(cause))
    if cause is not exc and not isinstance(exc, OSError):  # torch's RuntimeError hid it: the real one
        return type(cause)(cause.errno, f"{url}: {cause.strerror or cause}")
    return exc


RECORD_OVERHEAD = 4096  # a torch.save record's zip headers and data.pkl, rounded up


def estimated_bytes(items: Sequence[WriteItem]) -> int:
    """About the stored size of ``items`` (exact for tensors up to the small per-record overhead)."""
    return sum((item_size(i) if i.type != WriteItemType.BYTE_IO else 0) + RECORD_OVERHEAD for i in items)


SMALL_RECORD = 1024 * 1024  # a record whose fixed CPU cost (~0.3 ms) is worth more than its bytes' disk time


def write_order(items: Sequence[WriteItem]) -> list[WriteItem]:
    """The order of one data file's records: byte items first (torch's order), then the large tensors
    largest first, with the small ones (under :data:`SMALL_RECORD`) spread evenly after them.

    Why: each record costs a fixed ~0.3 ms of CPU (pickle, zip headers, checksums) however small, and the
    disk only waits on records whose bytes are not made yet. torch's split hands each file its items
    largest first, so a file ended with a run of small ones (a transformer's norms and biases: about 100
    records, 30 ms here) while the disk had nothing left to write. Spread out, each few small records are
    made while the disk writes the large record before them.
    """
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=item_size, reverse=True)
    out = [i for i in items if i.type == WriteItemType.BYTE_IO]
    large = [i for i in tensors if item_size(i) >= SMALL_RECORD]
    small = tensors[len(large) :]
    if not large:
        return out + small
    for n, item in enumerate(large):
        out.append(item)
        out += small[n * len(small) // len(large) : (n + 1) * len(small) // len(large)]
    return out


def group_items(
    items: Sequence[WriteItem], *, local: bool, thread_count: int, single_file_per_rank: bool, object_bytes: int
) -> list[list[WriteItem]]:
    """The items of each data file (see the module docstring); no empty files.

    Both cases use torch's split (largest items first, each into the smallest file so far): ``thread_count``
    files locally; on object stores as many more as it takes for the files to be about ``object_bytes``.
    """
    if not single_file_per_rank:
        return [[item] for item in items]
    files = thread_count
    if not local:
        files = max(thread_count, -(-estimated_bytes(items) // object_bytes))
    return [b for b in split_by_size_and_type(files, list(items)) if b]


class MemoryFile:
    """A write-only file in one ``bytearray``, allocated once at ``capacity`` (no regrowth copies for a
    good estimate) and trimmed to what was written: ``data`` after :meth:`close_buffer`."""

    def __init__(self, capacity: int) -> None:
        self.data = bytearray(capacity)
        self._view = memoryview(self.data)
        self._pos = 0

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        n = src.nbytes
        end = self._pos + n
        if end > len(self.data):  # the estimate was short: grow (one copy of what is there)
            self._view.release()
            self.data.extend(bytes(end - len(self.data)))
            self._view = memoryview(self.data)
        self._view[self._pos : end] = src
        self._pos = end
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """Nothing to flush: the bytes are sent whole by the caller."""

    def writable(self) -> bool:
        return True

    def close_buffer(self) -> bytearray:
        """The bytes written (the spare capacity is dropped in place)."""
        self._view.release()
        del self.data[self._pos :]
        return self.data


def save_record(obj: Any, stream: Any) -> None:
    """``torch.save(obj, stream)`` with each zip entry's CRC-32 computed by ISA-L: the same entries, offsets
    and CRC-32s as torch.save writes (``tests/formats/dcp_native/test_record_crc.py``).

    torch's zip writer computes its CRC-32s with a table-driven loop (``crc32_16bytes``): in a DCP save of
    512 MiB on one process that was 0.33 of the save's 0.57 s of CPU, more than serialising and writing
    together. Here torch's writer is told to compute none and :class:`ZipCrcFiller` fills in each entry's
    CRC-32 in the data descriptor and the central directory as they pass, computed by ISA-L (17-60 GB/s
    here) over the entry's bytes as they are written. Where this torch
    has no ``serialization._save`` of the signature used, it is ``torch.save`` itself.
    """
    if not SAVE_WITHOUT_CRC:
        torch.save(obj, stream)
        return
    filler = ZipCrcFiller(stream)
    save_without_crc(obj, filler)
    filler.finished()


_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"


class ZipLayoutError(DcpStorageError, RuntimeError):
    """torch's zip writer wrote something :class:`ZipCrcFiller` does not know; nothing is written with a
    missing CRC-32."""


class ZipCrcFiller:
    """The stream torch's zip writer writes to when told to compute no CRC-32: fills them in on the way.

    torch's writer (miniz) writes each entry as separate calls: a 30-byte local header, the name, the
    extra field, the data, then a data descriptor (signature, CRC-32, compressed and uncompressed size:
    16 bytes, 24 with zip64); at the end the central directory in one call, then the end records. The
    filler hashes the data calls, writes the descriptor with the CRC-32 put in, and puts each entry's CRC-32
    into its central directory record. Every field it relies on is checked (the descriptor's and the
    central directory's sizes against the bytes seen, a zero CRC where it writes one): anything else
    raises :class:`ZipLayoutError` instead of writing an archive with a wrong CRC-32.
    """

    # An entry's data goes on in pieces of this size, each CRC'd just before: the writer below hashes and
    # copies it while it is still in the L2 cache, and the disk gets its first bytes after one piece, not
    # after the CRC of the whole tensor (5 ms for 64 MiB here, during which the disk had nothing to write).
    PIECE = 1024 * 1024

    def __init__(self, out: Any) -> None:
        self._out = out
        self._meta = -1  # name and extra bytes still to come after a local header; -1: not in an entry
        self._in_data = False
        self._described = True
        self._crc = 0
        self._size = 0
        self._entries: list[tuple[int, int]] = []  # (crc, size) of each entry, in order
        self._central = 0  # central directory records filled in

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._in_data:
            if n in (16, 24) and view[:4] == _DESCRIPTOR and self._descriptor_fits(view):
                out = bytearray(view)
                out[4:8] = self._crc.to_bytes(4, "little")
                self._entries.append((self._crc, self._size))
                self._in_data = False
                self._out.write(out)
                return n
            if n <= self.PIECE:
                self._crc = _crc32(view, self._crc)
            else:  # a tensor's elements: each piece hashed, then passed on, while it is still in the CPU cache
                for pos in range(0, n, self.PIECE):
                    piece = view[pos : pos + self.PIECE]
                    self._crc = _crc32(piece, self._crc)
                    self._out.write(piece)
                self._size += n
                return n
            self._size += n
        elif self._meta > 0:
            if n > self._meta:
                raise ZipLayoutError(
                    f"a {n}-byte write where {self._meta} bytes of an entry's name and extra field were due"
                )
            self._meta -= n
            if self._meta == 0:
                self._entry_begins()
        elif n == 30 and view[:4] == _LOCAL:
            if int.from_bytes(view[14:18], "little") != 0:
                raise ZipLayoutError("a local header with a CRC-32 already")
            # With a data descriptor (bit 3) the data follows; without one, only an empty entry (CRC-32 0).
            self._described = bool(int.from_bytes(view[6:8], "little") & 0x8)
            if not self._described and int.from_bytes(view[18:26], "little") != 0:
                raise ZipLayoutError("a local header of a non-empty entry without a data descriptor")
            self._meta = int.from_bytes(view[26:28], "little") + int.from_bytes(view[28:30], "little")
            if self._meta == 0:
                self._out.write(view)
                self._entry_begins()
                return n
        elif n >= 46 and view[:4] == _CENTRAL:
            out = bytearray(view)
            self._fill_central(out)
            self._out.write(out)
            return n
        elif not self._entries or self._central != len(self._entries):  # only the end records remain
            raise ZipLayoutError(f"an unexpected {n}-byte write between entries")
        self._out.write(view)
        return n

    def _entry_begins(self) -> None:
        """The local header, name and extra field are out: the data comes next, or nothing (empty entry)."""
        self._meta = -1
        if self._described:
            self._in_data, self._crc, self._size = True, 0, 0
        else:
            self._entries.append((0, 0))

    def _descriptor_fits(self, view: memoryview) -> bool:
        wide = view.nbytes == 24
        sizes = [int.from_bytes(view[a : a + (8 if wide else 4)], "little") for a in ((8, 16) if wide else (8, 12))]
        return int.from_bytes(view[4:8], "little") == 0 and sizes == [self._size, self._size]

    def _fill_central(self, out: bytearray) -> None:
        pos = 0
        while pos + 46 <= len(out) and out[pos : pos + 4] == _CENTRAL:
            if self._central >= len(self._entries):
                raise ZipLayoutError("more central directory records than entries written")
            crc, size = self._entries[self._central]
            stored = int.from_bytes(out[pos + 24 : pos + 28], "little")
            if int.from_bytes(out[pos + 16 : pos + 20], "little") != 0 or stored not in (size, 0xFFFFFFFF):
                raise ZipLayoutError(f"central directory record {self._central} does not match its entry")
            out[pos + 16 : pos + 20] = crc.to_bytes(4, "little")
            self._central += 1
            pos += 46 + sum(int.from_bytes(out[pos + a : pos + a + 2], "little") for a in (28, 30, 32))
        if pos != len(out):
            raise ZipLayoutError("a central directory write that ends inside a record")

    def flush(self) -> None:
        self._out.flush()

    def finished(self) -> None:
        """Check that every entry written got its CRC-32 into the central directory."""
        if self._in_data or self._meta > 0 or self._central != len(self._entries):
            raise ZipLayoutError(
                f"the archive ended with {len(self._entries)} entries and {self._central} central directory records"
            )
