"""Streaming S3 ranged GETs straight into destination buffers (s3fs + aiobotocore).

``s3fs.cat_file`` collects the response body into a fresh ``bytes`` (touching twice the data in new
pages) and the caller copies it again; on a 2-core machine that client CPU is most of the cost
(measured here: 0.3-0.4 GB/s with threads over ``cat_file`` vs 0.7-0.9 GB/s streaming, see
``benchmarks/NOTES-s3-throughput.md``). This module issues the same signed ``GetObject`` through s3fs's
own client (credentials, endpoint, ``s3_additional_kwargs`` and ``requester_pays`` all apply), checks that
the answer is the range asked for (:mod:`.range_check`: status, ``Content-Range``, ``Content-Length``), then
copies each body chunk into the caller's buffers as it arrives. A body cut short resumes from the first
missing byte.

Every call here goes to the botocore client directly, past s3fs's ``_error_wrapper``: the transport's own
retry layer (:mod:`dcp_storage.transports.retry`) is the one that retries these calls, under its attempt
count and deadline (see that module for which layer retries what). Client errors are still translated
the way s3fs does it (``NoSuchKey`` -> ``FileNotFoundError``, ...), with the botocore error as the cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsspec.asyn import sync

from dcp_storage.errors import FileTooLargeError
from dcp_storage.transports.deadline import bounded_sync
from dcp_storage.transports.range_check import RangeMismatchError, check_range_answer, describe_answer, range_mismatch
from dcp_storage.transports.versions import VersionConditionFailed

__all__ = ["ScatterSink", "can_stream", "read_object", "read_object_version", "s3_call", "stream_range"]

_CLIENT_HOOKS = ("loop", "set_session", "get_s3", "split_path", "_get_s3_method_kwargs")


def can_stream(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem whose client we can call directly (reads and uploads)."""
    return type(fs).__name__ == "S3FileSystem" and all(hasattr(fs, name) for name in _CLIENT_HOOKS)


