"""The zstd seekable format's seek table: encoding, and parsing from an item's tail.

Layout (facebook/zstd ``contrib/seekable_format/zstd_seekable_compression_format.md``, version 0.1.0; all
integers little-endian): the zstd frames, then one skippable frame holding the table::

    Skippable_Magic_Number  u32  0x184D2A5E
    Frame_Size              u32  size of what follows (entries + footer)
    Seek_Table_Entries      Number_Of_Frames x (Compressed_Size u32, Decompressed_Size u32[, Checksum u32])
    Number_Of_Frames        u32
    Seek_Table_Descriptor   u8   bit 7: entries carry a checksum; bits 6-2 reserved (0); bits 1-0 unused
    Seekable_Magic_Number   u32  0x8F92EAB1

The checksum is the low 32 bits of the XXH64 of the frame's decompressed bytes, which is exactly the
content checksum zstd writes at the end of a frame made with ``write_checksum=True``; we copy it from there.
Since the table is a skippable frame, any zstd decoder (``zstd -d``, ``zstandard``) decodes the whole item
as the concatenation of its frames.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from dcp_storage.plugin_api import Frame, FrameIndex, NeedMoreTail

__all__ = [
    "FOOTER_BYTES",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "SeekTableError",
    "ZstdFrame",
    "encode_seek_table",
    "parse_seek_table",
    "table_bytes",
]

SKIPPABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
FOOTER_BYTES = 9
HEADER_BYTES = 8  # skippable magic + frame size
CHECKSUM_FLAG = 0x80
RESERVED_BITS = 0x7C
MAX_FRAMES = 0x8000000  # the reference implementation's limit
MAX_FRAME_BYTES = 0x40000000  # ditto, for one frame's decompressed size (1 GiB)

_FOOTER = struct.Struct("<IBI")
_HEADER = struct.Struct("<II")


class SeekTableError(ValueError):
    """The bytes at the end of an item are not a valid seek table (or do not match the item)."""


@dataclass(frozen=True)
class ZstdFrame(Frame):
    """A frame with the checksum its seek-table entry records (``None`` when the table has none)."""

    checksum: int | None = None


def encode_seek_table(entries: Sequence[tuple[int, int, int | None]], checksums: bool) -> bytes:
    """The skippable frame for ``(compressed_size, decompressed_size, checksum)`` entries."""
    if len(entries) > MAX_FRAMES:
        raise SeekTableError(f"{len(entries)} frames exceed the seekable format's limit of {MAX_FRAMES}")
    entry = struct.Struct("<III" if checksums else "<II")
    body = bytearray()
    for stored, raw, checksum in entries:
        if checksums:
            if checksum is None:
                raise SeekTableError("a frame has no checksum but the table records checksums")
            body += entry.pack(stored, raw, checksum)
        else:
            body += entry.pack(stored, raw)
    body += _FOOTER.pack(len(entries), CHECKSUM_FLAG if checksums else 0, SEEKABLE_MAGIC)
    return _HEADER.pack(SKIPPABLE_MAGIC, len(body)) + bytes(body)


def table_bytes(n_frames: int, checksums: bool) -> int:
    return HEADER_BYTES + n_frames * (12 if checksums else 8) + FOOTER_BYTES


def parse_seek_table(tail: memoryview | bytes, stored_length: int) -> FrameIndex:
    """The frame index of a ``stored_length``-byte item from its last ``len(tail)`` bytes.

    Raises :class:`NeedMoreTail` if the table is longer than ``tail``, :class:`SeekTableError` if the
    bytes are not a seek table that fits the item.
    """
    tail = memoryview(tail).cast("B")
    if stored_length < HEADER_BYTES + FOOTER_BYTES:
        raise SeekTableError(f"a {stored_length}-byte item cannot hold a seek table (not zstd-seekable output?)")
    if len(tail) < FOOTER_BYTES:
        raise NeedMoreTail(HEADER_BYTES + FOOTER_BYTES)
    n_frames, descriptor, magic = _FOOTER.unpack_from(tail, len(tail) - FOOTER_BYTES)
    if magic != SEEKABLE_MAGIC:
        raise SeekTableError(
            f"no seek table: the item ends with 0x{magic:08X}, not the seekable magic 0x{SEEKABLE_MAGIC:08X}"
        )
    if descriptor & RESERVED_BITS:
        raise SeekTableError(f"seek table descriptor 0x{descriptor:02X} sets reserved bits")
    if n_frames > MAX_FRAMES:
        raise SeekTableError(f"seek table claims {n_frames} frames (limit {MAX_FRAMES})")
    checksums = bool(descriptor & CHECKSUM_FLAG)
    size = table_bytes(n_frames, checksums)
    if size > stored_length:
        raise SeekTableError(
            f"seek table of {n_frames} frames ({size} bytes) is longer than the {stored_length}-byte item"
        )
    if len(tail) < size:
        raise NeedMoreTail(size)
    start = len(tail) - size
    skippable, frame_size = _HEADER.unpack_from(tail, start)
    if skippable != SKIPPABLE_MAGIC or frame_size != size - HEADER_BYTES:
        raise SeekTableError(
            f"seek table frame header is 0x{skippable:08X}/{frame_size}, expected 0x{SKIPPABLE_MAGIC:08X}/{size - HEADER_BYTES}"
        )
    entry = struct.Struct("<III" if checksums else "<II")
    frames: list[ZstdFrame] = []
    stored = raw = 0
    for i, values in enumerate(entry.iter_unpack(tail[start + HEADER_BYTES : len(tail) - FOOTER_BYTES])):
        c_size, d_size = values[0], values[1]
        if d_size > MAX_FRAME_BYTES:
            raise SeekTableError(f"frame {i} claims {d_size} decompressed bytes (limit {MAX_FRAME_BYTES})")
        frames.append(ZstdFrame(i, stored, stored + c_size, raw, raw + d_size, values[2] if checksums else None))
        stored, raw = stored + c_size, raw + d_size
    if stored + size != stored_length:
        raise SeekTableError(
            f"frames hold {stored} bytes and the seek table {size}, but the item has {stored_length} bytes"
        )
    return FrameIndex(frames)
