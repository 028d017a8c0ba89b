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
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    "SafetensorsHeader",
    "TORCH_TO_SAFETENSORS",
    "TensorEntry",
    "header_length",
    "parse_header",
    "safetensors_dtype",
    "saved_offsets",
    "torch_dtype",
]


def _table() -> dict[str, torch.dtype]:
    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "I32": "int32",
        "U32": "uint32",
        "I64": "int64",
        "U64": "uint64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }
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
