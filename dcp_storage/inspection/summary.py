"""``describe``: what a checkpoint holds and where, from metadata and headers only (no tensor data read).

One :class:`CheckpointInfo` for any format: the format descriptor, the files with their sizes, and a table
of tensors (key, dtype, shape, bytes) with, for each stored chunk, its offsets in the full tensor and the
file and byte range that hold it; non-tensor values likewise. Built-in formats are described from their
own structures (DCP ``.metadata`` storage map, safetensors headers, the ``torch.save`` zip index); a
plugin format from its reader's ``Metadata`` (file locations unknown).
"""

from __future__ import annotations

import math
import os
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from .. import registry
from ..formats.dcp_native.metadata_io import METADATA_FILE, read_metadata_file
from ..formats.safetensors.layout import discover, resolve
from ..formats.safetensors.metadata import StoredBytes, StoredChunk
from ..formats.safetensors.scan import scan_metadata
from ..formats.spec import FormatSpec
from ..formats.torch_save import TensorDescriptor, TorchSaveArchive
from ..gc_pause import gc_paused
from ..integrity.safetensors_check import safetensors_provenance
from ..integrity.summary import dcp_provenance
from ..opening import detect_format
from ..transports import Transport
from ..transports.factory import open_transport

__all__ = ["CheckpointInfo", "ChunkInfo", "FileInfo", "TensorInfo", "ValueInfo", "describe", "dtype_name"]


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


@dataclass(slots=True)
class ValueInfo:
    key: str
    file: str | None = None
    offset: int | None = None
    length: int | None = None


@dataclass
class FileInfo:
    name: str
    size: int | None  # None: listed by the checkpoint but missing


@dataclass
class CheckpointInfo:
    url: str
    format: str  # descriptor, e.g. "dcp/1"
    description: str
    layout: str  # "dcp", "safetensors file", "safetensors index", "torch.save zip", ...
    files: list[FileInfo] = field(default_factory=list)
    tensors: list[TensorInfo] = field(default_factory=list)
    values: list[ValueInfo] = field(default_factory=list)
    # What wrote it (from dcp-storage's manifest or header metadata): format, writer, extensions, checksums.
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def totals(self) -> dict[str, int]:
        return {
            "files": len(self.files),
            "file_bytes": sum(f.size or 0 for f in self.files),
            "tensors": len(self.tensors),
            "tensor_bytes": sum(t.nbytes for t in self.tensors),
            "chunks": sum(len(t.chunks) for t in self.tensors),
            "values": len(self.values),
        }

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["totals"] = self.totals
        return out


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _size_or_none(transport: Transport, path: str) -> int | None:
    return transport.size(path) if transport.exists(path) else None


def _ints(value: Any) -> list[int]:
    return list(value) if type(value) is torch.Size else [int(v) for v in value]  # a Size holds ints only


def _tensor_table(md: Metadata, locate: Any) -> tuple[list[TensorInfo], list[ValueInfo]]:
    """``locate(fqn, offsets or None)`` -> ``(file, offset, length)`` of a chunk's or value's storage."""
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


