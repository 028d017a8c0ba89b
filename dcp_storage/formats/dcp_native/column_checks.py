""":mod:`.metadata_checks` on :class:`~.columns.MetadataColumns`: the same verdict, on arrays.

:func:`columns_sound` is true only where ``metadata_problems(metadata_from_columns(cols), path)`` would be
empty: every check there has its vectorised twin here (numpy over all chunks at once; Python loops only
over distinct files, property rows and transform rows, plus :func:`~..tiling.tiling_problem` for the few
tensors whose chunks are not one row or one run along one axis). It gives no message: where it says no,
the caller takes the general path (the guarded unpickler and :func:`~.metadata_checks.check_metadata`),
which names each problem. So it may refuse more than the checks do (never less): it also refuses columns
that are not internally consistent (a decoder's bug) and a tensor listing two chunks at one offset (two
records under one ``MetadataIndex``).

Byte counts are computed without wrapping: a tensor's ``prod(shape) * itemsize`` in floating point, with
the few values within a rounding error of ``2**63`` recomputed exactly; chunk volumes as int64 once every
chunk is known to lie inside a tensor whose byte count fits; sums split into high and low 32-bit halves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import StorageMeta

from ...errors import CorruptCheckpointError
from ..limits import BROADCAST_BYTES, MAX_BYTES, MAX_NDIM
from ..paths import check_relative
from ..tiling import tiling_problem
from .columns import MetadataColumns
from .metadata_checks import _PROPERTY_TYPES, _incomplete

__all__ = ["columns_sound"]

_I64 = np.dtype(np.int64)
_I32 = np.dtype(np.int32)
_TWO63 = float(2**63)
_NEAR = 1e-9  # relative band around 2**63 recomputed exactly (float products of <= MAX_NDIM factors err ~1e-13)


def columns_sound(cols: MetadataColumns, path: str) -> bool:
    """Whether ``metadata_problems(metadata_from_columns(cols), path)`` is empty (see the module docstring)."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            return _sound(cols)
    except (TypeError, ValueError, IndexError, AttributeError, OverflowError):  # inconsistent columns
        return False


def _sound(cols: MetadataColumns) -> bool:
    if not _consistent(cols):
        return False
    meta = cols.storage_meta
    if meta is not None and (not isinstance(meta, StorageMeta) or _incomplete(meta)):
        return False
    n = len(cols.names)
    is_tensor = ~cols.is_bytes
    itemsize = _property_itemsizes(cols, is_tensor)
    if itemsize is None:
        return False
    if not _files_sound(cols) or not _transforms_sound(cols):
        return False

    # Shapes: at most MAX_NDIM dims, each in [0, MAX_DIM] (int64 bounds the top), bytes within MAX_BYTES.
    ndim = np.diff(cols.shape_at)
    if ndim.size and int(ndim.max()) > MAX_NDIM:
        return False
    if cols.dims.size and int(cols.dims.min()) < 0:
        return False
    t_items = np.where(is_tensor, itemsize[np.maximum(cols.prop, 0)] if itemsize.size else 0, 0)
    if not _bytes_fit(cols.dims, cols.shape_at, t_items):
        return False

    # Chunks: inside their tensor (each chunk has its tensor's dims: checked by _consistent).
    per_entry = np.diff(cols.chunk_at)
    entry_of_chunk = np.repeat(np.arange(n, dtype=_I64), per_entry)
    box_len = np.diff(cols.box_at)
    dim_of_box = np.repeat(cols.shape_at[:-1][entry_of_chunk] - cols.box_at[:-1], box_len) + np.arange(
        cols.chunk_offsets.size, dtype=_I64
    )
    shape_of_box = cols.dims[dim_of_box]
    off, size = cols.chunk_offsets, cols.chunk_sizes
    if off.size and (int(off.min()) < 0 or int(size.min()) < 0 or bool(np.any(size > shape_of_box - off))):
        return False  # (shape - off may be negative; neither side overflows with both non-negative)
    del dim_of_box

    # Records: byte ranges possible.
    b_off, b_len = cols.byte_offset, cols.byte_length
    if b_off.size and (int(b_off.min()) < 0 or int(b_len.min()) < 0 or bool(np.any(b_off > MAX_BYTES - b_len))):
        return False

    if not _tiled(cols, entry_of_chunk, per_entry, box_len, shape_of_box, is_tensor):
        return False
    del shape_of_box

    # Chunk byte counts: exact in int64 now that every chunk lies inside a tensor whose bytes fit.
    chunk_is_tensor = is_tensor[entry_of_chunk]
    vol = _volumes(size, cols.box_at)
    nbytes = np.where(chunk_is_tensor, vol * t_items[entry_of_chunk], 0)
    del vol
    has_transform = np.array([len(t) > 0 for t in cols.transforms] + [False], dtype=bool)
    transformed = has_transform[cols.transform]  # -1 reads the trailing False

    plain = chunk_is_tensor & ~transformed
    if _overlapping(cols) and not bool(np.any(plain & (nbytes > 0) & (b_len == nbytes))):
        return False  # shared bytes are allowed only in torch's DCP-safetensors layout
    excess = np.where(plain & (nbytes > b_len), nbytes - b_len, 0)
    return _total(excess) <= BROADCAST_BYTES.bytes


