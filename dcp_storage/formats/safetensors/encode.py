"""Bytes of a safetensors file and the plan of each file a save writes.

Bytes of a safetensors file: the header, the order of tensors, and tensors as raw little-endian bytes.

The layout this module produces is the one ``safetensors.serialize`` produces, so a file written here from
full tensors is byte-identical to ``safetensors.torch.save(tensors, metadata)``:

* 8 bytes: the header length ``N``, unsigned little-endian;
* ``N`` bytes: compact JSON (no spaces, UTF-8, ``__metadata__`` first, then one entry per tensor in data
  order with keys ``dtype``, ``shape``, ``data_offsets``), padded with spaces to a multiple of 8 so that
  the data section starts aligned;
* the data section: every tensor's row-major bytes, back to back, without gaps. ``data_offsets`` are
  relative to its start.

Tensors are ordered by *descending* dtype rank (safetensors' ``Dtype`` enum, which lists dtypes in
increasing alignment), then by name, so every tensor starts aligned to its element size.

The files of a Hugging Face safetensors save: which tensors each holds, its header, its digests.

Pure functions, no I/O; :mod:`.write_plan` calls them for a ``dcp.save`` and the converters for their
outputs. :func:`pack_files` packs tensors greedily into files of at most ``max_shard_size`` data bytes,
like ``huggingface_hub.split_torch_state_dict_into_shards`` (a tensor that would tip the current file over
the limit starts a new file, a tensor larger than the limit gets a file of its own). :func:`file_spec`
lays one file out: tensors in safetensors' own data order (see :mod:`.encode`), without gaps.

Checksums. With a ``checksum_algorithm`` each header's ``__metadata__`` also carries the provenance and one
digest per written chunk (see :mod:`.checksums`), planned as zero-filled
placeholders of the digest's fixed width: :func:`fill_header` later puts the real digests in without
changing the header's length, so every planned offset stays valid.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dcp_storage.errors import DcpStorageError, UnsupportedKeyError
from dcp_storage.formats.safetensors import checksums as sums
from dcp_storage.integrity.checksums import checksum
from dcp_storage.integrity.manifest import writer_descriptor

__all__ = [
    "FileSpec",
    "HeaderEntry",
    "PieceKey",
    "TensorSpec",
    "as_memoryview",
    "data_order",
    "dtype_rank",
    "encode_header",
    "file_spec",
    "fill_header",
    "header_metadata",
    "pack_files",
    "parse_size",
    "pwrite_all",
    "safetensors_order_key",
    "tensor_bytes",
]


# safetensors' Dtype enum order (increasing alignment); a file lists tensors by descending rank. Names the
# format defines but torch lacks (F4, F6_*) have no torch tensors to order, so they are left out.
_DTYPE_ORDER = (
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("dcp_storage's safetensors writer needs a little-endian host")


class HeaderEntry(NamedTuple):
    """One tensor's header record; ``begin``/``end`` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def dtype_rank(dtype: str) -> int:
    """Position of a safetensors dtype name in the format's alignment order."""
    try:
        return _RANK[dtype]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {dtype!r}") from None


def unstorable_keys(names: Iterable[str]) -> UnsupportedKeyError | None:
    """The error for names a safetensors header cannot hold (not UTF-8 encodable, or ``__metadata__``)."""
    bad = [n for n in names if n == "__metadata__" or not _utf8_encodable(n)]
    if not bad:
        return None
    return UnsupportedKeyError(bad, "safetensors", "a header key must be valid Unicode text other than __metadata__")


def _utf8_encodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def safetensors_order_key(name: str, dtype: str) -> tuple[int, str]:
    """Sort key that puts tensors in safetensors' data order (descending dtype rank, then name)."""
    return (-dtype_rank(dtype), name)


