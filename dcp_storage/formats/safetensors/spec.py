"""The safetensors format's spec: ``inspect`` and ``verify`` of safetensors checkpoints.

``inspect`` for safetensors checkpoints: every header's entries, the files, and the header provenance.

``verify`` for safetensors checkpoints (a file, a directory, an HF index, torch's DCP layouts).

Shallow: every header valid (JSON, dtypes, offsets inside the file, no overlaps), no trailing bytes after
the data section (the reference implementation refuses those), the index's ``weight_map`` consistent with
the headers, pieces tiling their tensors, a lone shard's set named; header digests and checksum coverage
where the writer recorded them. Deep: every digest the headers record
(:mod:`.checksum_check`).

Format registration for safetensors: single files, directories, HF indexes, torch's DCP layouts.
"""

from __future__ import annotations

import math
import os
import posixpath
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.columns import column_table, columns_of
from dcp_storage.formats.dcp_native.spec import SAFETENSORS, dcp_data_kind
from dcp_storage.formats.paths import HF_SHARD_RE, INDEX_SUFFIX, METADATA_FILE, SAFETENSORS_SUFFIX
from dcp_storage.formats.reports import (
    CheckpointInfo,
    FileInfo,
    TensorInfo,
    ValueInfo,
    VerifyReport,
    error_text,
    size_or_none,
    tensor_table,
)
from dcp_storage.formats.safetensors.checksums import FileSums
from dcp_storage.formats.safetensors.convert_out import TARGET
from dcp_storage.formats.safetensors.loader import blobs_of, read_headers, scan_metadata
from dcp_storage.formats.safetensors.metadata import (
    StoredBytes,
    StoredChunk,
    build_metadata,
    discover,
    looks_like_safetensors,
    resolve,
)
from dcp_storage.formats.safetensors.write_plan import report_safetensors_checksums, safetensors_provenance
from dcp_storage.formats.spec import HEAD_BYTES, FormatSpec, Probe
from dcp_storage.transports import open_transport

__all__ = ["FORMAT", "check_safetensors", "check_shard_set", "deep_check_safetensors", "describe_safetensors"]


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
        found: dict[Any, Any] = {}
        md = scan_metadata(transport, layout, found=found)
        # the provenance comes from the same header bytes: a header is fetched and parsed once
        known = {
            resolve(transport, layout.root, blob.file): FileSums(url, header.metadata, raw)
            for blob, (header, raw, url) in found.items()
            if blob.base == 0
        }
        del found
        cols = columns_of(md)
        if cols is not None:  # a header scanned as columns: rows built from arrays when asked for
            tensors, values = column_table(cols)
        else:
            tensors, values = _table(md)
        names = list(layout.files)
        if layout.kind == "index" and layout.index_path is not None:
            names.append(posixpath.basename(layout.index_path.replace(os.sep, "/")))
        if layout.kind == "dcp":
            names.append(METADATA_FILE)
        files = [FileInfo(n, size_or_none(transport, resolve(transport, layout.root, n))) for n in sorted(set(names))]
        provenance = (
            {}
            if layout.kind == "dcp"
            else safetensors_provenance(transport, [resolve(transport, layout.root, n) for n in layout.files], known)
        )
    kind = _LAYOUTS.get(layout.kind, layout.kind)
    return CheckpointInfo(url, spec.descriptor, spec.description, kind, files, tensors, values, provenance)


def _table(md: Any) -> tuple[list[TensorInfo], list[ValueInfo]]:
    """The rows of a plain ``Metadata``, each chunk placed by its storage entry."""
    # keyed by plain tuples: a MetadataIndex per lookup was seconds at a million tensors
    by_key = {(k.fqn, None if k.offset is None else tuple(k.offset)): v for k, v in (md.storage_data or {}).items()}

    def locate(fqn: str, offsets: list[int] | None) -> tuple[Any, ...]:
        entry = by_key.get((fqn, None if offsets is None else tuple(offsets)))
        if isinstance(entry, StoredChunk):
            return (entry.file, entry.data_offset, math.prod(entry.shape) * entry.dtype.itemsize)
        if isinstance(entry, StoredBytes):
            return (entry.file, entry.offset, entry.length)
        return (None, None, None)

    return tensor_table(md, locate)


_SIBLINGS_NAMED = 8


