"""The tool hooks of the ``npz`` format: what ``inspect`` shows and what ``verify`` checks.

``describe``: every array with the file and byte range of its data (stored members). ``check``: the zip
directory readable, every member a ``.npy`` array with a readable header, a dtype torch has (object arrays
refused: they need pickle) and, for stored members, exactly the data bytes its header promises.
``deep_check``: the CRC32 of every member, read in bounded pieces.
"""

from __future__ import annotations

import posixpath
import zipfile
from typing import Any

from dcp_storage.plugin_api import (
    CheckpointInfo,
    ChunkInfo,
    DcpStorageError,
    FileInfo,
    FormatSpec,
    TensorInfo,
    VerifyReport,
    open_transport,
)

from .archive import NpzArchive, torch_dtype

__all__ = ["check_npz", "deep_check_npz", "describe_npz"]

_PIECE = 1 << 20


def describe_npz(url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
    transport, path = open_transport(url, storage_options)
    with transport:
        archive = NpzArchive(transport, path)
        name = posixpath.basename(path)
        tensors = []
        for m in archive.members():
            dtype = str(torch_dtype(m.dtype, archive.url)).removeprefix("torch.")
            chunk = ChunkInfo([0] * len(m.shape), list(m.shape), name, m.data_offset, m.nbytes)
            tensors.append(TensorInfo(m.key, dtype, list(m.shape), m.nbytes, [chunk]))
        files = [FileInfo(name, archive.size)]
        archive.close()
    return CheckpointInfo(url, spec.descriptor, spec.description, "NumPy .npz archive", files, tensors)


def check_npz(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        try:
            archive = NpzArchive(transport, path)
        except DcpStorageError as exc:
            report.problems.append(str(exc))
            return
        good = 0
        for info in archive.zip.infolist():
            try:
                archive.member(info)
                good += 1
            except DcpStorageError as exc:  # one problem per member
                report.problems.append(str(exc))
        archive.close()
    report.checked.update(files=1, tensors=good, chunks=good)


def deep_check_npz(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        archive = NpzArchive(transport, path)
        infos = archive.zip.infolist()
        for info in infos:
            try:
                with archive.zip.open(info) as stream:  # zipfile compares the CRC32 at the member's end
                    while stream.read(_PIECE):
                        pass
            except (zipfile.BadZipFile, OSError) as exc:
                report.problems.append(f"{archive.url} (member {info.filename!r}): {exc}: the bytes changed")
        archive.close()
    report.checked["crc32_records"] = len(infos)
    report.notes.append("CRC32 of every .npz member checked")
