"""The layout rules of a zip archive, on bytes already read: end records, central directory, local headers.

A zip names every entry twice: once in the central directory at its end (what :mod:`.zip_index` and
torch's own reader consult) and once in the local header in front of the entry's bytes (what a reader
walking the file from its start sees: DCP's record parser). An archive where the two disagree, where two
entries share a name or overlap, or where a compressed entry inflates to more than it declares, reads
differently depending on who reads it: torch's reader picks one entry, ours another, and tensors load
with bytes nobody saved. Such archives are refused here, before any entry is used:

* names are unique and each local header repeats its central record: name, compression method, flags
  (data descriptor, UTF-8, no encryption) and, unless the sizes follow in a data descriptor, CRC and sizes;
* entries lie one after the other, none overlapping another or the central directory;
* a stored entry's compressed and uncompressed sizes are equal; a deflated one declares at most
  :data:`~dcp_storage.formats.paths.MAX_INFLATION_RATIO` times its compressed size, and is inflated into
  at most its declared size (:func:`inflate`): a deflate bomb costs its declared size, never more;
* zip64 fields are read from their extra field only when it holds them all.

Everything here works on ``bytes`` given by the caller; :mod:`.zip_index` fetches them through a transport
and :func:`check_zip_bytes` checks an archive held whole in memory (DCP records), CRCs included.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import NamedTuple

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.paths import MAX_INFLATION_RATIO
from dcp_storage.integrity.checksums import crc32

__all__ = [
    "DEFLATED",
    "LOCAL",
    "STORED",
    "ZipEntry",
    "check_layout",
    "check_descriptor",
    "check_local_header",
    "check_crc",
    "check_zip_bytes",
    "descriptor_span",
    "find_eocd",
    "index_from_tail",
    "inflate",
    "locate_end",
    "parse_central",
]

EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record, 22 bytes + comment
EOCD64_LOCATOR = struct.Struct("<4sIQI")  # 20 bytes, just before the end record
EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes (+ extensible data)
CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes + name + extra + comment
LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes + name + extra
EOCD_SIG = b"PK\x05\x06"
EOCD64_LOCATOR_SIG = b"PK\x06\x07"
EOCD64_SIG = b"PK\x06\x06"
CENTRAL_SIG = b"PK\x01\x02"
LOCAL_SIG = b"PK\x03\x04"
DESCRIPTOR_SIG = b"PK\x07\x08"
STORED, DEFLATED = 0, 8
_ZIP64_EXTRA = 0x0001
_U32_MAX = 0xFFFFFFFF
_ENCRYPTED = 0x0001 | 0x0040  # traditional and strong encryption
_DESCRIPTOR = 0x0008  # sizes and CRC follow the data
DESCRIPTOR_FLAG = _DESCRIPTOR
_UTF8 = 0x0800
_MUST_AGREE = _DESCRIPTOR | _UTF8 | _ENCRYPTED
_DESCRIPTOR_MAX = 24  # signature, CRC, two 8-byte sizes
_INFLATE_STEP = 1 << 20


class ZipEntry(NamedTuple):
    """One central-directory entry. ``limit``: where the next entry (or the central directory) begins;
    this entry's local header, data and data descriptor must all end there. (A named tuple: records read
    whole are checked entry by entry on the load path, and tuples are cheap to build.)"""

    name: str
    header_offset: int
    compressed_size: int
    size: int
    method: int
    crc32: int
    raw_name: bytes = b""
    flags: int = 0
    limit: int = 0


def find_eocd(tail: bytes) -> int:
    """Position in ``tail`` of the last end record whose comment length fits what follows it, or -1."""
    pos = len(tail)
    while True:
        pos = tail.rfind(EOCD_SIG, 0, pos)
        if pos < 0:
            return -1
        if pos + EOCD.size <= len(tail):
            comment_len = struct.unpack_from("<H", tail, pos + 20)[0]
            if pos + EOCD.size + comment_len == len(tail):
                return pos


def parse_central(data: bytes, n_entries: int, url: str) -> dict[str, ZipEntry]:
    """The ``n_entries`` records of a central directory, by name; refuses duplicates and encrypted entries."""
    entries: dict[str, ZipEntry] = {}
    pos = 0
    for _ in range(n_entries):
        if pos + CENTRAL.size > len(data) or data[pos : pos + 4] != CENTRAL_SIG:
            raise CorruptCheckpointError(f"{url}: corrupt zip central directory at entry {len(entries)}")
        (_, _made, _need, flags, method, _t, _d, crc, csize, usize, nlen, xlen, clen, _disk, _ia, _ea, offset) = (
            CENTRAL.unpack_from(data, pos)
        )
        name_at = pos + CENTRAL.size
        if name_at + nlen + xlen + clen > len(data):
            raise CorruptCheckpointError(f"{url}: zip central directory entry {len(entries)} runs past its end")
        raw_name = bytes(data[name_at : name_at + nlen])
        name = raw_name.decode("utf-8" if flags & _UTF8 else "cp437", "replace")
        if name in entries:
            raise CorruptCheckpointError(
                f"{url}: the zip archive holds two entries named {name!r}: readers would disagree on which one "
                "to load (a corrupt or hostile archive)"
            )
        if flags & _ENCRYPTED:
            raise CorruptCheckpointError(f"{url}: zip entry {name!r} is encrypted; torch.save never encrypts")
        if _U32_MAX in (usize, csize, offset):
            extra = data[name_at + nlen : name_at + nlen + xlen]
            usize, csize, offset = _zip64_fields(extra, (usize, csize, offset), url, name)
        entries[name] = ZipEntry(name, offset, csize, usize, method, crc, raw_name, flags)
        pos = name_at + nlen + xlen + clen
    return entries


def _zip64_fields(extra: bytes, values: tuple[int, int, int], url: str, name: str) -> tuple[int, int, int]:
    """Replace the 32-bit ``(usize, csize, offset)`` fields that are 0xFFFFFFFF by their zip64 values."""
    i = 0
    while i + 4 <= len(extra):
        header_id, length = struct.unpack_from("<HH", extra, i)
        body = extra[i + 4 : i + 4 + length]
        if len(body) < length:
            raise CorruptCheckpointError(f"{url}: zip entry {name!r} has an extra field that runs past its record")
        if header_id == _ZIP64_EXTRA:
            needed = sum(v == _U32_MAX for v in values)
            if len(body) < 8 * needed:
                raise CorruptCheckpointError(
                    f"{url}: zip entry {name!r} needs {needed} zip64 values but its zip64 field holds {len(body)} bytes"
                )
            wide = iter(struct.unpack_from(f"<{needed}Q", body))
            usize, csize, offset = (next(wide) if v == _U32_MAX else v for v in values)
            return usize, csize, offset
        i += 4 + length
    raise CorruptCheckpointError(f"{url}: zip entry {name!r} needs a zip64 extra field and has none")


def check_layout(entries: dict[str, ZipEntry], central_offset: int, url: str) -> dict[str, ZipEntry]:
    """Entries with their ``limit`` set, after checking sizes and that no two entries overlap.

    Uses only the central directory (no I/O): each entry needs at least its fixed local header, its name
    and its compressed bytes before the next entry starts. The exact check, with the local extra field and
    data descriptor, is :func:`check_local_header`'s.
    """
    for e in entries.values():
        if e.method == STORED and e.compressed_size != e.size:
            raise CorruptCheckpointError(
                f"{url}: zip entry {e.name!r} is stored uncompressed but declares {e.compressed_size} bytes stored "
                f"and {e.size} bytes of content (the sizes of a stored entry are equal)"
            )
        if e.method == DEFLATED and e.size > MAX_INFLATION_RATIO * max(e.compressed_size, 1):
            raise CorruptCheckpointError(
                f"{url}: zip entry {e.name!r} declares {e.size} bytes inflated from {e.compressed_size} (a ratio "
                f"above {MAX_INFLATION_RATIO}): a deflate bomb or a corrupt archive"
            )
    ordered = sorted(entries.values(), key=lambda e: e.header_offset)
    out: dict[str, ZipEntry] = {}
    for i, e in enumerate(ordered):
        limit = ordered[i + 1].header_offset if i + 1 < len(ordered) else central_offset
        end = e.header_offset + LOCAL.size + len(e.raw_name) + e.compressed_size
        if end > limit:
            what = f"entry {ordered[i + 1].name!r}" if i + 1 < len(ordered) else "the central directory"
            raise CorruptCheckpointError(
                f"{url}: zip entry {e.name!r} at byte {e.header_offset} ({e.compressed_size} bytes) overlaps {what} "
                f"at byte {limit}: entries must not share bytes (a corrupt or hostile archive)"
            )
        out[e.name] = e._replace(limit=limit)
    return {name: out[name] for name in entries}


def check_local_header(entry: ZipEntry, head: bytes, url: str) -> int | None:
    """Check the local header at the start of ``head`` against ``entry``; return where the entry's data
    starts (relative to the header), or ``None`` when ``head`` is too short to hold the whole header."""
    if len(head) < LOCAL.size or head[:4] != LOCAL_SIG:
        raise CorruptCheckpointError(f"{url}: no local zip header for {entry.name!r} at byte {entry.header_offset}")
    (_, _ver, flags, method, _t, _d, crc, csize, usize, nlen, xlen) = LOCAL.unpack_from(head)
    start = LOCAL.size + nlen + xlen
    if len(head) < LOCAL.size + nlen:
        return None
    name = head[LOCAL.size : LOCAL.size + nlen]
    if flags & _DESCRIPTOR:  # the real values follow the data: the local ones may be placeholders
        sizes_agree = (
            crc in (0, entry.crc32)
            and csize in (0, _U32_MAX, entry.compressed_size)
            and usize in (0, _U32_MAX, entry.size)
        )
    else:
        if _U32_MAX in (csize, usize):  # zip64: the sizes are in the local extra field
            if len(head) < start:
                return None
            extra = bytes(head[LOCAL.size + nlen : start])
            usize, csize, _ = _zip64_fields(extra, (usize, csize, 0), url, entry.name)
        sizes_agree = (crc, csize, usize) == (entry.crc32, entry.compressed_size, entry.size)
    if not (
        name == entry.raw_name and method == entry.method and not (flags ^ entry.flags) & _MUST_AGREE and sizes_agree
    ):
        differs = []
        if name != entry.raw_name:
            differs.append(f"name {bytes(name)!r}")
        if method != entry.method:
            differs.append(f"compression method {method} (central: {entry.method})")
        if (flags ^ entry.flags) & _MUST_AGREE:
            differs.append(f"flags {flags:#06x} (central: {entry.flags:#06x})")
        if not sizes_agree:
            differs.append(
                f"CRC {crc:#010x}, sizes {csize}/{usize} (central: {entry.crc32:#010x}, "
                f"{entry.compressed_size}/{entry.size})"
            )
        raise CorruptCheckpointError(
            f"{url}: the local header of zip entry {entry.name!r} at byte {entry.header_offset} disagrees with the "
            f"central directory: {', '.join(differs)} (a corrupt or hostile archive)"
        )
    trailer = _DESCRIPTOR_MAX if flags & _DESCRIPTOR else 0
    end = entry.header_offset + start + entry.compressed_size
    if end > entry.limit or (trailer and end + 12 > entry.limit):
        raise CorruptCheckpointError(
            f"{url}: zip entry {entry.name!r} ends at byte {end + (12 if trailer else 0)}, past the start of the next "
            f"entry or the central directory at byte {entry.limit} (overlapping entries)"
        )
    return start if len(head) >= start else None


def descriptor_span(entry: ZipEntry, data_start: int) -> tuple[int, int]:
    """Absolute ``(lo, hi)`` of the bytes :func:`check_descriptor` needs: the last 4 bytes of ``entry``'s data
    (``data_start``: absolute, where its local header places it) and what follows, up to a 24-byte
    descriptor, never past the next entry."""
    end = data_start + entry.compressed_size
    return max(data_start, end - 4), min(entry.limit, end + _DESCRIPTOR_MAX)


def check_descriptor(entry: ZipEntry, span: bytes | memoryview, url: str) -> None:
    """The data descriptor right after a flagged entry's data must repeat its CRC and sizes, where the
    entry's local header places the data.

    ``span``: the bytes :func:`descriptor_span` names. A local header that declares 4 extra bytes the central
    directory does not moves the data 4 bytes later: it still fits before the next entry, and the 12 bytes
    after it are the real descriptor without its signature, which the zip format allows. What gives it away
    is that signature as the data's last 4 bytes: a descriptor found right after ``PK\\x07\\x08`` is refused
    too, and so is one that does not repeat the entry's CRC and sizes.
    """
    if not entry.flags & _DESCRIPTOR:
        return
    span = bytes(span)
    before = min(4, entry.compressed_size)
    last, tail = span[:before], span[before:]
    body = tail[4:] if tail[:4] == DESCRIPTOR_SIG else tail
    want = (entry.crc32, entry.compressed_size, entry.size)
    ok = (len(body) >= 12 and struct.unpack_from("<III", body) == want) or (
        len(body) >= 20 and struct.unpack_from("<IQQ", body) == want
    )
    if ok and body is tail and last == DESCRIPTOR_SIG:
        ok = False  # the descriptor's own signature read as data: the data starts 4 bytes late
    if not ok:
        raise CorruptCheckpointError(
            f"{url}: zip entry {entry.name!r} (local header at byte {entry.header_offset}) is not followed by its "
            "data descriptor where its local header places the data: the local extra field declares bytes the "
            "central directory does not (the data would be read late); a corrupt or hostile archive"
        )


def inflate(raw: bytes | memoryview, entry: ZipEntry, url: str) -> bytes:
    """The entry's content from its compressed bytes: never more than its declared size is produced."""
    if entry.method == STORED:
        return bytes(raw)
    if entry.method != DEFLATED:
        raise CorruptCheckpointError(f"{url}: record {entry.name!r} uses zip compression method {entry.method}")
    inflater = zlib.decompressobj(-15)
    out = bytearray()
    pos = 0
    try:
        while not inflater.eof:
            if inflater.unconsumed_tail:
                feed = inflater.unconsumed_tail  # the output bound stopped it: go on with the same input
            elif pos < len(raw):
                feed, pos = raw[pos : pos + _INFLATE_STEP], pos + _INFLATE_STEP
            else:
                break
            # One byte more than declared tells a lying size apart; max_length is never 0 (no bound).
            out += inflater.decompress(feed, entry.size - len(out) + 1)
            if len(out) > entry.size:
                raise CorruptCheckpointError(
                    f"{url}: record {entry.name!r} inflates to more than the {entry.size} bytes it declares "
                    "(a deflate bomb or a corrupt archive)"
                )
    except zlib.error as exc:
        raise CorruptCheckpointError(f"{url}: record {entry.name!r} does not inflate ({exc})") from exc
    if len(out) != entry.size or not inflater.eof:
        raise CorruptCheckpointError(
            f"{url}: record {entry.name!r} inflates to {len(out)} bytes, not the {entry.size} it declares"
        )
    return bytes(out)


