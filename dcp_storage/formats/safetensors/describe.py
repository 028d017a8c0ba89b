"""``inspect`` for safetensors checkpoints: every header's entries, the files, and the header provenance."""

from __future__ import annotations

import math
import os
import posixpath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_storage.formats.paths import METADATA_FILE
from dcp_storage.formats.reports import CheckpointInfo, FileInfo, size_or_none, tensor_table
from dcp_storage.formats.safetensors.checksum_check import safetensors_provenance
from dcp_storage.formats.safetensors.layout import discover, resolve
from dcp_storage.formats.safetensors.metadata import StoredBytes, StoredChunk
from dcp_storage.formats.safetensors.scan import scan_metadata
from dcp_storage.formats.spec import FormatSpec
from dcp_storage.transports.factory import open_transport

__all__ = ["describe_safetensors"]

_LAYOUTS = {
    "file": "safetensors file",
    "directory": "safetensors directory",
    "index": "Hugging Face index",
    "dcp": "DCP .metadata + safetensors",
}


def describe_safetensors(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    """A file, a directory, an HF index or torch's DCP-safetensors layout, from the headers alone."""
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

        tensors, values = tensor_table(md, locate)
        names = list(layout.files)
        if layout.kind == "index" and layout.index_path is not None:
            names.append(posixpath.basename(layout.index_path.replace(os.sep, "/")))
        if layout.kind == "dcp":
            names.append(METADATA_FILE)
        files = [FileInfo(n, size_or_none(transport, resolve(transport, layout.root, n))) for n in sorted(set(names))]
        provenance = (
            {}
            if layout.kind == "dcp"
            else safetensors_provenance(transport, [resolve(transport, layout.root, n) for n in layout.files])
        )
    kind = _LAYOUTS.get(layout.kind, layout.kind)
    return CheckpointInfo(url, spec.descriptor, spec.description, kind, files, tensors, values, provenance)