def _consistent(cols: MetadataColumns) -> bool:
    """The arrays agree with each other (both builders guarantee it; a decoder's bug must not pass)."""
    n = len(cols.names)
    arrays = {
        "is_bytes": (cols.is_bytes, np.dtype(bool)),
        "prop": (cols.prop, _I32),
        "shape_at": (cols.shape_at, _I64),
        "dims": (cols.dims, _I64),
        "chunk_at": (cols.chunk_at, _I64),
        "chunk_offsets": (cols.chunk_offsets, _I64),
        "chunk_sizes": (cols.chunk_sizes, _I64),
        "box_at": (cols.box_at, _I64),
        "file": (cols.file, _I32),
        "byte_offset": (cols.byte_offset, _I64),
        "byte_length": (cols.byte_length, _I64),
        "transform": (cols.transform, _I32),
    }
    for array, dtype in arrays.values():
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
            return False
    if not isinstance(cols.names, list) or not all(type(name) is str for name in cols.names):
        return False
    if len(set(cols.names)) != n:
        return False
    if cols.is_bytes.size != n or cols.prop.size != n:
        return False
    for at, total in ((cols.shape_at, cols.dims.size), (cols.chunk_at, None)):
        if at.size != n + 1 or at[0] != 0 or (n and bool(np.any(np.diff(at) < 0))):
            return False
        if total is not None and at[-1] != total:
            return False
    c = int(cols.chunk_at[-1])
    if cols.box_at.size != c + 1 or cols.box_at[0] != 0 or (c and bool(np.any(np.diff(cols.box_at) < 0))):
        return False
    if cols.box_at[-1] != cols.chunk_offsets.size or cols.chunk_sizes.size != cols.chunk_offsets.size:
        return False
    if any(a.size != c for a in (cols.file, cols.byte_offset, cols.byte_length, cols.transform)):
        return False
    per_entry = np.diff(cols.chunk_at)
    ndim = np.diff(cols.shape_at)
    bytes_ = cols.is_bytes
    if bool(np.any(bytes_ & ((per_entry != 1) | (ndim != 0)))):
        return False  # a value: one record, no dimensions
    if bool(np.any(~bytes_ & ((cols.prop < 0) | (cols.prop >= len(cols.properties))))):
        return False
    if not np.array_equal(np.diff(cols.box_at), np.repeat(ndim, per_entry)):
        return False  # each chunk has its tensor's number of dimensions
    if c and (int(cols.file.min()) < 0 or int(cols.file.max()) >= len(cols.files)):
        return False
    return not (c and (int(cols.transform.min()) < -1 or int(cols.transform.max()) >= len(cols.transforms)))