def check_crc(data: bytes | memoryview, entry: ZipEntry, url: str) -> None:
    if len(data) != entry.size or crc32(data) != entry.crc32:
        raise CorruptCheckpointError(
            f"{url}: record {entry.name!r} fails its CRC32 check (the bytes read are not those written): restore the "
            "file from a good copy, or retry if the storage returned wrong bytes"
        )


FIRST_TAIL = 4096  # holds the end records of a torch.save archive (it writes no comment)
MAX_TAIL = EOCD.size + 0xFFFF + EOCD64_LOCATOR.size + EOCD64.size


def locate_end(read: Callable[[int, int], bytes], size: int) -> tuple[bytes, int, int] | None:
    """``(tail, tail_start, end record position in tail)`` of a file of ``size`` bytes read through
    ``read(lo, hi)``: the last 4 KiB first, the largest comment's reach if needed. ``None``: no end record."""
    tail_start = max(0, size - FIRST_TAIL)
    tail = read(tail_start, size)
    eocd_at = find_eocd(tail)
    if eocd_at < 0 and tail_start > 0:
        tail_start = max(0, size - MAX_TAIL)
        tail = read(tail_start, size)
        eocd_at = find_eocd(tail)
    return None if eocd_at < 0 else (tail, tail_start, eocd_at)


