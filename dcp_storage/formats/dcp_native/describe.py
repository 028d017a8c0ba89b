"""``inspect`` for DCP native checkpoints: the ``.metadata`` storage map, the data files and the manifest."""

from __future__ import annotations

from typing import Any

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.dcp_native.column_table import column_table
from dcp_storage.formats.dcp_native.lazy_metadata import columns_of
from dcp_storage.formats.dcp_native.manifest_io import read_manifest
from dcp_storage.formats.dcp_native.metadata_io import METADATA_FILE, read_metadata_file
from dcp_storage.formats.paths import DATA_SUFFIX
from dcp_storage.formats.reports import CheckpointInfo, FileInfo, TensorInfo, ValueInfo, size_or_none, tensor_table
from dcp_storage.formats.spec import FormatSpec
from dcp_storage.integrity.summary import manifest_provenance
from dcp_storage.transports.factory import open_transport

__all__ = ["dcp_provenance", "describe_dcp"]


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
        listed = [n for n in transport.listdir(root) if n.endswith(DATA_SUFFIX)]  # unreferenced data files too
        names = sorted({METADATA_FILE, *listed, *stored})
        files = [FileInfo(n, size_or_none(transport, transport.join(root, n))) for n in names]
        provenance = dcp_provenance(transport, root)
    return CheckpointInfo(url, spec.descriptor, spec.description, "dcp", files, tensors, values, provenance)


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
