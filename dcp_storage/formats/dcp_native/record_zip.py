"""The zip layer of a DCP record: walking its local headers, and checking a record held whole.

A DCP tensor record is a ``torch.save`` zip. The record parser (:mod:`.torch_record`) reads its first KiB
only, so it learns the layout from the local headers, in order (:func:`walk_records`): each must be
sound on its own (no encryption, stored sizes equal, zip64 fields complete) and no name may appear twice.
A record held whole in memory is checked in full (:func:`check_record_zip`: central directory against
local headers, overlaps, bounded inflation, CRC32s) before ``torch.load`` reads it, and for every record
read whole with ``verify=True``.
"""

from __future__ import annotations

import re
import struct

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.torch_save.zip_layout import check_zip_bytes

__all__ = ["UnsupportedRecord", "check_record_zip", "walk_records"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_SIG = b"PK\x03\x04"
_ZIP64_EXTRA_ID = 0x0001
_ENCRYPTED = 0x0001 | 0x0040
_DESCRIPTOR_SEARCH = 1 << 20  # metadata entries before the tensor data are tiny
_STORAGE_ENTRY = re.compile(r"(?:^|/)data/[^/]+$")


class UnsupportedRecord(Exception):
    """The record is valid but not a plain dense tensor we can slice; load it whole instead."""


def check_record_zip(data: bytes | memoryview, path: str) -> None:
    """Check a whole record held in memory, if it is a zip: layout (:mod:`..torch_save.zip_layout`: unique
    names, local headers agreeing with the central directory, no overlaps, bounded inflation) and every
    entry's CRC32. Always before ``torch.load`` reads a record (it trusts the central directory and
    inflates what it declares); for tensor records our parser decodes, only with ``verify=True``: on a
    checkpoint of small records the check costs more than 5% of the load (README)."""
    if bytes(data[:4]) == _LOCAL_SIG:
        check_zip_bytes(data, path)


def _descriptor_end(buf: memoryview, data_start: int) -> tuple[int, int] | None:
    """Find the data descriptor that closes an entry starting at ``data_start``.

    torch's zip writer streams entries with general-purpose flag 3 set: the local header says size 0 and
    the real sizes follow the data in a descriptor ``PK\\x07\\x08 crc csize usize`` (sizes 4 or 8 bytes).
    A candidate signature is accepted only if its size field equals the distance from ``data_start``,
    which a stray ``PK\\x07\\x08`` inside the data cannot fake by accident. Returns ``(size, next)``.
    """
    raw = bytes(buf[data_start : data_start + _DESCRIPTOR_SEARCH])
    pos = 0
    while True:
        p = raw.find(b"PK\x07\x08", pos)
        if p < 0:
            if len(raw) == _DESCRIPTOR_SEARCH:
                raise UnsupportedRecord("zip entry too large to walk")
            return None
        size = p
        for width, fmt in ((8, "<QQ"), (4, "<II")):
            end = p + 8 + 2 * width
            if end <= len(raw):
                csize, usize = struct.unpack_from(fmt, raw, p + 8)
                if csize == usize == size and (end + 2 > len(raw) or raw[end : end + 2] == b"PK"):
                    return size, data_start + end
        pos = p + 1


def walk_records(buf: memoryview, record_len: int, path: str) -> dict[str, tuple[int, int | None]]:
    """Map zip entry names to ``(data_start, size)`` for the local headers found in ``buf``.

    ``size`` is ``None`` for the last streamed entry whose closing descriptor is not in ``buf`` yet
    (its size is then known from ``data.pkl``). Stops at the central directory or where ``buf`` ends.
    Raises :class:`UnsupportedRecord` for compressed entries, :class:`CorruptCheckpointError` for garbage.
    """
    entries: dict[str, tuple[int, int | None]] = {}
    pos = 0
    while pos + _LOCAL_HEADER.size <= len(buf):
        sig = bytes(buf[pos : pos + 4])
        if sig != _LOCAL_SIG:
            if entries and sig[:2] == b"PK":
                return entries  # central directory or end record
            raise CorruptCheckpointError(
                f"{path}: expected a torch.save zip record at byte {pos} of the item, found {sig!r}"
            )
        (_, _ver, flags, method, _t, _d, _crc, csize, usize, nlen, xlen) = _LOCAL_HEADER.unpack_from(buf, pos)
        head_end = pos + _LOCAL_HEADER.size + nlen + xlen
        if head_end > len(buf):
            return entries
        name = bytes(buf[pos + _LOCAL_HEADER.size : pos + _LOCAL_HEADER.size + nlen]).decode("utf-8", "replace")
        if name in entries:
            raise CorruptCheckpointError(
                f"{path}: the torch.save record holds two zip entries named {name!r} (a corrupt or hostile record)"
            )
        if flags & _ENCRYPTED:
            raise CorruptCheckpointError(f"{path}: zip entry {name!r} of the record is encrypted")
        if method != 0:
            raise UnsupportedRecord(f"compressed zip entry {name}")
        if flags & 0x08 and _STORAGE_ENTRY.search(name):
            entries[name] = (head_end, None)  # the tensor bytes: size comes from data.pkl; stop here
            return entries
        if flags & 0x08:
            found = _descriptor_end(buf, head_end)
            if found is None:
                entries[name] = (head_end, None)
                return entries
            size, pos = found
            entries[name] = (head_end, size)
        else:
            if csize == 0xFFFFFFFF or usize == 0xFFFFFFFF:
                csize, usize = _zip64_sizes(buf[pos + _LOCAL_HEADER.size + nlen : head_end], path)
            if csize != usize:
                raise CorruptCheckpointError(
                    f"{path}: stored zip entry {name!r} declares {csize} bytes stored but {usize} bytes of content"
                )
            entries[name] = (head_end, csize)
            pos = head_end + csize
        if pos > record_len:
            raise CorruptCheckpointError(
                f"{path}: zip entry {name!r} runs to byte {pos} but the item is only {record_len} bytes "
                "(truncated or corrupt record)"
            )
    return entries


def _zip64_sizes(extra: memoryview, path: str) -> tuple[int, int]:
    """``(compressed, uncompressed)`` sizes from a local header's zip64 extra field."""
    i = 0
    while i + 4 <= len(extra):
        header_id, size = struct.unpack_from("<HH", extra, i)
        if header_id == _ZIP64_EXTRA_ID and size >= 16 and i + 4 + 16 <= len(extra):
            usize, csize = struct.unpack_from("<QQ", extra, i + 4)
            return int(csize), int(usize)
        i += 4 + size
    raise CorruptCheckpointError(f"{path}: zip64 entry without a complete zip64 extra field")
