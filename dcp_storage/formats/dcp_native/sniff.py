"""Which reader a directory holding ``.metadata`` needs: DCP's native records, or torch's safetensors layout.

Both layouts are ``.metadata`` plus ``__R_N.distcp`` files. In the native one (``FileSystemWriter``,
``FsspecWriter``) every item is a ``torch.save`` zip record; in torch's
``FileSystemWriter(serialization_format=SAFETENSORS)`` tensors are safetensors blobs, but non-tensor items
(a step counter) are still ``torch.save`` records and come first in the file. So a data file that starts
with a zip record is not proof of the native layout. Cheap tests first, each decisive only when it is:

1. the first data file starts like safetensors: the safetensors layout;
2. it starts with a zip record *and* ends with a zip end record (a native file ends with a record): native;
3. otherwise (a zip record then something else, garbage, transformed records) ``.metadata`` decides: in
   the safetensors layout a tensor's storage entry is exactly its elements' bytes long, while a native
   record adds a zip around them, so one such entry decides. A ``.metadata`` that cannot be read goes to the native reader, whose
   error then names the problem.
"""

from __future__ import annotations

import math
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.dcp_native.metadata_io import METADATA_FILE, read_metadata_file
from dcp_storage.formats.paths import DATA_SUFFIX
from dcp_storage.formats.safetensors.layout import looks_like_safetensors
from dcp_storage.formats.spec import HEAD_BYTES, Probe

__all__ = ["NATIVE", "SAFETENSORS", "dcp_data_kind"]

NATIVE, SAFETENSORS = "torch_save", "safetensors"
_UNKNOWN_SIZE = 1 << 62  # a directory probe reads heads only; the reader checks real sizes
_ZIP_LOCAL, _ZIP_END, _ZIP_END_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22


def _ends_with_zip(probe: Probe, name: str) -> bool:
    path = probe.transport.join(probe.path, name)
    size = probe.transport.size(path)
    if size < _ZIP_END_SIZE:
        return False
    tail = bytes(probe.transport.read_range(path, size - _ZIP_END_SIZE, size))
    return tail[:4] == _ZIP_END


def _kind_from_metadata(probe: Probe) -> str:
    path = probe.transport.join(probe.path, METADATA_FILE)
    try:
        md = read_metadata_file(probe.transport, path)
    except DcpStorageError:
        return NATIVE  # FsspecReader reports the problem, naming the file
    storage: dict[Any, Any] = md.storage_data or {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        for chunk in item.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            nbytes = math.prod(chunk.sizes) * item.properties.dtype.itemsize
            if info is not None and nbytes > 0 and int(info.length) == nbytes and not info.transform_descriptors:
                return SAFETENSORS  # a native record is never just its elements: its zip adds headers
    return NATIVE


def dcp_data_kind(probe: Probe) -> str | None:
    """``NATIVE`` or ``SAFETENSORS`` for a directory holding ``.metadata``; ``None`` for anything else."""

    if not probe.is_dir or METADATA_FILE not in probe.names:
        return None
    data = sorted(n for n in probe.names if n.endswith(DATA_SUFFIX))
    if not data:
        return NATIVE
    head = probe.head_of(data[0], HEAD_BYTES)
    if looks_like_safetensors(head, _UNKNOWN_SIZE):
        return SAFETENSORS
    if head.startswith(_ZIP_LOCAL) and _ends_with_zip(probe, data[0]):
        return NATIVE
    return _kind_from_metadata(probe)
