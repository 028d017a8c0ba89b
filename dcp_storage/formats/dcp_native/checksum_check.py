"""Checking a DCP checkpoint against its manifest's checksums, for ``verify`` (``dcp-storage verify``).

Shallow: every file the manifest lists is present with exactly the size recorded, and every record of the
metadata has a checksum. Deep: every file is read sequentially in pieces of at most ``piece_bytes`` (so
memory stays bounded whatever the file size) and each record's checksum is compared; every mismatch is
reported with its URL, byte range and the keys stored there, not just the first.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.dcp_native.crc_check import check_record_crcs
from dcp_storage.formats.dcp_native.manifest_io import read_manifest
from dcp_storage.formats.limits import METADATA, read_limited
from dcp_storage.formats.paths import METADATA_FILE
from dcp_storage.integrity.checksums import mismatch, new_hasher
from dcp_storage.integrity.manifest import Manifest
from dcp_storage.integrity.read_verify import key_name
from dcp_storage.integrity.verify_notes import PIECE_BYTES, no_checksums_note
from dcp_storage.text import printable

__all__ = ["ChecksumCheck", "check_dcp_checksums", "report_dcp_checksums"]
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
