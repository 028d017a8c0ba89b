"""``verify``'s whole-checkpoint checks: leftovers, unreferenced files and pending uploads.

Data files a killed ``overwrite=True`` save left beside a committed checkpoint (``verify --cleanup``).

Such a save writes its data files under new names and commits by replacing ``.metadata``
(:mod:`dcp_storage.formats.commit_claim`); killed before the commit, its files sit beside the old checkpoint,
which never names them, and cost storage until the next ``overwrite=True`` save retires them. This removes
them sooner, only where that is safe: a committed DCP checkpoint (the global ``.metadata``, no rank-local
``__{rank}.metadata``, which name files of their own) with no save's lock (a running save's files are
unreferenced too, until its commit).

Abandoned multipart uploads under a checkpoint prefix: list them, and abort the stale ones.

Object-store writes commit by completing a multipart upload (see :mod:`dcp_storage.transports`); a writer
that fails aborts its upload, but one that is killed (SIGKILL, OOM, a preempted node) cannot. Its parts
stay in the bucket, invisible to listings and reads but billed, until someone aborts the upload or a
bucket lifecycle rule (``AbortIncompleteMultipartUpload``) does. They never make a checkpoint look
complete; they only cost storage. ``verify`` names them, ``verify --cleanup`` /
:func:`abort_stale_uploads` aborts those older than a threshold (a younger one may belong to a save that
is still running).

Only transports with the optional :class:`~dcp_storage.transports.MultipartUploads` protocol (the S3
transport) have multipart uploads; for others the list is empty.

What ``verify`` says about leftovers of interrupted saves: an incomplete checkpoint, pending uploads.

An interrupted save at the checkpoint's location is a *problem* (there is no checkpoint there); in-progress
multipart uploads under it are *notes* (they never make a checkpoint look complete, they only cost storage,
and a young one may belong to a save that is still running).

:func:`remove_stale_leftovers` (``verify --cleanup``) removes what a killed save left that no running save
can own: its stale locks (judged and taken over as a save would, :mod:`dcp_storage.formats.commit_claim`, so a
save starting meanwhile and the cleanup never both act) and then, on a local disk, the temp files of its
unfinished writes. A location whose lock is held by a live (or unknown) holder is left untouched.

``verify``: is a checkpoint complete and readable? Every problem is collected and named, not just the first.

The checks are the format's own (its spec's ``check`` and ``deep_check`` hooks, in ``formats/<name>/``):
shallow ones read metadata, headers and file sizes only. ``deep=True`` then reads every tensor and value
through the format's reader, tensors in batches of up to 16 MiB (memory near the largest tensor or 16 MiB;
a batch that fails is read again one tensor at a time, so each problem names its tensor), and runs the format's deep
checks (recorded checksums, CRCs). A format without a ``check`` hook is checked by loading its reader's
metadata. Checkpoints written by dcp-storage carry a checksum of every record; without them the report
says so.
"""

from __future__ import annotations

import datetime as _dt
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dcp_storage.conversion.plan import MemoryReleaser
from dcp_storage.conversion.source import SourceTensor, TensorSource, byte_batches
from dcp_storage.errors import DcpStorageError, StaleManifestWarning
from dcp_storage.formats.commit_claim import hold_stale_lock, unreferenced_data_files
from dcp_storage.formats.commit_holder import MARKER_SUFFIX
from dcp_storage.formats.dcp_native.native import METADATA_FILE, read_metadata_file
from dcp_storage.formats.location import find_leftovers, list_all
from dcp_storage.formats.paths import LOCK_RE, RANK_METADATA_RE, TEMP_RE
from dcp_storage.formats.reports import VerifyReport, error_text
from dcp_storage.formats.spec import FormatSpec, registered_formats
from dcp_storage.inspection.summary import resolve_spec
from dcp_storage.text import printable
from dcp_storage.transports import MultipartUploads, open_transport
from dcp_storage.transports.s3_upload import PendingUpload

__all__ = [
    "Cleanup",
    "PendingUpload",
    "VerifyReport",
    "abort_stale_uploads",
    "check_leftovers",
    "list_pending_uploads",
    "remove_stale_leftovers",
    "remove_unreferenced_files",
    "verify",
]