def _describe_dcp(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    transport, root = open_transport(url, storage_options)
    with transport:
        path = transport.join(root, METADATA_FILE)
        md = read_metadata_file(transport, path)
        storage = md.storage_data or {}
        # Keyed by plain tuples: a dict lookup by MetadataIndex runs its Python __hash__ and __eq__, and a
        # checkpoint of a million tensors has a million of them.
        places = {
            (index.fqn, None if index.offset is None else tuple(index.offset)): (
                info.relative_path,
                int(info.offset),
                int(info.length),
            )
            for index, info in storage.items()
        }

        def locate(fqn: str, offsets: list[int] | None) -> tuple[Any, ...]:
            return places.get((fqn, None if offsets is None else tuple(offsets)), (None, None, None))

        tensors, values = _tensor_table(md, locate)
        listed = [n for n in transport.listdir(root) if n.endswith(".distcp")]  # unreferenced data files too
        names = sorted({METADATA_FILE, *listed, *(i.relative_path for i in storage.values())})
        files = [FileInfo(n, _size_or_none(transport, transport.join(root, n))) for n in names]
        provenance = dcp_provenance(transport, root)
    return CheckpointInfo(url, spec.descriptor, spec.description, "dcp", files, tensors, values, provenance)


def _describe_safetensors(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    transport, target = open_transport(url, storage_options)
    with transport:
        layout = discover(transport, target)
        md = scan_metadata(transport, layout)
        storage = md.storage_data or {}

        def locate(fqn: str, offsets: list[int] | None) -> tuple[Any, ...]:
            entry = storage.get(MetadataIndex(fqn, None if offsets is None else torch.Size(offsets)))
            if isinstance(entry, StoredChunk):
                return (entry.file, entry.data_offset, math.prod(entry.shape) * entry.dtype.itemsize)
            if isinstance(entry, StoredBytes):
                return (entry.file, entry.offset, entry.length)
            return (None, None, None)

        tensors, values = _tensor_table(md, locate)
        names = list(layout.files)
        if layout.kind == "index" and layout.index_path is not None:
            names.append(posixpath.basename(layout.index_path.replace(os.sep, "/")))
        if layout.kind == "dcp":
            names.append(".metadata")
        files = [FileInfo(n, _size_or_none(transport, resolve(transport, layout.root, n))) for n in sorted(set(names))]
        provenance = (
            {}
            if layout.kind == "dcp"
            else safetensors_provenance(transport, [resolve(transport, layout.root, n) for n in layout.files])
        )
    kind = {
        "file": "safetensors file",
        "directory": "safetensors directory",
        "index": "Hugging Face index",
        "dcp": "DCP .metadata + safetensors",
    }.get(layout.kind, layout.kind)
    return CheckpointInfo(url, spec.descriptor, spec.description, kind, files, tensors, values, provenance)


def _describe_torch_save(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    transport, path = open_transport(url, storage_options)
    with transport:
        archive = TorchSaveArchive.open(transport, path)
        name = posixpath.basename(path.replace(os.sep, "/"))
        starts = archive._data_starts()
        tensors, values = [], []
        for fqn, value in archive.flat.items():
            if isinstance(value, TensorDescriptor):
                shape = list(value.shape)
                start = starts[value.storage_key] + value.storage_offset * value.itemsize
                chunk = ChunkInfo([0] * len(shape), shape, name, start, value.nbytes)
                tensors.append(TensorInfo(fqn, dtype_name(value.dtype), shape, value.nbytes, [chunk]))
            else:
                values.append(ValueInfo(fqn, name, None, None))
        files = [FileInfo(name, archive.index.file_size)]
    return CheckpointInfo(url, spec.descriptor, spec.description, "torch.save zip", files, tensors, values)


def _describe_generic(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    reader = spec.open_reader(url, storage_options=storage_options)
    md = reader.read_metadata()
    tensors, values = _tensor_table(md, lambda _fqn, _offsets: (None, None, None))
    return CheckpointInfo(url, spec.descriptor, spec.description, spec.name, [], tensors, values)


_DESCRIBERS = {"dcp": _describe_dcp, "safetensors": _describe_safetensors, "torch_save": _describe_torch_save}


def resolve_spec(url: str, storage_options: dict[str, Any] | None, format: str | None) -> FormatSpec:
    return registry.get("formats", format) if format is not None else detect_format(url, storage_options)


def describe(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, format: str | None = None
) -> CheckpointInfo:
    """Describe the checkpoint at ``url`` (format detected unless ``format`` names one)."""
    url = os.fspath(url)
    spec = resolve_spec(url, storage_options, format)
    with gc_paused():  # one row object per tensor, millions at a million tensors (see gc_pause)
        return _DESCRIBERS.get(spec.name, _describe_generic)(url, spec, storage_options)
