"""``verify`` for ``torch.save`` files.

Shallow: zip end records and central directory, ``data.pkl`` decodable by the allow-list, every storage
record present, uncompressed, large enough and inside the file. Deep: the zip CRC32 of every stored record
(written by torch's zip writer), each read in pieces of bounded size.
"""

from __future__ import annotations

from typing import Any

from dcp_storage.formats.reports import VerifyReport, error_text
from dcp_storage.formats.torch_save.archive import TorchSaveArchive
from dcp_storage.formats.torch_save.zip_index import STORED, data_starts, read_zip_index
from dcp_storage.integrity.checksums import crc32, mismatch
from dcp_storage.transports.factory import open_transport

__all__ = ["check_torch_save", "deep_check_torch_save"]

_CRC_CHUNK = 8 * 1024 * 1024


def check_torch_save(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        try:
            archive = TorchSaveArchive.open(transport, path)
            archive._data_starts()  # every storage record's local header, inside the entry area
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(error_text(exc))
            return
        report.checked["files"] = 1
        report.checked["tensors"] = len(archive.tensors)
        report.checked["chunks"] = len(archive.tensors)


def deep_check_torch_save(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    if report.problems:  # a tensor did not read back: that is the finding, its record's CRC adds nothing
        return
    try:
        _check_crc32(report, url, storage_options)
    except Exception as exc:  # noqa: BLE001 - reported
        report.problems.append(error_text(exc))
    report.notes.append("CRC32 of every zip record (written by torch's zip writer) checked")


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
                crc = crc32(transport.read_range(path, lo, hi), crc)
            if crc != entry.crc32:
                report.problems.append(
                    f"{index.url}: record {name!r}: {mismatch('CRC32', f'{entry.crc32:08x}')}: "
                    "the bytes were changed after the file was written"
                )
        report.checked["crc32_records"] = len(names)
