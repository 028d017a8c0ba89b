"""The safetensors header: its dtypes, parsing and validation.

safetensors dtype names <-> torch dtypes (every dtype the format defines that torch has).

Parsing and validating safetensors headers: pure functions over bytes.

A safetensors blob is ``u64 little-endian N`` + ``N`` bytes of JSON + a data section. The JSON maps each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data section)
and may hold ``"__metadata__"``, a string-to-string map. torch's DCP writers put the position of each
stored chunk in the full tensor there, under ``DCP_SHARDING_INFO`` (see :func:`saved_offsets`).

Nothing here trusts the bytes: every check that fails raises
:class:`~dcp_storage.errors.CorruptCheckpointError` naming the file (``where``), the tensor and the
reason. Sizes are Python ints throughout, so a huge shape cannot overflow into a small byte count.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.paths import MAX_BYTES, MAX_DIM, MAX_NDIM

__all__ = [
    "LENGTH_BYTES",
    "MAX_HEADER_BYTES",
    "METADATA_KEY",
    "SAFETENSORS_TO_TORCH",
    "SAVED_OFFSETS_KEY",
    "SHARDING_INFO_KEY",
    "HeaderColumns",
    "SafetensorsHeader",
    "TORCH_TO_SAFETENSORS",
    "TensorEntry",
    "header_length",
    "parse_header",
    "safetensors_dtype",
    "saved_offsets",
    "scan_columns",
    "torch_dtype",
]


def _table() -> dict[str, torch.dtype]:
    # fmt: off
    names = {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
        "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
        "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
    }
    # fmt: on
    return {st: getattr(torch, tn) for st, tn in names.items() if isinstance(getattr(torch, tn, None), torch.dtype)}


SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = _table()
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype for a safetensors dtype string, or ``None`` if unknown."""
    return SAFETENSORS_TO_TORCH.get(name)


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors dtype string for a torch dtype, or ``None`` if the format has none."""
    return TORCH_TO_SAFETENSORS.get(dtype)


LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference (Rust) implementation enforces
METADATA_KEY = "__metadata__"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY
SAVED_OFFSETS_KEY = "saved_offsets"


class TensorEntry(NamedTuple):
    """One tensor of a header; ``begin``/``end`` are byte offsets into the data section. A named tuple, not a
    dataclass: a million-tensor header makes a million of them (a third of the time and memory)."""

    name: str
    dtype_name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated header. ``data_start``: where the data section starts, from the blob's start."""

    header_len: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        return LENGTH_BYTES + self.header_len


def header_length(prefix: bytes | bytearray | memoryview, blob_size: int, where: str) -> int:
    """The JSON length ``N`` from a blob's first 8 bytes, checked against ``blob_size`` and the 100 MiB cap.

    ``blob_size`` is the number of bytes from the blob's start to the end of the file.
    """
    if blob_size < LENGTH_BYTES or len(prefix) < LENGTH_BYTES:
        raise CorruptCheckpointError(
            f"{where}: {blob_size} bytes is too short for a safetensors file (needs an 8-byte header length; "
            "truncated?)"
        )
    (length,) = struct.unpack("<Q", bytes(prefix[:LENGTH_BYTES]))
    if length > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{where}: header length {length} is absurd (limit {MAX_HEADER_BYTES} bytes); not a safetensors file?"
        )
    if length > blob_size - LENGTH_BYTES:
        raise CorruptCheckpointError(
            f"{where}: header length {length} runs past the end of the {blob_size}-byte file (truncated, or not "
            "a safetensors file)"
        )
    return int(length)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # built in C; a key named twice leaves it shorter than the pairs
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value)


