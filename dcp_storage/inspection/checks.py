"""``verify``: is a checkpoint complete and readable? Every problem is collected and named, not just the first.

Shallow checks read metadata, headers and file sizes only:

* DCP native: ``.metadata`` present and decodable; every data file it names present; every record's
  ``offset + length`` within its file; every tensor's chunks inside the tensor, each with a storage entry,
  together covering every element; every non-tensor value with a storage entry.
* safetensors (file, directory, HF index, torch's DCP layouts): every header valid (JSON, dtypes, offsets
  inside the file, no overlaps), no trailing bytes after the data section (the reference implementation
  refuses those), the index's ``weight_map`` consistent with the headers, pieces tiling their tensors.
* ``torch.save``: zip end records and central directory, ``data.pkl`` decodable by the allow-list, every
  storage record present, uncompressed, large enough and inside the file.

``deep=True`` then reads every tensor and value through the format's reader, one at a time (memory near
the largest tensor), and for ``torch.save`` files checks the zip CRC32 of every record. Checkpoints written
by dcp-storage carry a checksum of every record (DCP: ``.dcp_storage.json``; safetensors: the header's
``__metadata__``): shallow checks compare file sizes with them, deep checks every checksum, reading each file
sequentially in bounded memory (:mod:`dcp_storage.integrity.deep_check`). Without them the report says so.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from .. import registry
from ..conversion.memory import MemoryReleaser
from ..conversion.source import TensorSource
from ..errors import DcpStorageError
from ..formats.dcp_native.metadata_io import METADATA_FILE, read_metadata_file
from ..formats.safetensors.layout import check_relative, discover, resolve
from ..formats.safetensors.metadata import build_metadata
from ..formats.safetensors.scan import blobs_of, read_headers
from ..formats.tiling import tiling_problem
from ..formats.torch_save import TorchSaveArchive
from ..formats.torch_save.zip_index import STORED, data_starts, read_zip_index
from ..integrity.checksums import mismatch
from ..integrity.deep_check import deep_check_dcp, report_dcp_checksums
from ..integrity.safetensors_check import deep_check_safetensors, report_safetensors_checksums
from ..text import printable
from ..transports.factory import open_transport
from .leftovers import check_leftovers
from .load_needs import check_extensions, check_shard_set
from .report import VerifyReport
from .summary import resolve_spec

__all__ = ["VerifyReport", "verify"]

NO_CHECKSUMS = (
    "no checksums recorded: this checkpoint's writer recorded none, so bit flips inside tensor data cannot be detected"
)
_CRC_CHUNK = 8 * 1024 * 1024
_MAX_KEYS_NAMED = 5


def _err(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, DcpStorageError) else f"{type(exc).__name__}: {exc}"


def _named(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_KEYS_NAMED])
    return shown + (f" and {len(keys) - _MAX_KEYS_NAMED} more" if len(keys) > _MAX_KEYS_NAMED else "")


# ------------------------------------------------------------------------------------------------ DCP
def _check_dcp(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
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
            report.problems.append(f"{transport.url(path)}: cannot be decoded: {_err(exc)}")
            return
        storage = md.storage_data if isinstance(md.storage_data, dict) else None
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
                report.problems.append(f"{transport.url(file_path)}: missing (holds {_named(keys)})")
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
                    f"{max(e for e, _k in ends)} (truncated?): {_named(short)} lie past its end"
                )
        report.checked["files"] = len(needs)
        _check_dcp_coverage(report, md, storage, transport.url(path))
        check_extensions(report, transport, root, storage, transport.url(path))  # plugins a load needs
        report_dcp_checksums(report, transport, root, storage, deep=False)  # sizes against the manifest


def _check_dcp_coverage(report: VerifyReport, md: Any, storage: dict[Any, Any], where: str) -> None:
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


# ---------------------------------------------------------------------------------------- safetensors
def _check_safetensors(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, target = open_transport(url, storage_options)
    with transport:
        try:
            layout = discover(transport, target)
            blobs = blobs_of(layout)
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(_err(exc))
            return
        headers, urls, broken = {}, {}, 0
        for blob in blobs:
            try:
                got, where = read_headers(transport, layout, [blob])
            except Exception as exc:  # noqa: BLE001 - one problem per file
                report.problems.append(_err(exc))
                broken += 1
                continue
            headers.update(got)
            urls.update(where)
            header = got[blob]
            if blob.base == 0 and layout.kind != "dcp":
                size = transport.size(resolve(transport, layout.root, blob.file))
                end = header.data_start + max((t.end for t in header.tensors.values()), default=0)
                if end != size:
                    report.problems.append(
                        f"{where[blob.file]}: {size - end} bytes after the last tensor's data (the data section must "
                        "end the file; safetensors refuses it)"
                    )
        report.checked["files"] = len({b.file for b in blobs})
        if layout.kind == "file":
            check_shard_set(report, transport, layout.root, layout.files[0])  # one shard of a set: name the rest
        if broken:
            return
        try:
            md = build_metadata(layout, headers, urls)
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(_err(exc))
            return
        report.checked["tensors"] = sum(isinstance(i, TensorStorageMetadata) for i in md.state_dict_metadata.values())
        report.checked["chunks"] = sum(
            len(i.chunks) for i in md.state_dict_metadata.values() if isinstance(i, TensorStorageMetadata)
        )
        if layout.kind != "dcp":  # header digests and coverage; torch's DCP layouts record none
            paths = [resolve(transport, layout.root, f) for f in sorted({b.file for b in blobs})]
            report_safetensors_checksums(report, transport, paths, deep=False)


# ------------------------------------------------------------------------------------------ torch.save
def _check_torch_save(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        try:
            archive = TorchSaveArchive.open(transport, path)
            archive._data_starts()  # every storage record's local header, inside the entry area
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(_err(exc))
            return
        report.checked["files"] = 1
        report.checked["tensors"] = len(archive.tensors)
        report.checked["chunks"] = len(archive.tensors)


def _check_crc32(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        index = read_zip_index(transport, path)
        names = [n for n, e in index.entries.items() if e.method == STORED]
        starts = data_starts(transport, index, names)
        for name in names:
            entry, start, crc = index.entries[name], starts[name], 0
            for lo in range(start, start + entry.compressed_size, _CRC_CHUNK):
                hi = min(lo + _CRC_CHUNK, start + entry.compressed_size)
                crc = zlib.crc32(transport.read_range(path, lo, hi), crc)
            if crc != entry.crc32:
                report.problems.append(
                    f"{index.url}: record {name!r}: {mismatch('CRC32', f'{entry.crc32:08x}')}: "
                    "the bytes were changed after the file was written"
                )
        report.checked["crc32_records"] = len(names)


# -------------------------------------------------------------------------------------------- deep
def _deep_read(
    report: VerifyReport,
    url: str,
    storage_options: dict[str, Any] | None,
    format: str | None,
    progress: Callable[[int], None] | None,
    on_start: Callable[[int], None] | None,
) -> None:

    try:
        source = TensorSource.open(url, storage_options, format)
    except Exception as exc:  # noqa: BLE001 - reported
        report.problems.append(f"cannot open for reading: {_err(exc)}")
        return

    read, releaser = 0, MemoryReleaser()
    with source:
        if on_start is not None:
            on_start(source.tensor_bytes)
        for fqn, info in source.tensors.items():
            try:
                tensor = source.read_tensor(fqn)
                del tensor
                releaser.freed(info.nbytes)
                read += 1
            except Exception as exc:  # noqa: BLE001 - one problem per tensor
                report.problems.append(f"tensor {fqn!r}: {_err(exc)}")
            if progress is not None:
                progress(info.nbytes)
        for fqn in source.values:
            try:
                source.read_value(fqn)
            except Exception as exc:  # noqa: BLE001 - one problem per value
                report.problems.append(f"value {fqn!r}: {_err(exc)}")
    report.checked["tensors_read"] = read


def _format_by_name(url: str) -> Any:
    """The built-in format a file name implies (``.safetensors``, ``.pt``...), when detection failed."""

    name = url.rstrip("/").lower()
    if name.endswith((".safetensors", ".safetensors.index.json")):
        return registry.get("formats", "safetensors")
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return registry.get("formats", "torch_save")
    return None


def verify(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    deep: bool = False,
    format: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check the checkpoint at ``url``; the report lists every problem found (empty: complete).

    Problems and notes are messages: names from the checkpoint in them are escaped
    (:func:`dcp_storage.text.printable`), whatever exception they came from.
    """
    url = os.fspath(url)
    report = VerifyReport(url, None, deep)
    try:
        _run_checks(report, storage_options, format, progress, on_start)
    finally:
        report.problems = [printable(p) for p in report.problems]
        report.notes = [printable(n) for n in report.notes]
    return report


