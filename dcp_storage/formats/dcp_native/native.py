"""Reading a ``.metadata``: the native C decoder, the allow-list fallback, and lazy views of the result.

Native decoding of a DCP ``.metadata`` pickle into :class:`~dcp_storage.formats.columns.MetadataColumns`.

:func:`decode_columns` runs the C decoder (``_metadata_decode.c``) on the raw bytes: it understands only the
regular, canonical pickles torch's ``pickle.dump(Metadata)`` writes and never imports or calls anything named
in the file (globals are matched against :func:`.metadata_io.metadata_allow_list`'s torch and DCP entries).
It returns ``None`` when the extension is not built or the bytes are anything else; the caller then takes the
general path (the guarded unpickler and :mod:`.metadata_checks`), which names every problem. Whenever it
returns columns they equal ``columns_from_metadata(pickle.loads(data))``.

torch's ``Metadata`` over :class:`~dcp_storage.formats.columns.MetadataColumns`: entries built when asked for, not kept.

torch's load protocol hands a ``Metadata`` to the planner and the reader; its ``state_dict_metadata`` and
``storage_data`` are plain dicts of dataclass instances, about 2 KB a tensor. :func:`lazy_metadata`
returns a real ``Metadata`` whose two maps are read-only views of the columns: looking up a key builds that
entry's ``TensorStorageMetadata`` (or ``_StorageInfo``) then and there, and nothing keeps it. Code that
walks every entry (torch's ``DefaultLoadPlanner``) still works, at the old cost per entry but without the
old memory; this library's planners and tools ask :func:`columns_of` for the columns and work on arrays.

The views are ``Mapping``\\ s, not ``dict`` subclasses: C code that reads a dict's slots directly would see
an empty dict, while a ``Mapping`` either goes through these methods or fails loudly. They pickle as their
columns (a rank shares the decoded metadata with the others as a few arrays).

Reading and writing DCP's ``.metadata`` file without trusting it.

torch writes ``.metadata`` with ``pickle.dump`` and reads it with ``pickle.load``. We write the same bytes
(so torch's reader loads our checkpoints) but read them with an allow-list: the DCP metadata classes,
``torch.Size``, dtypes, layouts, memory formats, enums (also pickled as ``getattr(enum, name)``) and plain
containers, and what the user registered with ``torch.serialization.add_safe_globals`` /
``safe_globals`` (:mod:`..safe_globals`). Anything else raises
:class:`~dcp_storage.errors.UnsafeCheckpointError` naming the file and the global.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage._torch import MemoryFormatEncoding, StorageInfo
from dcp_storage.formats.columns import (
    ColumnView,
    MetadataColumns,
    columns_from_metadata,
    metadata_from_columns,
)
from dcp_storage.formats.dcp_native.column_checks import columns_sound
from dcp_storage.formats.dcp_native.metadata_checks import check_metadata
from dcp_storage.formats.dcp_native.torch_record import metadata_allow_list
from dcp_storage.formats.paths import METADATA, METADATA_FILE, count_setting, read_limited
from dcp_storage.runtime import gc_paused
from dcp_storage.safe_unpickle import safe_loads, with_registered_globals

__all__ = [
    "DCP_VERSION",
    "LAZY_MIN_ENTRIES",
    "METADATA_FILE",
    "StateDictView",
    "StorageDataView",
    "available",
    "decode_columns",
    "dump_metadata",
    "lazy_metadata",
    "load_metadata",
    "metadata_allow_list",
    "read_metadata_file",
]


try:
    from dcp_storage.formats.dcp_native._metadata_decode import decode as _native_decode
except ImportError:  # built without a compiler: the general path does everything
    _native_decode = None


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
_SIZE, _GET_LAYOUT, _MEMFMT, _DTYPE, _LAYOUT, _PATH, _GETATTR = 8, 9, 10, 11, 12, 13, 14

_tables: tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]] | None = None


def available() -> bool:
    """Whether the C extension is built (it is wherever a compiler was present at install)."""
    return _native_decode is not None


def _memory_format_names() -> tuple[str, ...]:
    """``_MEM_FORMAT_ENCODING``'s member names, each at the row of its value (what the decoder expects)."""
    by_value = {member.value: member.name for member in MemoryFormatEncoding}
    if sorted(by_value) != list(range(len(by_value))) or len(by_value) > 3:
        return ()  # a torch whose enum changed: getattr-pickled members go to the general path
    return tuple(by_value[value] for value in range(len(by_value)))


def _build_tables() -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
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
        elif module == dcp_fs.__name__ and name == "_StorageInfo" and obj is StorageInfo:
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
        elif name == "getattr" and module in ("builtins", "__builtin__"):
            kind = _GETATTR  # Python 3.11.0-3.11.4 pickle an enum member as getattr(enum, name)
        if kind is not None:  # everything else (OrderedDict, _reconstructor, ...): general path
            table.append((module, name, kind, obj, payload))
    return tuple(table), tuple(layouts), _memory_format_names()


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
        tp.__setstate__((dtype, layout, requires_grad, MemoryFormatEncoding(mem_format), pin_memory))
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


def _storage_info(cols: MetadataColumns, c: int) -> StorageInfo:
    t = int(cols.transform[c])
    return StorageInfo(
        cols.files[int(cols.file[c])],
        int(cols.byte_offset[c]),
        int(cols.byte_length[c]),
        None if t < 0 else list(cols.transforms[t]),
    )