def parse_header(
    header: bytes | bytearray | memoryview, data_size: int, where: str, *, ends_the_file: bool = True
) -> SafetensorsHeader:
    """Parse and validate the JSON header ``header`` (the ``N`` bytes after the length).

    ``data_size``: bytes in the data section (bytes after the header up to the end of the file); tensors
    must lie inside it, may not overlap and, as the safetensors library requires, leave no byte between
    them. ``ends_the_file``: the data section is the rest of the file, so its last byte must belong to a
    tensor too; ``False`` for a blob inside a larger file (torch's DCP-safetensors layout, where the next
    blob follows).
    """
    raw = bytes(header)
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as dup:
        raise CorruptCheckpointError(f"{where}: header names {dup.key!r} twice") from None
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: header is not valid JSON ({_short(exc)})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: header is a JSON {type(doc).__name__}, expected an object")
    if data_size < 0:
        raise CorruptCheckpointError(f"{where}: file ends before its header does (truncated?)")

    metadata = doc.pop(METADATA_KEY, None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise CorruptCheckpointError(f"{where}: {METADATA_KEY!r} must map strings to strings")

    tensors = _entries(doc, data_size, where)
    _check_tiling(tensors.values(), data_size if ends_the_file else None, where)
    return SafetensorsHeader(len(raw), tensors, metadata)


_ITEMSIZES: dict[str, tuple[torch.dtype, int]] = {n: (d, d.itemsize) for n, d in SAFETENSORS_TO_TORCH.items()}


def _entries(doc: dict[str, Any], data_size: int, where: str) -> dict[str, TensorEntry]:
    """Every tensor entry of ``doc``, in its order. One inline pass over the common case (an object whose
    ``dtype`` is known, whose ``shape`` and ``data_offsets`` are lists of plain ints that agree and fit):
    at a million tensors the per-entry checks of :func:`_entry` were most of the parse. Any entry the pass
    does not accept goes through :func:`_entry`, which raises the error naming it (the same checks, the same
    first failing entry); each entry the pass accepts, :func:`_entry` would accept as the same entry."""
    out: dict[str, TensorEntry] = {}
    known, new, prod = _ITEMSIZES, TensorEntry, math.prod
    for name in list(doc):
        info = doc.pop(name)  # the decoded entry goes as its TensorEntry comes: one of the two is held at a time
        if type(info) is dict:
            dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            found = known.get(dtype_name) if type(dtype_name) is str else None
            if found is not None and type(shape) is list and type(offsets) is list and len(offsets) == 2:
                begin, end = offsets
                if (
                    type(begin) is int
                    and type(end) is int
                    and 0 <= begin <= end <= data_size
                    and len(shape) <= MAX_NDIM
                    and all([type(d) is int and 0 <= d <= MAX_DIM for d in shape])
                    and prod(shape) * found[1] == end - begin  # <= data_size, so within MAX_BYTES
                    and data_size <= MAX_BYTES
                ):
                    out[name] = new(name, dtype_name, found[0], tuple(shape), begin, end)
                    continue
        out[name] = _entry(name, info, data_size, where)
    return out


def _entry(name: str, info: Any, data_size: int, where: str) -> TensorEntry:
    what = f"{where}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{what}: entry is a JSON {type(info).__name__}, expected an object")
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype_name, str):
        raise CorruptCheckpointError(f"{what}: 'dtype' must be a string, got {_short(dtype_name)}")
    dtype = SAFETENSORS_TO_TORCH.get(dtype_name)
    if dtype is None:
        raise CorruptCheckpointError(
            f"{what}: unknown dtype {dtype_name!r} (known: {', '.join(sorted(SAFETENSORS_TO_TORCH))})"
        )
    if isinstance(shape, list) and len(shape) > MAX_NDIM:
        raise CorruptCheckpointError(f"{what}: 'shape' has {len(shape)} dimensions (at most {MAX_NDIM})")
    if not _int_list(shape) or any(d > MAX_DIM for d in shape):
        raise CorruptCheckpointError(f"{what}: 'shape' must be a list of int64 dimensions >= 0, got {_short(shape)}")
    if not _int_list(offsets) or len(offsets) != 2:
        raise CorruptCheckpointError(
            f"{what}: 'data_offsets' must be two non-negative integers [begin, end], got {_short(offsets)}"
        )
    begin, end = offsets
    if end < begin:
        raise CorruptCheckpointError(f"{what}: data_offsets [{begin}, {end}) end before they begin")
    expected = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if expected > MAX_BYTES:  # its digits may be more than Python prints
        raise CorruptCheckpointError(f"{what}: shape {_short(shape)} needs more than 2**63 - 1 bytes")
    if expected != end - begin:
        raise CorruptCheckpointError(
            f"{what}: shape {shape} of {dtype_name} needs {expected} bytes but data_offsets [{begin}, {end}) "
            f"hold {end - begin}"
        )
    if end > data_size:
        raise CorruptCheckpointError(
            f"{what}: data_offsets [{begin}, {end}) run past the end of the {data_size}-byte data section "
            "(truncated file?)"
        )
    return TensorEntry(name, dtype_name, dtype, tuple(shape), begin, end)


