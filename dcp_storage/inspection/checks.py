"""``verify``: is a checkpoint complete and readable? Every problem is collected and named, not just the first.

The checks are the format's own (its spec's ``check`` and ``deep_check`` hooks, in ``formats/<name>/``):
shallow ones read metadata, headers and file sizes only. ``deep=True`` then reads every tensor and value
through the format's reader, tensors in batches of up to 16 MiB (memory near the largest tensor or 16 MiB;
a batch that fails is read again one tensor at a time, so each problem names its tensor), and runs the format's deep
checks (recorded checksums, CRCs). A format without a ``check`` hook is checked by loading its reader's
metadata. Checkpoints written by dcp-storage carry a checksum of every record; without them the report
says so.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from dcp_storage.conversion.memory import MemoryReleaser
from dcp_storage.conversion.source import SourceTensor, TensorSource, byte_batches
from dcp_storage.errors import StaleManifestWarning
from dcp_storage.formats.detection import registered_formats
from dcp_storage.formats.reports import VerifyReport, error_text
from dcp_storage.formats.spec import FormatSpec
from dcp_storage.inspection.leftovers import check_leftovers
from dcp_storage.inspection.summary import resolve_spec
from dcp_storage.text import printable

__all__ = ["VerifyReport", "verify"]

NO_CHECKSUMS = (
    "no checksums recorded: this checkpoint's writer recorded none, so bit flips inside tensor data cannot be detected"
)


# -------------------------------------------------------------------------------------------- deep
def _deep_read(
    report: VerifyReport,
    url: str,
    storage_options: dict[str, Any] | None,
    format: str | None,
    progress: Callable[[int], None] | None,
    on_start: Callable[[int], None] | None,
) -> None:
    with warnings.catch_warnings():  # a stale manifest is the checksum check's note, not a line on stderr
        warnings.simplefilter("ignore", StaleManifestWarning)
        _read_all(report, url, storage_options, format, progress, on_start)


def _read_all(
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
        report.problems.append(f"cannot open for reading: {error_text(exc)}")
        return
    read, releaser = 0, MemoryReleaser()
    with source:
        if on_start is not None:
            on_start(source.tensor_bytes)
        for batch in byte_batches(source.tensors.values()):
            try:
                source.read_tensors([(info.fqn, None) for info in batch])  # dropped at once: only read
                read += len(batch)
            except Exception:  # noqa: BLE001 - read that batch again one by one, to name each problem
                read += _read_one_by_one(report, source, batch)
            releaser.freed(sum(info.nbytes for info in batch))
            if progress is not None:
                for info in batch:
                    progress(info.nbytes)
        for fqn in source.values:
            try:
                source.read_value(fqn)
            except Exception as exc:  # noqa: BLE001 - one problem per value
                report.problems.append(f"value {fqn!r}: {error_text(exc)}")
    report.checked["tensors_read"] = read


def _read_one_by_one(report: VerifyReport, source: TensorSource, batch: list[SourceTensor]) -> int:
    """Read each tensor of a batch that failed alone, recording one problem per failing tensor; returns
    how many were read."""
    read = 0
    for info in batch:
        try:
            source.read_tensor(info.fqn)
            read += 1
        except Exception as exc:  # noqa: BLE001 - one problem per tensor
            report.problems.append(f"tensor {info.fqn!r}: {error_text(exc)}")
    return read


def _format_by_name(url: str) -> FormatSpec | None:
    """The format a file name implies (its spec's ``suffixes``: ``.safetensors``, ``.pt``...), when detection
    failed; ``None`` when no format or more than one claims the name."""
    name = url.rstrip("/").lower()
    claims = [s for s in registered_formats().values() if any(name.endswith(x) for x in s.suffixes)]
    return claims[0] if len(claims) == 1 else None


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
            report.problems.append(error_text(exc))
            return
        report.notes.append(f"format not detected ({error_text(exc)}); checking it as {spec.descriptor} by its name")
    report.format = spec.descriptor
    if spec.check is not None:
        _run_hook(report, spec.check, storage_options)
    else:
        report.notes.append(f"format {spec.descriptor} has no checks of its own: only its reader's metadata is checked")
        try:
            spec.open_reader(url, storage_options=storage_options).read_metadata()
        except Exception as exc:  # noqa: BLE001 - reported
            report.problems.append(error_text(exc))
    if not deep:
        report.notes.append("tensor data not read (pass --deep to read every tensor)")
        return
    if report.problems:
        report.notes.append("deep read skipped: the checks above failed")
        return
    _deep_read(report, url, storage_options, spec.name, progress, on_start)
    if spec.deep_check is not None:
        _run_hook(report, spec.deep_check, storage_options)
    if not any("checksum" in n or "CRC32" in n for n in report.notes):
        report.notes.append(NO_CHECKSUMS)


def _run_hook(report: VerifyReport, hook: Callable[..., None], storage_options: dict[str, Any] | None) -> None:
    """A format's check; one that raises instead of reporting (a plugin's, on input it did not expect) is a
    problem of the checkpoint, not a crash of ``verify``."""
    try:
        hook(report, report.url, storage_options)
    except Exception as exc:  # noqa: BLE001 - reported
        report.problems.append(error_text(exc))
