"""The GCS transport (gcsfs): JSON-API requests one attempt each, under our retries.

GCS requests on gcsfs's session, one attempt each, so that the transport's retry layer is the only one.

gcsfs wraps every JSON-API request (``GCSFileSystem._request``) in ``retry_request``: 6 tries with sleeps
of 1, 2, 4, 8, 16 s on 5xx, 429 and connection errors. The count is fixed when the class is defined
(``@retry_request(retries=retries)``), so no constructor argument or storage option turns it down. The
functions here call the undecorated request (``_request.__wrapped__``, kept by the ``decorator`` package
gcsfs uses) with gcsfs's own session, headers, credentials and error mapping (404 is
``FileNotFoundError``, other errors ``HttpError`` with the status as ``code``): a permanent fault then
costs exactly the policy's ``max_attempts`` requests, and its deadline holds. Ranged reads check the
answer's status and ``Content-Range`` before reading the body (:func:`gcs_read_range`, :mod:`.range_check`).

Writes: :class:`GcsAtomicUpload` sends the whole file as one ``uploadType=media`` request at commit, from
memory (small files) or from a temporary file it spills to (larger ones). A media upload is idempotent (a
retry overwrites) and atomic (the object appears whole or not at all), so the retry layer can resend it
after any failure, including a response lost after GCS stored the object. A resumable upload would resend
only one chunk, but resuming after a chunk whose response was lost needs the persisted offset from a
status query (``Content-Range: bytes */*``), which the emulator (fake-gcs-server) does not implement: it
appends every chunk it gets and commits on a status query. The cost of the media upload: a failed attempt
resends the whole file, and the file passes through local disk when larger than one part.

The GCS transport (gcsfs): JSON-API requests one attempt each, under our retries (see :mod:`.gcs_io`).

Ranged reads check the answer's status and ``Content-Range`` before reading the body. Writes are one
media upload at close, sent from memory or a local spill file and retried as a whole, and never sent on
error; create-if-absent is an upload with ``ifGenerationMatch=0``.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any

from dcp_storage.transports.fsspec_transport import FsspecTransport, builtin_backend
from dcp_storage.transports.guards import IDENTITY, ListingBound, VersionConditionFailed, read_range_body
from dcp_storage.transports.http_store import read_prefix
from dcp_storage.transports.protocol import CountingWriter
from dcp_storage.transports.retry import bounded_sync

__all__ = [
    "GcsAtomicUpload",
    "GcsTransport",
    "gcs_create",
    "gcs_delete",
    "gcs_exists",
    "gcs_list_names",
    "gcs_put",
    "gcs_read",
    "gcs_read_range",
    "gcs_size",
    "gcs_size_version",
    "is_gcs",
]


_CONTENT_TYPE = "application/octet-stream"
_ERROR_BODY_MAX = 64 * 1024  # of an error answer, enough for GCS's JSON message


def _single_attempt(fs: Any) -> Any:
    return getattr(type(fs)._request, "__wrapped__", None)


def is_gcs(fs: Any) -> bool:
    """Whether ``fs`` is gcsfs's plain ``GCSFileSystem`` whose undecorated request we can call.

    Not its ``ExtendedGcsFileSystem`` (zonal buckets go over gRPC there).
    """
    return type(fs).__name__ == "GCSFileSystem" and hasattr(fs, "split_path") and _single_attempt(fs) is not None


def gcs_call(fs: Any, method: str, path: str, *args: Any, **kwargs: Any) -> tuple[int, Any, bytes]:
    """One JSON-API request, no retries: ``(status, headers, body)``; errors as gcsfs maps them."""
    status, headers, _info, contents = bounded_sync(fs.loop, _single_attempt(fs), fs, method, path, *args, **kwargs)
    return status, headers, contents


def _split(fs: Any, path: str) -> tuple[str, str]:
    bucket, key, _ = fs.split_path(path)
    return bucket, key


def gcs_read(fs: Any, path: str, max_bytes: int | None = None) -> bytes:
    """The whole object's bytes (``.metadata``, an index file); with ``max_bytes``, at most ``max_bytes + 1``
    of them (the caller refuses a result that long), streamed so a huge object is never held whole."""
    if max_bytes is None:
        _, _, body = gcs_call(fs, "GET", fs.url(path))
        return body
    return bytes(bounded_sync(fs.loop, _get_prefix, fs, path, max_bytes + 1))


async def _get_prefix(fs: Any, path: str, limit: int) -> bytearray:
    """The first ``limit`` bytes of the object (all of it when shorter), from one GET on gcsfs's session.

    gcsfs's own request reads the whole body before returning; this one stops reading at ``limit``.
    """
    from gcsfs.retry import validate_response  # gcsfs is optional; fs is a gcsfs filesystem here

    await fs._set_session()
    headers = fs._get_headers({})
    params = fs._get_params({})  # userProject, for requester-pays buckets
    async with fs.session.get(fs.url(path), params=params, headers=headers, timeout=fs.requests_timeout) as r:
        if r.status >= 400:
            validate_response(r.status, await r.content.read(_ERROR_BODY_MAX), path)
        return await read_prefix(r.content, limit)


async def _get_range(
    fs: Any, path: str, start: int, end: int, generation: str | None, saw: Callable[[str | None], None] | None
) -> bytes:
    from gcsfs.retry import validate_response  # gcsfs is optional; fs is a gcsfs filesystem here

    await fs._set_session()
    headers = fs._get_headers({"Range": f"bytes={start}-{end - 1}", **IDENTITY})
    params = fs._get_params({"generation": generation} if generation else {})  # + userProject (requester pays)
    async with fs.session.get(fs.url(path), params=params, headers=headers, timeout=fs.requests_timeout) as r:
        if generation and r.status in (404, 412):  # the pinned generation is gone: the object was replaced
            raise VersionConditionFailed(f"{path}: generation {generation} is no longer there")
        if r.status >= 400:
            validate_response(r.status, await r.content.read(_ERROR_BODY_MAX), path)
        if saw is not None:
            saw(r.headers.get("x-goog-generation"))
        return await read_range_body(r, start, end)


def gcs_read_range(
    fs: Any,
    path: str,
    start: int,
    end: int,
    generation: str | None = None,
    saw: Callable[[str | None], None] | None = None,
) -> bytes:
    """Bytes ``[start, end)`` of the object: exactly those, or :class:`~.range_check.RangeMismatchError`.

    One GET on gcsfs's session, with its headers (credentials), parameters, timeout and error mapping, like
    :func:`gcs_call`; it is not :func:`gcs_call` because gcsfs reads the whole body before returning, and the
    status and ``Content-Range`` must be checked before that (a ``200`` may carry a whole large object).
    With ``generation`` it reads that generation (``generation=``; gone: :class:`~.versions.VersionConditionFailed`);
    ``saw`` gets the answer's ``x-goog-generation`` before the body is read.
    """
    return bytes(bounded_sync(fs.loop, _get_range, fs, path, start, end, generation, saw))


def _metadata(fs: Any, path: str) -> dict[str, Any]:
    bucket, key = _split(fs, path)
    _, _, body = gcs_call(fs, "GET", "b/{}/o/{}", bucket, key)
    return json.loads(body)


def gcs_size(fs: Any, path: str) -> int:
    """Size of the object at ``path``; ``FileNotFoundError`` if there is none."""
    return gcs_size_version(fs, path)[0]


def gcs_size_version(fs: Any, path: str) -> tuple[int, str | None]:
    """Size and generation of the object at ``path`` (one metadata request)."""
    meta = _metadata(fs, path)
    generation = meta.get("generation")
    return int(meta["size"]), str(generation) if generation is not None else None


def gcs_exists(fs: Any, path: str) -> bool:
    """Whether ``path`` is an object, or a prefix with objects under it (a directory), or a bucket."""
    bucket, key = _split(fs, path)
    try:
        if not key:
            gcs_call(fs, "GET", "b/{}", bucket)
            return True
        _metadata(fs, path)
        return True
    except FileNotFoundError:
        if not key:
            return False
    try:
        _, _, body = gcs_call(fs, "GET", "b/{}/o", bucket, prefix=key.rstrip("/") + "/", maxResults=1)
    except FileNotFoundError:  # no such bucket
        return False
    return bool(json.loads(body).get("items"))


def gcs_list_names(fs: Any, path: str) -> list[str]:
    """Names of the objects and prefixes directly under ``path`` (sorted); empty if there are none."""
    bucket, key = _split(fs, path)
    prefix = key.rstrip("/") + "/" if key else ""
    names: set[str] = set()
    token: str | None = None
    bound = ListingBound(fs.unstrip_protocol(path))  # a listing that never ends is cut off (:mod:`.listing`)
    while True:
        params: dict[str, Any] = {"prefix": prefix, "delimiter": "/"}
        if token:
            params["pageToken"] = token
        try:
            _, _, body = gcs_call(fs, "GET", "b/{}/o", bucket, **params)
        except FileNotFoundError:  # no such bucket
            return []
        page = json.loads(body)
        for item in page.get("items", ()):
            names.add(item["name"][len(prefix) :])
        for sub in page.get("prefixes", ()):
            names.add(posixpath.basename(sub.rstrip("/")))
        token = page.get("nextPageToken")
        bound.page(len(page.get("items", ())) + len(page.get("prefixes", ())), token or None)
        if not token:
            break
    names.discard("")  # a zero-byte "directory marker" object named like the prefix
    return sorted(names)


def gcs_delete(fs: Any, path: str) -> None:
    """Delete the object at ``path``; ``FileNotFoundError`` if there is none (a retry after a lost answer)."""
    bucket, key = _split(fs, path)
    try:
        gcs_call(fs, "DELETE", "b/{}/o/{}", bucket, key)
    finally:
        fs.invalidate_cache(path)


def gcs_put(fs: Any, path: str, data: bytes | str, size: int) -> None:
    """One ``uploadType=media`` request: the object ``path`` becomes ``data`` (bytes, or a local file's path).

    A file is opened anew for each call: aiohttp closes a file body once it has sent it.
    """
    bucket, key = _split(fs, path)
    with contextlib.ExitStack() as stack:
        body: bytes | IO[bytes] = data if isinstance(data, bytes) else stack.enter_context(open(data, "rb"))
        gcs_call(
            fs,
            "POST",
            f"{fs._location}/upload/storage/v1/b/{{}}/o",
            bucket,
            uploadType="media",
            name=key,
            data=body,
            headers={"Content-Type": _CONTENT_TYPE, "Content-Length": str(size)},
        )
    fs.invalidate_cache(path)


def gcs_create(fs: Any, path: str, data: bytes) -> None:
    """Create the object ``path`` holding ``data`` only if there is none: ``FileExistsError`` otherwise.

    One ``uploadType=multipart`` request with ``ifGenerationMatch=0`` (GCS answers ``412``, which gcsfs
    raises as ``FileExistsError``). Multipart rather than media: fake-gcs-server ignores the condition on
    a media upload, and the object's name travels in the JSON part either way.
    """
    bucket, key = _split(fs, path)
    boundary = f"dcp-storage-{uuid.uuid4().hex}"
    head = (
        f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps({'name': key})}\r\n"
        f"--{boundary}\r\nContent-Type: {_CONTENT_TYPE}\r\n\r\n"
    )
    body = head.encode() + bytes(data) + f"\r\n--{boundary}--\r\n".encode()
    try:
        gcs_call(
            fs,
            "POST",
            f"{fs._location}/upload/storage/v1/b/{{}}/o",
            bucket,
            uploadType="multipart",
            ifGenerationMatch="0",
            data=body,
            headers={"Content-Type": f"multipart/related; boundary={boundary}", "Content-Length": str(len(body))},
        )
    finally:
        fs.invalidate_cache(path)


class GcsAtomicUpload:
    """A write-only file committed by one retried media upload (module docstring: why not resumable).

    Bytes stay in memory up to ``spill_size``, then go to a temporary file (removed at commit or abandon). ``runner(fn, what)``
    runs ``fn`` under the transport's retry policy. Nothing is visible before :meth:`commit` succeeds;
    :meth:`abandon` only drops the local bytes (no request was made, nothing to abort).
    """

    def __init__(self, fs: Any, path: str, spill_size: int, runner: Any) -> None:
        self.fs = fs
        self.path = path
        self.spill_size = spill_size
        self._run = runner
        self._memory = bytearray()
        self._file: IO[bytes] | None = None
        self._spill: str | None = None
        self.size = 0
        self.requests = 0
        self.closed = False

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"write to a closed upload of {self.path}")
        view = memoryview(data).cast("B")
        if self._file is None and len(self._memory) + view.nbytes > self.spill_size:
            fd, self._spill = tempfile.mkstemp(prefix="dcp-storage-gcs-")
            self._file = os.fdopen(fd, "wb")
            self._file.write(self._memory)
            self._memory = bytearray()
        if self._file is not None:
            self._file.write(view)
        else:
            self._memory += view
        self.size += view.nbytes
        return view.nbytes

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing to do: the bytes are sent at :meth:`commit`."""

    def commit(self) -> None:
        try:
            body = bytes(self._memory) if self._spill is None else self._spill
            if self._file is not None:
                self._file.close()
            self._run(lambda: gcs_put(self.fs, self.path, body, self.size), f"write ({self.size} bytes)")
            self.requests += 1
        finally:
            self._close()

    def abandon(self) -> None:
        self._close()

    def _close(self) -> None:
        self.closed = True
        self._memory = bytearray()
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self._spill is not None:
            with contextlib.suppress(OSError):
                os.remove(self._spill)
            self._spill = None


@builtin_backend
class GcsTransport(FsspecTransport):
    """Objects in Google Cloud Storage or fake-gcs-server (``gs://``, ``gcs://``)."""

    serves = staticmethod(is_gcs)  # the filesystems this class is the transport of

    def _exists(self, path: str) -> bool:
        return gcs_exists(self.fs, path)

    def _size(self, path: str) -> int:
        return gcs_size(self.fs, path)

    def _delete(self, path: str) -> None:
        gcs_delete(self.fs, path)

    def _list_names(self, path: str) -> list[str]:
        return gcs_list_names(self.fs, path)

    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        return gcs_read(self.fs, path, max_bytes)

    def _size_version(self, path: str) -> tuple[int, str | None]:
        return gcs_size_version(self.fs, path)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        return gcs_read_range(self.fs, path, start, end)

    def _read_range_version(
        self, path: str, start: int, end: int, expected: str | None, saw: Callable[[str | None], None]
    ) -> bytes:
        """Reads the pinned generation (``generation=``), and reports the answer's (see :mod:`.versions`)."""
        return gcs_read_range(self.fs, path, start, end, expected, saw)

    def _put(self, path: str, data: bytes, nbytes: int) -> None:
        gcs_put(self.fs, path, data, nbytes)

    def _put_if_absent(self, path: str, data: bytes) -> None:
        gcs_create(self.fs, path, data)

    def _open_atomic(self, path: str) -> Iterator[CountingWriter]:
        """One media upload at close, retried as a whole (see :mod:`.gcs_io`); nothing sent on error."""
        upload = GcsAtomicUpload(self.fs, path, self.config.part_size, self._runner(path))
        writer = CountingWriter(upload, self.counters)  # type: ignore[arg-type]
        try:
            yield writer
            upload.commit()
        finally:
            upload.abandon()
            self.counters.add(requests=upload.requests)
