"""torch's ``Metadata`` over :class:`~.columns.MetadataColumns`: entries built when asked for, not kept.

torch's load protocol hands a ``Metadata`` to the planner and the reader; its ``state_dict_metadata`` and
``storage_data`` are plain dicts of dataclass instances, about 2 KB a tensor. :func:`lazy_metadata`
returns a real ``Metadata`` whose two maps are read-only views of the columns: looking up a key builds that
entry's ``TensorStorageMetadata`` (or ``_StorageInfo``) then and there, and nothing keeps it. Code that
walks every entry (torch's ``DefaultLoadPlanner``) still works, at the old cost per entry but without the
old memory; this library's planners and tools ask :func:`columns_of` for the columns and work on arrays.

The views are ``Mapping``\\ s, not ``dict`` subclasses: C code that reads a dict's slots directly would see
an empty dict, while a ``Mapping`` either goes through these methods or fails loudly. They pickle as their
columns (a rank shares the decoded metadata with the others as a few arrays).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from dcp_storage.formats.dcp_native.columns import MetadataColumns

__all__ = ["StateDictView", "StorageDataView", "columns_of", "lazy_metadata", "rows_of"]

_SCAN = 8  # chunks of one tensor searched in order; beyond, a per-tensor table (built once)


class _Rows:
    """Row of each name and, for tensors of many chunks, the chunk of each offset: built on first use."""

    def __init__(self, cols: MetadataColumns) -> None:
        self.cols = cols
        self._rows: dict[str, int] | None = None
        self._chunks: dict[int, dict[tuple[int, ...], int]] = {}

    def row(self, fqn: Any) -> int | None:
        return self.table().get(fqn) if isinstance(fqn, str) else None

    def table(self) -> dict[str, int]:
        """``{name: row}`` (built on first use, then shared)."""
        if self._rows is None:
            self._rows = {name: i for i, name in enumerate(self.cols.names)}
        return self._rows

    def chunk(self, i: int, offsets: Any) -> int | None:
        """The chunk of entry ``i`` at ``offsets`` (``None``: a value's one record), or ``None``."""
        cols = self.cols
        first, last = int(cols.chunk_at[i]), int(cols.chunk_at[i + 1])
        if cols.is_bytes[i]:
            return first if offsets is None else None
        if offsets is None:
            return None
        key = tuple(offsets)
        if last - first > _SCAN:
            table = self._chunks.get(i)
            if table is None:
                table = self._chunks[i] = {
                    tuple(cols.chunk_offsets[cols.box_at[c] : cols.box_at[c + 1]].tolist()): c
                    for c in range(first, last)
                }
            return table.get(key)
        for c in range(first, last):
            if tuple(cols.chunk_offsets[cols.box_at[c] : cols.box_at[c + 1]].tolist()) == key:
                return c
        return None


def _storage_info(cols: MetadataColumns, c: int) -> _StorageInfo:
    t = int(cols.transform[c])
    return _StorageInfo(
        cols.files[int(cols.file[c])],
        int(cols.byte_offset[c]),
        int(cols.byte_length[c]),
        None if t < 0 else list(cols.transforms[t]),
    )


class StateDictView(Mapping[str, Any]):
    """``Metadata.state_dict_metadata`` over columns (read-only; each lookup builds a fresh entry)."""

    def __init__(self, cols: MetadataColumns, rows: _Rows | None = None) -> None:
        self.columns = cols
        self._rows = rows if rows is not None else _Rows(cols)

    def entry(self, i: int) -> TensorStorageMetadata | BytesStorageMetadata:
        """The entry of row ``i``."""
        cols = self.columns
        if cols.is_bytes[i]:
            return BytesStorageMetadata()
        chunks = [
            ChunkStorageMetadata(*cols.chunk_box(c)) for c in range(int(cols.chunk_at[i]), int(cols.chunk_at[i + 1]))
        ]
        return TensorStorageMetadata(cols.properties[int(cols.prop[i])], cols.shape(i), chunks)

    def tensor_dtype(self, fqn: Any) -> torch.dtype | None:
        """The stored dtype of tensor ``fqn`` (``None``: no such tensor), without building its entry."""
        i = self._rows.row(fqn)
        if i is None or self.columns.is_bytes[i]:
            return None
        return self.columns.properties[int(self.columns.prop[i])].dtype

    def chunk(self, fqn: Any, offsets: Any) -> ChunkStorageMetadata | None:
        """The chunk of tensor ``fqn`` at ``offsets``, built alone (``None``: none there).

        Readers ask once per read item; building the whole entry each time would cost the square of a
        tensor's chunk count."""
        i = self._rows.row(fqn)
        if i is None or self.columns.is_bytes[i] or offsets is None:
            return None
        c = self._rows.chunk(i, offsets)
        return None if c is None else ChunkStorageMetadata(*self.columns.chunk_box(c))

    def __getitem__(self, fqn: str) -> TensorStorageMetadata | BytesStorageMetadata:
        i = self._rows.row(fqn)
        if i is None:
            raise KeyError(fqn)
        return self.entry(i)

    def __contains__(self, fqn: object) -> bool:
        return self._rows.row(fqn) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns.names)

    def __len__(self) -> int:
        return len(self.columns.names)

    def __repr__(self) -> str:
        return f"<state_dict_metadata of {len(self)} entries, as columns>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (StateDictView, (self.columns,))


