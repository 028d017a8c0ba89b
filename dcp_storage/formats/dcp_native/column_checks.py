"""Checking a DCP checkpoint's columns and records: zip CRC-32s for ``verify --deep`` and the column-level checks.

``verify --deep`` of a DCP checkpoint without usable checksums: the zip CRC-32 of every record.

Each tensor record of a ``.distcp`` file is a ``torch.save`` zip, whose central directory records the CRC-32
of every entry. A checkpoint that torch's writer saved (no manifest), or whose manifest is stale, is still
checked bit for bit where it stores tensors: each record's zip index is read through a window onto its
byte range (:class:`_Window`), and every stored entry is hashed in pieces of bounded size, so memory stays
bounded whatever the record size. Records that are not zips (``BYTE_IO`` items, records written through
a stream extension) carry no CRC and are counted apart.

:mod:`.metadata_checks` on :class:`~.columns.MetadataColumns`: the same verdict, on arrays.

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

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import StorageMeta

from dcp_storage.errors import CorruptCheckpointError, DcpStorageError
from dcp_storage.formats.columns import MetadataColumns
from dcp_storage.formats.dcp_native.metadata_checks import _PROPERTY_TYPES, _incomplete
from dcp_storage.formats.paths import BROADCAST_BYTES, MAX_BYTES, MAX_NDIM, all_plain, check_relative
from dcp_storage.formats.reading import tiling_problem
from dcp_storage.formats.torch_save.zip_index import STORED, data_starts, read_zip_index
from dcp_storage.integrity.blocks import key_name
from dcp_storage.integrity.checksums import crc32
from dcp_storage.runtime import distinct_ints
from dcp_storage.transports import RangeRequest

__all__ = ["check_record_crcs", "columns_sound"]


_PIECE = 8 * 1024 * 1024
_ZIP = b"PK\x03\x04"


class _Window:
    """The byte range ``[offset, offset + length)`` of one file, as the transport of a file of its own."""

    def __init__(self, transport: Any, path: str, offset: int, length: int) -> None:
        self._t, self._path, self._offset, self._length = transport, path, offset, length

    def url(self, _path: str) -> str:
        return f"{self._t.url(self._path)} [{self._offset}, {self._offset + self._length})"

    def size(self, _path: str) -> int:
        return self._length

    def read_range(self, _path: str, lo: int, hi: int) -> Any:
        return self._t.read_range(self._path, self._offset + lo, self._offset + min(hi, self._length))

    def read_ranges(self, reqs: list[RangeRequest]) -> list[Any]:
        return [self.read_range(r.path, r.start, r.end) for r in reqs]


def check_record_crcs(
    transport: Any, root: str, storage: dict[Any, Any], problems: list[str], seen: Callable[[str, int, int], bool]
) -> tuple[int, int]:
    """Check the CRC-32 of every zip entry of every record; ``(records checked, records without a CRC)``.

    A problem names the file, the record's byte range, the keys it holds and the entry; ``seen(url, lo,
    hi)`` tells a record already reported (the deep read of its tensor failed) from a new one.
    """
    keys: dict[tuple[str, int, int, tuple[str, ...]], list[str]] = {}
    for index, info in storage.items():
        transforms = tuple(getattr(info, "transform_descriptors", None) or ())
        keys.setdefault((info.relative_path, int(info.offset), int(info.length), transforms), []).append(
            key_name(index)
        )
    checked = skipped = 0
    for (name, offset, length, transforms), held in sorted(keys.items()):
        path = transport.join(root, name)
        url = transport.url(path)
        if transforms or length < 4 or bytes(transport.read_range(path, offset, offset + 4)) != _ZIP:
            skipped += 1
            continue
        window = _Window(transport, path, offset, length)
        try:
            index = read_zip_index(window, name)  # type: ignore[arg-type]
            entries = [n for n, e in index.entries.items() if e.method == STORED]
            starts = data_starts(window, index, entries)  # type: ignore[arg-type]
        except DcpStorageError as exc:
            if not seen(url, offset, offset + length):
                problems.append(f"{exc} (holding {', '.join(held[:5])})")
            continue
        checked += 1
        for entry_name in entries:
            entry, start, value = index.entries[entry_name], starts[entry_name], 0
            for lo in range(start, start + entry.compressed_size, _PIECE):
                value = crc32(window.read_range(name, lo, min(lo + _PIECE, start + entry.compressed_size)), value)
            if value != entry.crc32 and not seen(url, offset, offset + length):
                problems.append(
                    f"{url} [{offset}, {offset + length}) (holding {', '.join(held[:5])}): zip entry {entry_name!r} "
                    f"fails its CRC-32 (recorded {entry.crc32:08x}): the bytes changed after they were written; "
                    "restore the file from a good copy or re-save the checkpoint"
                )
    return checked, skipped


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

    # Records: byte ranges possible.
    b_off, b_len = cols.byte_offset, cols.byte_length
    if b_off.size and (int(b_off.min()) < 0 or int(b_len.min()) < 0 or bool(np.any(b_off > MAX_BYTES - b_len))):
        return False

    # Chunks: inside their tensor and tiling it; their element counts.
    per_entry = np.diff(cols.chunk_at)
    if n and int(per_entry.min()) == 1 and int(per_entry.max()) == 1:
        entry_of_chunk = np.arange(n, dtype=_I64)
    else:
        entry_of_chunk = np.repeat(np.arange(n, dtype=_I64), per_entry)
    vol = _chunk_volumes(cols, entry_of_chunk, per_entry, is_tensor)
    if vol is None:
        return False

    # Chunk byte counts: exact in int64 now that every chunk lies inside a tensor whose bytes fit.
    chunk_is_tensor = is_tensor[entry_of_chunk]
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
    if not isinstance(cols.names, list) or (n and set(map(type, cols.names)) != {str}):
        return False
    if len(set(cols.names)) != n:  # distinct keys (a dict's)
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
    rows = np.flatnonzero(used).tolist()
    if all_plain([cols.files[row] for row in rows]):  # a file per tensor: a million names in one C pass
        return True
    for row in rows:
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
    approx[_seg_reduce(np.logical_or, dims == 0, shape_at, False)] = 0.0  # not inf * 0 (nan)
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


def _total(values: np.ndarray) -> int:
    """The exact sum of non-negative int64 ``values`` (as halves: no wrapping)."""
    if not values.size:
        return 0
    high = int(np.sum(values >> 32, dtype=np.int64))
    low = int(np.sum(values & 0xFFFFFFFF, dtype=np.int64))
    return (high << 32) + low


def _chunk_volumes(
    cols: MetadataColumns, entry_of_chunk: np.ndarray, per_entry: np.ndarray, is_tensor: np.ndarray
) -> np.ndarray | None:
    """Each chunk's element count, or ``None`` if a chunk lies outside its tensor or a tensor's chunks do not
    tile it (:func:`~..tiling.tiling_problem` is not ``None``, or two chunks share their offsets).

    Chunks are taken by their number of dimensions (a few distinct values), as ``(chunks, dims)`` arrays.
    A tensor of one chunk tiles it if its sizes are the shape. One of several chunks: the common case is a
    run along one axis (the other dimensions whole, at offset 0), each chunk starting where the one before it
    ended and the last ending at the tensor's end; any other set of chunks goes to ``tiling_problem``.
    """
    off, size, box_at = cols.chunk_offsets, cols.chunk_sizes, cols.box_at
    vol = np.ones(entry_of_chunk.size, dtype=_I64)
    has_zero_dim = _seg_reduce(np.logical_or, cols.dims == 0, cols.shape_at, False)
    if bool(np.any(is_tensor & (per_entry == 0) & ~has_zero_dim)):
        return None  # no chunk: sound only for a tensor of no elements (a scalar has one)
    box_len = np.diff(box_at)
    general = np.flatnonzero(is_tensor & (per_entry > 1) & (np.diff(cols.shape_at) == 0)).tolist()  # scalars
    for d in distinct_ints(box_len):
        if d == 0:
            continue
        ch = np.flatnonzero(box_len == d)  # tensor chunks only (a value has no dimensions)
        ent = entry_of_chunk[ch]
        at = np.arange(d, dtype=_I64)
        cells = box_at[ch][:, None] + at
        o, n = off[cells], size[cells]
        shape = cols.dims[cols.shape_at[ent][:, None] + at]
        del cells
        if int(o.min()) < 0 or int(n.min()) < 0 or bool(np.any(n > shape - o)):
            return None  # (shape - o may be negative; neither side overflows with both non-negative)
        vol[ch] = np.where(np.any(n == 0, axis=1), 0, np.prod(np.maximum(n, 1), axis=1))
        whole = n == shape
        single = per_entry[ent] == 1
        if bool(np.any(single & ~np.all(whole, axis=1))):
            return None
        several = ~single
        if bool(np.any(several)):
            general += _runs_not_proven(ent[several], o[several], n[several], shape[several], whole[several])
    for i in general:
        if not _tiles_exactly(cols, i):
            return None
    return vol


def _runs_not_proven(ent: np.ndarray, o: np.ndarray, n: np.ndarray, shape: np.ndarray, whole: np.ndarray) -> list[int]:
    """Tensors (of ``ent``: the chunks of tensors with several, in order) whose chunks are not shown to tile
    them as one run along one axis."""
    first = np.ones(ent.size, dtype=bool)
    first[1:] = ent[1:] != ent[:-1]
    starts = np.flatnonzero(first)
    tensor = np.cumsum(first) - 1  # each chunk's tensor, 0..T-1
    partial = np.logical_or.reduceat(~((o == 0) & whole), starts, axis=0)  # (T, dims): where chunks differ
    ok = np.count_nonzero(partial, axis=1) == 1
    axis = np.argmax(partial, axis=1)[tensor]
    rows = np.arange(ent.size)
    start, stop, end = o[rows, axis], o[rows, axis] + n[rows, axis], shape[rows, axis]
    order = np.lexsort((start, tensor))
    tensor, start, stop, end = tensor[order], start[order], stop[order], end[order]
    head = np.ones(ent.size, dtype=bool)
    head[1:] = tensor[1:] != tensor[:-1]
    tail = np.ones(ent.size, dtype=bool)
    tail[:-1] = head[1:]
    bad = (head & (start != 0)) | (tail & (stop != end))
    bad[1:] |= ~head[1:] & ((start[1:] != stop[:-1]) | (start[1:] <= start[:-1]))
    ok[tensor[bad]] = False
    return ent[starts][~ok].tolist()


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
