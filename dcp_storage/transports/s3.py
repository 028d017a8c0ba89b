"""The S3 transport (s3fs): requests made on s3fs's client one attempt at a time, under our retries.

s3fs retries on its own (5 tries, unaware of any deadline); calling the botocore client directly leaves our
retry layer as the only one, so a permanent fault costs exactly ``max_attempts`` requests. A key is a file, a
key prefix followed by ``/`` is a directory, as in s3fs. Writes are one ``PutObject`` or a multipart upload
whose every request is retried on its own, aborted if it finally fails (:mod:`.s3_upload`); create-if-absent
is a ``PutObject`` with ``If-None-Match: *``; uploads a killed writer left can be listed and aborted.

Reads (ranges, whole small objects, sizes, listing pages) are sent directly by the thread that needs them
(:func:`direct_range` and below), or else through aiobotocore (:mod:`.s3_stream`); either checks the answer's
status and ``Content-Range`` (:func:`~.guards.check_range_answer`) and resumes a cut-off body from the first
byte missing; a whole-file read over ``max_bytes`` is refused unread. Why directly: through aiobotocore the
event loop's one thread read every body chunk into a new ``bytes``, then copied it into place (on s3rver,
512 MiB, one process: 0.8-0.9 CPU-seconds per load against 0.20-0.29 for plain ``http.client`` GETs). Here the
worker thread sends the request on a keep-alive connection of its own and ``readinto``s the body into the
destination. The request is s3fs's client's own: the call goes through botocore (per-request options, endpoint
rules, credentials, signature) and leaves it at its ``before-send`` event, unsent (:func:`_prepared`); only
where that client sends alone (http/https, no proxy, no client certificate, one attempt per call; TLS with the
context aiobotocore builds). Answers go through botocore's parser (errors, listings) and s3fs's translation; a
bucket in another region is left to botocore's redirector. A load never starts aiobotocore's HTTP session (its
first request: 50-100 ms more). ``DCP_STORAGE_S3_DIRECT=0`` turns this off."""

from __future__ import annotations

import contextlib
import contextvars
import http.client
import os
import socket
import ssl
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dcp_storage.errors import FileTooLargeError
from dcp_storage.runtime import fork_safe
from dcp_storage.transports import s3_upload
from dcp_storage.transports.fsspec_transport import FsspecTransport, builtin_backend
from dcp_storage.transports.guards import (
    RangeMismatchError,
    check_object_checksum,
    check_range_answer,
    describe_answer,
    error_in_200,
    is_encoded,
    range_mismatch,
)
from dcp_storage.transports.protocol import CountingWriter
from dcp_storage.transports.ranges import FetchGroup
from dcp_storage.transports.retry import bounded_sync, cut_at_deadline, error_code, raise_if_past_deadline, remaining
from dcp_storage.transports.s3_stream import (
    ScatterSink,
    can_stream,
    client_call,
    client_ready,
    read_object_version,
    s3_delete,
    s3_exists,
    s3_list_names,
    s3_size_version,
    stream_range,
    translate_client_error,
)
from dcp_storage.transports.s3_upload import PendingUpload, S3AtomicUpload, abort_pending, list_pending, put_object

__all__ = ["DIRECT_ENV", "S3Transport", "direct_head", "direct_list_page", "direct_object", "direct_range"]