async def _call(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 API call on s3fs's client, with s3fs's per-request options, without s3fs's retry wrapper."""
    from botocore.exceptions import ClientError  # s3fs depends on botocore
    from s3fs.errors import translate_boto_error

    await fs.set_session()
    client = await fs.get_s3(kwargs.get("Bucket"))
    bound = getattr(client, method)
    try:
        return await bound(**fs._get_s3_method_kwargs(bound, **kwargs))
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "PreconditionFailed" and "IfMatch" in kwargs:
            raise VersionConditionFailed(
                f"{method} {kwargs.get('Key')}: the object is not the version read first"
            ) from exc
        translated = translate_boto_error(exc)
        if translated is exc:
            raise
        raise translated from exc


def _client_ready(fs: Any) -> None:
    """Build s3fs's client (once per filesystem) before a request's deadline starts counting.

    Building it is local work (botocore loads its service model and endpoint rules), not a request in flight;
    inside the deadline it took a share of the first request's time, all of it on a busy machine.
    """
    if getattr(fs, "_s3", None) is None:
        sync(fs.loop, fs.set_session)


def s3_call(fs: Any, method: str, **kwargs: Any) -> Any:
    """Blocking :func:`_call`: ``s3_call(fs, "put_object", Bucket=..., Key=..., Body=...)``."""
    _client_ready(fs)
    return bounded_sync(fs.loop, _call, fs, method, **kwargs)


class ScatterSink:
    """Writes the bytes of one group range into its segments' buffers, skipping coalescing gaps.

    ``pieces`` are ``(start, end, view)`` relative to the range start, sorted and non-overlapping.
    """

    def __init__(self, pieces: list[tuple[int, int, memoryview]]) -> None:
        self._pieces = pieces
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def write(self, pos: int, chunk: memoryview) -> None:
        end = pos + len(chunk)
        i = self._next
        pieces = self._pieces
        while i < len(pieces) and pieces[i][1] <= pos:
            i += 1
        self._next = i
        while i < len(pieces) and pieces[i][0] < end:
            p_start, p_end, view = pieces[i]
            lo, hi = max(p_start, pos), min(p_end, end)
            view[lo - p_start : hi - p_start] = chunk[lo - pos : hi - pos]
            if p_end > end:
                break
            i += 1


async def _get_range(
    fs: Any,
    path: str,
    start: int,
    end: int,
    emit: Callable[[int, memoryview], None],
    if_match: str | None,
    saw: Callable[[str | None], None] | None,
) -> int:
    bucket, key, version = fs.split_path(path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
    if version:
        kwargs["VersionId"] = version
    if if_match:
        kwargs["IfMatch"] = if_match  # the version this load saw first (:mod:`.versions`)
    response = await _call(fs, "get_object", **kwargs)
    body = response["Body"]
    got = 0
    want = end - start
    try:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        content_range, length = response.get("ContentRange"), response.get("ContentLength")
        check_range_answer(start, end, status, content_range, length, response.get("ContentEncoding"))
        if saw is not None:
            saw(response.get("ETag"))  # before any byte is emitted

        def longer() -> RangeMismatchError:  # no Content-Length (chunked), and more than the range came
            return range_mismatch(start, end, f"a longer body ({describe_answer(status, content_range, None)})")

        content = getattr(getattr(body, "raw_stream", None), "content", None)
        if content is not None and hasattr(content, "readany"):
            while got < want:
                chunk = await content.readany()
                if not chunk:
                    break
                if len(chunk) > want - got:
                    raise longer()
                emit(got, memoryview(chunk))
                got += len(chunk)
            if got == want and length is None and await content.read(1):
                raise longer()
        else:  # another HTTP backend: one read, still no second copy on our side
            data = await body.read()
            if len(data) > want:
                raise longer()
            emit(0, memoryview(data))
            got = len(data)
    finally:
        body.close()
    return got


def stream_range(
    fs: Any,
    path: str,
    start: int,
    end: int,
    emit: Callable[[int, memoryview], None],
    if_match: str | None = None,
    saw: Callable[[str | None], None] | None = None,
) -> int:
    """GET bytes ``[start, end)`` of ``path``, calling ``emit(offset, chunk)`` per chunk; returns bytes got.

    Fewer than ``end - start`` bytes means the body was cut short; the caller decides whether to resume. An
    answer with other bytes than asked raises :class:`~.range_check.RangeMismatchError` before any ``emit``.
    With ``if_match`` the GET is conditional on that ETag (a ``412`` raises
    :class:`~.versions.VersionConditionFailed`); ``saw(etag)`` gets the answer's ETag before any ``emit``.
    """
    _client_ready(fs)
    return int(bounded_sync(fs.loop, _get_range, fs, path, start, end, emit, if_match, saw))


async def _get_object(fs: Any, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
    bucket, key, version = fs.split_path(path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if version:
        kwargs["VersionId"] = version
    response = await _call(fs, "get_object", **kwargs)
    body = response["Body"]
    try:
        size = response.get("ContentLength")
        if max_bytes is not None and isinstance(size, int) and size > max_bytes:
            raise FileTooLargeError(fs.unstrip_protocol(path), size, max_bytes)  # the body is never read
        if max_bytes is not None and not isinstance(size, int):
            return bytes(await body.read(max_bytes + 1)), response.get("ETag")
        return bytes(await body.read()), response.get("ETag")  # a body cut short raises (the client checks)
    finally:
        body.close()


def read_object(fs: Any, path: str, max_bytes: int | None = None) -> bytes:
    """GET a whole (small) object: ``.metadata``, an index file; at most ``max_bytes + 1`` bytes of it, and
    none when the response says it is larger (:class:`~dcp_storage.errors.FileTooLargeError`)."""
    return read_object_version(fs, path, max_bytes)[0]


def read_object_version(fs: Any, path: str, max_bytes: int | None = None) -> tuple[bytes, str | None]:
    """:func:`read_object` and the answer's ETag."""
    _client_ready(fs)
    data, etag = bounded_sync(fs.loop, _get_object, fs, path, max_bytes)
    return bytes(data), etag
