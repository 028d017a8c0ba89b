"""Decoding one stored record safely: its zip frame, its pickle, and seekable transforms of its bytes.

Seekable stream transforms: a transform that can serve uncompressed byte ranges of a stored item.

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

The zip layer of a DCP record: walking its local headers, and checking a record held whole.

A DCP tensor record is a ``torch.save`` zip. The record parser (:mod:`.torch_record`) reads its first KiB
only, so it learns the layout from the local headers, in order (:func:`walk_records`): each must be
sound on its own (no encryption, stored sizes equal, zip64 fields complete) and no name may appear twice.
A record held whole in memory is checked in full (:func:`check_record_zip`: central directory against
local headers, overlaps, bounded inflation, CRC32s) before ``torch.load`` reads it, and for every record
read whole with ``verify=True``.

A strict decoder for the ``data.pkl`` that ``torch.save`` writes for one plain tensor.

Every tensor record of a DCP checkpoint carries a ``data.pkl`` of about 40 opcodes:
``_rebuild_tensor_v2(persistent_id(("storage", FloatStorage, "0", "cpu", numel)), offset, size, stride,
requires_grad, OrderedDict())``. Decoding it with the allow-list unpickler costs ~50 us per record
(a guard walk over the opcodes, an attribute snapshot of the allow-listed objects, the C unpickler with
Python callbacks); a rank that reshards a 2 GiB checkpoint reads a few hundred of them.

:func:`decode_tensor_pickle` interprets only the opcodes that pickle writes for such a record, on a
plain Python stack: globals are looked up in the caller's allow-list by name (nothing is imported),
``REDUCE`` calls only allow-listed callables, the memo is a dict (no index can make it allocate; one past
the stream's length is declined, as the full path refuses it), and there is no ``BUILD``, so nothing can
be mutated. Anything else returns ``None`` and the caller uses the full allow-list unpickler, which
reports it precisely. Records that share shape, dtype and storage key pickle to identical bytes, so
results are cached by those bytes.
"""

from __future__ import annotations

import bisect
import pickle
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.torch_save.zip_layout import check_zip_bytes

__all__ = [
    "Frame",
    "FrameIndex",
    "NeedMoreTail",
    "SeekableTransform",
    "UnsupportedRecord",
    "check_record_zip",
    "decode_tensor_pickle",
    "walk_records",
]


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


_CACHE_LIMIT = 4096
_cache: dict[bytes, Any] = {}

_PROTO = pickle.PROTO[0]
_FRAME = pickle.FRAME[0]
_GLOBAL = pickle.GLOBAL[0]
_BINPUT = pickle.BINPUT[0]
_LONG_BINPUT = pickle.LONG_BINPUT[0]
_MEMOIZE = pickle.MEMOIZE[0]
_BINGET = pickle.BINGET[0]
_LONG_BINGET = pickle.LONG_BINGET[0]
_MARK = pickle.MARK[0]
_BINUNICODE = pickle.BINUNICODE[0]
_SHORT_BINUNICODE = pickle.SHORT_BINUNICODE[0]
_BININT = pickle.BININT[0]
_BININT1 = pickle.BININT1[0]
_BININT2 = pickle.BININT2[0]
_LONG1 = pickle.LONG1[0]
_TUPLE = pickle.TUPLE[0]
_TUPLE1 = pickle.TUPLE1[0]
_TUPLE2 = pickle.TUPLE2[0]
_TUPLE3 = pickle.TUPLE3[0]
_EMPTY_TUPLE = pickle.EMPTY_TUPLE[0]
_NEWTRUE = pickle.NEWTRUE[0]
_NEWFALSE = pickle.NEWFALSE[0]
_NONE = pickle.NONE[0]
_EMPTY_DICT = pickle.EMPTY_DICT[0]
_BINPERSID = pickle.BINPERSID[0]
_REDUCE = pickle.REDUCE[0]
_STOP = pickle.STOP[0]


class _NotCanonical(Exception):
    """The stream uses something outside the subset this decoder interprets."""


def decode_tensor_pickle(
    data: bytes,
    allowed: dict[tuple[str, str], Any],
    persistent_load: Callable[[Any], Any],
) -> Any | None:
    """Decode ``data`` if it is a canonical single-tensor pickle; ``None`` for anything else.

    ``allowed`` and ``persistent_load`` are the same allow-list and persistent-id handler the full
    unpickler would get; results are cached by ``data`` per ``(allowed, persistent_load)``, so they must
    be pure (module-level tables and functions). Any exception, including one raised by an allow-listed
    callable, also returns ``None``: the full unpickler then decodes the stream again and classifies it.
    """
    key = data
    hit = _cache.get(key)
    if hit is not None and hit[0] is allowed and hit[1] is persistent_load:
        return hit[2]
    try:
        result = _interpret(data, allowed, persistent_load)
    except Exception:  # noqa: BLE001 - malformed or unsupported: the full unpickler reports it
        return None
    if len(_cache) >= _CACHE_LIMIT:
        _cache.clear()
    _cache[key] = (allowed, persistent_load, result)
    return result