@builtin_backend
class S3Transport(FsspecTransport):
    """Objects in S3 or an S3-compatible store (``s3://``, ``s3a://``)."""

    serves = staticmethod(can_stream)  # the filesystems this class is the transport of

    def set_up_client(self) -> None:
        """Build s3fs's client now (:class:`~.protocol.ClientSetUp`). A failure is left to the first request, which
        builds it again under the retry policy and reports it as one of our errors, naming the URL."""
        with contextlib.suppress(Exception):
            client_ready(self.fs)

    def pending_uploads(self, path: str) -> list[PendingUpload]:
        """In-progress multipart uploads of ``path`` or under it (:mod:`.s3_pending`): the whole listing under
        the retry policy's deadline, and bounded in pages and entries (:mod:`.listing`)."""
        return self._retry(lambda: list_pending(self.fs, path), lambda: f"list multipart uploads {self.url(path)}")  # type: ignore[no-any-return]

    def abort_upload(self, path: str, upload: PendingUpload) -> bool:
        """Abort one of :meth:`pending_uploads`; ``False`` if it is gone meanwhile."""
        return abort_pending(self.fs, path, upload)

    def _exists(self, path: str) -> bool:
        return s3_exists(self.fs, path)

    def _size(self, path: str) -> int:
        return self._size_version(path)[0]

    def _delete(self, path: str) -> None:
        s3_delete(self.fs, path)

    def _list_names(self, path: str) -> list[str]:
        return s3_list_names(self.fs, path, lambda kwargs: direct_list_page(self.fs, kwargs))

    def _size_version(self, path: str) -> tuple[int, str | None]:
        return direct_head(self.fs, path) or s3_size_version(self.fs, path)

    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        return self._read_whole_version(path, max_bytes)[0]

    def _read_whole_version(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        return direct_object(self.fs, path, max_bytes) or read_object_version(self.fs, path, max_bytes)

    def _put_if_absent(self, path: str, data: bytes) -> None:
        s3_upload.s3_put_if_absent(self.fs, path, data, self.url(path))

    def _group_fetch(self, group: FetchGroup, pieces: list[tuple[int, int, memoryview]]) -> Callable[[], None]:
        """One attempt at a fetch group, streamed into ``pieces``; a retry resumes after the bytes in place, on
        condition of the version pinned (:meth:`_pinned`), so it cannot append another version's bytes."""
        sink = ScatterSink(pieces)
        done = 0

        def fetch() -> None:
            nonlocal done
            base = done
            sink.reset()

            def emit(offset: int, chunk: memoryview) -> None:
                nonlocal done
                sink.write(base + offset, chunk)
                done = base + offset + len(chunk)

            def landed(at: int) -> None:  # ``at``: from the group's start, as ``done``
                nonlocal done
                done = at

            def fill(readinto: Callable[[memoryview], int], nbytes: int) -> int:
                return sink.fill(base, base + nbytes, readinto, landed) - base

            def read(expected: str | None, saw: Callable[[str | None], None]) -> int:
                nonlocal done
                start = group.start + base
                try:
                    got = direct_range(self.fs, group.path, start, group.end, fill, expected, saw)
                except RangeMismatchError:
                    done = base  # what landed came with an answer that is not the range: none of it counts
                    raise
                if got is not None:
                    return got
                return stream_range(self.fs, group.path, start, group.end, emit, expected, saw)

            try:
                self._pinned(group.path, read)
            finally:
                self.counters.add(requests=1, bytes_read=done - base)
            if done != group.length:
                raise self._short_read(group, done)

        return fetch

    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """One ``PutObject``, retried."""
        self.versions.forget(path)
        put_object(self.fs, path, data, self._runner(path))
        self.counters.add(requests=1, bytes_written=memoryview(data).nbytes)

    def _open_atomic(self, path: str) -> Iterator[CountingWriter]:
        """Every request of the upload retried on its own; aborted if it finally fails."""
        upload = S3AtomicUpload(
            self.fs, path, self.config.part_size, self._runner(path), self.executor(), self.parts_in_flight
        )
        writer = CountingWriter(upload, self.counters)  # type: ignore[arg-type]
        try:
            yield writer
            upload.commit()
        except BaseException as exc:
            upload.abandon(exc)
            if upload.failure is not None and upload.failure is not exc:
                raise upload.failure  # ours, not what a serializer in between made of it
            raise
        finally:
            self.counters.add(requests=upload.requests)


# ------------------------------------------------------------------------------ direct reads
DIRECT_ENV = "DCP_STORAGE_S3_DIRECT"
_DEFAULT_TIMEOUT = 60.0  # botocore's default connect and read timeouts
_ERROR_BODY_BYTES = 64 * 1024  # an error answer's XML is read up to this much
_CONNECTIONS = threading.local()  # per thread: {(scheme, host, port): (pid, connection)}


@dataclass
class _Direct:
    """What one s3fs filesystem's direct reads need: whether they apply, its TLS context and timeouts."""

    usable: bool
    ssl_context: Any = None
    connect_timeout: float = _DEFAULT_TIMEOUT
    read_timeout: float = _DEFAULT_TIMEOUT


_STATE: weakref.WeakKeyDictionary[Any, _Direct] = weakref.WeakKeyDictionary()
_STATE_LOCK = fork_safe(threading.Lock())


def direct_range(
    fs: Any,
    path: str,
    start: int,
    end: int,
    fill: Callable[[Callable[[memoryview], int], int], int],
    if_match: str | None,
    saw: Callable[[str | None], None] | None,
) -> int | None:
    """GET bytes ``[start, end)`` of ``path`` into place: ``fill(readinto, nbytes)`` reads the body with
    ``readinto`` and returns how many bytes landed. Returns that count (fewer than asked: the body was cut
    short), or ``None`` when this path does not apply (the caller uses :func:`~.s3_stream.stream_range`).
    Raises what that path raises: a range that is not what was asked (before any byte lands), an error
    answer as botocore parses it and s3fs translates it, a failed connection."""
    params = {"Range": f"bytes={start}-{end - 1}", **({"IfMatch": if_match} if if_match else {})}
    left = remaining()
    with _answer(fs, "GetObject", path, params) as resp:
        if resp is None:
            return None
        header, content_range = resp.getheader("Content-Length"), resp.getheader("Content-Range")
        length = int(header) if header is not None and header.isdigit() else None
        check_range_answer(start, end, resp.status, content_range, length, resp.getheader("Content-Encoding"))
        if saw is not None:
            saw(resp.getheader("ETag"))  # before any byte lands
        got = fill(resp.readinto, end - start)
        if got < end - start:
            raise_if_past_deadline(left)  # the deadline cut the body short
        if got == end - start and not resp.isclosed() and resp.read(1) and length is None:
            # no Content-Length (chunked), and more than the range came
            raise range_mismatch(start, end, f"a longer body ({describe_answer(resp.status, content_range, None)})")
        return got


def direct_object(fs: Any, path: str, max_bytes: int | None) -> tuple[bytes, str | None] | None:
    """A whole (small) object and its ETag, as :func:`~.s3_stream.read_object_version` (``None``: that path):
    none of its bytes when the answer says it is over ``max_bytes``."""
    with _answer(fs, "GetObject", path, {}) as resp:
        if resp is None or is_encoded(resp.getheader("Content-Encoding")):
            return None  # (a store that encodes anyway: aiobotocore's path reads it as before)
        header = resp.getheader("Content-Length")
        size = int(header) if header is not None and header.isdigit() else None
        if max_bytes is not None and size is not None and size > max_bytes:
            raise FileTooLargeError(fs.unstrip_protocol(path), size, max_bytes)  # the body is never read
        try:
            data = resp.read(max_bytes + 1) if max_bytes is not None and size is None else resp.read()
        except http.client.HTTPException as exc:  # a body cut short (IncompleteRead): transient, as there
            raise ConnectionError(f"GET {fs.unstrip_protocol(path)}: {type(exc).__name__}: {exc}") from exc
        check_object_checksum(resp, data)
        return data, resp.getheader("ETag")


def direct_head(fs: Any, path: str) -> tuple[int, str | None] | None:
    """The size and ETag of the object at ``path`` (one ``HeadObject``), as :func:`s3_size_version` (``None``:
    that path)."""
    with _answer(fs, "HeadObject", path, {}) as resp:
        if resp is None:
            return None
        resp.read()  # nothing: the answer is done and its connection reusable
        header = resp.getheader("Content-Length")
        return (int(header), resp.getheader("ETag")) if header is not None and header.isdigit() else None


def direct_list_page(fs: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """One ``ListObjectsV2`` page (API ``kwargs``) as the client returns it: botocore's parser, keys URL-decoded as
    botocore does (it asks for ``EncodingType=url``). ``None``: that path (:func:`~.s3_stream.s3_list_names`)."""
    params = {k: v for k, v in kwargs.items() if k != "Bucket"}
    with _answer(fs, "ListObjectsV2", kwargs["Bucket"], params) as resp:
        if resp is None or is_encoded(resp.getheader("Content-Encoding")):
            return None
        answer = _read(resp, None)
    if error_in_200(answer["body"]):  # S3 may answer 200 with an error in the body: botocore makes it a 500
        raise _error_answer(fs, {**answer, "status_code": 500}, "ListObjectsV2", "list_objects_v2", kwargs)[1]
    from botocore.handlers import decode_list_object_v2

    parsed = _parsed(fs, "ListObjectsV2", answer)
    decode_list_object_v2(parsed, context={"encoding_type_auto_set": "EncodingType" not in params})
    return parsed


@contextlib.contextmanager
def _answer(fs: Any, operation: str, path: str, params: dict[str, str]) -> Iterator[http.client.HTTPResponse | None]:
    """The answer to ``operation`` (with API ``params`` such as ``Range``) on ``path`` sent directly, its body
    unread; ``None`` where this path does not apply, or for an answer that botocore would follow itself (a
    bucket in another region: its redirector re-signs the request there). An error answer is raised as the
    client would raise it. The operation's deadline bounds the whole exchange, a server trickling bytes too
    (:func:`~.retry.cut_at_deadline`). The connection stays for this thread's next request only if the answer was read to its
    end."""
    left = remaining()
    if os.environ.get(DIRECT_ENV, "1").strip().lower() in ("0", "false", "no", "off") or (
        left is not None and left <= 0  # the other path reports a passed deadline
    ):
        yield None
        return
    client_ready(fs, fs.unstrip_protocol(path))
    bucket, key, version = fs.split_path(path)
    keyed = {} if operation == "ListObjectsV2" else {"Key": key, **({"VersionId": version} if version else {})}
    kwargs, method = {"Bucket": bucket, **keyed, **params}, _METHODS[operation]
    state = _state(fs)
    try:
        request = bounded_sync(fs.loop, _prepared, fs, method, kwargs) if state.usable else None
    except Exception:  # noqa: BLE001 - the other path makes the same client call and reports what it raises
        request = None
    if request is None:
        yield None
        return
    parts = urllib.parse.urlsplit(request.url)
    headers = {str(k): v for k, v in request.headers.items()}
    if request.method == "GET":
        headers.setdefault("Accept-Encoding", "identity")  # not signed (nor need it be): bytes as stored
    target = parts.path + ("?" + parts.query if parts.query else "")
    used: list[socket.socket] = []
    timer = cut_at_deadline(left, used)
    try:
        conn, resp = _send(state, parts, request.method, target, headers, left, used)
        try:
            if resp.getheader("Transfer-Encoding") is not None and resp.getheader("Content-Length") is not None:
                raise ConnectionError(  # HTTP/1.1 refuses such a message (as aiohttp does): transient
                    f"{request.method} {fs.unstrip_protocol(path)}: an answer with both Content-Length and "
                    "Transfer-Encoding"
                )
            if resp.status >= 300:
                failure, translated = _error_answer(fs, _read(resp, _ERROR_BODY_BYTES), operation, method, kwargs)
                if resp.status in (301, 307) or error_code(failure) in _REDIRECTS or resp.getheader(_REGION):
                    yield None  # another region: botocore's own path follows it (and remembers the region)
                    return
                raise translated
            yield resp
        finally:
            if not resp.isclosed():  # an answer not read to its end: the connection cannot be reused
                _drop(conn)
    except (OSError, http.client.HTTPException) as exc:
        raise_if_past_deadline(left, exc)
        raise
    finally:
        if timer is not None:
            timer.cancel()


_METHODS = {"GetObject": "get_object", "HeadObject": "head_object", "ListObjectsV2": "list_objects_v2"}
_REDIRECTS = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"})
_REGION = "x-amz-bucket-region"


class _Prepared(Exception):  # noqa: N818 - not an error: how the signed request leaves botocore unsent
    def __init__(self, request: Any) -> None:
        super().__init__("prepared")
        self.request = request


_PREPARING: contextvars.ContextVar[bool] = contextvars.ContextVar("dcp_storage_s3_preparing", default=False)


def _hand_over(request: Any, **_kwargs: Any) -> None:
    """``before-send`` handler: a request being prepared for a direct send leaves the client here, unsent."""
    if _PREPARING.get():
        raise _Prepared(request)


async def _prepared(fs: Any, method: str, kwargs: dict[str, Any]) -> Any:
    """The request ``method`` with ``kwargs`` as s3fs's client sends it (serialised, endpoint resolved, signed),
    taken at botocore's ``before-send`` event instead of being sent."""
    client = await fs.get_s3(kwargs.get("Bucket"))
    client.meta.events.register_first("before-send.s3", _hand_over, unique_id="dcp-storage-direct-send")
    token = _PREPARING.set(True)
    try:
        await client_call(fs, method, **kwargs)
    except _Prepared as prepared:
        return prepared.request
    finally:
        _PREPARING.reset(token)
    return None  # another handler answered it: not this path


def _error_answer(fs: Any, answer: dict[str, Any], operation: str, method: str, kwargs: Any) -> tuple[Exception, ...]:
    """The error an error answer is: parsed by botocore's own parser into its modelled ``ClientError``, and that
    translated as :func:`~.s3_stream.s3_call` does (``NoSuchKey`` -> ``FileNotFoundError``, ...)."""
    from botocore.exceptions import ClientError

    parsed = _parsed(fs, operation, answer)
    exc = ClientError(parsed, operation)
    exc = fs._s3.exceptions.from_code(error_code(exc) or str(answer["status_code"]))(parsed, operation)
    return exc, translate_client_error(exc, method, kwargs)


def _read(resp: http.client.HTTPResponse, limit: int | None) -> dict[str, Any]:
    """An answer as botocore's parser takes it, its body read up to ``limit`` bytes (``None``: whole)."""
    return {"status_code": resp.status, "headers": dict(resp.getheaders()), "body": resp.read(limit)}


def _parsed(fs: Any, operation: str, answer: dict[str, Any]) -> Any:
    """``answer`` (status, headers, body) as botocore's parser reads it for ``operation``."""
    from botocore.parsers import create_parser

    return create_parser("rest-xml").parse(answer, fs._s3.meta.service_model.operation_model(operation).output_shape)


def _send(
    state: _Direct,
    parts: urllib.parse.SplitResult,
    method: str,
    target: str,
    headers: dict[str, str],
    left: float | None,
    used: list[socket.socket],
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """The request on this thread's connection to the endpoint (its socket added to ``used``), and its answer's headers. A
    kept-alive connection the server closed meanwhile (reset before any answer) is replaced once, as aiohttp
    does; any other failure is raised (an ``http.client`` or TLS error as a ``ConnectionError``: transient, for
    the retry layer, as botocore's ``HTTPClientError`` is)."""
    for attempt in range(2):
        conn, reused = _connection(state, parts)
        timeout = state.read_timeout if left is None else min(state.read_timeout, left)
        try:
            if conn.sock is None:
                conn.timeout = min(state.connect_timeout, timeout)
            conn.request(method, target, headers=headers)
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
                used.append(conn.sock)  # the answer reads this socket even where the connection lets it go
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            _drop(conn)
            stale = isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError))
            if not (reused and stale) or attempt:  # a timeout, or a new connection's failure: the caller's
                if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError):
                    raise
                raise ConnectionError(f"{method} {parts.hostname}:{parts.port}: {type(exc).__name__}: {exc}") from exc
    raise AssertionError("unreachable")


