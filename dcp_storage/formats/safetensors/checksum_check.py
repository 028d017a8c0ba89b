"""Checking safetensors files against the checksums their headers record, for ``verify`` (``--deep``).

Shallow: every file says whether it records checksums; those that do have their header digest and the
coverage of their tensors checked (two small reads per file). Deep: every recorded digest is compared,
reading each tensor's bytes in pieces of at most ``piece_bytes`` when its pieces are contiguous byte ranges
(a ``Shard(0)`` chunk, or a tensor written whole), or the tensor whole when a piece is strided (a
``Shard(1)`` chunk): memory stays near the largest such tensor. Every problem names URL, range and key.
"""

from __future__ import annotations

from typing import Any

import torch

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.safetensors.checksums import FileSums, Piece
from dcp_storage.formats.safetensors.write_plan import chunk_runs
from dcp_storage.integrity.checksums import mismatch, new_hasher
from dcp_storage.integrity.verify_notes import PIECE_BYTES, no_checksums_note

__all__ = ["check_file", "report_safetensors_checksums", "safetensors_provenance"]


def _contiguous_range(piece: Piece, shape: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """``[begin, end)`` of the piece inside its tensor's bytes, when it is one run; else ``None``."""
    runs = chunk_runs(shape, piece.offsets, piece.sizes, itemsize)
    if runs.count > 1:
        return None
    return (runs.start, runs.start + runs.nbytes)


def check_file(
    transport: Any, path: str, *, deep: bool, piece_bytes: int = PIECE_BYTES
) -> tuple[FileSums | None, list[str], int]:
    """The file's checksums, the problems found and how many digests were compared."""
    try:
        sums, header = FileSums.read(transport, path)
    except DcpStorageError as exc:
        return None, [str(exc)], 0
    if not sums.present:
        return sums, [], 0
    problems = [p for p in (sums.header_problem(),) if p]
    problems += sums.coverage_problems(header.tensors)
    if problems or not deep:
        return sums, problems, 0
    compared = 0
    for name, entry in header.tensors.items():
        shape, itemsize = entry.shape, entry.dtype.itemsize
        base = header.data_start + entry.begin
        span = f"bytes [{base}, {base + entry.nbytes})"
        pieces = sums.pieces(name, shape)
        if isinstance(pieces, str):  # reported by coverage_problems
            continue
        ranges = [_contiguous_range(p, shape, itemsize) for p in pieces]
        if all(r is not None for r in ranges):
            for piece, r in zip(pieces, ranges):
                lo, hi = r  # type: ignore[misc]
                hasher = new_hasher(sums.algorithm or "")
                for at in range(base + lo, base + hi, piece_bytes):
                    hasher.update(transport.read_range(path, at, min(at + piece_bytes, base + hi)))
                compared += 1
                got = hasher.hexdigest()
                if got != piece.digest:
                    problems.append(
                        f"{sums.url} bytes [{base + lo}, {base + hi}) (holding {piece.describe(name)}): "
                        f"{mismatch(sums.algorithm, piece.digest)}: the stored "
                        "bytes changed after they were written"
                    )
            continue
        raw = bytes(transport.read_range(path, base, base + entry.nbytes))
        full = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        problem = sums.check_tensor(name, shape, itemsize, full, span)
        compared += len(pieces)
        if problem:
            problems.append(problem)
    return sums, problems, compared


def report_safetensors_checksums(report: Any, transport: Any, paths: list[str], *, deep: bool) -> None:
    """Add the checksum findings of the safetensors files ``paths`` to a ``VerifyReport``."""
    with_sums, without, compared, writers, algorithms = 0, 0, 0, set(), set()
    for path in paths:
        sums, problems, n = check_file(transport, path, deep=deep)
        report.problems.extend(p for p in problems if p not in report.problems)
        compared += n
        if sums is None:
            continue
        if sums.present:
            with_sums += 1
            writers.add(sums.writer or "unknown writer")
            algorithms.add(sums.algorithm or "unknown algorithm")
        else:
            without += 1
    if with_sums == 0:
        if not deep:
            report.notes.append(
                no_checksums_note(
                    "not dcp-storage's SafetensorsWriter: safetensors files written by others carry no checksum"
                )
            )
        return
    written_by = ", ".join(sorted(writers))
    if deep:
        report.checked["checksum_records"] = compared
        report.notes.append(
            f"{', '.join(sorted(algorithms))} checksums of {compared} tensor pieces in {with_sums} files checked "
            f"(written by {written_by})" + (f"; {without} files record none" if without else "")
        )
    elif not report.deep:
        report.notes.append(
            f"header checksums of {with_sums} files checked ({', '.join(sorted(algorithms))} checksums of the "
            "tensor data: pass --deep)" + (f"; {without} files record none" if without else "")
        )


def safetensors_provenance(transport: Any, paths: list[str]) -> dict[str, Any]:
    """Provenance for ``inspect`` from the headers of ``paths``: format, writer, checksums (empty if none)."""
    writers, formats, algorithms, records, without = set(), set(), set(), 0, 0
    for path in paths:
        try:
            sums, _header = FileSums.read(transport, path)
        except DcpStorageError as exc:
            return {"error": str(exc)}
        if not sums.present and sums.writer is None:
            without += 1
            continue
        writers.add(sums.writer or "unknown")
        formats.add(sums.format or "safetensors")
        if sums.algorithm:
            algorithms.add(sums.algorithm)
        records += sum(1 if not v.startswith("[") else v.count('"') // 2 for v in sums.values.values())
    if not writers:
        return {}
    out: dict[str, Any] = {
        "format": ", ".join(sorted(formats)),
        "writer": ", ".join(sorted(writers)),
        "extensions": [],
        "checksums": ", ".join(sorted(algorithms)) or None,
        "checksummed_records": records,
    }
    if without:
        out["files_without_provenance"] = without
    return out
