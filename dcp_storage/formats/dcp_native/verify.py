"""``verify`` for DCP native checkpoints.

Shallow: ``.metadata`` present and decodable; every data file it names present; every record's
``offset + length`` within its file; every tensor's chunks inside the tensor, each with a storage entry,
together covering every element; every non-tensor value with a storage entry; every stream extension a
load needs installed; file sizes against the manifest. Deep: every record's checksum in the manifest
(:mod:`.checksum_check`), each file read sequentially in bounded memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.dcp_native.checksum_check import report_dcp_checksums
from dcp_storage.formats.dcp_native.extensions import ExtensionResolver
from dcp_storage.formats.dcp_native.metadata_io import METADATA_FILE, read_metadata_file
from dcp_storage.formats.paths import check_relative
from dcp_storage.formats.reports import VerifyReport, error_text, named_keys
from dcp_storage.formats.tiling import tiling_problem
from dcp_storage.transports.factory import open_transport

__all__ = ["check_dcp", "check_extensions", "deep_check_dcp"]


def check_dcp(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    """The shallow checks (see the module docstring)."""
    transport, root = open_transport(url, storage_options)
    with transport:
        path = transport.join(root, METADATA_FILE)
        if not transport.exists(path):
            report.problems.append(
                f"{transport.url(path)}: missing: the save did not complete (metadata is written last) or this is "
                "not a checkpoint"
            )
            return
        try:
            md = read_metadata_file(transport, path)
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(f"{transport.url(path)}: cannot be decoded: {error_text(exc)}")
            return
        storage = md.storage_data if isinstance(md.storage_data, Mapping) else None
        if storage is None:
            report.problems.append(f"{transport.url(path)}: carries no storage map")
            return
        needs: dict[str, list[tuple[int, str]]] = {}
        for index, info in storage.items():
            try:
                rel = check_relative(
                    getattr(info, "relative_path", None), f"{transport.url(path)}: entry for {index.fqn!r}"
                )
            except DcpStorageError as exc:
                report.problems.append(str(exc))
                continue
            end = int(info.offset) + int(info.length)
            if int(info.offset) < 0 or int(info.length) < 0:
                report.problems.append(
                    f"{transport.url(path)}: entry for {index.fqn!r} has a negative offset or length"
                )
            needs.setdefault(rel, []).append((end, index.fqn))
        for rel, ends in sorted(needs.items()):
            file_path = transport.join(root, rel)
            keys = sorted({k for _e, k in ends})
            if not transport.exists(file_path):
                report.problems.append(f"{transport.url(file_path)}: missing (holds {named_keys(keys)})")
                continue
            try:
                size = transport.size(file_path)
            except DcpStorageError as exc:  # a file the transport refuses (say, one leading out): a problem
                report.problems.append(str(exc))
                continue
            short = sorted({k for e, k in ends if e > size})
            if short:
                report.problems.append(
                    f"{transport.url(file_path)}: is {size} bytes but the metadata places records up to byte "
                    f"{max(e for e, _k in ends)} (truncated?): {named_keys(short)} lie past its end"
                )
        report.checked["files"] = len(needs)
        _check_coverage(report, md, storage, transport.url(path))
        check_extensions(report, transport, root, storage, transport.url(path))  # plugins a load needs
        report_dcp_checksums(report, transport, root, storage, deep=False)  # sizes against the manifest


def _check_coverage(report: VerifyReport, md: Any, storage: dict[Any, Any], where: str) -> None:
    chunks = 0
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                report.problems.append(f"{where}: value {fqn!r} has no storage entry")
            continue
        if not isinstance(item, TensorStorageMetadata):
            report.problems.append(f"{where}: {fqn!r} has unknown metadata {type(item).__name__}")
            continue
        size = [int(s) for s in item.size]
        boxes, inside = [], True
        for chunk in item.chunks:
            chunks += 1
            offsets, sizes = [int(o) for o in chunk.offsets], [int(s) for s in chunk.sizes]
            if len(offsets) != len(size) or any(o < 0 or o + n > s for o, n, s in zip(offsets, sizes, size)):
                report.problems.append(
                    f"{where}: tensor {fqn!r} chunk at {offsets} of size {sizes} lies outside {size}"
                )
                inside = False
            if MetadataIndex(fqn, chunk.offsets) not in storage:
                report.problems.append(f"{where}: tensor {fqn!r} chunk at {offsets} has no storage entry")
            boxes.append((offsets, sizes))
        tiling = tiling_problem(size, boxes) if inside else None
        if tiling is not None:
            report.problems.append(f"{where}: tensor {fqn!r}: {tiling}")
    report.checked["tensors"] = sum(isinstance(i, TensorStorageMetadata) for i in md.state_dict_metadata.values())
    report.checked["chunks"] = chunks


def _descriptors(info: Any) -> tuple[str, ...] | None:
    """An entry's transform descriptors; ``None`` when they are not a list of strings."""
    descs = getattr(info, "transform_descriptors", None)
    if descs is None:
        return ()
    if not isinstance(descs, (list, tuple)) or not all(isinstance(d, str) for d in descs):
        return None
    return tuple(descs)


def check_extensions(report: VerifyReport, transport: Any, root: str, storage: dict[Any, Any], where: str) -> None:
    """One problem per extension (descriptor list) that the items of ``storage`` need and nobody provides.

    An item written through a stream extension (compression, ...) records its descriptors
    (``stream.zstd_seekable/1``); a load without a plugin that provides one fails on every such item. Each
    distinct descriptor list is resolved once, as a load would, and a missing one is one problem naming the
    descriptor, the distribution to install and how many items need it.
    """
    users: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for index, info in storage.items():
        descs = _descriptors(info)
        if descs is None:
            report.problems.append(f"{where}: entry for {index.fqn!r} has malformed transform descriptors")
        elif descs:
            users.setdefault(descs, []).append((index.fqn, str(getattr(info, "relative_path", ""))))
    if not users:
        return
    resolver = ExtensionResolver(transport, root)
    for descs, items in sorted(users.items()):
        keys = sorted({k for k, _f in items})
        files = sorted({f for _k, f in items})
        try:
            resolver.resolve(descs, transport.url(transport.join(root, files[0])), keys[0])
        except DcpStorageError as exc:  # UnknownExtensionError: the descriptor, the distribution to install
            report.problems.append(
                f"{exc}; a load would fail: {len(items)} item(s) in {len(files)} file(s) need it ({named_keys(keys)})"
            )
    report.checked["extensions"] = len({d for descs in users for d in descs})


def deep_check_dcp(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    """Every checksum the manifest records, file by file (the deep half of the manifest check)."""
    transport, root = open_transport(url, storage_options)
    with transport:
        md = read_metadata_file(transport, transport.join(root, METADATA_FILE))
        report_dcp_checksums(report, transport, root, md.storage_data or {}, deep=True)