def index_from_tail(
    read: Callable[[int, int], bytes], tail: bytes, tail_start: int, eocd_at: int, url: str
) -> tuple[int, dict[str, ZipEntry]]:
    """``(central directory offset, entries)``, checked (:func:`check_layout`), from the end records found
    by :func:`locate_end`; ``read(lo, hi)`` fetches what the tail does not hold."""
    (_, disk, _cd_disk, _n_disk, n_entries, cd_size, cd_offset, _clen) = EOCD.unpack_from(tail, eocd_at)
    eocd_abs = tail_start + eocd_at
    locator_at = eocd_at - EOCD64_LOCATOR.size
    cd_end_limit = eocd_abs
    if locator_at >= 0 and tail[locator_at : locator_at + 4] == EOCD64_LOCATOR_SIG:
        _, _disk, eocd64_offset, _ndisks = EOCD64_LOCATOR.unpack_from(tail, locator_at)
        if eocd64_offset + EOCD64.size > tail_start + locator_at:
            raise CorruptCheckpointError(f"{url}: zip64 end record offset {eocd64_offset} is past the end record")
        if eocd64_offset >= tail_start:
            rec = tail[eocd64_offset - tail_start : eocd64_offset - tail_start + EOCD64.size]
        else:
            rec = read(eocd64_offset, eocd64_offset + EOCD64.size)
        if len(rec) < EOCD64.size or rec[:4] != EOCD64_SIG:
            raise CorruptCheckpointError(f"{url}: bad zip64 end record at byte {eocd64_offset} (truncated file?)")
        _sig, _rsize, _made, _need, disk, _cd_disk, _n_disk, n_entries, cd_size, cd_offset = EOCD64.unpack_from(rec)
        cd_end_limit = eocd64_offset
    if disk != 0:
        raise CorruptCheckpointError(f"{url}: multi-disk zip archives are not supported")
    if cd_offset + cd_size > cd_end_limit:
        raise CorruptCheckpointError(
            f"{url}: the central directory [{cd_offset}, {cd_offset + cd_size}) runs past its end record at "
            f"{cd_end_limit}: the file is truncated or not a complete torch.save archive"
        )
    if n_entries * CENTRAL.size > cd_size:
        raise CorruptCheckpointError(
            f"{url}: the zip end record counts {n_entries} entries, more than its {cd_size}-byte central directory holds"
        )
    if cd_offset >= tail_start:
        central = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        central = read(cd_offset, cd_offset + cd_size)
    entries = parse_central(central, n_entries, url)
    return cd_offset, check_layout(entries, cd_offset, url)


def check_zip_bytes(buf: bytes | memoryview, url: str, *, crc: bool = True) -> dict[str, ZipEntry]:
    """Check a whole zip held in memory (a DCP record): layout, local headers, and (``crc``) every entry's
    CRC32, inflating deflated entries into at most their declared size. Returns the entries."""
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf

    def read(lo: int, hi: int) -> bytes:
        return bytes(view[lo:hi])

    end = locate_end(read, len(view))
    if end is None:
        raise CorruptCheckpointError(f"{url}: not a zip archive (no end-of-central-directory record)")
    _cd, entries = index_from_tail(read, *end, url)
    for e in entries.values():
        start = check_local_header(e, view[e.header_offset : e.limit], url)
        if start is None:
            raise CorruptCheckpointError(f"{url}: the local header of zip entry {e.name!r} runs past the entry")
        raw = view[e.header_offset + start : e.header_offset + start + e.compressed_size]
        lo, hi = descriptor_span(e, e.header_offset + start)
        check_descriptor(e, view[lo:hi], url)
        if crc:
            check_crc(inflate(raw, e, url) if e.method != STORED else raw, e, url)
        elif e.method != STORED:
            inflate(raw, e, url)  # torch.load would inflate it: bounded here first
    return entries