def _check_tiling(entries: Any, data_size: int | None, where: str) -> None:
    """Tensors (zero-size ones aside) cover the data section from its first byte, without overlap or gap,
    up to ``data_size`` when it is given: bytes no tensor claims are read by no check (``verify`` included),
    and the safetensors library refuses such a file."""
    spans = sorted((e for e in entries if e.nbytes > 0), key=lambda e: (e.begin, e.end))
    for prev, cur in itertools.pairwise(spans):
        if cur.begin < prev.end:
            raise CorruptCheckpointError(
                f"{where}: tensors {prev.name!r} [{prev.begin}, {prev.end}) and {cur.name!r} "
                f"[{cur.begin}, {cur.end}) overlap"
            )
        if cur.begin > prev.end:
            _untiled(where, prev.end, cur.begin, f"between tensors {prev.name!r} and {cur.name!r}")
    if spans and spans[0].begin > 0:
        _untiled(where, 0, spans[0].begin, f"before tensor {spans[0].name!r}")
    end = spans[-1].end if spans else 0
    if data_size is not None and data_size > end:
        _untiled(where, end, data_size, f"after tensor {spans[-1].name!r}" if spans else "and no tensor holds data")


def _untiled(where: str, begin: int, end: int, place: str) -> None:
    raise CorruptCheckpointError(
        f"{where}: bytes [{begin}, {end}) of the data section belong to no tensor ({place}); a safetensors file's "
        "tensors cover its data section exactly (the safetensors library refuses this file too)"
    )


# ---- a large header as columns: 1M tensors are 100 MB of JSON; json.loads alone made a dict, a list and ints each
# (3.6 s, +770 MiB). scan_columns reads the canonical form the safetensors library writes with one regular expression
# into arrays and accepts only what parse_header accepts, as the same header; anything else (whitespace, an escape in
# a name, another key order, 19 digits, a failing check) gives None, and parse_header decides and names the problem.
_NUM = rb"(?:0|[1-9][0-9]{0,17})"
_ENTRY = re.compile(  # separator, name, dtype, shape, begin, end
    rb'([{,])"([^"\\\x00-\x1f]*)":\{"dtype":"([A-Z0-9_]{1,16})","shape":\[((?:%s(?:,%s)*)?)\],"data_offsets":\[(%s),(%s)\]\}'
    % ((_NUM,) * 4)
)
_ENTRY_FIXED = len(b',"":{"dtype":"","shape":[],"data_offsets":[,]}')  # an entry's bytes beyond its fields
_METADATA_OPEN = b'{"' + METADATA_KEY.encode() + b'":'
_PRODUCT_GUARD = float(2**61)  # a float product of a shape below this has an exact int64 product
_SCAN_RUN = 4 << 20  # bytes of entries matched at once


