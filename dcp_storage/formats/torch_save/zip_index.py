"""The entries of a zip archive, read from its end with a few ranged reads.

``torch.save`` writes a zip whose entries are stored uncompressed, each streamed with a data descriptor,
and always closes it with a zip64 end record, the central directory listing every entry's name, size and
local-header offset. Reading the tail (end record, zip64 locator and record) and then the central directory
gives every record's place without reading any record; the exact start of an entry's bytes needs its local
header too (its extra field carries torch's alignment padding), which :func:`data_starts` reads in one
batch of small ranged reads.

Nothing here knows about tensors; :mod:`.archive` builds on it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from ...errors import CorruptCheckpointError
from ...transports import RangeRequest, Transport

__all__ = ["NotAZipError", "ZipEntry", "ZipIndex", "data_starts", "read_entry", "read_zip_index"]

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record, 22 bytes + comment
_EOCD64_LOCATOR = struct.Struct("<4sIQI")  # 20 bytes, just before the end record
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes (+ extensible data)
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes + name + extra + comment
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes + name + extra
_EOCD_SIG = b"PK\x05\x06"
_EOCD64_LOCATOR_SIG = b"PK\x06\x07"
_EOCD64_SIG = b"PK\x06\x06"
_CENTRAL_SIG = b"PK\x01\x02"
_LOCAL_SIG = b"PK\x03\x04"
_ZIP64_EXTRA = 0x0001
_MAX_COMMENT = 0xFFFF
_FIRST_TAIL = 4096  # holds the end records of a torch.save archive (it writes no comment)
_LOCAL_SLACK = 256  # extra-field bytes to read with a local header on the first try (torch pads to 64)
STORED, DEFLATED = 0, 8


class NotAZipError(CorruptCheckpointError):
    """The file has no zip end record; ``head`` holds its first bytes (to tell the legacy format apart)."""

    def __init__(self, message: str, head: bytes) -> None:
        super().__init__(message)
        self.head = head


@dataclass(frozen=True)
class ZipEntry:
    """One central-directory entry."""

    name: str
    header_offset: int
    compressed_size: int
    size: int
    method: int
    crc32: int


@dataclass(frozen=True)
class ZipIndex:
    """The entries of the zip at ``path`` (a path of the transport's filesystem), by name."""

    path: str
    url: str
    file_size: int
    central_offset: int  # entry bytes all lie before this
    entries: dict[str, ZipEntry]


def read_zip_index(transport: Transport, path: str) -> ZipIndex:
    """Read the end records and the central directory of the zip at ``path``.

    Raises :class:`NotAZipError` when there is no end record (empty, garbage, legacy ``torch.save``
    pickle format) and :class:`CorruptCheckpointError` for an inconsistent one (truncated file).
    """
    url = transport.url(path)
    size = transport.size(path)
    if size == 0:
        raise NotAZipError(f"{url}: the file is empty, not a torch.save archive", b"")
    tail_start = max(0, size - _FIRST_TAIL)
    tail = bytes(transport.read_range(path, tail_start, size))
    eocd_at = _find_eocd(tail)
    if eocd_at < 0 and tail_start > 0:
        tail_start = max(0, size - (_EOCD.size + _MAX_COMMENT + _EOCD64_LOCATOR.size + _EOCD64.size))
        tail = bytes(transport.read_range(path, tail_start, size))
        eocd_at = _find_eocd(tail)
    if eocd_at < 0:
        head = tail[:64] if tail_start == 0 else bytes(transport.read_range(path, 0, min(size, 64)))
        raise NotAZipError(f"{url}: not a zip archive (no end-of-central-directory record)", head)

    (_, disk, _cd_disk, _n_disk, n_entries, cd_size, cd_offset, _clen) = _EOCD.unpack_from(tail, eocd_at)
    eocd_abs = tail_start + eocd_at
    locator_at = eocd_at - _EOCD64_LOCATOR.size
    if locator_at >= 0 and tail[locator_at : locator_at + 4] == _EOCD64_LOCATOR_SIG:
        _, _disk, eocd64_offset, _ndisks = _EOCD64_LOCATOR.unpack_from(tail, locator_at)
        if eocd64_offset + _EOCD64.size > eocd_abs:
            raise CorruptCheckpointError(f"{url}: zip64 end record offset {eocd64_offset} is past the end record")
        if eocd64_offset >= tail_start:
            rec = tail[eocd64_offset - tail_start : eocd64_offset - tail_start + _EOCD64.size]
        else:
            rec = bytes(transport.read_range(path, eocd64_offset, eocd64_offset + _EOCD64.size))
        sig, _rsize, _made, _need, disk, _cd_disk, _n_disk, n_entries, cd_size, cd_offset = _EOCD64.unpack_from(rec)
        if sig != _EOCD64_SIG:
            raise CorruptCheckpointError(f"{url}: bad zip64 end record at byte {eocd64_offset} (truncated file?)")
        cd_end_limit = eocd64_offset
    else:
        cd_end_limit = eocd_abs
    if disk != 0:
        raise CorruptCheckpointError(f"{url}: multi-disk zip archives are not supported")
    if cd_offset + cd_size > cd_end_limit:
        raise CorruptCheckpointError(
            f"{url}: the central directory [{cd_offset}, {cd_offset + cd_size}) runs past its end record at "
            f"{cd_end_limit}: the file is truncated or not a complete torch.save archive"
        )
    if cd_offset >= tail_start:
        central = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        central = bytes(transport.read_range(path, cd_offset, cd_offset + cd_size))
    entries = _parse_central(central, n_entries, url)
    for e in entries.values():
        if e.header_offset + _LOCAL.size + e.compressed_size > cd_offset:
            raise CorruptCheckpointError(
                f"{url}: zip entry {e.name!r} at byte {e.header_offset} ({e.compressed_size} bytes) overlaps the "
                f"central directory at {cd_offset}"
            )
    return ZipIndex(path, url, size, cd_offset, entries)


def _find_eocd(tail: bytes) -> int:
    """Position in ``tail`` of the last end record whose comment length fits what follows it."""
    pos = len(tail)
    while True:
        pos = tail.rfind(_EOCD_SIG, 0, pos)
        if pos < 0:
            return -1
        if pos + _EOCD.size <= len(tail):
            comment_len = struct.unpack_from("<H", tail, pos + 20)[0]
            if pos + _EOCD.size + comment_len == len(tail):
                return pos


def _parse_central(data: bytes, n_entries: int, url: str) -> dict[str, ZipEntry]:
    entries: dict[str, ZipEntry] = {}
    pos = 0
    for _ in range(n_entries):
        if pos + _CENTRAL.size > len(data) or data[pos : pos + 4] != _CENTRAL_SIG:
            raise CorruptCheckpointError(f"{url}: corrupt zip central directory at entry {len(entries)}")
        (_, _made, _need, flags, method, _t, _d, crc, csize, usize, nlen, xlen, clen, _disk, _ia, _ea, offset) = (
            _CENTRAL.unpack_from(data, pos)
        )
        name_at = pos + _CENTRAL.size
        raw_name = data[name_at : name_at + nlen]
        name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        extra = data[name_at + nlen : name_at + nlen + xlen]
        if usize == 0xFFFFFFFF or csize == 0xFFFFFFFF or offset == 0xFFFFFFFF:
            usize, csize, offset = _zip64_fields(extra, usize, csize, offset, url, name)
        entries[name] = ZipEntry(name, offset, csize, usize, method, crc)
        pos = name_at + nlen + xlen + clen
    return entries


def _zip64_fields(extra: bytes, usize: int, csize: int, offset: int, url: str, name: str) -> tuple[int, int, int]:
    i = 0
    while i + 4 <= len(extra):
        header_id, length = struct.unpack_from("<HH", extra, i)
        if header_id == _ZIP64_EXTRA:
            body = extra[i + 4 : i + 4 + length]
            values = list(struct.unpack_from(f"<{len(body) // 8}Q", body)) if len(body) >= 8 else []
            if usize == 0xFFFFFFFF:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF:
                csize = values.pop(0)
            if offset == 0xFFFFFFFF:
                offset = values.pop(0)
            return usize, csize, offset
        i += 4 + length
    raise CorruptCheckpointError(f"{url}: zip entry {name!r} needs a zip64 extra field and has none")


def data_starts(transport: Transport, index: ZipIndex, names: Iterable[str]) -> dict[str, int]:
    """Byte offset where each named entry's bytes begin (after its local header), read in one batch."""
    todo = {n: _LOCAL_SLACK for n in names}
    out: dict[str, int] = {}
    while todo:
        order = list(todo)
        reqs = []
        for n in order:
            e = index.entries[n]
            end = min(e.header_offset + _LOCAL.size + len(n.encode()) + todo[n], index.central_offset)
            reqs.append(RangeRequest(index.path, e.header_offset, end))
        todo = {}
        for n, buf in zip(order, transport.read_ranges(reqs)):
            e = index.entries[n]
            head = bytes(buf)  # type: ignore[arg-type]
            if len(head) < _LOCAL.size or head[:4] != _LOCAL_SIG:
                raise CorruptCheckpointError(
                    f"{index.url}: no local zip header for {n!r} at byte {e.header_offset} (corrupt archive)"
                )
            nlen, xlen = struct.unpack_from("<HH", head, 26)
            need = _LOCAL.size + nlen + xlen
            if need > len(head):
                if e.header_offset + need > index.central_offset:
                    raise CorruptCheckpointError(f"{index.url}: local header of {n!r} runs into the central directory")
                todo[n] = need - _LOCAL.size - len(n.encode())
                continue
            start = e.header_offset + need
            if start + e.compressed_size > index.central_offset:
                raise CorruptCheckpointError(
                    f"{index.url}: entry {n!r} ends at byte {start + e.compressed_size}, past the entry area "
                    f"({index.central_offset} bytes)"
                )
            out[n] = start
    return out


def read_entry(transport: Transport, index: ZipIndex, name: str, max_bytes: int) -> bytes:
    """The (decompressed, CRC-checked) bytes of one small entry: local header and data in one read."""
    e = index.entries[name]
    if e.size > max_bytes:
        raise CorruptCheckpointError(
            f"{index.url}: record {name!r} is {e.size} bytes, more than the {max_bytes} allowed"
        )
    end = min(
        e.header_offset + _LOCAL.size + len(name.encode()) + _LOCAL_SLACK + e.compressed_size, index.central_offset
    )
    buf = bytes(transport.read_range(index.path, e.header_offset, end))
    if len(buf) < _LOCAL.size or buf[:4] != _LOCAL_SIG:
        raise CorruptCheckpointError(f"{index.url}: no local zip header for {name!r} at byte {e.header_offset}")
    nlen, xlen = struct.unpack_from("<HH", buf, 26)
    start = _LOCAL.size + nlen + xlen
    if start + e.compressed_size <= len(buf):
        raw = buf[start : start + e.compressed_size]
    else:
        abs_start = e.header_offset + start
        raw = bytes(transport.read_range(index.path, abs_start, abs_start + e.compressed_size))
    if e.method == DEFLATED:
        try:
            raw = zlib.decompress(raw, -15)
        except zlib.error as exc:
            raise CorruptCheckpointError(f"{index.url}: record {name!r} does not inflate ({exc})") from exc
    elif e.method != STORED:
        raise CorruptCheckpointError(f"{index.url}: record {name!r} uses zip compression method {e.method}")
    if len(raw) != e.size or zlib.crc32(raw) != e.crc32:
        raise CorruptCheckpointError(f"{index.url}: record {name!r} fails its CRC check (corrupt archive)")
    return raw