def check_safetensors(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    """The shallow checks (see the module docstring)."""
    transport, target = open_transport(url, storage_options)
    with transport:
        try:
            layout = discover(transport, target)
            blobs = blobs_of(layout)
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(error_text(exc))
            return
        headers, urls, broken = {}, {}, 0
        for blob in blobs:
            try:
                got, where = read_headers(transport, layout, [blob])
            except Exception as exc:  # noqa: BLE001 - one problem per file
                report.problems.append(error_text(exc))
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
            report.problems.append(error_text(exc))
            return
        report.checked["tensors"] = sum(isinstance(i, TensorStorageMetadata) for i in md.state_dict_metadata.values())
        report.checked["chunks"] = sum(
            len(i.chunks) for i in md.state_dict_metadata.values() if isinstance(i, TensorStorageMetadata)
        )
        if layout.kind != "dcp":  # header digests and coverage; torch's DCP layouts record none
            paths = [resolve(transport, layout.root, f) for f in sorted({b.file for b in blobs})]
            report_safetensors_checksums(report, transport, paths, deep=False)


def deep_check_safetensors(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    """Every digest the headers record, each file read in bounded memory."""
    transport, target = open_transport(url, storage_options)
    with transport:
        layout = discover(transport, target)
        files = sorted({b.file for b in blobs_of(layout) if b.base == 0})
        report_safetensors_checksums(report, transport, [resolve(transport, layout.root, f) for f in files], deep=True)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SIBLINGS_NAMED])
    return shown + (f" and {len(names) - _SIBLINGS_NAMED} more" if len(names) > _SIBLINGS_NAMED else "")


def check_shard_set(report: VerifyReport, transport: Any, root: str, name: str) -> None:
    """Name the index and siblings of ``name`` (a file under ``root``) if it is one shard of an HF set.

    ``model-00001-of-00003.safetensors`` verified alone is a valid file, but only one part of a checkpoint:
    the report names the set's index and siblings and asks for the index to be verified. A set whose
    siblings or index are missing cannot be loaded as a whole (readers refuse shards without their index
    as an interrupted save), so that is a problem, not a note.
    """
    shard = HF_SHARD_RE.match(name)
    if shard is None:
        return
    number, _, total = name[len(shard.group("prefix")) + 1 : -len(".safetensors")].partition("-of-")
    count = int(total)
    siblings = [f"{shard.group('prefix')}-{i:0{len(number)}d}-of-{total}.safetensors" for i in range(1, count + 1)]
    siblings = [s for s in siblings if s != name]
    index = shard.group("prefix") + INDEX_SUFFIX
    try:
        present = set(transport.listdir(root))
    except DcpStorageError as exc:  # an unlistable parent: say what to look for
        report.notes.append(f"{name} is one shard of a sharded set of {count}; its directory cannot be listed ({exc})")
        return
    missing = [s for s in [index, *siblings] if s not in present]
    where = transport.url(root)
    if missing:
        report.problems.append(
            f"{name} is shard {int(number)} of a sharded set of {count}, but {_listed(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {where}: the set cannot be loaded "
            f"(an interrupted save or download?)"
        )
        return
    report.notes.append(
        f"{name} is one shard of a sharded set: verify {posixpath.join(where, index)} to check the whole set "
        f"(siblings: {_listed(siblings)})"
    )


_UNKNOWN_SIZE = 1 << 62  # a directory probe reads heads only; the reader checks real sizes


def _sniff(probe: Probe) -> int | None:
    if not probe.is_dir:
        if probe.basename.endswith(INDEX_SUFFIX) and probe.head.lstrip().startswith(b"{"):
            return 100
        return 100 if looks_like_safetensors(probe.head, probe.size) else None
    if probe.first_named(INDEX_SUFFIX) is not None:
        return 90
    first = probe.first_named(SAFETENSORS_SUFFIX)  # a directory of a million data files: no Python loop
    if first is not None:
        return 80 if looks_like_safetensors(probe.head_of(first, HEAD_BYTES), _UNKNOWN_SIZE) else None
    if (
        METADATA_FILE in probe.names
    ):  # FileSystemWriter(serialization_format=SAFETENSORS): .distcp files are safetensors
        return 100 if dcp_data_kind(probe) == SAFETENSORS else None
    return None


FORMAT = FormatSpec(
    name="safetensors",
    version="1",
    sniff=_sniff,
    description="safetensors: a file, a directory, an HF model.safetensors.index.json, torch's DCP layouts",
    reader="dcp_storage.SafetensorsReader(url)",
    describe=describe_safetensors,
    check=check_safetensors,
    deep_check=deep_check_safetensors,
    convert_target=TARGET,
    suffixes=(SAFETENSORS_SUFFIX, INDEX_SUFFIX),
)
