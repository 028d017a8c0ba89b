"""What ``verify`` says about leftovers of interrupted saves: an incomplete checkpoint, pending uploads.

An interrupted save at the checkpoint's location is a *problem* (there is no checkpoint there); in-progress
multipart uploads under it are *notes* (they never make a checkpoint look complete, they only cost storage,
and a young one may belong to a save that is still running).

:func:`remove_stale_leftovers` (``verify --cleanup``) removes what a killed save left that no running save
can own: its stale locks (judged and taken over as a save would, :mod:`dcp_storage.storage.claim`, so a
save starting meanwhile and the cleanup never both act) and then, on a local disk, the temp files of its
unfinished writes. A location whose lock is held by a live (or unknown) holder is left untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.completeness import find_leftovers, list_all
from dcp_storage.formats.paths import LOCK_RE, TEMP_RE
from dcp_storage.formats.reports import VerifyReport
from dcp_storage.inspection.uploads import list_pending_uploads
from dcp_storage.storage.claim import hold_stale_lock
from dcp_storage.storage.takeover import MARKER_SUFFIX
from dcp_storage.transports.factory import open_transport

__all__ = ["Cleanup", "check_leftovers", "remove_stale_leftovers"]

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