def remove_unreferenced_files(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Remove the data files under ``url`` that its ``.metadata`` does not name; return their URLs.

    Removes nothing (returns ``[]``) unless ``url`` is a committed DCP checkpoint that no save holds.
    """
    transport, root = open_transport(url, storage_options)
    with transport:
        names = transport.listdir(root)
        if METADATA_FILE not in names or any(RANK_METADATA_RE.match(n) or LOCK_RE.match(n) for n in names):
            return []
        md = read_metadata_file(transport, transport.join(root, METADATA_FILE))
        referenced = {info.relative_path for info in (md.storage_data or {}).values()}
        directories = {name.rpartition("/")[0] for name in referenced if "/" in name}
        gone = unreferenced_data_files(transport, root, referenced, None, directories)
        for name in gone:
            transport.remove(transport.join(root, name))
        return [transport.url(transport.join(root, name)) for name in gone]


DEFAULT_OLDER_THAN = _dt.timedelta(hours=1)
_R = TypeVar("_R")


def _with_uploads(url: str, storage_options: dict[str, Any] | None, fn: Callable[[Any, str], _R], none: _R) -> _R:
    """``fn(transport, path)`` on the transport of ``url`` if it has multipart uploads, else ``none``."""
    transport, path = open_transport(url, storage_options)
    with transport:
        return fn(transport, path) if isinstance(transport, MultipartUploads) else none


def list_pending_uploads(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> list[PendingUpload]:
    """Every in-progress multipart upload for ``url`` or for objects under it (``url/...``).

    Empty for filesystems without multipart uploads. Raises :class:`~dcp_storage.errors.DcpStorageError`
    naming the bucket if the store refuses the listing (e.g. no ``s3:ListBucketMultipartUploads``).
    """
    return _with_uploads(os.fspath(url), storage_options, lambda t, path: t.pending_uploads(path), [])


def abort_stale_uploads(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    older_than: float | _dt.timedelta = DEFAULT_OLDER_THAN,
) -> list[PendingUpload]:
    """Abort the in-progress multipart uploads under ``url`` started more than ``older_than`` ago.

    ``older_than``: a :class:`~datetime.timedelta` or seconds (default one hour: an upload younger than
    that may belong to a save still running; ``0`` aborts every one). Uploads whose start time the store
    does not report are aborted only with ``older_than=0``. Returns the aborted uploads. An upload that
    is gone by the time it is aborted (completed or aborted meanwhile) is skipped.
    """
    limit = older_than if isinstance(older_than, _dt.timedelta) else _dt.timedelta(seconds=float(older_than))
    if limit < _dt.timedelta(0):
        raise ValueError(f"older_than must be >= 0, got {older_than!r}")
    now = _dt.datetime.now(_dt.timezone.utc)

    def abort(transport: Any, path: str) -> list[PendingUpload]:
        aborted = []
        for upload in transport.pending_uploads(path):
            age = upload.age(now)
            if limit and (age is None or age < limit):
                continue
            if transport.abort_upload(path, upload):
                aborted.append(upload)
        return aborted

    return _with_uploads(os.fspath(url), storage_options, abort, [])


_UPLOADS_NAMED = 5


def check_leftovers(report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> bool:
    """Note pending uploads under ``url``; add a problem and return ``False`` if ``url`` is an interrupted save."""
    try:
        uploads = list_pending_uploads(url, storage_options)
    except DcpStorageError as exc:
        report.notes.append(str(exc))
        uploads = []
    if uploads:
        named = "; ".join(u.describe() for u in uploads[:_UPLOADS_NAMED])
        more = f"; and {len(uploads) - _UPLOADS_NAMED} more" if len(uploads) > _UPLOADS_NAMED else ""
        report.notes.append(
            f"{len(uploads)} multipart upload(s) in progress under {url} (left by an interrupted or running "
            f"save; their parts are billed until aborted): {named}{more}. `dcp-storage verify --cleanup` aborts "
            "those older than --older-than"
        )
    try:
        transport, path = open_transport(url, storage_options)
        leftovers = find_leftovers(transport, path)
    except Exception:  # noqa: BLE001 - unreadable location: the format checks that follow report it
        return True
    if leftovers is None:
        return True
    report.problems.append(str(leftovers.error()))
    return False


@dataclass
class Cleanup:
    """What :func:`remove_stale_leftovers` removed (names under the location, and why each lock was stale),
    or why it removed nothing (``held``: a live save's lock)."""

    removed: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    held: str | None = None


def _is_lock(name: str) -> bool:
    while name.endswith(MARKER_SUFFIX):  # a takeover marker (of a marker) left by a taker that died
        name = name[: -len(MARKER_SUFFIX)]
    return LOCK_RE.match(name) is not None


def remove_stale_leftovers(url: str, storage_options: dict[str, Any] | None) -> Cleanup:
    """Remove the stale locks at ``url`` and (local disks) the temp files of killed saves (module docstring)."""
    transport, path = open_transport(url, storage_options)
    names = list_all(transport, path)
    held = []
    result = Cleanup()
    try:
        for name in sorted((n for n in names if _is_lock(n)), key=len, reverse=True):  # markers first
            claim, why = hold_stale_lock(transport, transport.join(path, name))
            if claim is None:
                result.held = f"{transport.url(transport.join(path, name))}: held by {why}"
                return result
            held.append(claim)
            result.reasons[name] = why
        if getattr(transport, "is_local", False):
            for name in names:
                if TEMP_RE.match(name):
                    transport.remove(transport.join(path, name))
                    result.removed.append(name)
    finally:
        for claim in held:
            claim.release()
            result.removed.append(claim.path.rsplit("/", 1)[-1])
    return result


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
