"""Create-if-absent writes: the one primitive that lets exactly one of two writers win.

A save claims its location by creating a small object that must not exist yet
(:mod:`dcp_storage.storage.claim`). Checking first and writing second is not enough: two writers both see
"absent" and both write. Each store has an atomic primitive, which its transport's ``create_new`` uses
(GCS's is in :mod:`.gcs_io`, the others here):

* local disk: ``open(O_CREAT | O_EXCL)``, then the bytes. No ``fsync``: every process sees the file at
  once, and a claim only has to outlive its save's process, not the machine (after a power loss no save
  is running any more);
* S3: ``PutObject`` with ``If-None-Match: *`` (``412 PreconditionFailed`` when the key exists; a
  ``409 ConditionalRequestConflict`` while another conditional write to the key is in flight is retried);
* GCS: an upload with ``ifGenerationMatch=0`` (``412``, which gcsfs maps to ``FileExistsError``);
* anything else: fsspec's ``pipe_file(path, data, mode="create")``. adlfs sends ``If-None-Match: *``
  (azurite and Azure answer ``409 BlobAlreadyExists``, adlfs raises ``FileExistsError``); ``memory://``
  checks its store and then writes, so those calls hold a process-wide lock (the store lives in the
  process, so the lock makes the pair atomic). A filesystem that does not implement ``mode="create"``
  inherits fsspec's default, which checks and then writes: not atomic (a third-party filesystem's own
  limit, stated in the README).

A request retried after a lost response (the store created the object, the answer never arrived) sees its
own object and would report "exists": ``create_new`` then compares the stored bytes with its own
(:func:`holds`; the callers' bytes carry a random save id), so a lost response does not turn a winner
into a loser.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from fsspec.implementations.memory import MemoryFileSystem

from dcp_storage.transports.s3_stream import s3_call

__all__ = ["create_local", "fsspec_put_if_absent", "holds", "s3_put_if_absent"]

_MEMORY_LOCK = threading.Lock()

_OWN_CHECK_LIMIT = 64 * 1024  # a claim is a few hundred bytes: a larger object is not ours, and is not read


def create_local(path: str, data: bytes) -> bool:
    """``O_CREAT | O_EXCL``, then the bytes: ``True`` if this call created ``path``."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise
    finally:
        os.close(fd)
    return True


def s3_put_if_absent(fs: Any, path: str, data: bytes, url: str) -> None:
    """One conditional ``PutObject``; ``FileExistsError`` if an object is at ``path``."""
    bucket, key, _ = fs.split_path(path)
    try:
        s3_call(fs, "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except OSError as exc:
        if _precondition_failed(exc):
            raise FileExistsError(f"{url} exists") from exc
        raise
    fs.invalidate_cache(path)


def fsspec_put_if_absent(fs: Any, path: str, data: bytes) -> None:
    """fsspec's ``pipe_file(mode="create")``; ``memory://`` under the process-wide lock."""
    if isinstance(fs, MemoryFileSystem):
        with _MEMORY_LOCK:
            fs.pipe_file(path, data, mode="create")
    else:
        fs.pipe_file(path, data, mode="create")


def _precondition_failed(exc: BaseException) -> bool:
    """Whether S3 refused the write because the key exists (412 ``PreconditionFailed``)."""
    current: BaseException | None = exc
    while current is not None:
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return True
        current = current.__cause__
    return False


def holds(transport: Any, path: str, data: bytes) -> bool:
    """Whether the object at ``path`` is ``data``: our own write, whose first response was lost.

    For any transport with ``size`` and ``read_file`` (a plugin's ``create_new`` uses it too).
    """
    try:
        if transport.size(path) != len(data) or len(data) > _OWN_CHECK_LIMIT:
            return False
        return bytes(transport.read_file(path)) == bytes(data)
    except FileNotFoundError:  # removed meanwhile: still not ours
        return False
