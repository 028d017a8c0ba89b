"""``describe``: what a checkpoint holds and where, from metadata and headers only (no tensor data read).

One :class:`CheckpointInfo` for any format: the format descriptor, the files with their sizes, and a table
of tensors (key, dtype, shape, bytes) with, for each stored chunk, its offsets in the full tensor and the
file and byte range that hold it; non-tensor values likewise. The format describes itself through its
spec's ``describe`` hook (:class:`~dcp_storage.formats.spec.FormatSpec`); a format without one is
described from its reader's ``Metadata`` (file locations unknown).
"""

from __future__ import annotations

import os
from typing import Any

from dcp_storage import registry
from dcp_storage.formats.reports import (
    CheckpointInfo,
    ChunkInfo,
    FileInfo,
    TensorInfo,
    ValueInfo,
    dtype_name,
    tensor_table,
)
from dcp_storage.formats.spec import FormatSpec
from dcp_storage.gc_pause import gc_paused
from dcp_storage.opening import detect_format

__all__ = ["CheckpointInfo", "ChunkInfo", "FileInfo", "TensorInfo", "ValueInfo", "describe", "dtype_name"]


def describe_from_reader(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    """What any format's reader tells: its ``Metadata`` (tensors, shapes, chunks), no files or byte ranges."""
    reader = spec.open_reader(url, storage_options=storage_options)
    md = reader.read_metadata()
    tensors, values = tensor_table(md, lambda _fqn, _offsets: (None, None, None))
    return CheckpointInfo(url, spec.descriptor, spec.description, spec.name, [], tensors, values)


def resolve_spec(url: str, storage_options: dict[str, Any] | None, format: str | None) -> FormatSpec:
    return registry.get("formats", format) if format is not None else detect_format(url, storage_options)


def describe(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, format: str | None = None
) -> CheckpointInfo:
    """Describe the checkpoint at ``url`` (format detected unless ``format`` names one)."""
    url = os.fspath(url)
    spec = resolve_spec(url, storage_options, format)
    with gc_paused():  # one row object per tensor, millions at a million tensors (see gc_pause)
        return (spec.describe or describe_from_reader)(url, spec, storage_options)
