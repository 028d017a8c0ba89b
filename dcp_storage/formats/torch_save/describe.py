"""``inspect`` for ``torch.save`` files: every tensor with the byte range of its elements in its zip record
(from the central directory and ``data.pkl``; no storage is read)."""

from __future__ import annotations

import os
import posixpath
from typing import Any

from dcp_storage.formats.reports import CheckpointInfo, ChunkInfo, FileInfo, TensorInfo, ValueInfo, dtype_name
from dcp_storage.formats.spec import FormatSpec
from dcp_storage.formats.torch_save.archive import TorchSaveArchive
from dcp_storage.formats.torch_save.pickle_tree import TensorDescriptor
from dcp_storage.transports.factory import open_transport

__all__ = ["describe_torch_save"]


def describe_torch_save(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
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
