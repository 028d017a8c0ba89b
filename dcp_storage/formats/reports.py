"""What a format's ``describe`` and ``check`` hooks fill in: the reports ``inspect`` and ``verify`` print.

They live with the formats, below the tools, because the hooks that build them live in ``formats/<name>/``
(and in plugins): a format describes and checks its own layout, and :mod:`dcp_storage.inspection` only
picks the hook and prints the result. :func:`tensor_table` builds the tensor and value rows from a DCP
``Metadata`` for any format, given where each chunk is stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from dcp_storage.errors import DcpStorageError
from dcp_storage.text import redact_urls
from dcp_storage.transports.protocol import ListedSizes

__all__ = [
    "CheckpointInfo",
    "ChunkInfo",
    "FileInfo",
    "Locate",
    "TensorInfo",
    "TensorRows",
    "TensorSummary",
    "ValueInfo",
    "VerifyReport",
    "dtype_name",
    "error_text",
    "named_keys",
    "file_infos",
    "listed_sizes",
    "size_or_none",
    "tensor_summaries",
    "tensor_table",
]

_MAX_KEYS_NAMED = 5


# Slotted: a checkpoint of a million tensors makes a million of each (a third of the memory of plain ones).
@dataclass(slots=True)
class ChunkInfo:
    offsets: list[int]
    sizes: list[int]
    file: str | None = None
    offset: int | None = None  # byte offset of the stored record/elements in ``file``
    length: int | None = None


@dataclass(slots=True)
class TensorInfo:
    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    chunks: list[ChunkInfo] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return sorted({c.file for c in self.chunks if c.file is not None})


TensorSummary = tuple[str, str, Sequence[int], int, Sequence[str], int]
"""One tensor's table row as ``inspect`` shows it: key, dtype, shape, bytes, files, number of chunks."""


class TensorRows(Sequence[TensorInfo]):
    """A read-only sequence of :class:`TensorInfo` built on access (from a format's columns), not kept.

    A checkpoint of a million tensors would otherwise hold a million rows and their chunks (about 1 KB
    each). Compares equal to a list of the same rows. Subclasses give ``__len__`` and ``row(i)``, and may
    give faster :meth:`summaries`, :meth:`tensor_bytes` and :meth:`chunk_count` than these, which build
    every row.
    """

    def row(self, i: int) -> TensorInfo:
        raise NotImplementedError

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.row(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        j = i.__index__()
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"tensor row {i} out of range ({n} rows)")
        return self.row(j)

    def __iter__(self) -> Iterator[TensorInfo]:
        return (self.row(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, TensorRows)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self)} tensor rows>"

    def summaries(self) -> Iterator[TensorSummary]:
        return ((t.key, t.dtype, t.shape, t.nbytes, t.files, len(t.chunks)) for t in self)

    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self)

    def chunk_count(self) -> int:
        return sum(len(t.chunks) for t in self)


def tensor_summaries(tensors: Sequence[TensorInfo]) -> Iterator[TensorSummary]:
    """Each tensor's :data:`TensorSummary`, without building rows where ``tensors`` need not."""
    if isinstance(tensors, TensorRows):
        return tensors.summaries()
    return ((t.key, t.dtype, t.shape, t.nbytes, t.files, len(t.chunks)) for t in tensors)


@dataclass(slots=True)
class ValueInfo:
    key: str
    file: str | None = None
    offset: int | None = None
    length: int | None = None


@dataclass(slots=True)
class FileInfo:  # slotted: a checkpoint of a file per tensor has a million of them
    name: str
    size: int | None  # None: listed by the checkpoint but missing


@dataclass
class CheckpointInfo:
    url: str
    format: str  # descriptor, e.g. "dcp/1"
    description: str
    layout: str  # "dcp", "safetensors file", "safetensors index", "torch.save zip", ...
    files: list[FileInfo] = field(default_factory=list)
    tensors: Sequence[TensorInfo] = field(default_factory=list)  # a list, or TensorRows built on access
    values: list[ValueInfo] = field(default_factory=list)
    # What wrote it (from dcp-storage's manifest or header metadata): format, writer, extensions, checksums.
    provenance: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:  # ``url`` stays exact (it opens the checkpoint); what is shown is masked
        return redact_urls(
            f"CheckpointInfo(url={self.url!r}, format={self.format!r}, layout={self.layout!r}, "
            f"{len(self.files)} files, {len(self.tensors)} tensors, {len(self.values)} values)"
        )

    @property
    def totals(self) -> dict[str, int]:
        rows = self.tensors
        lazy = isinstance(rows, TensorRows)
        return {
            "files": len(self.files),
            "file_bytes": sum(f.size or 0 for f in self.files),
            "tensors": len(rows),
            "tensor_bytes": rows.tensor_bytes() if lazy else sum(t.nbytes for t in rows),
            "chunks": rows.chunk_count() if lazy else sum(len(t.chunks) for t in rows),
            "values": len(self.values),
        }

    def as_dict(self) -> dict[str, Any]:
        if isinstance(self.tensors, TensorRows):  # asdict would deep-copy it: its rows, as a list of dicts
            out = asdict(replace(self, tensors=[]))
            out["tensors"] = [asdict(t) for t in self.tensors]
        else:
            out = asdict(self)
        out["totals"] = self.totals
        return _redacted(out) if redact_urls(self.url) != self.url else out  # a presigned URL: masked


