"""A safetensors checkpoint as DCP ``Metadata``: finding its blobs (one file, a directory, an HF index, torch's
layouts).

Finding the safetensors blobs of a checkpoint: one file, a directory, an HF index, torch's DCP layouts.

What a URL can point at, and how each is recognised (no guessing beyond this list):

* ``.../x.safetensors``: that one file.
* ``.../model.safetensors.index.json`` (any ``*.json``): a Hugging Face index; its ``weight_map`` names
  the shard files, relative to the index's directory.
* a directory holding ``.metadata``: torch's ``FileSystemWriter(serialization_format=SAFETENSORS)``. The
  ``.distcp`` files are safetensors blobs (after any non-tensor items) and the pickled ``.metadata``,
  read with an allow-list unpickler, says where each one starts.
* a directory holding ``model.safetensors.index.json``: that index.
* any other directory: every ``*.safetensors`` file directly in it. This covers a single HF file and
  torch's ``HuggingFaceStorageWriter``, whose ``save_distributed`` files (``shard-XXXXX-model-...``) carry
  each chunk's position in ``__metadata__``.

Paths are kept relative to the checkpoint root (as DCP's own storage map does) and resolved with
:func:`resolve`. Index entries that would leave the root (``..``, absolute paths, URLs) are refused.

DCP ``Metadata`` from parsed safetensors headers, plus the storage map that locates every chunk.

Pure functions over what :mod:`.scan` fetched. The storage map (``Metadata.storage_data``) maps each
``MetadataIndex(fqn, chunk offsets)`` to a :class:`StoredChunk` (where the chunk's elements lie: relative
file, absolute byte offset, dtype, shape) or, for non-tensor items of a DCP ``.metadata`` checkpoint, a
:class:`StoredBytes`. Both are small frozen dataclasses: they pickle, so the coordinator can broadcast the
whole ``Metadata`` to its peers.

A tensor stored in pieces across files (torch's ``save_distributed`` layout: each piece's position in
``__metadata__``) becomes one ``TensorStorageMetadata`` with one ``ChunkStorageMetadata`` per piece. The
pieces must tile the full tensor exactly: a missing piece (a shard file that is gone) or two pieces that
overlap is an error here rather than silently unloaded elements later.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import posixpath
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_storage.formats.columns import MetadataColumns, columns_of
from dcp_storage.formats.dcp_native.native import METADATA_FILE, lazy_metadata, lazy_min_entries, read_metadata_file
from dcp_storage.formats.location import raise_if_incomplete
from dcp_storage.formats.paths import INDEX, INDEX_FILE, check_relative, read_limited
from dcp_storage.formats.paths import SAFETENSORS_SUFFIX as SUFFIX
from dcp_storage.formats.reading import StoredTensor
from dcp_storage.formats.safetensors.header import (
    LENGTH_BYTES,
    MAX_HEADER_BYTES,
    SAFETENSORS_TO_TORCH,
    SHARDING_INFO_KEY,
    HeaderColumns,
    SafetensorsHeader,
    TensorEntry,
    saved_offsets,
)
from dcp_storage.runtime import distinct_ints
from dcp_storage.transports import Transport

__all__ = [
    "Blob",
    "INDEX_FILE",
    "Layout",
    "MAX_OVERLAP_CHECK_CHUNKS",
    "SUFFIX",
    "StoredBytes",
    "StoredChunk",
    "build_metadata",
    "check_relative",
    "discover",
    "looks_like_safetensors",
    "parse_index",
    "resolve",
]


def looks_like_safetensors(head: bytes | bytearray | memoryview, size: int) -> bool:
    """Whether a file of ``size`` bytes starting with ``head`` (at least 9 bytes) looks like safetensors.

    The 8-byte little-endian header length must fit the file and the 100 MiB cap, and the header must
    start with ``{``. Cheap enough for format auto-detection; says nothing about the rest of the header.
    """
    if len(head) < LENGTH_BYTES + 1 or size < LENGTH_BYTES + 2:
        return False
    (length,) = struct.unpack("<Q", bytes(head[:LENGTH_BYTES]))
    return (
        2 <= length <= min(size - LENGTH_BYTES, MAX_HEADER_BYTES)
        and bytes(head[LENGTH_BYTES : LENGTH_BYTES + 1]) == b"{"
    )


@dataclass
class Layout:
    """A discovered checkpoint.

    ``root``: the directory (transport path) that ``files`` and the index entries are relative to.
    ``kind``: ``"file"``, ``"directory"``, ``"index"`` or ``"dcp"``. ``index``: the index's transport path
    and ``weight_map`` (tensor name -> relative file) for ``"index"``. ``dcp_metadata``: the decoded
    ``.metadata`` for ``"dcp"``. ``source_url``: what to name in errors about the layout as a whole (the
    index, the ``.metadata`` file, or the root).
    """

    kind: str
    root: str
    files: list[str]
    source_url: str = ""
    index_path: str | None = None
    weight_map: dict[str, str] = field(default_factory=dict)
    dcp_metadata: Metadata | None = None


def resolve(transport: Transport, root: str, relative: str) -> str:
    """The transport path of ``relative`` under ``root``."""
    if transport.is_local:
        return transport.join(root, relative) if root else relative
    if root in ("", "/"):
        return root + relative
    return transport.join(root, relative)


def _parent(transport: Transport, path: str) -> tuple[str, str]:
    if transport.is_local:
        return os.path.dirname(path), os.path.basename(path)
    stripped = path.rstrip("/")
    head, tail = posixpath.split(stripped)
    if not head and stripped.startswith("/"):
        head = "/"
    return head, tail


def parse_index(data: bytes, index_url: str) -> dict[str, str]:
    """The ``weight_map`` of an HF index (tensor name -> relative file name), validated."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{index_url}: index is not valid JSON ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{index_url}: index has no 'weight_map' object")
    for tensor, name in weight_map.items():
        check_relative(name, f"{index_url}: weight_map entry {tensor!r}")
    return dict(weight_map)