class StorageDataView(Mapping[MetadataIndex, _StorageInfo]):
    """``Metadata.storage_data`` over columns: one ``MetadataIndex`` per chunk (and per value)."""

    def __init__(self, cols: MetadataColumns, rows: _Rows | None = None) -> None:
        self.columns = cols
        self._rows = rows if rows is not None else _Rows(cols)

    def _chunk(self, index: object) -> int | None:
        if not isinstance(index, MetadataIndex):
            return None
        i = self._rows.row(index.fqn)
        return None if i is None else self._rows.chunk(i, index.offset)

    def __getitem__(self, index: MetadataIndex) -> _StorageInfo:
        c = self._chunk(index)
        if c is None:
            raise KeyError(index)
        return _storage_info(self.columns, c)

    def __contains__(self, index: object) -> bool:
        return self._chunk(index) is not None

    def __iter__(self) -> Iterator[MetadataIndex]:
        cols = self.columns
        for i, fqn in enumerate(cols.names):
            first, last = int(cols.chunk_at[i]), int(cols.chunk_at[i + 1])
            if cols.is_bytes[i]:
                yield MetadataIndex(fqn)
                continue
            for n, c in enumerate(range(first, last)):
                yield MetadataIndex(fqn, cols.chunk_offsets[cols.box_at[c] : cols.box_at[c + 1]].tolist(), n)

    def __len__(self) -> int:
        return self.columns.chunk_count

    def __repr__(self) -> str:
        return f"<storage_data of {len(self)} entries, as columns>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (StorageDataView, (self.columns,))


def lazy_metadata(cols: MetadataColumns) -> Metadata:
    """A torch ``Metadata`` whose maps are views of ``cols`` (see the module docstring)."""
    rows = _Rows(cols)
    return Metadata(
        state_dict_metadata=StateDictView(cols, rows),  # type: ignore[arg-type]
        planner_data=cols.planner_data,
        storage_data=StorageDataView(cols, rows),
        storage_meta=cols.storage_meta,
        version=cols.version,
    )


def columns_of(md: Any) -> MetadataColumns | None:
    """The columns behind ``md`` if it came from :func:`lazy_metadata` (and still has its views), else ``None``."""
    state = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    if isinstance(state, StateDictView) and isinstance(storage, StorageDataView) and state.columns is storage.columns:
        return state.columns
    return None


def rows_of(md: Any) -> dict[str, int] | None:
    """``{name: row}`` of the columns behind ``md`` (built once, shared with its views; do not modify), or ``None``."""
    if columns_of(md) is None:
        return None
    return md.state_dict_metadata._rows.table()  # type: ignore[no-any-return]
