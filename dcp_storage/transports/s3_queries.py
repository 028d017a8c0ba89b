"""S3 metadata requests (exists, size, list, delete) on s3fs's client, one attempt each.

s3fs runs these through its own retry wrapper (5 tries on connection errors and ``SlowDown``, unaware of
any deadline), under ours. Calling the botocore client directly leaves the transport's retry layer as the
only one, so a permanent fault costs exactly ``max_attempts`` requests and the final error's attempt
count is true. Semantics follow s3fs's for the cases the transport needs: a key is a file, a key prefix
followed by ``/`` is a directory.
"""

from __future__ import annotations

import posixpath
from typing import Any

from dcp_storage.transports.listing import ListingBound
from dcp_storage.transports.s3_stream import s3_call

__all__ = ["s3_delete", "s3_exists", "s3_list_names", "s3_size", "s3_size_version"]


def _split(fs: Any, path: str) -> tuple[str, str]:
    bucket, key, _ = fs.split_path(path)
    return bucket, key


def s3_size(fs: Any, path: str) -> int:
    """Size of the object at ``path`` (``HeadObject``); ``FileNotFoundError`` if there is none."""
    return s3_size_version(fs, path)[0]


def s3_size_version(fs: Any, path: str) -> tuple[int, str | None]:
    """Size and ETag of the object at ``path`` (one ``HeadObject``)."""
    bucket, key = _split(fs, path)
    head = s3_call(fs, "head_object", Bucket=bucket, Key=key)
    return int(head["ContentLength"]), head.get("ETag")


def s3_exists(fs: Any, path: str) -> bool:
    """Whether ``path`` is an object, or a prefix with objects under it (a directory), or a bucket."""
    bucket, key = _split(fs, path)
    if key:
        try:
            s3_call(fs, "head_object", Bucket=bucket, Key=key)
            return True
        except FileNotFoundError:
            pass
        prefix = key.rstrip("/") + "/"
        try:
            listed = s3_call(fs, "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
        except FileNotFoundError:  # NoSuchBucket
            return False
        return bool(listed.get("KeyCount") or listed.get("Contents") or listed.get("CommonPrefixes"))
    try:
        s3_call(fs, "head_bucket", Bucket=bucket)
        return True
    except FileNotFoundError:
        return False


def s3_list_names(fs: Any, path: str) -> list[str]:
    """Names of the objects and prefixes directly under ``path`` (sorted); empty if there are none."""
    bucket, key = _split(fs, path)
    prefix = key.rstrip("/") + "/" if key else ""
    names: set[str] = set()
    token: str | None = None
    bound = ListingBound(fs.unstrip_protocol(path))  # a listing that never ends is cut off (:mod:`.listing`)
    while True:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        if token:
            kwargs["ContinuationToken"] = token
        try:
            page = s3_call(fs, "list_objects_v2", **kwargs)
        except FileNotFoundError:  # NoSuchBucket
            return []
        for entry in page.get("Contents", ()):
            names.add(entry["Key"][len(prefix) :])
        for entry in page.get("CommonPrefixes", ()):
            names.add(posixpath.basename(entry["Prefix"].rstrip("/")))
        token = page.get("NextContinuationToken")
        done = not page.get("IsTruncated") or not token
        bound.page(len(page.get("Contents", ())) + len(page.get("CommonPrefixes", ())), None if done else token)
        if done:
            break
    names.discard("")  # a zero-byte "directory marker" object named like the prefix
    return sorted(names)


def s3_delete(fs: Any, path: str) -> None:
    """Delete the object at ``path``; deleting a missing key succeeds (S3 semantics), so retries are safe."""
    bucket, key = _split(fs, path)
    s3_call(fs, "delete_object", Bucket=bucket, Key=key)
    fs.invalidate_cache(path)