class HeaderColumns(NamedTuple):
    """A header scanned into arrays (:func:`scan_columns`): tensor ``i`` is ``names[i]`` of dtype
    ``dtype_names[dtype[i]]``, shape ``dims[shape_at[i]:shape_at[i + 1]]``, bytes ``[begin[i], end[i])`` of the
    data section. Stands for a :class:`SafetensorsHeader` (``header_len``, ``metadata``, ``data_start``)."""

    header_len: int
    names: list[str]
    dtype_names: list[str]
    dtype: np.ndarray
    shape_at: np.ndarray
    dims: np.ndarray
    begin: np.ndarray
    end: np.ndarray
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        return LENGTH_BYTES + self.header_len

    def header(self) -> SafetensorsHeader:
        """The same header as :func:`parse_header` gives (an entry per tensor), for the general path."""
        table, at, dims = (
            [(n, SAFETENSORS_TO_TORCH[n]) for n in self.dtype_names],
            self.shape_at.tolist(),
            self.dims.tolist(),
        )
        rows = zip(self.names, self.dtype.tolist(), at, at[1:], self.begin.tolist(), self.end.tolist())
        tensors = {name: TensorEntry(name, *table[d], tuple(dims[a:z]), b, e) for name, d, a, z, b, e in rows}
        return SafetensorsHeader(self.header_len, tensors, self.metadata)


def scan_columns(
    header: bytes | bytearray | memoryview, data_size: int, where: str, *, ends_the_file: bool = True
) -> HeaderColumns | None:
    """The header as arrays when it is canonical and passes every check of :func:`parse_header` (same arguments;
    ``where`` unused: nothing is raised), else ``None``. Scanned in runs of about :data:`_SCAN_RUN` bytes, each cut
    where an entry starts, so one run's matches at a time are ``bytes`` (a million tensors: +0.5 GiB at once)."""
    view = memoryview(header).cast("B")
    end = len(view)
    while end and view[end - 1] in b" \t\n\r":
        end -= 1
    if end < 2 or view[0] != ord("{") or view[end - 1] != ord("}") or not 0 <= data_size <= MAX_BYTES:
        return None
    first = _ENTRY.search(view, 0, end - 1)
    if first is None:
        return None
    metadata = _scanned_metadata(view, first.start())
    if metadata is False:
        return None
    runs = _Runs()
    pos, stop = first.start(), end - 1
    while pos < stop:
        cut = _ENTRY.search(view, pos + _SCAN_RUN, stop) if pos + _SCAN_RUN < stop else None
        upto = stop if cut is None else cut.start()
        if not runs.add(_ENTRY.findall(view, pos, upto), upto - pos, opening=pos == 0):
            return None
        pos = upto
    return runs.columns(len(view), data_size, ends_the_file, metadata)


