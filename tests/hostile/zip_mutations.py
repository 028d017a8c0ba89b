"""Byte surgery on ``torch.save`` zips: layouts a zip reader must refuse, made from a valid archive.

Each function takes the bytes of a valid zip (``torch.save``'s, or any other) and returns a copy with one
layout attack: a duplicate entry name, a local header that disagrees with the central directory (name,
offset, method, sizes, flags), a zip64 extra field that is missing or short, a deflate bomb. The central
directory is rewritten whole (:func:`rewrite_central`) so entries can gain or lose fields; the end records
(plain and zip64) are patched to match. Used by the hostile corpus and the format's unit tests.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

__all__ = [
    "Central",
    "central_records",
    "deflate_bomb_zip",
    "duplicate_entry",
    "edit_entry",
    "local_offset",
    "overlapping_entry",
    "patch_local",
    "shift_local_data",
    "rewrite_central",
    "stored_zip",
    "zero_stream",
]

_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")


@dataclass(frozen=True)
class Central:
    """One central-directory record (fields as stored, ``extra`` raw)."""

    name: bytes
    made: int
    need: int
    flags: int
    method: int
    time: int
    date: int
    crc: int
    csize: int
    usize: int
    extra: bytes
    comment: bytes
    disk: int
    iattr: int
    eattr: int
    offset: int

    def pack(self) -> bytes:
        head = _CENTRAL.pack(
            b"PK\x01\x02", self.made, self.need, self.flags, self.method, self.time, self.date, self.crc,
            self.csize, self.usize, len(self.name), len(self.extra), len(self.comment), self.disk, self.iattr,
            self.eattr, self.offset,
        )  # fmt: skip
        return head + self.name + self.extra + self.comment


def _ends(data: bytes) -> tuple[int, int, int, int]:
    """(end record position, zip64 end record position or -1, central directory offset, its size)."""
    eocd = data.rfind(b"PK\x05\x06")
    _, _, _, _, _, cd_size, cd_offset, _ = _EOCD.unpack_from(data, eocd)
    eocd64 = data.rfind(b"PK\x06\x06", 0, eocd)
    if eocd64 >= 0:
        *_, cd_size, cd_offset = _EOCD64.unpack_from(data, eocd64)
    return eocd, eocd64, cd_offset, cd_size


def central_records(data: bytes) -> list[Central]:
    _, _, cd_offset, cd_size = _ends(data)
    out, pos = [], cd_offset
    while pos < cd_offset + cd_size:
        f = _CENTRAL.unpack_from(data, pos)
        nlen, xlen, clen = f[10], f[11], f[12]
        at = pos + _CENTRAL.size
        name, extra, comment = (
            data[at : at + nlen],
            data[at + nlen : at + nlen + xlen],
            data[at + nlen + xlen : at + nlen + xlen + clen],
        )
        out.append(Central(name, *f[1:10], extra, comment, *f[13:17]))  # type: ignore[arg-type]
        pos = at + nlen + xlen + clen
    return out


def rewrite_central(data: bytes, edit: Callable[[list[Central]], list[Central]]) -> bytes:
    """``data`` with its central directory replaced by ``edit(records)``; end records patched to match."""
    eocd, eocd64, cd_offset, cd_size = _ends(data)
    records = edit(central_records(data))
    central = b"".join(r.pack() for r in records)
    tail = bytearray(data[cd_offset + cd_size :])
    shift = len(central) - cd_size
    n = len(records)
    if eocd64 >= 0:
        at = eocd64 - cd_offset - cd_size
        struct.pack_into("<QQQ", tail, at + 24, n, n, len(central))
        loc = eocd - cd_offset - cd_size - 20
        if tail[loc : loc + 4] == b"PK\x06\x07":
            struct.pack_into("<Q", tail, loc + 8, eocd64 + shift)
    at = eocd - cd_offset - cd_size
    struct.pack_into("<HHI", tail, at + 8, min(n, 0xFFFF), min(n, 0xFFFF), min(len(central), 0xFFFFFFFF))
    return data[:cd_offset] + central + bytes(tail)


def _by_name(records: list[Central], name: str) -> Central:
    return next(r for r in records if r.name.decode() == name or r.name.decode().endswith("/" + name))


def local_offset(data: bytes, name: str) -> int:
    return _by_name(central_records(data), name).offset


def patch_local(data: bytes, name: str, **fields: int | bytes) -> bytes:
    """Overwrite fields of ``name``'s local header in place (``name_bytes`` must keep its length)."""
    at = local_offset(data, name)
    out = bytearray(data)
    sig, ver, flags, method, t, d, crc, csize, usize, nlen, xlen = _LOCAL.unpack_from(out, at)
    values = {"flags": flags, "method": method, "crc": crc, "csize": csize, "usize": usize}
    values.update({k: v for k, v in fields.items() if k != "name_bytes"})  # type: ignore[misc]
    _LOCAL.pack_into(
        out,
        at,
        sig,
        ver,
        values["flags"],
        values["method"],
        t,
        d,
        values["crc"],
        values["csize"],
        values["usize"],
        nlen,
        int(fields.get("xlen", xlen)),  # type: ignore[arg-type]
    )
    new_name = fields.get("name_bytes")
    if isinstance(new_name, bytes):
        if len(new_name) != nlen:
            raise ValueError("a local name patch must keep the name's length")
        out[at + _LOCAL.size : at + _LOCAL.size + nlen] = new_name
    return bytes(out)


