"""The DCP native format's spec: detecting a ``.metadata`` directory, and ``inspect`` of one.

Which reader a directory holding ``.metadata`` needs: DCP's native records, or torch's safetensors layout.

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

``inspect`` for DCP native checkpoints: the ``.metadata`` storage map, the data files and the manifest.

Format registration for DCP's native layout (``.metadata`` + ``.distcp`` torch.save records).
"""

from __future__ import annotations

import math
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.columns import column_table, columns_of
from dcp_storage.formats.dcp_native.extensions import TARGET
from dcp_storage.formats.dcp_native.manifest_io import read_manifest
from dcp_storage.formats.dcp_native.native import METADATA_FILE, read_metadata_file
from dcp_storage.formats.dcp_native.verify import check_dcp, deep_check_dcp
from dcp_storage.formats.paths import DATA_SUFFIX
from dcp_storage.formats.reports import CheckpointInfo, TensorInfo, ValueInfo, file_infos, listed_sizes, tensor_table
from dcp_storage.formats.safetensors.metadata import looks_like_safetensors
from dcp_storage.formats.spec import HEAD_BYTES, FormatSpec, Probe
from dcp_storage.integrity.blocks import manifest_provenance
from dcp_storage.transports import open_transport

__all__ = ["FORMAT", "NATIVE", "SAFETENSORS", "dcp_data_kind", "dcp_provenance", "describe_dcp"]


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
    first = probe.first_named(DATA_SUFFIX)  # any data file tells; no sort or Python loop over a million
    if first is None:
        return NATIVE
    head = probe.head_of(first, HEAD_BYTES)
    if looks_like_safetensors(head, _UNKNOWN_SIZE):
        return SAFETENSORS
    if head.startswith(_ZIP_LOCAL) and _ends_with_zip(probe, first):
        return NATIVE
    return _kind_from_metadata(probe)


def dcp_provenance(transport: Any, root: str) -> dict[str, Any]:
    """Provenance of the DCP checkpoint at ``root``; a damaged manifest is shown as such, not raised."""
    try:
        return manifest_provenance(read_manifest(transport, root))
    except DcpStorageError as exc:
        return {"error": str(exc)}


def describe_dcp(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    """Every tensor chunk and value with its data file and byte range; every data file with its size."""
    transport, root = open_transport(url, storage_options)
    with transport:
        path = transport.join(root, METADATA_FILE)
        md = read_metadata_file(transport, path)
        cols = columns_of(md)
        if cols is not None:  # rows built from arrays when asked for (a million tensors: seconds, not minutes)
            tensors, values = column_table(cols)
            stored: Any = cols.files
        else:
            tensors, values, stored = _table(md)
        sizes = listed_sizes(transport, root)  # one listing, sizes with it: a million data files in seconds
        listing = sizes or transport.listdir(root)
        listed = [n for n in listing if n.endswith(DATA_SUFFIX)]  # unreferenced data files too
        names = _union_sorted(listed, stored)
        files = file_infos(transport, root, names, sizes)
        provenance = dcp_provenance(transport, root)
    return CheckpointInfo(url, spec.descriptor, spec.description, "dcp", files, tensors, values, provenance)


def _union_sorted(listed: list[str], stored: Any) -> list[str]:
    """``sorted({METADATA_FILE, *listed, *stored})``, faster for a million names: the listing (distinct
    names, none of them ``.metadata``) is sorted alone, and the stored names it lacks, sorted, are merged
    in (two sorted runs: timsort merges them in linear time)."""
    extra = set(stored)
    extra.difference_update(listed)
    extra.add(METADATA_FILE)
    return sorted(sorted(extra) + sorted(listed))


def _table(md: Any) -> tuple[list[TensorInfo], list[ValueInfo], set[str]]:
    """The rows of a plain ``Metadata``, and the files its storage map names."""
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

    tensors, values = tensor_table(md, locate)
    return tensors, values, {i.relative_path for i in storage.values()}


def _sniff(probe: Probe) -> int | None:
    # .distcp files that are not torch.save records: DCP's safetensors serialization (see .sniff)
    return 100 if dcp_data_kind(probe) == NATIVE else None


FORMAT = FormatSpec(
    name="dcp",
    version="1",
    sniff=_sniff,
    description="torch.distributed.checkpoint native layout: .metadata + __R_N.distcp",
    reader="dcp_storage.FsspecReader(url)",
    describe=describe_dcp,
    check=check_dcp,
    deep_check=deep_check_dcp,
    convert_target=TARGET,
)