@dataclass
class VerifyReport:
    """What ``verify`` found: every problem (each naming file, key and reason), notes, and counts."""

    url: str
    format: str | None
    deep: bool
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)

    def __repr__(self) -> str:  # ``url`` stays exact (``verify`` opens it); what is shown is masked
        return redact_urls(
            f"VerifyReport(url={self.url!r}, format={self.format!r}, deep={self.deep}, "
            f"problems={self.problems!r}, notes={self.notes!r}, checked={self.checked!r})"
        )

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return _redacted({**asdict(self), "ok": self.ok})


def _redacted(value: Any) -> Any:
    """``value`` (a report's ``as_dict``) with URL secrets masked in every string: file names made from a
    presigned URL carry its query (``describe`` walks only when its URL has secrets: a million rows cost
    nothing otherwise)."""
    if isinstance(value, str):
        return redact_urls(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_redacted(v) for v in value)
    return value


Locate = Callable[[str, "list[int] | None"], tuple[Any, ...]]
"""``locate(fqn, offsets or None)`` -> ``(file, offset, length)`` of a chunk's or value's storage."""


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def size_or_none(transport: Any, path: str) -> int | None:
    """A listed file's size, or ``None`` when it is missing (``inspect`` shows it as such)."""
    return transport.size(path) if transport.exists(path) else None


def listed_sizes(transport: Any, root: str) -> dict[str, int | None]:
    """Every entry under ``root`` with its size where one listing tells it
    (:class:`~dcp_storage.transports.ListedSizes`: a million data files in seconds, not a million checked
    ``size`` calls); empty where the store cannot (then list and ask :func:`size_or_none`)."""
    return transport.listed_sizes(root) if isinstance(transport, ListedSizes) else {}


def file_infos(transport: Any, root: str, names: Sequence[str], listed: dict[str, int | None]) -> list[FileInfo]:
    """A row for each of ``names`` (files under ``root``) with its size or ``None`` (missing): from
    ``listed`` (:func:`listed_sizes`) where it has one, else by :func:`size_or_none`."""
    return [
        FileInfo(n, size if size is not None else size_or_none(transport, transport.join(root, n)))
        for n, size in zip(names, map(listed.get, names))
    ]


def error_text(exc: BaseException) -> str:
    """A problem line for ``exc``: our errors' own messages, anything else with its class name."""
    return str(exc) if isinstance(exc, DcpStorageError) else f"{type(exc).__name__}: {exc}"


def named_keys(keys: list[str]) -> str:
    """The first few keys, quoted, and how many more: a problem about a million keys stays one line."""
    shown = ", ".join(repr(k) for k in keys[:_MAX_KEYS_NAMED])
    return shown + (f" and {len(keys) - _MAX_KEYS_NAMED} more" if len(keys) > _MAX_KEYS_NAMED else "")


def _ints(value: Any) -> list[int]:
    return list(value) if type(value) is torch.Size else [int(v) for v in value]  # a Size holds ints only


def tensor_table(md: Metadata, locate: Locate) -> tuple[list[TensorInfo], list[ValueInfo]]:
    """The tensor and value rows of ``md``, each chunk placed by ``locate``."""
    tensors, values = [], []
    names: dict[Any, str] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            shape = _ints(item.size)
            dtype = item.properties.dtype
            name = names.get(dtype)
            if name is None:
                name = names[dtype] = dtype_name(dtype)
            info = TensorInfo(fqn, name, shape, math.prod(shape) * dtype.itemsize)
            for chunk in item.chunks:
                offsets = _ints(chunk.offsets)
                info.chunks.append(ChunkInfo(offsets, _ints(chunk.sizes), *locate(fqn, offsets)))
            tensors.append(info)
        elif isinstance(item, BytesStorageMetadata):
            values.append(ValueInfo(fqn, *locate(fqn, None)))
    return tensors, values