def encode_header(entries: Iterable[HeaderEntry], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix plus the padded JSON header, for ``entries`` given in data order.

    Writers plan every header before writing any data, so a key no header can hold fails here, before I/O.
    """
    entries = list(entries)
    unstorable = unstorable_keys(e.name for e in entries)
    if unstorable is not None:
        raise unstorable
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    position = 0
    for e in entries:
        if e.begin != position or e.end < e.begin:
            raise ValueError(
                f"{e.name}: data_offsets [{e.begin}, {e.end}) leave a gap or overlap (expected start {position})"
            )
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
        position = e.end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The row-major bytes of ``tensor`` as a 1-d ``uint8`` tensor on the tensor's device (no copy if possible)."""
    t = tensor.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def as_memoryview(u8: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU ``uint8`` tensor."""
    if u8.numel() == 0:
        return memoryview(b"")
    return memoryview(u8.numpy()).cast("B")


def pwrite_all(fd: int, data: memoryview, offset: int) -> int:
    """``os.pwrite`` until every byte of ``data`` is at ``offset`` (a call may write less than asked)."""
    done = 0
    total = data.nbytes
    while done < total:
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset + done}")
        done += n
    return total


def data_order(entries: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(name, dtype)`` pairs sorted into safetensors' data order."""
    return sorted(entries, key=lambda e: safetensors_order_key(e[0], e[1]))


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (10**9) or ``"500MiB"`` (2**20), as HF spells them."""
    if isinstance(size, bool):
        raise TypeError(f"max_shard_size must be an int or a size string, got {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = _SIZE_RE.match(size)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size {size!r} is not a size; use an int of bytes or e.g. '500MB', '5GB', '2GiB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"max_shard_size must be an int or a size string, got {type(size).__name__}")
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return value


def header_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The user's ``__metadata__`` for every header of a save, after ``{"format": "pt"}`` (``transformers``
    requires it); keys starting with the writer's reserved prefix are refused."""
    out = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str; {k!r}: {type(v).__name__} is not")
        if k.startswith(sums.RESERVED_PREFIX):
            raise ValueError(f"metadata key {k!r}: keys starting with {sums.RESERVED_PREFIX!r} are the writer's own")
        out[k] = v
    return out


@dataclass(frozen=True)
class TensorSpec:
    """A full tensor as the checkpoint stores it."""

    fqn: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


PieceKey = tuple[str, tuple[int, ...]]  # (fqn, chunk offsets): names one digest of a file


@dataclass(frozen=True)
class FileSpec:
    """One output file: its name, encoded header, tensors in data order and where each one begins.

    With checksums, ``header`` holds zero-filled digests; ``entries``, ``metadata`` (user metadata and
    provenance), ``pieces`` (each tensor's chunk boxes) and ``algorithm`` let :func:`fill_header` rebuild it.
    """

    name: str
    header: bytes
    tensors: tuple[str, ...]
    begins: Mapping[str, int]  # absolute file offset of each tensor's first byte
    size: int
    entries: tuple[HeaderEntry, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    pieces: Mapping[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = field(default_factory=dict)
    algorithm: str | None = None

    @property
    def piece_keys(self) -> list[PieceKey]:
        """Every digest this file's header needs (zero-size tensors need none: theirs is known)."""
        return [(fqn, offsets) for fqn, boxes in self.pieces.items() for offsets, _sizes in boxes]


def pack_files(specs: Sequence[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Greedy, order-preserving packing of tensors into groups of at most ``max_shard_size`` bytes."""
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_size = 0
    for spec in specs:
        n = spec.nbytes
        if current and current_size + n > max_shard_size:
            groups.append(current)
            current, current_size = [], 0
        current.append(spec)
        current_size += n
        if current_size > max_shard_size:  # a tensor larger than the limit: alone in its file
            groups.append(current)
            current, current_size = [], 0
    if current or not groups:
        groups.append(current)
    return groups


def _with_digests(spec: FileSpec, digests: Mapping[PieceKey, str] | None) -> dict[str, str]:
    """``spec``'s ``__metadata__``: user metadata, provenance, and the digests (zero-filled when ``None``)."""
    md = dict(spec.metadata)
    algorithm = spec.algorithm
    if algorithm is None:
        return md
    zero = sums.placeholder(algorithm)
    md[sums.ALGORITHM_KEY] = algorithm
    for e in spec.entries:
        boxes = spec.pieces.get(e.name, ())
        if not boxes:  # no bytes to write: the digest of nothing
            pieces = [sums.Piece((0,) * len(e.shape), e.shape, checksum(b"", algorithm))]
        else:
            pieces = [sums.Piece(o, s, zero if digests is None else digests[(e.name, o)]) for o, s in boxes]
        md[sums.CHECKSUM_PREFIX + e.name] = sums.encode_pieces(pieces, e.shape)
    md[sums.HEADER_KEY] = zero  # last, sealed by fill_header
    return md


def file_spec(
    name: str,
    group: Sequence[TensorSpec],
    metadata: Mapping[str, str] | None,
    algorithm: str | None,
    boxes: Mapping[str, list[tuple[tuple[int, ...], tuple[int, ...]]]],
) -> FileSpec:
    """File ``name`` holding ``group``: its header (digests zero-filled) and where each tensor begins.

    ``boxes``: every tensor's chunk boxes (element offsets and sizes), one digest each.
    """
    ordered = sorted(group, key=lambda s: safetensors_order_key(s.fqn, s.dtype))
    entries, position = [], 0
    for s in ordered:
        entries.append(HeaderEntry(s.fqn, s.dtype, s.shape, position, position + s.nbytes))
        position += s.nbytes
    user = dict(metadata or {})
    if algorithm is not None:
        user[sums.WRITER_KEY] = writer_descriptor()
        user[sums.FORMAT_KEY] = "safetensors/1"
    pieces = {e.name: tuple(sorted(boxes.get(e.name, ()))) for e in entries}
    draft = FileSpec(name, b"", (), {}, 0, tuple(entries), user, pieces, algorithm)
    header = encode_header(entries, _with_digests(draft, None))
    begins = {e.name: len(header) + e.begin for e in entries}
    return FileSpec(
        name,
        header,
        tuple(e.name for e in entries),
        begins,
        len(header) + position,
        tuple(entries),
        user,
        pieces,
        algorithm,
    )


def fill_header(spec: FileSpec, digests: Mapping[PieceKey, str]) -> bytes:
    """``spec``'s header with the real digests and the sealed header digest; same length as planned."""
    if spec.algorithm is None:
        return spec.header
    missing = [f"{fqn!r} at {list(o)}" for fqn, o in spec.piece_keys if (fqn, o) not in digests]
    if missing:
        raise DcpStorageError(f"{spec.name}: no checksum arrived for the chunks {', '.join(missing[:5])}")
    header = encode_header(spec.entries, _with_digests(spec, digests))
    if len(header) != len(spec.header):
        raise DcpStorageError(
            f"{spec.name}: the header with checksums is {len(header)} bytes, planned {len(spec.header)} (a digest "
            "of the wrong width?)"
        )
    return sums.seal_header(header, spec.algorithm)
