"""The tool hooks of the ``npz`` format: what ``inspect`` shows and what ``verify`` checks.

``describe``: every array with the file and byte range of its data. ``check``: the zip directory readable,
every member an uncompressed ``.npy`` array with a readable header, a dtype torch has (object arrays
refused: they need pickle) and exactly the data bytes its header promises. ``deep_check``: the CRC32 of
every member, read in bounded pieces.
"""

from __future__ import annotations

import posixpath
import zlib
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
            dtype = str(torch_dtype(m.dtype, archive.where(m.member))).removeprefix("torch.")
            chunk = ChunkInfo([0] * len(m.shape), list(m.shape), name, m.data_offset, m.nbytes)
            tensors.append(TensorInfo(m.key, dtype, list(m.shape), m.nbytes, [chunk]))
        files = [FileInfo(name, archive.size)]
    return CheckpointInfo(url, spec.descriptor, spec.description, "NumPy .npz archive", files, tensors)


def check_npz(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        try:
            parsed = NpzArchive(transport, path).parse()
        except DcpStorageError as exc:
            report.problems.append(str(exc))
            return
        problems = [str(found) for found in parsed.values() if isinstance(found, DcpStorageError)]
    report.problems.extend(problems)  # one problem per member
    good = len(parsed) - len(problems)
    report.checked.update(files=1, tensors=good, chunks=good)


def deep_check_npz(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
    transport, path = open_transport(url, storage_options)
    with transport:
        archive = NpzArchive(transport, path)
        names = archive.names()
        for name in names:
            entry = archive.index.entries[name]
            if entry.method != 0:
                continue  # compressed: check reports it; its stored bytes are not what the CRC covers
            start, end = archive.data_range(name)
            crc = 0
            for at in range(start, end, _PIECE):
                crc = zlib.crc32(transport.read_range(path, at, min(at + _PIECE, end)), crc)
            if crc != entry.crc32:
                report.problems.append(
                    f"{archive.where(name)}: CRC32 {crc:08x}, the zip records {entry.crc32:08x}: the bytes changed"
                )
    report.checked["crc32_records"] = len(names)
    report.notes.append("CRC32 of every .npz member checked")
