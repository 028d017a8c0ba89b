"""S3 requests on s3fs's client: its building, ranged GETs streamed into buffers, whole objects, metadata.

Streaming S3 ranged GETs straight into destination buffers (s3fs + aiobotocore), where the transport's
direct GETs (:func:`~.s3.direct_range`) do not apply or are switched off.

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
Metadata requests (exists, size, list, delete) are one API call each; a key is a file, a key prefix
followed by ``/`` is a directory, as in s3fs.

The client itself is built before a request's deadline starts (:func:`client_ready`), with botocore's data
loaded once per process and more quickly than botocore's own loader does it (:func:`share_loader`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import posixpath
import threading
from collections.abc import Callable
from typing import Any

from fsspec.asyn import sync

from dcp_storage.errors import FileTooLargeError, StorageOptionsError
from dcp_storage.runtime import fork_safe
from dcp_storage.transports.guards import (
    ListingBound,
    RangeMismatchError,
    VersionConditionFailed,
    check_range_answer,
    describe_answer,
    range_mismatch,
)
from dcp_storage.transports.retry import bounded_sync, error_code

__all__ = [
    "ScatterSink",
    "client_ready",
    "can_stream",
    "client_call",
    "read_object",
    "read_object_version",
    "s3_delete",
    "s3_exists",
    "s3_list_names",
    "s3_size",
    "share_loader",
    "model_loader",
    "s3_size_version",
    "translate_client_error",
    "s3_call",
    "stream_range",
]


_CLIENT_HOOKS = ("loop", "set_session", "get_s3", "split_path", "_get_s3_method_kwargs")


def can_stream(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem whose client we can call directly (reads and uploads)."""
    return type(fs).__name__ == "S3FileSystem" and all(hasattr(fs, name) for name in _CLIENT_HOOKS)