def _property_itemsizes(cols: MetadataColumns, is_tensor: np.ndarray) -> np.ndarray | None:
    """The element size of each property row, or ``None`` if a row a tensor uses is malformed."""
    used = np.zeros(len(cols.properties), dtype=bool)
    used[cols.prop[is_tensor]] = True
    sizes = np.zeros(len(cols.properties), dtype=_I64)
    for row in np.flatnonzero(used).tolist():
        props = cols.properties[row]
        if _incomplete(props):
            return None
        dtype = getattr(props, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            return None
        if any(not isinstance(getattr(props, name, None), kind) for name, kind in _PROPERTY_TYPES):
            return None
        sizes[row] = dtype.itemsize
    return sizes


def _files_sound(cols: MetadataColumns) -> bool:
    used = np.zeros(len(cols.files), dtype=bool)
    used[cols.file] = True
    for row in np.flatnonzero(used).tolist():
        try:
            check_relative(cols.files[row], "storage entry")
        except CorruptCheckpointError:
            return False
    return True


def _transforms_sound(cols: MetadataColumns) -> bool:
    return all(isinstance(t, (list, tuple)) and all(isinstance(d, str) for d in t) for t in cols.transforms)


def _segments(at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts of the non-empty segments ``[at[i], at[i+1])`` and their mask (for ``ufunc.reduceat``)."""
    nonempty = np.diff(at) > 0
    return at[:-1][nonempty], nonempty


def _seg_reduce(ufunc: np.ufunc, values: np.ndarray, at: np.ndarray, empty: Any) -> np.ndarray:
    """``ufunc`` over each segment of ``values`` (``empty`` for an empty one)."""
    starts, nonempty = _segments(at)
    out = np.full(at.size - 1, empty, dtype=values.dtype)
    if starts.size:
        out[nonempty] = ufunc.reduceat(values, starts)
    return out


def _bytes_fit(dims: np.ndarray, shape_at: np.ndarray, itemsize: np.ndarray) -> bool:
    """Whether ``prod(shape) * itemsize <= MAX_BYTES`` for every entry (dims already non-negative)."""
    approx = _seg_reduce(np.multiply, dims.astype(np.float64), shape_at, 1.0) * itemsize
    if bool(np.any(approx > _TWO63 * (1 + _NEAR))):
        return False
    near = np.flatnonzero(approx >= _TWO63 * (1 - _NEAR))
    for i in near.tolist():  # within a rounding error of the limit: exactly
        total = int(itemsize[i])
        for d in dims[shape_at[i] : shape_at[i + 1]].tolist():
            total *= d
        if total > MAX_BYTES:
            return False
    return True


def _volumes(sizes: np.ndarray, box_at: np.ndarray) -> np.ndarray:
    """Elements of each box, exact where its product fits int64 (a box with a 0 size counts 0 exactly)."""
    prod = _seg_reduce(np.multiply, np.maximum(sizes, 1), box_at, 1)
    has_zero = _seg_reduce(np.logical_or, sizes == 0, box_at, False)
    return np.where(has_zero, 0, prod)


def _total(values: np.ndarray) -> int:
    """The exact sum of non-negative int64 ``values`` (as halves: no wrapping)."""
    if not values.size:
        return 0
    high = int(np.sum(values >> 32, dtype=np.int64))
    low = int(np.sum(values & 0xFFFFFFFF, dtype=np.int64))
    return (high << 32) + low


def _tiled(
    cols: MetadataColumns,
    entry_of_chunk: np.ndarray,
    per_entry: np.ndarray,
    box_len: np.ndarray,
    shape_of_box: np.ndarray,
    is_tensor: np.ndarray,
) -> bool:
    """Whether every tensor's chunks tile it (:func:`~..tiling.tiling_problem` is ``None``), with no two
    chunks of one tensor at the same offsets. Chunks already lie inside their tensors."""
    off, size = cols.chunk_offsets, cols.chunk_sizes
    # No chunk: sound only for a tensor of no elements (a scalar has one).
    has_zero_dim = _seg_reduce(np.logical_or, cols.dims == 0, cols.shape_at, False)
    if bool(np.any(is_tensor & (per_entry == 0) & ~has_zero_dim)):
        return False
    # One chunk: its sizes are the shape.
    mismatch = _seg_reduce(np.logical_or, size != shape_of_box, cols.box_at, False)
    single = (per_entry == 1)[entry_of_chunk] & is_tensor[entry_of_chunk]
    if bool(np.any(single & mismatch)):
        return False
    multi_entries = np.flatnonzero(is_tensor & (per_entry > 1))
    if not multi_entries.size:
        return True
    # Several chunks: the common case is a run along one axis (the other dims whole, offsets 0), in order of
    # offset, each chunk starting where the previous ended, the last ending at the tensor's end.
    multi = (per_entry > 1)[entry_of_chunk] & is_tensor[entry_of_chunk]
    chunks = np.flatnonzero(multi)
    local = np.arange(off.size, dtype=_I64) - np.repeat(cols.box_at[:-1], box_len)  # each box value's dim
    partial = ~((off == 0) & (size == shape_of_box))
    big = np.int64(MAX_NDIM + 1)
    lo = _seg_reduce(np.minimum, np.where(partial, local, big), cols.box_at, big)[chunks]
    hi = _seg_reduce(np.maximum, np.where(partial, local, -1), cols.box_at, np.int64(-1))[chunks]
    ent = entry_of_chunk[chunks]
    # per tensor: the one axis its chunks are partial along (-1: none or several)
    ent_at = np.concatenate(([0], np.cumsum(per_entry[multi_entries])))
    t_lo = _seg_reduce(np.minimum, lo, ent_at, big)
    t_hi = _seg_reduce(np.maximum, hi, ent_at, np.int64(-1))
    axis_of = np.full(len(cols.names), -1, dtype=_I64)
    axis_of[multi_entries] = np.where(t_lo == t_hi, t_hi, -1)
    axis = axis_of[ent]
    ok_entry = np.zeros(len(cols.names), dtype=bool)
    ok_entry[multi_entries] = True
    ok_entry[ent[axis < 0]] = False
    pick = cols.box_at[:-1][chunks] + np.maximum(axis, 0)
    start, stop = off[pick], off[pick] + size[pick]
    limit = cols.dims[cols.shape_at[:-1][ent] + np.maximum(axis, 0)]
    order = np.lexsort((start, ent))
    ent, start, stop, limit = ent[order], start[order], stop[order], limit[order]
    first = np.ones(ent.size, dtype=bool)
    first[1:] = ent[1:] != ent[:-1]
    last = np.ones(ent.size, dtype=bool)
    last[:-1] = first[1:]
    bad = first & (start != 0)
    bad |= last & (stop != limit)
    follows = ~first
    bad[1:] |= follows[1:] & ((start[1:] != stop[:-1]) | (start[1:] <= start[:-1]))
    ok_entry[ent[bad]] = False
    for i in multi_entries[~ok_entry[multi_entries]].tolist():
        if not _tiles_exactly(cols, i):
            return False
    return True


def _tiles_exactly(cols: MetadataColumns, i: int) -> bool:
    """The general case of one tensor, as :mod:`.metadata_checks` decides it (plus distinct offsets)."""
    shape = cols.dims[cols.shape_at[i] : cols.shape_at[i + 1]].tolist()
    boxes = []
    for c in range(int(cols.chunk_at[i]), int(cols.chunk_at[i + 1])):
        lo, hi = cols.box_at[c], cols.box_at[c + 1]
        boxes.append((cols.chunk_offsets[lo:hi].tolist(), cols.chunk_sizes[lo:hi].tolist()))
    if len({tuple(o) for o, _s in boxes}) != len(boxes):
        return False
    return tiling_problem(shape, boxes) is None


def _overlapping(cols: MetadataColumns) -> bool:
    """Whether two records of non-zero length share bytes of one file."""
    keep = np.flatnonzero(cols.byte_length > 0)
    if keep.size < 2:
        return False
    file, start = cols.file[keep], cols.byte_offset[keep]
    stop = start + cols.byte_length[keep]
    order = np.lexsort((start, file))
    file, start, stop = file[order], start[order], stop[order]
    return bool(np.any((file[1:] == file[:-1]) & (start[1:] < stop[:-1])))
