"""``describe``'s tensor and value rows straight from a ``.metadata``'s columns (:mod:`.columns`).

The same rows :func:`~dcp_storage.formats.reports.tensor_table` builds from torch's ``Metadata`` (each chunk
placed in its data file and byte range), but a tensor's :class:`~dcp_storage.formats.reports.TensorInfo` is
built when it is asked for and not kept: at a million tensors ``describe`` holds the columns and a few
arrays, not a million rows, and ``inspect`` prints its table from :meth:`ColumnTensors.summaries` without
building rows at all. Totals are sums over arrays.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from dcp_storage.formats.dcp_native.columns import MetadataColumns
from dcp_storage.formats.reports import ChunkInfo, TensorInfo, TensorRows, TensorSummary, ValueInfo, dtype_name

__all__ = ["ColumnTensors", "column_table"]

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
    for k in np.unique(ndim).tolist():
        at = np.flatnonzero(ndim == k)
        dims = cols.dims[start[at, None] + np.arange(k)]  # (rows, k); k = 0: one element each
        size = itemsize[cols.prop[rows[at]]]
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