def discover(transport: Transport, path: str) -> Layout:
    """Work out what ``path`` (a transport path) holds; raises :class:`CheckpointNotFoundError` if nothing."""
    url = transport.url(path)
    if path.endswith(".json"):
        return _index_layout(transport, path)
    if path.endswith(SUFFIX):
        return _single_file(transport, path)
    names = transport.listdir(path)
    raise_if_incomplete(transport, path, names)  # shards without their index: IncompleteCheckpointError
    if not names:
        empty_dir = transport.is_local and os.path.isdir(path)  # what a save killed before its first file leaves
        if transport.exists(path) and not empty_dir:
            return _single_file(transport, path)
        raise CheckpointNotFoundError(f"{url}: {'an empty directory' if empty_dir else 'no such file or directory'}")
    if METADATA_FILE in names:
        return _dcp_layout(transport, path)
    if INDEX_FILE in names:
        return _index_layout(transport, transport.join(path, INDEX_FILE))
    files = sorted(n for n in names if n.endswith(SUFFIX))
    if not files:
        raise CheckpointNotFoundError(
            f"{url}: no *{SUFFIX} files, no {INDEX_FILE} and no {METADATA_FILE} in this directory"
        )
    return Layout("directory", path, files, url)


def _single_file(transport: Transport, path: str) -> Layout:
    root, name = _parent(transport, path)
    return Layout("file", root, [name], transport.url(path))


def _index_layout(transport: Transport, index_path: str) -> Layout:
    url = transport.url(index_path)
    try:
        data = read_limited(transport, index_path, INDEX)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(f"{url}: no such index file") from exc
    weight_map = parse_index(data, url)
    root, _ = _parent(transport, index_path)
    files = sorted(set(weight_map.values()))
    if not files:
        raise CorruptCheckpointError(f"{url}: index's weight_map is empty")
    return Layout("index", root, files, url, index_path=index_path, weight_map=weight_map)


def _dcp_layout(transport: Transport, root: str) -> Layout:
    path = transport.join(root, METADATA_FILE)
    metadata = read_metadata_file(transport, path)
    if metadata.storage_data is None or not isinstance(metadata.storage_data, Mapping):
        raise CorruptCheckpointError(f"{transport.url(path)}: metadata carries no storage map")
    cols = columns_of(metadata)
    if cols is not None:  # views of checked columns: their files, without building every entry
        return Layout(
            "dcp",
            root,
            sorted({cols.files[i] for i in distinct_ints(cols.file)}),
            transport.url(path),
            dcp_metadata=metadata,
        )
    files: set[str] = set()
    for index, info in metadata.storage_data.items():
        rel = getattr(info, "relative_path", None)
        files.add(check_relative(rel, f"{transport.url(path)}: storage entry for {index.fqn!r}"))
    return Layout("dcp", root, sorted(files), transport.url(path), dcp_metadata=metadata)