async def client_call(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 API call on s3fs's client, with s3fs's per-request options, without s3fs's retry wrapper."""
    from botocore.exceptions import ClientError, EndpointResolutionError  # s3fs depends on botocore

    share_loader(fs)
    await fs.set_session()
    client = await fs.get_s3(kwargs.get("Bucket"))
    bound = getattr(client, method)
    try:
        return await bound(**fs._get_s3_method_kwargs(bound, **kwargs))
    except ClientError as exc:
        translated = translate_client_error(exc, method, kwargs)
        if translated is exc:
            raise
        raise translated from exc
    except EndpointResolutionError as exc:  # an endpoint_url botocore cannot use ("ftp://...")
        raise options_error(fs, _call_url(kwargs), exc) from exc


def translate_client_error(exc: Exception, method: str, kwargs: dict[str, Any]) -> Exception:
    """What a botocore ``ClientError`` of ``method`` called with ``kwargs`` is raised as (its cause set)."""
    from s3fs.errors import translate_boto_error

    if error_code(exc) == "PreconditionFailed" and kwargs.get("IfMatch"):
        failed = VersionConditionFailed(f"{method} {kwargs.get('Key')}: the object is not the version read first")
        failed.__cause__ = exc
        return failed
    translated = translate_boto_error(exc)
    if translated is not exc:
        translated.__cause__ = exc
    return translated  # type: ignore[no-any-return]


def client_ready(fs: Any, url: str = "") -> None:
    """Build s3fs's client (once per filesystem) before a request's deadline starts counting; ``url`` (of the
    request that needs it) is named if the storage options cannot make one (:class:`StorageOptionsError`).

    Building it is local work (botocore loads its service model and endpoint rules), not a request in flight;
    inside the deadline it took a share of the first request's time, all of it on a busy machine.
    """
    if getattr(fs, "_s3", None) is not None:
        return
    share_loader(fs)
    try:
        sync(fs.loop, fs.set_session)
    except ValueError as exc:  # botocore checks its options as it builds: "Invalid endpoint: ...", a bad region
        raise options_error(fs, url, exc) from exc


_LOADERS: dict[Any, Any] = {}  # botocore data loaders by data path, shared by the S3 clients of this process
_LOADERS_LOCK = fork_safe(threading.Lock())


def share_loader(fs: Any) -> None:
    """Give ``fs``, before it builds its client, the session s3fs would make, with this process's shared botocore
    data loader (:func:`model_loader`). Building a client is local work every cold load pays before its first
    request (140-190 ms here); with the loader shared, a client after the first parses nothing again (12 ms).
    A session the caller gave (``session=``) is left as it is; anything unexpected leaves ``fs`` to make its own."""
    if getattr(fs, "session", True) is not None or getattr(fs, "_s3", None) is not None:
        return
    try:
        from aiobotocore.session import AioSession

        session = AioSession(**fs.kwargs)
        data_path = session.get_config_variable("data_path")  # AWS_DATA_PATH, or the profile's data_path
        with _LOADERS_LOCK:
            loader = _LOADERS.get(data_path) or _LOADERS.setdefault(data_path, model_loader(data_path))
        session.register_component("data_loader", loader)
    except Exception:  # a profile that does not exist, another s3fs: its own set_session raises as before
        return
    fs.session = session
    if hasattr(fs, "_session_is_owned"):
        fs._session_is_owned = True  # as when s3fs made it: set_session(refresh=True) makes a new one


def model_loader(data_path: str | None) -> Any:
    """A botocore data loader for ``data_path`` (``AWS_DATA_PATH``: extra folders searched first, as
    ``botocore.loaders.create_loader`` reads it), doing less than botocore's own where this botocore is the
    expected one: it does not list every service folder it ships (~400, a ``stat`` per API version) before
    loading a model, once per model type, only to tell an unknown service (the service's own folder tells as
    much), and it parses JSON into plain dicts, which keep the order, not through ``object_pairs_hook=OrderedDict``
    (a Python call per object: 79 ms for the S3 model, S3 endpoint rules and ``endpoints.json`` against 38 ms).
    The first client: 140-195 ms -> 70-100 ms."""
    from botocore import loaders

    botocores, quick = loaders.create_loader(data_path), _quick_loader_class()
    return botocores if quick is None else quick(botocores.search_paths, include_default_search_paths=False)


@functools.cache
def _quick_loader_class() -> Any:
    """The loader class below, where botocore's JSON file loader has the method it replaces, with the expected
    signature; ``None`` (botocore's own loader) elsewhere."""
    from botocore import loaders

    try:
        params = tuple(inspect.signature(loaders.JSONFileLoader._load_file).parameters)
    except (AttributeError, TypeError, ValueError):
        return None
    if params != ("self", "full_path", "open_method") or not hasattr(loaders.Loader, "FILE_LOADER_CLASS"):
        return None

    class _PlainJSONFileLoader(loaders.JSONFileLoader):  # type: ignore[misc]
        """botocore's JSON file loader parsing into plain dicts (ordered as ``OrderedDict``, half the time)."""

        def _load_file(self, full_path: str, open_method: Any) -> Any:
            if not os.path.isfile(full_path):
                return None
            with open_method(full_path, "rb") as fp:
                payload = fp.read().decode("utf-8")
            return json.loads(payload)

    class _ModelLoader(loaders.Loader):  # type: ignore[misc]
        """botocore's loader, asking the service's own folder whether it knows a service."""

        FILE_LOADER_CLASS = _PlainJSONFileLoader

        @loaders.instance_cache
        def load_service_model(self, service_name: str, type_name: str, api_version: str | None = None) -> Any:
            """As botocore's, without listing every service folder first: a service is known when some search
            path has an API version of it with a ``type_name`` file, which is what that listing checks. An
            unknown service, a version not there, or anything else going wrong here goes to botocore's own
            method, which does it all again or raises its own error."""
            try:
                if "/" in service_name or os.sep in service_name or service_name.startswith("."):
                    raise ValueError(service_name)  # not a folder's name: botocore's own method refuses it
                version = api_version or max(self.list_api_versions(service_name, type_name))
                model = self.load_data(os.path.join(service_name, version, type_name))
                self._extras_processor.process(model, self._find_extras(service_name, type_name, version))
            except Exception:  # noqa: BLE001 - botocore's own path decides, and raises its own error
                return super().load_service_model(service_name, type_name, api_version)
            return model

    return _ModelLoader


def _call_url(kwargs: dict[str, Any]) -> str:
    """The URL an API call's ``Bucket``/``Key`` name, for messages."""
    return f"s3://{kwargs.get('Bucket', '')}/{kwargs.get('Key', '')}".rstrip("/")


def options_error(fs: Any, url: str, exc: BaseException) -> StorageOptionsError:
    """Our error for storage options botocore refused (as it builds its client, or resolves a request's endpoint)."""
    endpoint = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    return StorageOptionsError(
        f"{url or 's3'}: cannot make an S3 client from the storage options ({exc}; endpoint_url={endpoint!r}): give "
        "endpoint_url as an http(s) URL such as http://localhost:9000 (or leave it out for AWS) and region_name as "
        "a region such as us-east-1, in the storage options or AWS_ENDPOINT_URL / AWS_REGION"
    )


def s3_call(fs: Any, method: str, **kwargs: Any) -> Any:
    """Blocking :func:`client_call`: ``s3_call(fs, "put_object", Bucket=..., Key=..., Body=...)``."""
    client_ready(fs, _call_url(kwargs))
    return bounded_sync(fs.loop, client_call, fs, method, **kwargs)


_SCRATCH_BYTES = 1 << 16  # the bytes between coalesced pieces, read and dropped (ScatterSink.fill)


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

    def fill(self, pos: int, end: int, readinto: Callable[[memoryview], int], landed: Callable[[int], None]) -> int:
        """Read ``[pos, end)`` of the range with ``readinto`` straight into the segments' buffers (the gaps
        into a scratch buffer); ``landed(p)`` after each read that ends at ``p``. Returns where the bytes
        stopped: ``end``, or less if the body ended first."""
        pieces, i, at = self._pieces, 0, pos
        scratch: memoryview | None = None
        while at < end:
            while i < len(pieces) and pieces[i][1] <= at:
                i += 1
            if i < len(pieces) and pieces[i][0] <= at:
                p_start, p_end, view = pieces[i]
                target = view[at - p_start : min(p_end, end) - p_start]
            else:
                gap_end = min(end, pieces[i][0]) if i < len(pieces) else end
                if scratch is None:
                    scratch = memoryview(bytearray(_SCRATCH_BYTES))
                target = scratch[: min(_SCRATCH_BYTES, gap_end - at)]
            n = readinto(target)
            if not n:
                break
            at += n
            landed(at)
        return at


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
    response = await client_call(fs, "get_object", **kwargs)
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
    client_ready(fs, fs.unstrip_protocol(path))
    return int(bounded_sync(fs.loop, _get_range, fs, path, start, end, emit, if_match, saw))


async def _get_object(fs: Any, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
    bucket, key, version = fs.split_path(path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if version:
        kwargs["VersionId"] = version
    response = await client_call(fs, "get_object", **kwargs)
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
    client_ready(fs, fs.unstrip_protocol(path))
    data, etag = bounded_sync(fs.loop, _get_object, fs, path, max_bytes)
    return bytes(data), etag


# ------------------------------------------------------------------------------ metadata requests
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


def s3_list_names(fs: Any, path: str, direct: Callable[[dict[str, Any]], Any] | None = None) -> list[str]:
    """Names of the objects and prefixes directly under ``path`` (sorted); empty if there are none. ``direct``
    sends a page's request instead, if it can (``None``: it cannot; :func:`~.s3.direct_list_page`)."""
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
            page = direct(kwargs) if direct is not None else None
            page = s3_call(fs, "list_objects_v2", **kwargs) if page is None else page
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