def _run_checks(
    report: VerifyReport,
    storage_options: dict[str, Any] | None,
    format: str | None,
    progress: Callable[[int], None] | None,
    on_start: Callable[[int], None] | None,
) -> None:
    url, deep = report.url, report.deep
    if not check_leftovers(report, url, storage_options):  # an interrupted save: named, nothing else to check
        return
    try:
        spec = resolve_spec(url, storage_options, format)
    except Exception as exc:  # noqa: BLE001 - reported, unless the name says which format to check
        spec = _format_by_name(url) if not isinstance(exc, FileNotFoundError) else None
        if spec is None:
            report.problems.append(_err(exc))
            return
        report.notes.append(f"format not detected ({_err(exc)}); checking it as {spec.descriptor} by its name")
    report.format = spec.descriptor
    checks = {"dcp": _check_dcp, "safetensors": _check_safetensors, "torch_save": _check_torch_save}
    check = checks.get(spec.name)
    if check is not None:
        check(report, url, storage_options)
    else:
        report.notes.append(f"format {spec.descriptor} is a plugin's: only its reader's metadata is checked")
        try:
            spec.open_reader(url, storage_options=storage_options).read_metadata()
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(_err(exc))
    if not deep:
        report.notes.append("tensor data not read (pass --deep to read every tensor)")
        return
    if report.problems:
        report.notes.append("deep read skipped: the checks above failed")
        return
    _deep_read(report, url, storage_options, spec.name, progress, on_start)
    if spec.name == "torch_save" and not report.problems:
        try:
            _check_crc32(report, url, storage_options)
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(_err(exc))
        report.notes.append("CRC32 of every zip record (written by torch's zip writer) checked")
    elif spec.name == "dcp":
        try:
            deep_check_dcp(report, url, storage_options)  # every recorded checksum, file by file
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(_err(exc))
    elif spec.name == "safetensors":
        try:
            deep_check_safetensors(report, url, storage_options)  # every digest the headers record
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(_err(exc))
    if not any("checksum" in n or "CRC32" in n for n in report.notes):
        report.notes.append(NO_CHECKSUMS)