def _interpret(data: bytes, allowed: dict[tuple[str, str], Any], persistent_load: Callable[[Any], Any]) -> Any:
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    pos, end = 0, len(data)
    from_bytes = int.from_bytes
    while pos < end:
        op = data[pos]
        pos += 1
        if op == _BINPUT:
            if data[pos] > end:  # as for LONG_BINPUT: the full path refuses an index past the stream
                raise _NotCanonical("memo index beyond the stream")
            memo[data[pos]] = stack[-1]
            pos += 1
        elif op == _MEMOIZE:
            memo[len(memo)] = stack[-1]
        elif op == _BININT1:
            stack.append(data[pos])
            pos += 1
        elif op == _BININT2:
            stack.append(from_bytes(data[pos : pos + 2], "little"))
            pos += 2
        elif op == _BININT:
            stack.append(from_bytes(data[pos : pos + 4], "little", signed=True))
            pos += 4
        elif op == _LONG1:
            n = data[pos]
            stack.append(from_bytes(data[pos + 1 : pos + 1 + n], "little", signed=True))
            pos += 1 + n
        elif op == _BINUNICODE or op == _SHORT_BINUNICODE:
            width = 4 if op == _BINUNICODE else 1
            n = from_bytes(data[pos : pos + width], "little")
            pos += width
            if pos + n > end:
                raise _NotCanonical("string runs past the stream")
            stack.append(data[pos : pos + n].decode("utf-8"))
            pos += n
        elif op == _MARK:
            marks.append(len(stack))
        elif op == _TUPLE:
            k = marks.pop()
            items = tuple(stack[k:])
            del stack[k:]
            stack.append(items)
        elif op == _TUPLE2:
            b = stack.pop()
            stack[-1] = (stack[-1], b)
        elif op == _TUPLE1:
            stack[-1] = (stack[-1],)
        elif op == _TUPLE3:
            c = stack.pop()
            b = stack.pop()
            stack[-1] = (stack[-1], b, c)
        elif op == _EMPTY_TUPLE:
            stack.append(())
        elif op == _NEWFALSE:
            stack.append(False)
        elif op == _NEWTRUE:
            stack.append(True)
        elif op == _NONE:
            stack.append(None)
        elif op == _EMPTY_DICT:
            stack.append({})
        elif op == _BINGET:
            stack.append(memo[data[pos]])
            pos += 1
        elif op == _LONG_BINPUT:
            index = from_bytes(data[pos : pos + 4], "little")
            if index > end:  # no pickler numbers its memo past its own length; the full path refuses it
                raise _NotCanonical("memo index beyond the stream")
            memo[index] = stack[-1]
            pos += 4
        elif op == _LONG_BINGET:
            stack.append(memo[from_bytes(data[pos : pos + 4], "little")])
            pos += 4
        elif op == _GLOBAL:
            first = data.index(b"\n", pos)
            second = data.index(b"\n", first + 1)
            name = (data[pos:first].decode("ascii"), data[first + 1 : second].decode("ascii"))
            stack.append(allowed[name])  # KeyError: not allow-listed
            pos = second + 1
        elif op == _BINPERSID:
            stack[-1] = persistent_load(stack[-1])
        elif op == _REDUCE:
            args = stack.pop()
            func = stack[-1]
            if type(args) is not tuple or not callable(func):
                raise _NotCanonical("REDUCE of a non-callable or without an argument tuple")
            stack[-1] = func(*args)
        elif op == _STOP:
            if len(stack) != 1 or marks or pos != end:
                raise _NotCanonical("STOP with a stack that is not one object")
            return stack[0]
        elif op == _PROTO:
            if data[pos] > pickle.HIGHEST_PROTOCOL:  # the C unpickler refuses it: so do we
                raise _NotCanonical(f"pickle protocol {data[pos]}")
            pos += 1
        elif op == _FRAME:
            pos += 8
        else:
            raise _NotCanonical(f"opcode {op:#x}")
        if pos > end:
            raise _NotCanonical("argument runs past the stream")
    raise _NotCanonical("no STOP")
