"""The entries of a zip archive, read from its end with a few ranged reads.

``torch.save`` writes a zip whose entries are stored uncompressed, each streamed with a data descriptor,
and always closes it with a zip64 end record, the central directory listing every entry's name, size and
local-header offset. Reading the tail (end record, zip64 locator and record) and then the central directory
gives every record's place without reading any record; the exact start of an entry's bytes needs its local
header too (its extra field carries torch's alignment padding), which :func:`data_starts` reads in one
batch of small ranged reads. The layout rules (unique names, local headers that repeat the central
directory, no overlaps, bounded inflation) are :mod:`.zip_layout`'s, checked on the way.

Nothing here knows about tensors; :mod:`.archive` builds on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.torch_save.zip_layout import (
    DEFLATED,
    DESCRIPTOR_FLAG,
    LOCAL,
    STORED,
    ZipEntry,
    check_crc,
    check_descriptor,
    check_local_header,
    descriptor_span,
    index_from_tail,
    inflate,
    locate_end,
)
from dcp_storage.transports import RangeRequest, Transport

__all__ = ["DEFLATED", "STORED", "NotAZipError", "ZipEntry", "ZipIndex", "data_starts", "read_entry", "read_zip_index"]

_LOCAL_SLACK = 256  # extra-field bytes to read with a local header on the first try (torch pads to 64)


class NotAZipError(CorruptCheckpointError):
    """The file has no zip end record; ``head`` holds its first bytes (to tell the legacy format apart)."""

    def __init__(self, message: str, head: bytes) -> None:
        super().__init__(message)
        self.head = head


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

    def read(lo: int, hi: int) -> bytes:
        return bytes(transport.read_range(path, lo, hi))

    end = locate_end(read, size)
    if end is None:
        raise NotAZipError(f"{url}: not a zip archive (no end-of-central-directory record)", read(0, min(size, 64)))
    cd_offset, entries = index_from_tail(read, *end, url)
    return ZipIndex(path, url, size, cd_offset, entries)


def data_starts(transport: Transport, index: ZipIndex, names: Iterable[str]) -> dict[str, int]:
    """Byte offset where each named entry's bytes begin (after its local header), read in one batch."""
    todo = {n: _LOCAL_SLACK for n in names}
    out: dict[str, int] = {}
    while todo:
        order = list(todo)
        reqs = []
        for n in order:
            e = index.entries[n]
            end = min(e.header_offset + LOCAL.size + len(e.raw_name) + todo[n], e.limit)
            reqs.append(RangeRequest(index.path, e.header_offset, end))
        todo = {}
        for n, buf in zip(order, transport.read_ranges(reqs)):
            e = index.entries[n]
            head = bytes(buf)  # type: ignore[arg-type]
            start = check_local_header(e, head, index.url)
            if start is None:
                need = _needed(head)
                if e.header_offset + need > e.limit:
                    raise CorruptCheckpointError(f"{index.url}: local header of {n!r} runs into the next entry")
                todo[n] = need - LOCAL.size - len(e.raw_name)
                continue
            out[n] = e.header_offset + start
    _check_descriptors(transport, index, out)
    return out


def _check_descriptors(transport: Transport, index: ZipIndex, starts: dict[str, int]) -> None:
    """Each flagged entry's data descriptor, where its local header places the end of its data (one batch;
    a descriptor ends at the next entry's local header, so a transport that coalesces near ranges reads
    them with the headers' bytes)."""
    flagged = [n for n in starts if index.entries[n].flags & DESCRIPTOR_FLAG]
    spans = [descriptor_span(index.entries[n], starts[n]) for n in flagged]
    reqs = [RangeRequest(index.path, lo, hi) for lo, hi in spans]
    for n, buf in zip(flagged, transport.read_ranges(reqs) if reqs else []):
        check_descriptor(index.entries[n], bytes(buf), index.url)  # type: ignore[arg-type]


def _needed(head: bytes) -> int:
    """Bytes the local header at the start of ``head`` occupies (its name and extra field included)."""
    nlen, xlen = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    return LOCAL.size + nlen + xlen


def read_entry(transport: Transport, index: ZipIndex, name: str, max_bytes: int) -> bytes:
    """The (inflated, CRC-checked) bytes of one small entry: local header and data in one read."""
    e = index.entries[name]
    if e.size > max_bytes:
        raise CorruptCheckpointError(
            f"{index.url}: record {name!r} is {e.size} bytes, more than the {max_bytes} allowed"
        )
    end = min(e.header_offset + LOCAL.size + len(e.raw_name) + _LOCAL_SLACK + e.compressed_size + 24, e.limit)
    buf = bytes(transport.read_range(index.path, e.header_offset, end))
    start = check_local_header(e, buf, index.url)
    if start is None:
        start = _needed(buf)
    if start + e.compressed_size <= len(buf):
        raw = buf[start : start + e.compressed_size]
    else:
        abs_start = e.header_offset + start
        raw = bytes(transport.read_range(index.path, abs_start, abs_start + e.compressed_size))
    lo, hi = descriptor_span(e, e.header_offset + start)  # read with the entry (24 bytes more) when it fits
    if hi - e.header_offset <= len(buf):
        tail = buf[lo - e.header_offset : hi - e.header_offset]
    else:
        tail = bytes(transport.read_range(index.path, lo, hi))
    check_descriptor(e, tail, index.url)
    data = inflate(raw, e, index.url)
    check_crc(data, e, index.url)
    return data