def shift_local_data(data: bytes, name: str, by: int = 4) -> bytes:
    """``name``'s local header declares ``by`` more extra-field bytes than it holds, the central directory
    unchanged: a reader that trusts the local header reads the entry's bytes ``by`` bytes late (the data still
    fits before the next entry when the entry has a 16-byte data descriptor, read as a 12-byte one)."""
    at = local_offset(data, name)
    xlen = _LOCAL.unpack_from(data, at)[-1]
    return patch_local(data, name, xlen=xlen + by)


def edit_entry(data: bytes, name: str, **changes: int | bytes) -> bytes:
    """``data`` with the central record of ``name`` changed (``offset=``, ``csize=``, ``extra=``...)."""
    return rewrite_central(data, lambda rs: [replace(r, **changes) if r is _by_name(rs, name) else r for r in rs])  # type: ignore[arg-type]


def duplicate_entry(data: bytes, name: str, payload: bytes) -> bytes:
    """A second, self-consistent entry named like ``name`` (``payload`` stored after the last entry, its
    local and central records agreeing): which of the two a reader picks decides which bytes it loads."""
    _, _, cd_offset, _ = _ends(data)
    original = _by_name(central_records(data), name)
    crc = zlib.crc32(payload)
    local = _LOCAL.pack(
        b"PK\x03\x04", 20, original.flags & 0x800, 0, 0, 0x21, crc, len(payload), len(payload), len(original.name), 0
    )
    blob = local + original.name + payload
    twin = replace(
        original,
        flags=original.flags & 0x800,
        method=0,
        crc=crc,
        csize=len(payload),
        usize=len(payload),
        extra=b"",
        offset=cd_offset,
    )
    moved = data[:cd_offset] + blob + data[cd_offset:]
    eocd, eocd64, _, _ = _ends(moved)
    out = bytearray(moved)
    struct.pack_into("<I", out, eocd + 16, min(cd_offset + len(blob), 0xFFFFFFFF))
    if eocd64 >= 0:
        struct.pack_into("<Q", out, eocd64 + 48, cd_offset + len(blob))
        loc = eocd - 20
        if out[loc : loc + 4] == b"PK\x06\x07":
            struct.pack_into("<Q", out, loc + 8, eocd64)
    return rewrite_central(bytes(out), lambda rs: rs + [twin])


def stored_zip(entries: list[tuple[str, bytes]], *, deflated: dict[str, tuple[bytes, int, int]] | None = None) -> bytes:
    """A plain zip of ``entries`` (no data descriptors). ``deflated[name] = (stream, declared_size, crc)``
    stores that entry as a raw deflate stream with the sizes and CRC given, whatever the stream inflates to."""
    deflated = deflated or {}
    out, central = bytearray(), []
    for name, payload in entries:
        raw_name = name.encode()
        if name in deflated:
            stream, usize, crc = deflated[name]
            method, body = 8, stream
        else:
            method, body, usize, crc = 0, payload, len(payload), zlib.crc32(payload)
        offset = len(out)
        out += _LOCAL.pack(b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(body), usize, len(raw_name), 0)
        out += raw_name + body
        central.append(Central(raw_name, 20, 20, 0, method, 0, 0x21, crc, len(body), usize, b"", b"", 0, 0, 0, offset))
    cd = b"".join(r.pack() for r in central)
    cd_offset = len(out)
    out += cd + _EOCD.pack(b"PK\x05\x06", 0, 0, len(central), len(central), len(cd), cd_offset, 0)
    return bytes(out)


def zero_stream(n: int) -> bytes:
    """A raw deflate stream of ``n`` zero bytes, built in milliseconds: one fully flushed 1 MiB block repeated
    (a full flush resets the compressor, so every block compresses to the same bytes)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = comp.compress(bytes(1 << 20)) + comp.flush(zlib.Z_FULL_FLUSH)
    rest = comp.compress(bytes(n & ((1 << 20) - 1))) + comp.flush()
    return block * (n >> 20) + rest


def deflate_bomb_zip(
    entries: list[tuple[str, bytes]], name: str, *, inflated: int, declared: int | None = None
) -> bytes:
    """``entries`` as a zip whose entry ``name`` is a deflate stream of ``inflated`` zero bytes (about 1 KB per
    MiB) that declares ``declared`` bytes (default: the real entry's size, so only inflating tells)."""
    stream = zero_stream(inflated)
    real = dict(entries)[name]
    size = len(real) if declared is None else declared
    return stored_zip(entries, deflated={name: (stream, size, zlib.crc32(real))})


def overlapping_entry(data: bytes, name: str, host: str, at: int = 1024) -> bytes:
    """Entry ``name`` moved inside ``host``'s bytes: a copy of its local header and data written ``at`` bytes
    into ``host``'s data, and its central record pointed there. Each entry alone looks sound; they overlap."""
    records = central_records(data)
    moved, big = _by_name(records, name), _by_name(records, host)
    sig, ver, flags, method, t, d, crc, csize, usize, nlen, xlen = _LOCAL.unpack_from(data, moved.offset)
    start = moved.offset + _LOCAL.size + nlen + xlen
    header = _LOCAL.pack(sig, ver, flags & ~0x08, method, t, d, moved.crc, moved.csize, moved.usize, nlen, 0)
    blob = header + moved.name + data[start : start + moved.csize]
    host_start = big.offset + _LOCAL.size + sum(struct.unpack_from("<HH", data, big.offset + 26))
    if at + len(blob) > big.csize:
        raise ValueError(f"{host} is too small to hide {name} in it")
    pos = host_start + at
    out = data[:pos] + blob + data[pos + len(blob) :]
    out = rewrite_central(
        out, lambda rs: [replace(r, offset=pos, flags=r.flags & ~0x08) if r.name == moved.name else r for r in rs]
    )
    return out
