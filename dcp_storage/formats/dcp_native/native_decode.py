"""Native decoding of a DCP ``.metadata`` pickle into :class:`~.columns.MetadataColumns`.

:func:`decode_columns` runs the C decoder (``_metadata_decode.c``) on the raw bytes: it understands only the
regular, canonical pickles torch's ``pickle.dump(Metadata)`` writes and never imports or calls anything named
in the file (globals are matched against :func:`.metadata_io.metadata_allow_list`'s torch and DCP entries).
It returns ``None`` when the extension is not built or the bytes are anything else; the caller then takes the
general path (the guarded unpickler and :mod:`.metadata_checks`), which names every problem. Whenever it
returns columns they equal ``columns_from_metadata(pickle.loads(data))``.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, StorageMeta, TensorProperties

from dcp_storage.formats.dcp_native.allow_list import metadata_allow_list
from dcp_storage.formats.dcp_native.columns import MetadataColumns

try:
    from dcp_storage.formats.dcp_native._metadata_decode import decode as _native_decode
except ImportError:  # built without a compiler: the general path does everything
    _native_decode = None

__all__ = ["available", "decode_columns"]

# Kinds of the global table (the G_* enum of _metadata_decode.c).
_CLASS_KINDS = {
    "Metadata": 0,
    "TensorStorageMetadata": 1,
    "BytesStorageMetadata": 2,
    "ChunkStorageMetadata": 3,
    "TensorProperties": 4,
    "MetadataIndex": 5,
    "StorageMeta": 7,
}
_SIZE, _GET_LAYOUT, _MEMFMT, _DTYPE, _LAYOUT, _PATH = 8, 9, 10, 11, 12, 13

_tables: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None


def available() -> bool:
    """Whether the C extension is built (it is wherever a compiler was present at install)."""
    return _native_decode is not None


def _build_tables() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    layouts: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) not in seen:
            seen.add(str(value))
            layouts.append((str(value), value))
    layout_row = {name: i for i, (name, _) in enumerate(layouts)}
    table: list[tuple[str, str, int, Any, int]] = []
    for (module, name), obj in metadata_allow_list().items():
        kind = None
        payload = 0
        if module == dcp_md.__name__ and name in _CLASS_KINDS and obj is getattr(dcp_md, name):
            kind = _CLASS_KINDS[name]
        elif module == dcp_md.__name__ and name == "_MEM_FORMAT_ENCODING":
            kind = _MEMFMT
        elif module == dcp_fs.__name__ and name == "_StorageInfo" and obj is dcp_fs._StorageInfo:
            kind = 6
        elif (module, name) == ("torch", "Size"):
            kind = _SIZE
        elif (module, name) == ("torch.serialization", "_get_layout"):
            kind = _GET_LAYOUT
        elif module == "torch" and isinstance(obj, torch.dtype):
            kind = _DTYPE
        elif module == "torch" and isinstance(obj, torch.layout) and str(obj) in layout_row:
            kind, payload = _LAYOUT, layout_row[str(obj)]
        elif module == "pathlib" and isinstance(obj, type) and issubclass(obj, pathlib.PurePath):
            kind = _PATH
        if kind is not None:  # everything else (OrderedDict, getattr, _reconstructor, ...): general path
            table.append((module, name, kind, obj, payload))
    return tuple(table), tuple(layouts)


def decode_columns(data: bytes | bytearray | memoryview) -> MetadataColumns | None:
    """The columns of a regular ``.metadata`` pickle, or ``None`` (extension missing, or not regular)."""
    global _tables
    if _native_decode is None:
        return None
    if _tables is None:
        _tables = _build_tables()
    if isinstance(data, memoryview) and not data.c_contiguous:
        data = data.tobytes()
    raw = _native_decode(data, *_tables)
    if raw is None:
        return None
    return _columns(raw)


def _columns(raw: tuple[Any, ...]) -> MetadataColumns:
    (names, is_bytes, prop, props, shape_at, dims, chunk_at, chunk_offsets, chunk_sizes, box_at, file, byte_offset,
     byte_length, transform, files, transforms, planner_data, storage_meta, version) = raw  # fmt: skip
    properties = []
    for dtype, layout, requires_grad, mem_format, pin_memory in props:
        tp = TensorProperties.__new__(TensorProperties)  # as pickle makes it: __new__, then __setstate__
        tp.__setstate__((dtype, layout, requires_grad, _MEM_FORMAT_ENCODING(mem_format), pin_memory))
        properties.append(tp)
    if storage_meta is not None:
        state = storage_meta
        storage_meta = StorageMeta.__new__(StorageMeta)
        storage_meta.__dict__.update(state)

    def arr(b: bytes, dtype: Any) -> np.ndarray:
        return np.frombuffer(b, dtype=dtype)

    return MetadataColumns(
        names=names,
        is_bytes=arr(is_bytes, np.bool_),
        prop=arr(prop, np.int32),
        properties=properties,
        shape_at=arr(shape_at, np.int64),
        dims=arr(dims, np.int64),
        chunk_at=arr(chunk_at, np.int64),
        chunk_offsets=arr(chunk_offsets, np.int64),
        chunk_sizes=arr(chunk_sizes, np.int64),
        box_at=arr(box_at, np.int64),
        file=arr(file, np.int32),
        byte_offset=arr(byte_offset, np.int64),
        byte_length=arr(byte_length, np.int64),
        transform=arr(transform, np.int32),
        files=files,
        transforms=transforms,
        planner_data=planner_data,
        storage_meta=storage_meta,
        version=version,
    )