class StateDictView(ColumnView, Mapping[str, Any]):
    """``Metadata.state_dict_metadata`` over columns (read-only; each lookup builds a fresh entry)."""

    serves = "state_dict_metadata"

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

    def row_table(self) -> dict[str, int]:
        return self._rows.table()

    def __reduce__(self) -> tuple[Any, ...]:
        return (StateDictView, (self.columns,))


class StorageDataView(ColumnView, Mapping[MetadataIndex, Any]):
    """``Metadata.storage_data`` over columns: one ``MetadataIndex`` per chunk (and per value), whose value
    ``value(columns, chunk)`` builds (a DCP ``_StorageInfo``; another format's own record, such as a
    safetensors ``StoredChunk``; a module-level function, so that the view pickles)."""

    serves = "storage_data"

    def __init__(
        self,
        cols: MetadataColumns,
        rows: _Rows | None = None,
        value: Callable[[MetadataColumns, int], Any] | None = None,
    ) -> None:
        self.columns = cols
        self._rows = rows if rows is not None else _Rows(cols)
        self._value = value or _storage_info

    def _chunk(self, index: object) -> int | None:
        if not isinstance(index, MetadataIndex):
            return None
        i = self._rows.row(index.fqn)
        return None if i is None else self._rows.chunk(i, index.offset)

    def __getitem__(self, index: MetadataIndex) -> Any:
        c = self._chunk(index)
        if c is None:
            raise KeyError(index)
        return self._value(self.columns, c)

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

    def row_table(self) -> dict[str, int]:
        return self._rows.table()

    def __reduce__(self) -> tuple[Any, ...]:
        return (StorageDataView, (self.columns, None, None if self._value is _storage_info else self._value))


def lazy_metadata(cols: MetadataColumns, value: Callable[[MetadataColumns, int], Any] | None = None) -> Metadata:
    """A torch ``Metadata`` whose maps are views of ``cols`` (see the module docstring); ``value`` builds a
    storage entry (:class:`StorageDataView`; DCP's ``_StorageInfo`` by default)."""
    rows = _Rows(cols)
    return Metadata(
        state_dict_metadata=StateDictView(cols, rows),  # type: ignore[arg-type]
        planner_data=cols.planner_data,
        storage_data=StorageDataView(cols, rows, value),
        storage_meta=cols.storage_meta,
        version=cols.version,
    )


DCP_VERSION = "1.0.0"  # the Metadata.version written: torch's FileSystemWriter's


_ALLOWED = metadata_allow_list()


# Entries from which a .metadata decoded as columns is served as views of them (lazy_metadata) rather than
# as torch's dicts of objects (about 2 KB a tensor); 0 serves every one as views (the test suite's switch).
LAZY_MIN_ENTRIES = 20_000
LAZY_MIN_ENTRIES_ENV = "DCP_STORAGE_LAZY_METADATA_ENTRIES"
# Which decoder gives columns: "native" (the C decoder, when built), "python" (the guarded unpickler, then
# columns_from_metadata: slower; for tests and machines without the native module), "off" (never columns).
DECODER_ENV = "DCP_STORAGE_METADATA_DECODER"
_DECODERS = ("native", "python", "off")


def lazy_min_entries() -> int:
    """:data:`LAZY_MIN_ENTRIES`, or the value of ``DCP_STORAGE_LAZY_METADATA_ENTRIES`` (read at each use)."""
    return count_setting(LAZY_MIN_ENTRIES_ENV, LAZY_MIN_ENTRIES, "entries")


def _decoder() -> str:
    raw = os.environ.get(DECODER_ENV, "").strip() or "native"
    if raw not in _DECODERS:
        raise ValueError(f"{DECODER_ENV}={raw!r} must be one of {', '.join(_DECODERS)}")
    return raw


def _served(cols: MetadataColumns) -> Metadata:
    return lazy_metadata(cols) if len(cols) >= lazy_min_entries() else metadata_from_columns(cols)


def load_metadata(data: bytes | bytearray | memoryview, path: str) -> Metadata:
    """Decode ``.metadata`` bytes read from ``path``; never runs code from them.

    The decoded object is checked too (:mod:`.metadata_checks`: dtypes, shapes, byte counts, chunk bounds,
    storage entries that stay inside the checkpoint), so every problem is reported here, naming ``path``.

    Fast path: the native decoder reads a canonical pickle straight into columns (:mod:`.columns`), checked
    on arrays (:mod:`.column_checks`); a sound one is served as views of its columns from
    ``DCP_STORAGE_LAZY_METADATA_ENTRIES`` entries (20,000), as a plain ``Metadata`` below. Anything else (no
    native module, a pickle outside its subset, columns the checks refuse) takes the general path, which
    names each problem.
    """
    decoder = _decoder()
    with gc_paused():  # millions of small acyclic objects at a million tensors (see gc_pause)
        if decoder == "native":
            cols = decode_columns(data)
            if cols is not None and columns_sound(cols, path):
                return _served(cols)
        metadata = safe_loads(data, path, with_registered_globals(_ALLOWED), expected=Metadata)
        if decoder == "python":
            cols = columns_from_metadata(metadata)
            if cols is not None and columns_sound(cols, path):
                return _served(cols)
        return check_metadata(metadata, path)


def read_metadata_file(transport: Any, path: str) -> Metadata:
    """Read (at most :data:`~dcp_storage.formats.paths.METADATA` bytes) and decode the ``.metadata`` at ``path``."""
    return load_metadata(read_limited(transport, path, METADATA), transport.url(path))


def dump_metadata(metadata: Metadata) -> bytes:
    """Encode ``metadata`` exactly as torch's ``FileSystemWriter`` does (``pickle.dump``)."""
    return pickle.dumps(metadata)
