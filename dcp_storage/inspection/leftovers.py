"""What ``verify`` says about leftovers of interrupted saves: an incomplete checkpoint, pending uploads.

An interrupted save at the checkpoint's location is a *problem* (there is no checkpoint there); in-progress
multipart uploads under it are *notes* (they never make a checkpoint look complete, they only cost storage,
and a young one may belong to a save that is still running).
"""

from __future__ import annotations

from typing import Any

from ..errors import DcpStorageError
from ..formats.completeness import find_leftovers
from ..formats.reports import VerifyReport
from ..transports.factory import open_transport
from .uploads import list_pending_uploads

__all__ = ["check_leftovers"]

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
