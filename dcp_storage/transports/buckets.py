"""Buckets and containers: checked once per save, never created unless asked, named when missing.

s3fs's ``makedirs`` creates a missing bucket (gcsfs's and adlfs's ``mkdir`` do too), so a writer that
"makes the checkpoint directory" on an object store turns a typo in the bucket name into a new bucket and
saves there. Object stores have no directories to make, so writers here call :func:`prepare_output`
instead: on the coordinator one existence request for the bucket (S3 ``HeadBucket``, GCS ``GET b/{bucket}``,
Azure container properties), a :class:`~dcp_storage.errors.BucketNotFoundError` naming it if it is missing,
and ``makedirs`` only on filesystems with real directories (local disks, ``memory://``, SFTP...).
``create_bucket=True`` creates a missing bucket for users who want that.

Loads name a missing bucket too: :func:`missing_bucket` is asked on a reader's error path only, after
something was not found, so a healthy load makes no extra request.

A store has buckets when its fsspec filesystem splits paths into ``(bucket, key, version)`` (s3fs, gcsfs,
adlfs: ``split_path``). Transports without an fsspec filesystem (plugins) are left to their own rules.
"""

from __future__ import annotations

import contextlib
from typing import Any

from dcp_storage.errors import BucketNotFoundError, StorageAccessError
from dcp_storage.transports.access import access_errors

__all__ = [
    "LOAD_FIX",
    "SAVE_FIX",
    "bucket_of",
    "make_output_root",
    "missing_bucket",
    "prepare_output",
    "require_bucket",
]

_CONTAINER_PROTOCOLS = frozenset({"az", "abfs", "abfss", "adl"})
LOAD_FIX = "check the {noun} name in the URL, and the endpoint or account in storage_options"
SAVE_FIX = (
    "check the {noun} name in the URL; writers never create buckets or containers: create it first, or pass "
    "create_bucket=True (--create-bucket)"
)


def bucket_of(transport: Any, path: str) -> str | None:
    """The bucket (Azure: container) ``path`` lies in, or ``None`` for a store without buckets."""
    split = getattr(getattr(transport, "fs", None), "split_path", None)
    if not callable(split):
        return None
    try:
        bucket = split(path)[0]
    except (ValueError, TypeError, IndexError):
        return None
    return bucket if isinstance(bucket, str) and bucket else None


def _noun(transport: Any) -> str:
    protocol = getattr(transport.fs, "protocol", "")
    names = protocol if isinstance(protocol, (tuple, list)) else (protocol,)
    return "container" if _CONTAINER_PROTOCOLS & set(names) else "bucket"


def missing_bucket(transport: Any, path: str, fix: str = LOAD_FIX) -> BucketNotFoundError | None:
    """The error for ``path`` if its bucket does not exist (one request); ``None`` if it does or has none.

    ``fix`` may name the ``{noun}`` (``bucket`` or ``container``).
    """
    bucket = bucket_of(transport, path)
    if bucket is None or transport.exists(bucket):
        return None
    noun = _noun(transport)
    return BucketNotFoundError(transport.url(path), bucket, noun, fix.format(noun=noun))


def require_bucket(transport: Any, path: str, *, create: bool = False) -> None:
    """Raise :class:`BucketNotFoundError` if ``path``'s bucket is missing; with ``create``, create it instead.

    Credentials that may write objects but not ask about the bucket (S3 ``HeadBucket`` needs
    ``s3:ListBucket``) get a 403: the bucket's existence is then unknown, and the save goes on (its next
    request tells what is wrong, with a body that says why, where a HEAD answer has none).
    """
    try:
        error = missing_bucket(transport, path, SAVE_FIX)
    except StorageAccessError:
        return
    if error is None:
        return
    if not create:
        raise error
    with (
        access_errors(lambda: f"create {error.noun} {transport.url(error.bucket)}"),
        contextlib.suppress(
            FileExistsError  # another process created it meanwhile
        ),
    ):
        transport.fs.mkdir(error.bucket)


def make_output_root(transport: Any, root: str) -> None:
    """Create the output directory where directories exist; on object stores there is nothing to make."""
    if bucket_of(transport, root) is None:
        transport.makedirs(root)


def prepare_output(transport: Any, root: str, *, coordinator: bool, create_bucket: bool = False) -> None:
    """A writer's set-up for ``root``: the bucket checked (or created) by the coordinator, directories made."""
    if coordinator:
        require_bucket(transport, root, create=create_bucket)
    make_output_root(transport, root)