def _connection(state: _Direct, parts: urllib.parse.SplitResult) -> tuple[http.client.HTTPConnection, bool]:
    """This thread's keep-alive connection to the endpoint for filesystems judged as ``state`` (a connection made
    with one TLS context is never another's), a new one after ``fork`` (the parent's socket is not this
    process's to use), and whether it was made for an earlier request."""
    pool: dict[tuple[str, str, int | None, int], tuple[int, _Direct, http.client.HTTPConnection]] = (
        getattr(_CONNECTIONS, "pool", None) or {}
    )
    _CONNECTIONS.pool = pool
    where = (parts.scheme, parts.hostname or "", parts.port, id(state))
    held = pool.get(where)
    if held is not None and held[0] == os.getpid() and held[1] is state:
        return held[2], True
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(
            parts.hostname or "", parts.port, timeout=state.connect_timeout, context=state.ssl_context
        )
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=state.connect_timeout)
    pool[where] = (os.getpid(), state, conn)
    return conn, False


def _drop(conn: http.client.HTTPConnection) -> None:
    pool = getattr(_CONNECTIONS, "pool", None) or {}
    for where in [w for w, held in pool.items() if held[2] is conn]:
        del pool[where]
    conn.close()


def _state(fs: Any) -> _Direct:
    with _STATE_LOCK:
        state = _STATE.get(fs)
    if state is None:
        state = _judge(fs)
        with _STATE_LOCK, contextlib.suppress(TypeError):  # one that cannot be weakly referenced: judged each time
            _STATE[fs] = state
    return state


