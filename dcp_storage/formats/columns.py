"""A DCP ``Metadata`` as columns (arrays of shapes, chunk boxes, byte ranges) and their tables.

The one metadata view below every format, planner and strategy: a format that decodes its layout straight
into columns (the DCP ``.metadata`` C decoder) serves torch a ``Metadata`` whose two maps are
:class:`ColumnView` s, and the planners, read strategies and tools ask :func:`columns_of` for the arrays
instead of walking torch's objects. Nothing here knows a file format.

torch's ``Metadata`` object graph costs about 2 KB per tensor (six dataclass instances, each with its
``__dict__``, and three ``torch.Size``), 2 GB at a million tensors, before any planning. These columns
hold the same information in about 100 bytes per tensor plus its name, so that ``describe``, ``inspect``
and this library's planners work on a million tensors in seconds and well under a gigabyte, building torch
objects only for the entries a caller touches (:mod:`.lazy_metadata`).

Columns describe *regular* metadata only: every state-dict entry a tensor (``TensorStorageMetadata``) or a
value (``BytesStorageMetadata``), every chunk of a tensor with exactly one storage entry and every storage
entry serving exactly one chunk or value. Anything else (and everything a check refuses) takes the general
path: the guarded unpickler and :mod:`.metadata_checks`, which name each problem. So a column never needs to
represent a malformed value; :func:`columns_from_metadata` returns ``None`` where the general path must
decide.

Layout (``N`` entries of ``state_dict_metadata``, in the file's order; ``C`` chunks in all; a value entry
counts as one chunk of zero dimensions, so ``C >= N``):

========================  ===========  ========================================================
``names``                 ``list[str]``  the state-dict keys
``is_bytes``              bool ``[N]``   ``BytesStorageMetadata`` entries
``prop``                  int32 ``[N]``  row of ``properties`` (``-1`` for values)
``properties``            list           distinct ``TensorProperties`` (compared by their five fields)
``shape_at``              int64 ``[N+1]`` entry ``i``'s shape is ``dims[shape_at[i]:shape_at[i+1]]``
``dims``                  int64
``chunk_at``              int64 ``[N+1]`` entry ``i``'s chunks are ``chunk_at[i] .. chunk_at[i+1]-1``
``chunk_offsets``         int64         chunk ``c``'s offsets: ``chunk_offsets[box_at[c]:box_at[c+1]]``
``chunk_sizes``           int64         likewise its sizes (each chunk has its tensor's number of dims)
``box_at``                int64 ``[C+1]``
``file``                  int32 ``[C]``   row of ``files`` holding chunk ``c``'s record
``byte_offset``           int64 ``[C]``   the record's ``_StorageInfo.offset``
``byte_length``           int64 ``[C]``   its ``length``
``transform``             int32 ``[C]``   row of ``transforms`` (``-1``: ``transform_descriptors`` is ``None``)
``files``                 ``list[str]``  distinct ``relative_path`` values
``transforms``            list          distinct ``transform_descriptors`` (tuples of str)
``planner_data``, ``storage_meta``, ``version``: the ``Metadata`` fields as torch objects (small)
========================  ===========  ========================================================

Chunks keep the order of their tensor's ``chunks`` list. The storage entries' own order and their
``MetadataIndex.index`` hints are not kept (torch compares and hashes a ``MetadataIndex`` by ``fqn`` and
``offset`` only).

``describe``'s tensor and value rows straight from a ``.metadata``'s columns (:mod:`.columns`).

The same rows :func:`~dcp_storage.formats.reports.tensor_table` builds from torch's ``Metadata`` (each chunk
placed in its data file and byte range), but a tensor's :class:`~dcp_storage.formats.reports.TensorInfo` is
built when it is asked for and not kept: at a million tensors ``describe`` holds the columns and a few
arrays, not a million rows, and ``inspect`` prints its table from :meth:`ColumnTensors.summaries` without
building rows at all. Totals are sums over arrays.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage._torch import StorageInfo
from dcp_storage.formats.reports import ChunkInfo, TensorInfo, TensorRows, TensorSummary, ValueInfo, dtype_name
from dcp_storage.runtime import distinct_ints

__all__ = [
    "ColumnTensors",
    "ColumnView",
    "MetadataColumns",
    "column_table",
    "columns_from_metadata",
    "columns_of",
    "metadata_from_columns",
    "property_key",
    "rows_of",
    "saved_chunk",
    "stored_dtype",
]


_I32 = np.int32
_I64 = np.int64


def property_key(props: TensorProperties) -> tuple[Any, ...]:
    """What makes two ``TensorProperties`` the same row of :attr:`MetadataColumns.properties`: the five
    fields and their types (``requires_grad=1`` is not ``True``: the checks refuse the one and not the other)."""
    values = (props.dtype, props.layout, props.requires_grad, props.memory_format, props.pin_memory)
    return (*values, *(type(v) for v in values))


@dataclasses.dataclass(frozen=True, eq=False)
class MetadataColumns:
    """The columns of one ``.metadata`` (see the module's table)."""

    names: list[str]
    is_bytes: np.ndarray
    prop: np.ndarray
    properties: list[TensorProperties]
    shape_at: np.ndarray
    dims: np.ndarray
    chunk_at: np.ndarray
    chunk_offsets: np.ndarray
    chunk_sizes: np.ndarray
    box_at: np.ndarray
    file: np.ndarray
    byte_offset: np.ndarray
    byte_length: np.ndarray
    transform: np.ndarray
    files: list[str]
    transforms: list[tuple[str, ...]]
    planner_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None

    def __len__(self) -> int:
        return len(self.names)

    @property
    def chunk_count(self) -> int:
        return int(self.chunk_at[-1]) if len(self.chunk_at) else 0

    def shape(self, i: int) -> torch.Size:
        return torch.Size(self.dims[self.shape_at[i] : self.shape_at[i + 1]].tolist())

    def chunk_box(self, c: int) -> tuple[torch.Size, torch.Size]:
        lo, hi = self.box_at[c], self.box_at[c + 1]
        return torch.Size(self.chunk_offsets[lo:hi].tolist()), torch.Size(self.chunk_sizes[lo:hi].tolist())

    def nbytes(self) -> int:
        """Bytes held by the arrays (names, properties and the small fields not counted)."""
        return sum(
            getattr(self, f.name).nbytes
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        )


class ColumnView:
    """Base of a ``Metadata`` map served over :class:`MetadataColumns` (a format's lazy views): ``serves``
    names the ``Metadata`` field it stands for, ``columns`` the arrays it reads."""

    serves: str = ""
    columns: MetadataColumns

    def row_table(self) -> dict[str, int]:
        """``{name: row}`` of :attr:`columns` (built once, shared; do not modify)."""
        raise NotImplementedError

    # The ``state_dict_metadata`` view answers these two without building whole entries.
    def tensor_dtype(self, fqn: Any) -> torch.dtype | None:
        raise NotImplementedError

    def chunk(self, fqn: Any, offsets: Any) -> ChunkStorageMetadata | None:
        raise NotImplementedError


def _view(md: Any, field: str) -> ColumnView | None:
    view = getattr(md, field, None)
    return view if isinstance(view, ColumnView) and view.serves == field else None


def columns_of(md: Any) -> MetadataColumns | None:
    """The columns behind ``md`` when both its maps are views of the same columns, else ``None``."""
    state, storage = _view(md, "state_dict_metadata"), _view(md, "storage_data")
    if state is not None and storage is not None and state.columns is storage.columns:
        return state.columns
    return None


def rows_of(md: Any) -> dict[str, int] | None:
    """``{name: row}`` of the columns behind ``md`` (built once, shared with its views; do not modify), or ``None``."""
    if columns_of(md) is None:
        return None
    return md.state_dict_metadata.row_table()  # type: ignore[no-any-return]


def stored_dtype(metadata: Metadata | None, fqn: str) -> torch.dtype | None:
    """The dtype the metadata gives tensor ``fqn``; ``None`` when it has no such tensor (or no metadata)."""
    if metadata is None:
        return None
    state = metadata.state_dict_metadata
    view = _view(metadata, "state_dict_metadata")
    if view is not None:  # without building the entry
        return view.tensor_dtype(fqn)
    md = state.get(fqn)
    dtype = getattr(getattr(md, "properties", None), "dtype", None) if isinstance(md, TensorStorageMetadata) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def saved_chunk(metadata: Metadata | None, index: Any) -> ChunkStorageMetadata | None:
    """The chunk of the metadata that ``index`` (a ``MetadataIndex``) names; ``None`` when it names none."""
    if metadata is None:
        return None
    view = _view(metadata, "state_dict_metadata")
    if view is not None:  # one chunk built, not the whole entry
        return view.chunk(index.fqn, index.offset)
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    offsets, hint, chunks = tuple(index.offset or ()), index.index, md.chunks
    if hint is not None and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == offsets:
        return chunks[hint]
    return next((c for c in chunks if tuple(c.offsets) == offsets), None)


def _dims_of(value: Any) -> list[int] | None:
    if not isinstance(value, (torch.Size, list, tuple)):
        return None
    out = list(value)
    if not all(type(v) is int for v in out):
        return None
    return out


def columns_from_metadata(md: Metadata) -> MetadataColumns | None:
    """The columns of a decoded ``Metadata``; ``None`` where it is not regular (see the module docstring).

    The reference for the native decoder (which builds the same columns from the pickle's bytes) and the
    way a ``Metadata`` built in memory gets columns. Values are not range-checked here: that is the checks'
    job (:mod:`.column_checks`). Objects a pickle built without some of their fields are not regular either.
    """
    try:
        return _columns_from_metadata(md)
    except (AttributeError, TypeError):  # a field missing, or unhashable where a key is expected
        return None


def _columns_from_metadata(md: Metadata) -> MetadataColumns | None:
    state, storage = md.state_dict_metadata, md.storage_data
    if type(state) is not dict or type(storage) is not dict:
        return None
    records: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str or type(info).__name__ != "_StorageInfo":
            return None
        offset = None if index.offset is None else _dims_of(index.offset)
        if index.offset is not None and offset is None:
            return None
        key = (index.fqn, None if offset is None else tuple(offset))
        if key in records:
            return None
        records[key] = info
    names: list[str] = []
    is_bytes: list[bool] = []
    prop: list[int] = []
    properties: list[TensorProperties] = []
    prop_rows: dict[tuple[Any, ...], int] = {}
    shape_at, dims = [0], []
    chunk_at, chunk_offsets, chunk_sizes, box_at = [0], [], [], [0]
    file, byte_offset, byte_length, transform = [], [], [], []
    files: list[str] = []
    file_rows: dict[str, int] = {}
    transforms: list[tuple[str, ...]] = []
    transform_rows: dict[tuple[str, ...], int] = {}
    used: set[tuple[str, tuple[int, ...] | None]] = set()  # records serving a chunk (or a value)

    def add_record(info: Any) -> bool:
        rel, off, length = info.relative_path, info.offset, info.length
        descriptors = getattr(info, "transform_descriptors", None)
        if type(rel) is not str or type(off) is not int or type(length) is not int:
            return False
        if descriptors is not None:
            if type(descriptors) is not list or not all(type(d) is str for d in descriptors):
                return False  # a tuple would be served back as a list (torch writes lists), unequal
            descriptors = tuple(descriptors)
            transform.append(transform_rows.setdefault(descriptors, len(transform_rows)))
            if len(transforms) < len(transform_rows):
                transforms.append(descriptors)
        else:
            transform.append(-1)
        file.append(file_rows.setdefault(rel, len(file_rows)))
        if len(files) < len(file_rows):
            files.append(rel)
        byte_offset.append(off)
        byte_length.append(length)
        return True

    for fqn, item in state.items():
        if type(fqn) is not str:
            return None
        names.append(fqn)
        if type(item) is BytesStorageMetadata:
            info = records.get((fqn, None))
            if info is None or not add_record(info):
                return None
            used.add((fqn, None))
            is_bytes.append(True)
            prop.append(-1)
            shape_at.append(len(dims))
            box_at.append(len(chunk_offsets))
            chunk_at.append(chunk_at[-1] + 1)
            continue
        if type(item) is not TensorStorageMetadata or type(item.properties) is not TensorProperties:
            return None
        size = _dims_of(item.size)
        if size is None or type(item.chunks) is not list:
            return None
        key = property_key(item.properties)
        row = prop_rows.get(key)
        if row is None:
            row = prop_rows[key] = len(properties)
            properties.append(item.properties)
        is_bytes.append(False)
        prop.append(row)
        dims += size
        shape_at.append(len(dims))
        for chunk in item.chunks:
            if type(chunk) is not ChunkStorageMetadata:
                return None
            offsets, sizes = _dims_of(chunk.offsets), _dims_of(chunk.sizes)
            if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
                return None
            rkey = (fqn, tuple(offsets))
            info = records.get(rkey)
            if info is None or rkey in used or not add_record(info):  # no record, or two chunks at one offset
                return None
            used.add(rkey)
            chunk_offsets += offsets
            chunk_sizes += sizes
            box_at.append(len(chunk_offsets))
        chunk_at.append(chunk_at[-1] + len(item.chunks))
    if len(used) != len(records):  # a storage entry serving no chunk
        return None
    try:  # an integer beyond int64 raises OverflowError: the checks name it
        return MetadataColumns(
            names=names,
            is_bytes=np.array(is_bytes, dtype=bool),
            prop=np.array(prop, dtype=_I32),
            properties=properties,
            shape_at=np.array(shape_at, dtype=_I64),
            dims=np.array(dims, dtype=_I64),
            chunk_at=np.array(chunk_at, dtype=_I64),
            chunk_offsets=np.array(chunk_offsets, dtype=_I64),
            chunk_sizes=np.array(chunk_sizes, dtype=_I64),
            box_at=np.array(box_at, dtype=_I64),
            file=np.array(file, dtype=_I32),
            byte_offset=np.array(byte_offset, dtype=_I64),
            byte_length=np.array(byte_length, dtype=_I64),
            transform=np.array(transform, dtype=_I32),
            files=files,
            transforms=transforms,
            planner_data=md.planner_data,
            storage_meta=md.storage_meta,
            version=md.version,
        )
    except OverflowError:
        return None


def metadata_from_columns(cols: MetadataColumns) -> Metadata:
    """A plain torch ``Metadata`` holding every entry (for small checkpoints and for comparing in tests)."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for i, fqn in enumerate(cols.names):
        first, last = int(cols.chunk_at[i]), int(cols.chunk_at[i + 1])
        if cols.is_bytes[i]:
            state[fqn] = BytesStorageMetadata()
            keys = [MetadataIndex(fqn)]
        else:
            chunks = [ChunkStorageMetadata(*cols.chunk_box(c)) for c in range(first, last)]
            state[fqn] = TensorStorageMetadata(cols.properties[int(cols.prop[i])], cols.shape(i), chunks)
            keys = [MetadataIndex(fqn, chunk.offsets, n) for n, chunk in enumerate(chunks)]
        for c, key in zip(range(first, last), keys):
            t = int(cols.transform[c])
            storage[key] = StorageInfo(
                cols.files[int(cols.file[c])],
                int(cols.byte_offset[c]),
                int(cols.byte_length[c]),
                None if t < 0 else list(cols.transforms[t]),
            )
    return Metadata(
        state_dict_metadata=state,
        planner_data=cols.planner_data,
        storage_data=storage,
        storage_meta=cols.storage_meta,
        version=cols.version,
    )


_BLOCK = 4096  # rows converted from arrays to Python lists at a time when iterating
_EXACT = 2.0**62  # element and byte counts estimated (as floats) above this are computed exactly in Python


class ColumnTensors(TensorRows):
    """The tensor rows of ``cols`` (entries that are not values, in the file's order), built on access."""

    def __init__(self, cols: MetadataColumns) -> None:
        self.cols = cols
        self.rows = np.flatnonzero(~cols.is_bytes)  # the entry of each tensor row
        self._dtypes = [dtype_name(p.dtype) for p in cols.properties]
        self._nbytes, self._exact = _byte_counts(cols, self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def nbytes(self, j: int) -> int:
        exact = self._exact.get(j)
        return int(self._nbytes[j]) if exact is None else exact

    def row(self, j: int) -> TensorInfo:
        cols, r = self.cols, int(self.rows[j])
        files, box_at, offsets, sizes = cols.files, cols.box_at, cols.chunk_offsets, cols.chunk_sizes
        chunks = [
            ChunkInfo(
                offsets[box_at[c] : box_at[c + 1]].tolist(),
                sizes[box_at[c] : box_at[c + 1]].tolist(),
                files[cols.file[c]],
                int(cols.byte_offset[c]),
                int(cols.byte_length[c]),
            )
            for c in range(int(cols.chunk_at[r]), int(cols.chunk_at[r + 1]))
        ]
        shape = cols.dims[cols.shape_at[r] : cols.shape_at[r + 1]].tolist()
        return TensorInfo(cols.names[r], self._dtypes[cols.prop[r]], shape, self.nbytes(j), chunks)

    def summaries(self) -> Iterator[TensorSummary]:
        cols = self.cols
        names, dtypes, files, exact = cols.names, self._dtypes, cols.files, self._exact
        alone = [(f,) for f in files]  # a one-chunk tensor's files: shared tuples
        for start in range(0, len(self.rows), _BLOCK):
            rows = self.rows[start : start + _BLOCK]
            shape_lo, chunk_lo = int(cols.shape_at[rows[0]]), int(cols.chunk_at[rows[0]])
            shape_hi, chunk_hi = int(cols.shape_at[rows[-1] + 1]), int(cols.chunk_at[rows[-1] + 1])
            shape_a, shape_b = (cols.shape_at[rows] - shape_lo).tolist(), (cols.shape_at[rows + 1] - shape_lo).tolist()
            chunk_a, chunk_b = (cols.chunk_at[rows] - chunk_lo).tolist(), (cols.chunk_at[rows + 1] - chunk_lo).tolist()
            dims = cols.dims[shape_lo:shape_hi].tolist()
            held = cols.file[chunk_lo:chunk_hi].tolist()
            props = cols.prop[rows].tolist()
            nbytes = self._nbytes[start : start + _BLOCK].tolist()
            for k, r in enumerate(rows.tolist()):
                c0, c1 = chunk_a[k], chunk_b[k]
                if c1 - c0 == 1:
                    where: tuple[str, ...] = alone[held[c0]]
                else:
                    where = tuple(sorted({files[f] for f in held[c0:c1]}))
                size = nbytes[k] if not exact else exact.get(start + k, nbytes[k])
                yield names[r], dtypes[props[k]], tuple(dims[shape_a[k] : shape_b[k]]), size, where, c1 - c0

    def tensor_bytes(self) -> int:
        if not self._exact and float(self._nbytes.sum(dtype=np.float64)) < _EXACT:
            return int(self._nbytes.sum())
        return sum(self.nbytes(j) for j in range(len(self.rows)))

    def chunk_count(self) -> int:
        cols = self.cols
        return int((cols.chunk_at[self.rows + 1] - cols.chunk_at[self.rows]).sum())


def _byte_counts(cols: MetadataColumns, rows: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
    """Each tensor row's byte count (elements times item size), and the exact ones too large for int64."""
    itemsize = np.array([p.dtype.itemsize for p in cols.properties] or [0], dtype=np.int64)
    out = np.zeros(len(rows), dtype=np.int64)
    exact: dict[int, int] = {}
    start = cols.shape_at[rows]
    ndim = cols.shape_at[rows + 1] - start
    for k in distinct_ints(ndim):
        at = np.flatnonzero(ndim == k)
        dims = cols.dims[start[at, None] + np.arange(k)]  # (rows, k); k = 0: one element each
        size = itemsize[cols.prop[rows[at]]]
        with np.errstate(over="ignore", invalid="ignore"):  # too large for int64: the exact rows below
            estimate = dims.astype(np.float64).prod(axis=1) * size
            out[at] = dims.prod(axis=1) * size
        for j in at[estimate >= _EXACT].tolist():
            r = int(rows[j])
            exact[j] = math.prod(cols.dims[cols.shape_at[r] : cols.shape_at[r + 1]].tolist()) * int(
                itemsize[cols.prop[r]]
            )
    return out, exact


def column_table(cols: MetadataColumns) -> tuple[ColumnTensors, list[ValueInfo]]:
    """The tensor rows (built on access) and the value rows of ``cols``, each placed in its file."""
    values = [
        ValueInfo(
            cols.names[r],
            cols.files[cols.file[c]],
            int(cols.byte_offset[c]),
            int(cols.byte_length[c]),
        )
        for r, c in zip(np.flatnonzero(cols.is_bytes).tolist(), cols.chunk_at[:-1][cols.is_bytes].tolist())
    ]
    return ColumnTensors(cols), values
