"""Abandoned multipart uploads under a checkpoint prefix: list them, and abort the stale ones.

Object-store writes commit by completing a multipart upload (see :mod:`dcp_storage.transports`); a writer
that fails aborts its upload, but one that is killed (SIGKILL, OOM, a preempted node) cannot. Its parts
stay in the bucket, invisible to listings and reads but billed, until someone aborts the upload or a
bucket lifecycle rule (``AbortIncompleteMultipartUpload``) does. They never make a checkpoint look
complete; they only cost storage. ``verify`` names them, ``verify --cleanup`` /
:func:`abort_stale_uploads` aborts those older than a threshold (a younger one may belong to a save that
is still running).

Only transports with the optional :class:`~dcp_storage.transports.MultipartUploads` protocol (the S3
transport) have multipart uploads; for others the list is empty.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable
from typing import Any, TypeVar

from dcp_storage.transports import MultipartUploads
from dcp_storage.transports.factory import open_transport
from dcp_storage.transports.s3_pending import PendingUpload

__all__ = ["PendingUpload", "abort_stale_uploads", "list_pending_uploads"]

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