# Pairwise overlap checks cost O(chunks^2) per tensor; past this many chunks only coverage is checked.
MAX_OVERLAP_CHECK_CHUNKS = 1024


@dataclass(frozen=True)
class Blob:
    """A safetensors blob: file ``file`` (relative to the root) from byte ``base`` on (0 for a whole file)."""

    file: str
    base: int = 0


@dataclass(frozen=True)
class StoredChunk:
    """One stored chunk: ``tensor``'s elements in ``file``, row-major, from byte ``data_offset`` on."""

    file: str
    data_offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    tensor: str

    def stored(self, path: str, url: str) -> StoredTensor:
        return StoredTensor.contiguous(
            path, self.data_offset, self.dtype, self.shape, f"{url} (tensor {self.tensor!r})"
        )


@dataclass(frozen=True)
class StoredBytes:
    """A non-tensor item: bytes ``[offset, offset + length)`` of ``file`` (DCP ``.metadata`` layouts)."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


def build_metadata(
    layout: Layout, headers: Mapping[Blob, SafetensorsHeader | HeaderColumns], urls: Mapping[str, str]
) -> Metadata:
    """The DCP ``Metadata`` of ``layout`` given every blob's header; ``urls``: relative file -> URL.

    Headers scanned as columns (:func:`~.header.scan_columns`) are served as views of one set of columns
    (:func:`_from_header_columns`) when the layout allows; otherwise each becomes a plain header again."""
    if layout.kind != "dcp" and headers and all(isinstance(h, HeaderColumns) for h in headers.values()):
        md = _from_header_columns(layout, headers)  # type: ignore[arg-type]
        if md is not None:
            return md
    plain = {b: h.header() if isinstance(h, HeaderColumns) else h for b, h in headers.items()}
    if layout.kind == "dcp":
        return _from_dcp_metadata(layout, plain, urls)
    return _from_headers(layout, plain, urls)


def _from_header_columns(layout: Layout, headers: Mapping[Blob, HeaderColumns]) -> Metadata | None:
    """The metadata of whole tensors, each in one file, as views of columns (a million tensors: about 100
    bytes each instead of torch's ~2 KB of objects), or ``None`` where :func:`_from_headers` must decide
    (fewer tensors than :func:`~.dcp_native.native.lazy_min_entries`, torch's pieces of a tensor, a name in
    two files, an index that disagrees with the files: the general path assembles or names them)."""
    blobs = sorted(headers, key=lambda b: (b.file, b.base))
    parts = [headers[b] for b in blobs]
    if sum(len(h.names) for h in parts) < lazy_min_entries() or any(b.base for b in blobs):
        return None
    if any(SHARDING_INFO_KEY in (h.metadata or {}) for h in parts):
        return None
    names = parts[0].names if len(parts) == 1 else [n for h in parts for n in h.names]
    if len(parts) > 1 and len(set(names)) != len(names):  # each header's own names are distinct (scan_columns)
        return None
    weight_map = layout.weight_map
    if weight_map:
        file_of = {n: b.file for b, h in zip(blobs, parts) for n in h.names}
        if len(file_of) != len(weight_map) or any(file_of.get(n) != f for n, f in weight_map.items()):
            return None
    dtype_names = sorted({n for h in parts for n in h.dtype_names})
    rows = {n: i for i, n in enumerate(dtype_names)}
    dims = np.concatenate([h.dims for h in parts])
    dims_before = np.cumsum([0] + [len(h.dims) for h in parts[:-1]]).tolist()
    shape_at = np.concatenate([[0], *(h.shape_at[1:] + n for h, n in zip(parts, dims_before))]).astype(np.int64)
    count = len(names)
    cols = MetadataColumns(
        names=names,
        is_bytes=np.zeros(count, dtype=bool),
        prop=np.concatenate([np.array([rows[n] for n in h.dtype_names], dtype=np.int32)[h.dtype] for h in parts]),
        properties=[TensorProperties(dtype=SAFETENSORS_TO_TORCH[n]) for n in dtype_names],
        shape_at=shape_at,
        dims=dims,
        chunk_at=np.arange(count + 1, dtype=np.int64),
        chunk_offsets=np.zeros(len(dims), dtype=np.int64),
        chunk_sizes=dims,
        box_at=shape_at,
        file=np.concatenate([np.full(len(h.names), i, dtype=np.int32) for i, h in enumerate(parts)]),
        byte_offset=np.concatenate([h.begin + (b.base + h.data_start) for b, h in zip(blobs, parts)]),
        byte_length=np.concatenate([h.end - h.begin for h in parts]),
        transform=np.full(count, -1, dtype=np.int32),
        files=[b.file for b in blobs],
        transforms=[],
    )
    return lazy_metadata(cols, _stored_chunk)


def _stored_chunk(cols: MetadataColumns, c: int) -> StoredChunk:
    """The storage entry of chunk ``c`` of safetensors columns (one chunk per tensor: chunk ``c`` is row ``c``)."""
    lo, hi = int(cols.box_at[c]), int(cols.box_at[c + 1])
    dtype = cols.properties[int(cols.prop[c])].dtype
    return StoredChunk(
        cols.files[int(cols.file[c])],
        int(cols.byte_offset[c]),
        dtype,
        tuple(cols.chunk_sizes[lo:hi].tolist()),
        cols.names[c],
    )


# ------------------------------------------------------------------------------------- plain and HF
class _Piece(NamedTuple):
    offsets: tuple[int, ...]
    entry: TensorEntry
    blob: Blob
    data_start: int


def _from_headers(layout: Layout, headers: Mapping[Blob, SafetensorsHeader], urls: Mapping[str, str]) -> Metadata:
    pieces: dict[str, list[_Piece]] = {}
    index_url = layout.source_url
    for blob in sorted(headers, key=lambda b: (b.file, b.base)):
        header = headers[blob]
        offsets = saved_offsets(header, urls[blob.file])
        for name, entry in header.tensors.items():
            if layout.weight_map and layout.weight_map.get(name, blob.file) != blob.file:
                continue  # the index says another shard holds it
            pieces.setdefault(name, []).append(_Piece(offsets[name], entry, blob, header.data_start))
    for name, file in layout.weight_map.items():
        if not any(p.blob.file == file for p in pieces.get(name, ())):
            raise CorruptCheckpointError(
                f"{index_url}: weight_map entry {name!r} names {file!r}, but {urls.get(file, file)} holds no "
                "tensor of that name"
            )

    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, StoredChunk] = {}
    sizes: dict[tuple[int, ...], torch.Size] = {}  # one torch.Size per distinct shape: they are immutable
    for name, found in pieces.items():
        if len(found) == 1 and not any(found[0].offsets):  # a whole tensor in one piece: nothing to assemble
            size, kept = found[0].entry.shape, found
        else:
            size, kept = _assemble(name, found, urls)
        chunks = []
        for p in kept:
            offsets = sizes.get(p.offsets)
            if offsets is None:
                offsets = sizes[p.offsets] = torch.Size(p.offsets)
            shape = sizes.get(p.entry.shape)
            if shape is None:
                shape = sizes[p.entry.shape] = torch.Size(p.entry.shape)
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=shape))
            storage[MetadataIndex(name, p.offsets)] = StoredChunk(
                p.blob.file, p.blob.base + p.data_start + p.entry.begin, p.entry.dtype, p.entry.shape, name
            )
        state[name] = TensorStorageMetadata(TensorProperties(dtype=kept[0].entry.dtype), torch.Size(size), chunks)
    return Metadata(state_dict_metadata=state, storage_data=storage)  # type: ignore[arg-type]


def _assemble(name: str, found: list[_Piece], urls: Mapping[str, str]) -> tuple[tuple[int, ...], list[_Piece]]:
    """The full tensor's size and the pieces to keep (empty ones dropped); checks they tile it exactly."""
    first = found[0]
    where = f"tensor {name!r} in {urls[first.blob.file]}"
    for p in found[1:]:
        if p.entry.dtype != first.entry.dtype or len(p.entry.shape) != len(first.entry.shape):
            raise CorruptCheckpointError(
                f"{where} is {first.entry.dtype_name} {list(first.entry.shape)} but its piece in "
                f"{urls[p.blob.file]} is {p.entry.dtype_name} {list(p.entry.shape)}"
            )
    size = tuple(max(p.offsets[d] + p.entry.shape[d] for p in found) for d in range(len(first.entry.shape)))
    nonempty = [p for p in found if math.prod(p.entry.shape) > 0]
    kept = nonempty or [found[0]]
    if len(found) == 1 and not any(first.offsets):
        return size, kept
    seen: dict[tuple[int, ...], _Piece] = {}
    for p in kept:
        other = seen.setdefault(p.offsets, p)
        if other is not p:
            raise CorruptCheckpointError(
                f"tensor {name!r}: both {urls[other.blob.file]} and {urls[p.blob.file]} hold the piece at offsets "
                f"{list(p.offsets)}; remove the stale file"
            )
    volume = sum(math.prod(p.entry.shape) for p in kept)
    if volume != math.prod(size):
        files = ", ".join(urls[p.blob.file] for p in kept)
        raise CorruptCheckpointError(
            f"tensor {name!r}: its pieces ({files}) hold {volume} of the {math.prod(size)} elements of the full "
            f"{list(size)} tensor; a shard file is missing or pieces overlap"
        )
    if len(kept) <= MAX_OVERLAP_CHECK_CHUNKS:
        for i, a in enumerate(kept):
            for b in kept[i + 1 :]:
                if _overlap(a, b):
                    raise CorruptCheckpointError(
                        f"tensor {name!r}: pieces in {urls[a.blob.file]} (offsets {list(a.offsets)}) and "
                        f"{urls[b.blob.file]} (offsets {list(b.offsets)}) overlap"
                    )
    return size, kept


def _overlap(a: _Piece, b: _Piece) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.entry.shape, b.offsets, b.entry.shape)
    )


