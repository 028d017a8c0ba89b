"""Create-if-absent writes: the one primitive that lets exactly one of two writers win.

A save claims its location by creating a small object that must not exist yet
(:mod:`dcp_storage.storage.claim`). Checking first and writing second is not enough: two writers both see
"absent" and both write. Each store has an atomic primitive, used here:

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
own object and would report "exists": :func:`create_new` then compares the stored bytes with its own (the
callers' bytes carry a random save id), so a lost response does not turn a winner into a loser.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from fsspec.implementations.memory import MemoryFileSystem

from .gcs_io import gcs_create
from .s3_stream import can_stream, s3_call

__all__ = ["create_new", "holds"]

_MEMORY_LOCK = threading.Lock()
_OWN_CHECK_LIMIT = 64 * 1024  # a claim is a few hundred bytes: a larger object is not ours, and is not read


def create_new(transport: Any, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` if nothing is there; ``True`` if this call created it.

    ``False`` means another writer's object is at ``path`` (its bytes differ from ``data``). Transient
    failures are retried under the transport's policy; other errors are raised. Counted as one request;
    the bytes are not added to ``bytes_written``, which sums the bytes a checkpoint keeps (a claim is
    removed when its save commits).
    """
    transport.counters.add(requests=1)
    if transport.is_local:
        return _create_local(path, data)
    url = transport.url(path)
    try:
        transport._retry(lambda: _put_if_absent(transport, path, data), lambda: f"create {url} if absent")
    except FileExistsError:
        return holds(transport, path, data)
    return True


def _create_local(path: str, data: bytes) -> bool:
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


def _put_if_absent(transport: Any, path: str, data: bytes) -> None:
    """One conditional write; ``FileExistsError`` if an object is at ``path``."""
    fs = transport.fs
    if can_stream(fs):
        bucket, key, _ = fs.split_path(path)
        try:
            s3_call(fs, "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except OSError as exc:
            if _precondition_failed(exc):
                raise FileExistsError(f"{transport.url(path)} exists") from exc
            raise
        fs.invalidate_cache(path)
    elif transport._gcs:
        gcs_create(fs, path, data)
    elif isinstance(fs, MemoryFileSystem):
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