def _judge(fs: Any) -> _Direct:
    """Whether direct GETs send what the client would (module docstring), and the client's TLS and timeouts."""
    client = getattr(fs, "_s3", None)
    endpoint = getattr(client, "_endpoint", None)
    session = getattr(endpoint, "http_session", None)
    host = getattr(endpoint, "host", None)
    if session is None or not isinstance(host, str) or not hasattr(client, "meta"):
        return _Direct(False)
    retries = getattr(getattr(client, "meta", None), "config", None)
    retries = getattr(retries, "retries", None) or {}
    if retries.get("total_max_attempts") != 1 and retries.get("max_attempts") != 0:
        return _Direct(False)  # the client retries on its own (storage options asked it to): its path keeps that
    try:
        scheme = urllib.parse.urlsplit(host).scheme
        if scheme not in ("http", "https") or getattr(session, "_cert_file", None) is not None:
            return _Direct(False)
        if session._proxy_config.proxy_url_for(host):
            return _Direct(False)
        context = session._build_verify_context() if scheme == "https" else None
        timeout = getattr(session, "_timeout", None)
    except Exception:  # noqa: BLE001 - another aiobotocore than the one this was written for: the usual path
        return _Direct(False)
    connect = getattr(timeout, "sock_connect", None) or _DEFAULT_TIMEOUT
    read = getattr(timeout, "sock_read", None) or _DEFAULT_TIMEOUT
    return _Direct(True, context, float(connect), float(read))