# ------------------------------------------------------------------------------ DCP .metadata layout
def _from_dcp_metadata(layout: Layout, headers: Mapping[Blob, SafetensorsHeader], urls: Mapping[str, str]) -> Metadata:
    md, md_url = layout.dcp_metadata, layout.source_url
    if md is None or md.storage_data is None:
        raise CorruptCheckpointError(f"{md_url}: metadata carries no storage map")
    storage: dict[MetadataIndex, StoredChunk | StoredBytes] = {}
    for index, info in md.storage_data.items():
        item = md.state_dict_metadata.get(index.fqn)
        where = f"{md_url}: storage entry for {index.fqn!r}"
        if item is None:
            raise CorruptCheckpointError(f"{where}: the state dict metadata has no such key")
        file, offset, length = info.relative_path, int(info.offset), int(info.length)
        if isinstance(item, BytesStorageMetadata):
            transforms = tuple(getattr(info, "transform_descriptors", None) or ())
            storage[index] = StoredBytes(file, offset, length, transforms)
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{where}: unknown metadata entry {type(item).__name__}")
        blob = Blob(file, offset)
        header = headers[blob]
        blob_url = f"{urls[file]} (safetensors at byte {offset})"
        entry = header.tensors.get(index.fqn)
        if entry is None:
            raise CorruptCheckpointError(f"{blob_url}: holds no tensor {index.fqn!r}, which {md_url} places there")
        chunk_offsets = tuple(index.offset or ())
        chunk = next((c for c in item.chunks if tuple(c.offsets) == chunk_offsets), None)
        expected = tuple(chunk.sizes) if chunk is not None else None
        if entry.dtype != item.properties.dtype or entry.shape != expected or entry.nbytes != length:
            raise CorruptCheckpointError(
                f"{blob_url}: tensor {index.fqn!r} is {entry.dtype_name} {list(entry.shape)} ({entry.nbytes} bytes) "
                f"but {md_url} says {item.properties.dtype} {list(expected) if expected else '?'} ({length} bytes)"
            )
        stored_at = saved_offsets(header, blob_url).get(index.fqn)
        if stored_at is not None and any(stored_at) and stored_at != chunk_offsets:
            raise CorruptCheckpointError(
                f"{blob_url}: tensor {index.fqn!r} is the piece at {list(stored_at)} but {md_url} says "
                f"{list(chunk_offsets)}"
            )
        storage[index] = StoredChunk(
            file, offset + header.data_start + entry.begin, entry.dtype, entry.shape, index.fqn
        )
    return dataclasses.replace(md, storage_data=storage)