class _Runs:
    """The columns of :func:`scan_columns`, run by run."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.kinds: dict[bytes, int] = {}  # dtype name -> row
        self.dtype, self.ndim, self.dims, self.begin, self.end = [], [], [], [], []  # type: ignore[var-annotated]

    def add(self, found: list[tuple[bytes, ...]], span: int, opening: bool) -> bool:
        """One run's matches, which must tile its ``span`` bytes: the first after ``{`` when ``opening``, every
        other one after a comma."""
        if not found:
            return False
        seps, names_b, dtypes_b, shapes_b, begins_b, ends_b = zip(*found)
        del found
        if seps.count(b"{") != (1 if opening else 0) or (opening and seps[0] != b"{"):
            return False
        matched = _ENTRY_FIXED * len(seps) + sum(map(len, names_b)) + sum(map(len, dtypes_b))
        if matched + sum(map(len, shapes_b)) + sum(map(len, begins_b)) + sum(map(len, ends_b)) != span:
            return False  # bytes between the entries: not canonical
        try:
            self.names += [n.decode("utf-8") for n in names_b]
        except UnicodeDecodeError:
            return False
        kinds = self.kinds
        self.dtype.append(np.array([kinds.setdefault(d, len(kinds)) for d in dtypes_b], dtype=np.int32))
        self.ndim.append(np.fromiter((s.count(b",") + 1 if s else 0 for s in shapes_b), np.int64, len(shapes_b)))
        self.dims.append(_ints(b",".join(s for s in shapes_b if s).split(b",") if any(shapes_b) else []))
        self.begin.append(_ints(begins_b))
        self.end.append(_ints(ends_b))
        return True

    def columns(
        self, header_len: int, data_size: int, ends_the_file: bool, metadata: dict[str, str] | None
    ) -> HeaderColumns | None:
        names = self.names
        if METADATA_KEY in names or len(set(names)) != len(names):
            return None
        dtype_names = [k.decode() for k in self.kinds]
        if any(n not in _ITEMSIZES for n in dtype_names):
            return None
        dtype, ndim, dims = np.concatenate(self.dtype), np.concatenate(self.ndim), np.concatenate(self.dims)
        begin, end = np.concatenate(self.begin), np.concatenate(self.end)
        shape_at = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(ndim, out=shape_at[1:])
        if len(dims) != shape_at[-1] or (ndim > MAX_NDIM).any():
            return None
        itemsize = np.array([_ITEMSIZES[n][1] for n in dtype_names], dtype=np.int64)[dtype]
        nbytes = _products(ndim, shape_at, dims, itemsize)
        if nbytes is None or not ((begin <= end) & (end <= data_size) & (end - begin == nbytes)).all():
            return None
        if not _tiled(begin, end, data_size if ends_the_file else None):
            return None
        return HeaderColumns(header_len, names, dtype_names, dtype, shape_at, dims, begin, end, metadata)


def _ints(digits: Any) -> np.ndarray:
    return np.fromiter(map(int, digits), dtype=np.int64, count=len(digits))


def _scanned_metadata(body: memoryview, first: int) -> dict[str, str] | None | bool:
    """The ``__metadata__`` object before the first entry (``None``: no such key; ``False``: not canonical)."""
    if first == 0:
        return None
    if bytes(body[: len(_METADATA_OPEN)]) != _METADATA_OPEN or body[first] != ord(","):
        return False
    try:
        value = json.loads(bytes(body[len(_METADATA_OPEN) : first]).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError):  # _DuplicateKey is a ValueError
        return False
    return value if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()) else False


def _products(ndim: np.ndarray, shape_at: np.ndarray, dims: np.ndarray, itemsize: np.ndarray) -> np.ndarray | None:
    """Each tensor's byte count (its shape's product times its item size), or ``None`` if one might not fit."""
    out = itemsize.copy()
    has = np.flatnonzero(ndim > 0)
    if len(has):
        with np.errstate(over="ignore", invalid="ignore"):  # inf, or inf * 0 = nan (then the exact product is 0)
            approx = np.multiply.reduceat(dims.astype(np.float64), shape_at[has]) * itemsize[has]
        if (approx >= _PRODUCT_GUARD).any():
            return None  # the general path computes it exactly (and refuses it, or not)
        out[has] = np.multiply.reduceat(dims, shape_at[has]) * itemsize[has]
    return out


def _tiled(begin: np.ndarray, end: np.ndarray, data_size: int | None) -> bool:
    """:func:`_check_tiling`'s question: do the non-empty tensors tile the data section (up to ``data_size``)?"""
    nonempty = end > begin
    order = np.argsort(begin[nonempty], kind="stable")
    b, e = begin[nonempty][order], end[nonempty][order]
    if len(b) and (b[0] != 0 or (b[1:] != e[:-1]).any()):
        return False
    return data_size is None or data_size == (int(e[-1]) if len(b) else 0)


def saved_offsets(header: SafetensorsHeader, where: str) -> dict[str, tuple[int, ...]]:
    """Where each tensor of ``header`` sits in its full tensor, from torch's ``DCP_SHARDING_INFO``.

    Tensors the sharding info does not name (and all tensors of files without it) start at the origin.
    """
    out = {name: (0,) * len(entry.shape) for name, entry in header.tensors.items()}
    text = (header.metadata or {}).get(SHARDING_INFO_KEY)
    if text is None:
        return out
    try:
        info = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: {SHARDING_INFO_KEY} is not valid JSON ({_short(exc)})") from None
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{where}: {SHARDING_INFO_KEY} must be a JSON object")
    for name, entry in header.tensors.items():
        item = info.get(name)
        if item is None:
            continue
        offsets = item.get(SAVED_OFFSETS_KEY) if isinstance(item, dict) else None
        if not _int_list(offsets) or len(offsets) != len(entry.shape):
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r}: {SHARDING_INFO_KEY} {SAVED_OFFSETS_KEY} must be {len(entry.shape)} "
                f"non-negative integers, got {_short(offsets)}"
            )
        out[name] = tuple(offsets)
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
