"""``verify`` of a DCP checkpoint: files, sizes and checksums against its manifest.

Checking a DCP checkpoint against its manifest's checksums, for ``verify`` (``dcp-storage verify``).

Shallow: every file the manifest lists is present with exactly the size recorded, and every record of the
metadata has a checksum. Deep: every file is read sequentially in pieces of at most ``piece_bytes`` (so
memory stays bounded whatever the file size) and each record's checksum is compared; every mismatch is
reported with its URL, byte range and the keys stored there, not just the first.

``verify`` for DCP native checkpoints.

Shallow: ``.metadata`` present and decodable; every data file it names present; every record's
``offset + length`` within its file; every tensor's chunks inside the tensor, each with a storage entry,
together covering every element; every non-tensor value with a storage entry; every stream extension a
load needs installed; file sizes against the manifest. Deep: every record's checksum in the manifest
(:mod:`.checksum_check`), each file read sequentially in bounded memory.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.dcp_native.column_checks import check_record_crcs
from dcp_storage.formats.dcp_native.extensions import ExtensionResolver
from dcp_storage.formats.dcp_native.manifest_io import read_manifest
from dcp_storage.formats.dcp_native.native import read_metadata_file
from dcp_storage.formats.paths import METADATA, METADATA_FILE, check_relative, read_limited
from dcp_storage.formats.reading import tiling_problem
from dcp_storage.formats.reports import VerifyReport, error_text, named_keys
from dcp_storage.integrity.blocks import PIECE_BYTES, key_name, no_checksums_note
from dcp_storage.integrity.checksums import mismatch, new_hasher
from dcp_storage.integrity.manifest import Manifest
from dcp_storage.text import printable
from dcp_storage.transports import open_transport

__all__ = [
    "ChecksumCheck",
    "check_dcp",
    "check_dcp_checksums",
    "check_extensions",
    "deep_check_dcp",
    "report_dcp_checksums",
]


_MAX_KEYS_NAMED = 5


@dataclass
class ChecksumCheck:
    """What a checksum check found: problems (each naming file, range and keys) and counts."""

    problems: list[str] = field(default_factory=list)
    records: int = 0
    files: int = 0
    bytes: int = 0


def _keys(keys: list[str]) -> str:
    if not keys:
        return "no key in the metadata"
    shown = ", ".join(keys[:_MAX_KEYS_NAMED])
    return shown + (f" and {len(keys) - _MAX_KEYS_NAMED} more" if len(keys) > _MAX_KEYS_NAMED else "")


def _keys_by_record(storage: dict[Any, Any]) -> dict[tuple[str, int, int], list[str]]:
    out: dict[tuple[str, int, int], list[str]] = {}
    for index, info in storage.items():
        out.setdefault((info.relative_path, int(info.offset), int(info.length)), []).append(key_name(index))
    return out


def check_dcp_checksums(
    transport: Any,
    root: str,
    manifest: Manifest,
    storage: dict[Any, Any],
    *,
    deep: bool,
    piece_bytes: int = PIECE_BYTES,
) -> ChecksumCheck:
    """Compare the data files of a DCP checkpoint with ``manifest`` (sizes; with ``deep``, every checksum)."""
    result = ChecksumCheck()
    if manifest.algorithm is None:
        return result
    keys = _keys_by_record(storage)
    for (name, offset, length), names in sorted(keys.items()):
        if manifest.item(name, offset, length) is None:
            result.problems.append(
                f"{transport.url(transport.join(root, name))} bytes [{offset}, {offset + length}) (holding "
                f"{_keys(names)}): the manifest records no checksum for this record"
            )
    for name, entry in sorted(manifest.files.items()):
        path = transport.join(root, name)
        url = transport.url(path)
        result.files += 1
        if not transport.exists(path):
            held = sorted({k for i in entry.items for k in keys.get((name, i.offset, i.length), [])})
            result.problems.append(f"{url}: missing (holds {_keys(held)})")
            continue
        size = transport.size(path)
        if size != entry.size:
            result.problems.append(
                f"{url}: is {size} bytes but was written with {entry.size} ({'truncated' if size < entry.size else 'grown'})"
            )
            continue
        if deep:
            _check_file(transport, path, url, manifest, name, keys, result, piece_bytes)
    return result


def _check_file(
    transport: Any,
    path: str,
    url: str,
    manifest: Manifest,
    name: str,
    keys: dict[tuple[str, int, int], list[str]],
    result: ChecksumCheck,
    piece_bytes: int,
) -> None:
    algorithm = manifest.algorithm or ""
    for item in sorted(manifest.files[name].items, key=lambda i: i.offset):
        try:
            hasher = new_hasher(algorithm)
        except DcpStorageError as exc:
            result.problems.append(f"{url}: {exc}")
            return
        for lo in range(item.offset, item.end, piece_bytes):
            hasher.update(transport.read_range(path, lo, min(lo + piece_bytes, item.end)))
        result.records += 1
        result.bytes += item.length
        got = hasher.hexdigest()
        if got != item.digest:
            held = _keys(keys.get((name, item.offset, item.length), []))
            result.problems.append(
                f"{url} bytes [{item.offset}, {item.end}) (holding {held}): {mismatch(algorithm, item.digest)}: "
                "the bytes changed after they were written"
            )


def _same_mismatch(problem: str, where: str) -> bool:
    """Whether ``problem`` (the deep read's) is the checksum failure of the record at ``where``."""
    same_record = where in problem.replace(" bytes [", " [")
    return same_record and ("checksum mismatch" in problem or "CRC-32" in problem)


def report_dcp_checksums(report: Any, transport: Any, root: str, storage: dict[Any, Any], *, deep: bool) -> None:
    """Add the checksum findings for a DCP checkpoint to a ``VerifyReport`` (problems, notes, counts).

    Shallow (``deep=False``): file sizes and checksum coverage. Deep: every record's checksum as well, or
    (no manifest, or a stale one) the zip CRC-32 of every record. A manifest that does not describe the
    ``.metadata`` (another writer saved over the checkpoint) is one note, not a problem per record.
    """
    try:
        metadata = read_limited(transport, transport.join(root, METADATA_FILE), METADATA)
        with warnings.catch_warnings(record=True) as stale:
            warnings.simplefilter("always")
            manifest = read_manifest(transport, root, metadata=bytes(metadata))
    except DcpStorageError as exc:
        report.problems.append(str(exc))
        return
    for w in stale:
        note = f"{w.message}"
        if note not in report.notes:
            report.notes.append(note)
    if manifest is None or manifest.algorithm is None:
        if not deep:
            if not report.deep:  # a deep run says what it checked instead
                report.notes.append(no_checksums_note(manifest.writer if manifest else None, zip_crcs=True))
            return

        def seen(url: str, lo: int, hi: int) -> bool:
            return any(url in p and f"[{lo}, {hi})" in p for p in report.problems)

        checked, skipped = check_record_crcs(transport, root, storage, report.problems, seen)
        report.checked["crc32_records"] = checked
        who = printable(manifest.writer) if manifest else "its writer (not dcp-storage, e.g. torch's)"
        report.notes.append(
            f"no checksums recorded by {who}; the zip CRC-32 of {checked} records checked instead"
            + (f" ({skipped} records that are not zips carry none)" if skipped else "")
        )
        return
    found = check_dcp_checksums(transport, root, manifest, storage, deep=deep)
    for p in found.problems:  # the deep read (a checked load) may have reported this mismatch already
        where = p.split(" (holding")[0].replace(" bytes [", " [")
        if p not in report.problems and not any(_same_mismatch(q, where) for q in report.problems):
            report.problems.append(p)
    if deep:
        report.checked["checksum_records"] = found.records
        report.notes.append(
            f"{manifest.algorithm} checksums of {found.records} records in {found.files} files checked "
            f"({found.bytes} bytes, written by {manifest.writer})"
        )
    elif not report.deep:
        report.notes.append(f"file sizes checked against the manifest ({manifest.algorithm} checksums: pass --deep)")


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
