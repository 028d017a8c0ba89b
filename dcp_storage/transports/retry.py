"""Retrying transient storage failures with backoff and jitter, under the deadline of the operation running on this
thread.

The deadline of the storage operation running on this thread, applied to each request in flight.

:class:`~dcp_storage.transports.retry.RetryPolicy` ``deadline`` bounds a whole operation, retries included.
Checking it between attempts is not enough: a server that stalls before its headers, or in the middle of a
body, holds one attempt for as long as the client's own socket timeout (botocore's ``read_timeout``, 60 s
by default, gcsfs's ``sock_read``), and a stall that trickles a byte now and then holds it forever. So
:func:`~dcp_storage.transports.retry.call_with_retry` opens an :func:`operation_deadline` around its
attempts, and every request the transports run on an fsspec event loop goes through :func:`bounded_sync`,
which cancels the request when the operation's time is up and raises :class:`AttemptTimeoutError` (a
``TimeoutError``: transient, so the retry layer then raises its ``TransportError`` naming the URL).

Operations nest (a create-if-absent that reads back its own object): the inner one never outlives the outer.

Retrying transient storage failures with exponential backoff and jitter.

Object stores throttle (S3 ``503 SlowDown``), reset connections and cut bodies short; a checkpoint load
that touches thousands of ranges will meet some of these. Client libraries retry only some of them
(boto-style clients give up on a truncated body), so the transport wraps every storage call in
:func:`call_with_retry`. Permanent errors (missing file, access denied, bad request) are raised at once.

Which layer retries what
------------------------
Stacked retry layers multiply: botocore (5 attempts by default) under s3fs (5 on connection errors and
``SlowDown``) under ours (6) is 150 requests for one permanent fault, and an inner layer's backoff
(botocore sleeps up to 2**n seconds, gcsfs up to 32 s) makes any deadline of ours meaningless. So:

* **Ours** (:class:`RetryPolicy`: ``max_attempts``, ``deadline``, backoff) covers every transport
  operation: ranged reads (a body cut short resumes from the first missing byte), whole-file reads
  (``.metadata``), ``write_file``, each request of an ``open_atomic`` upload (create, each part,
  complete, or the single PUT), ``exists``, ``size``, ``listdir``, ``remove``, ``makedirs``.
* **botocore**: :meth:`FsspecTransport.from_url <dcp_storage.transports.FsspecTransport.from_url>` gives
  s3fs ``config_kwargs={"retries": {"total_max_attempts": 1}}`` (one attempt per call) unless the caller
  configured ``retries`` there; with their own setting, attempts multiply and they chose so.
* **s3fs**: every S3 request of the transport (ranged and whole-object GETs, PUTs, multipart requests,
  HEAD, list, delete) calls the botocore client directly (:mod:`~dcp_storage.transports.s3_stream`,
  :mod:`~dcp_storage.transports.s3_upload`, :mod:`~dcp_storage.transports.s3`), past s3fs's
  ``_error_wrapper`` (which would retry connection errors and ``SlowDown`` ``S3FileSystem.retries`` = 5
  times more). Only ``makedirs`` goes through s3fs (a no-op below a bucket that exists).
* **gcsfs** retries 5xx, 429 and connection errors 6 times with sleeps of 1, 2, 4, 8, 16 s, a count fixed
  when its class is defined (no option turns it down). So every GCS request of the transport (ranged and
  whole-object GETs, the media upload of a write, object metadata, list, delete) calls gcsfs's undecorated
  request, one attempt each (:mod:`~dcp_storage.transports.gcs`). gcsfs sets no timeout by default
  (``requests_timeout=None``: a stalled server hangs a request forever), so ``from_url`` gives it
  ``requests_timeout=aiohttp.ClientTimeout(sock_connect=30, sock_read=60)`` unless the caller set one.
* Other clients keep their own retries and ours wraps them: adlfs and HTTP have their own policies.

The deadline is checked after every failed attempt: the operation gives up when the backoff sleep plus the
longest attempt so far would end past it, so a permanent fault surfaces before the deadline as long as
attempts take about as long as earlier ones. An attempt in flight is bounded by the client's timeouts
(botocore ``connect_timeout``/``read_timeout``, gcsfs ``requests_timeout``) and by the deadline itself: the
requests the transports run on fsspec's event loop (S3, GCS, HTTP, Azure reads) are cancelled when it passes
(:mod:`.deadline`), so a server that stalls before its headers or in mid-body fails the operation at its
deadline, naming the URL, whatever the client's socket timeouts are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fsspec.asyn import sync

from dcp_storage.errors import DcpStorageError, TransportError

__all__ = [
    "AttemptTimeoutError",
    "RetryPolicy",
    "TruncatedReadError",
    "bounded_call",
    "bounded_sync",
    "call_with_retry",
    "error_chain",
    "error_code",
    "http_status",
    "is_transient",
    "operation_deadline",
    "remaining",
    "single_layer_client_options",
]


_local = threading.local()


class AttemptTimeoutError(TimeoutError):
    """A request was still unanswered (or its body unfinished) when its operation's deadline passed.

    Internal signal, like a socket timeout: the retry layer gives up on it with a ``TransportError``.
    """


@contextlib.contextmanager
def operation_deadline(seconds: float | None) -> Iterator[None]:
    """Bound the requests made on this thread inside the block to ``seconds`` from now (``None``: no bound)."""
    outer: float | None = getattr(_local, "ends", None)
    ends = outer
    if seconds is not None:
        mine = time.monotonic() + seconds
        ends = mine if outer is None else min(outer, mine)
    _local.ends = ends
    try:
        yield
    finally:
        _local.ends = outer


def remaining() -> float | None:
    """Seconds left to the current operation's deadline on this thread (``None``: no deadline)."""
    ends: float | None = getattr(_local, "ends", None)
    return None if ends is None else ends - time.monotonic()


def bounded_sync(loop: Any, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fsspec.asyn.sync(loop, func, *args, **kwargs)``, cancelled when the operation's deadline passes.

    Without a deadline it is fsspec's ``sync``. With one, the coroutine runs as a task on ``loop`` and this
    thread waits on its future for the time left; on expiry the task is cancelled (which closes the
    request's connection). That costs no extra task per request, unlike ``sync(timeout=...)``, whose
    ``asyncio.wait_for`` wraps every request in one more.
    """
    left = remaining()
    if left is None:
        return sync(loop, func, *args, **kwargs)
    if left <= 0:
        raise AttemptTimeoutError("the operation's deadline passed before this request was sent")
    if loop is None or loop.is_closed():
        raise RuntimeError("Loop is not running")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise NotImplementedError("Calling sync() from within a running loop")
    future = asyncio.run_coroutine_threadsafe(func(*args, **kwargs), loop)
    try:
        return future.result(timeout=left)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise AttemptTimeoutError(
            f"no complete answer within the {left:.1f}s left to the operation's deadline (a stalled server or "
            "connection; RetryPolicy(deadline=...) sets it)"
        ) from None


def bounded_call(fs: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``fs.<name>(*args, **kwargs)``; on an async fsspec filesystem, bounded like :func:`bounded_sync`.

    fsspec's blocking methods wait on the event loop for as long as the request takes: a server that stalls
    holds one attempt for the client's own timeouts (the Azure SDK's read timeout; aiohttp has none). The
    coroutine behind the method (``_name``) is run through :func:`bounded_sync` instead.
    """
    inner = getattr(fs, "fs", None)  # a wrapper (``dir::``'s DirFileSystem) is async only over an async filesystem
    wraps_sync = inner is not None and not getattr(inner, "async_impl", False)
    if getattr(fs, "async_impl", False) and hasattr(fs, f"_{name}") and not wraps_sync:
        return bounded_sync(fs.loop, getattr(fs, f"_{name}"), *args, **kwargs)
    return getattr(fs, name)(*args, **kwargs)


T = TypeVar("T")


class TruncatedReadError(OSError):
    """A read returned fewer bytes than asked for although the object is long enough.

    Internal signal for "retry this": a body cut short by a reset connection looks like this.
    """


# Exception class names (matched along the MRO, so optional client libraries need not be imported) that
# mean "the connection or the body failed, the same request may succeed".
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "ClientPayloadError",  # aiohttp: body cut short
        "ServerDisconnectedError",
        "ClientOSError",
        "ClientConnectionError",
        "ServerTimeoutError",
        "ResponseStreamingError",  # botocore
        "HTTPClientError",  # botocore: the HTTP layer failed (s3fs retries it too)
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "IncompleteReadError",
        "IncompleteRead",  # http.client
        "ProtocolError",  # urllib3
        "FSTimeoutError",  # fsspec
        "TruncatedReadError",
        "RangeMismatchError",  # range_check: an answer with other bytes than the range asked for
    }
)
_TRANSIENT_ERRNOS = frozenset(
    # EBUSY: s3fs's translation of 503 SlowDown / ServiceUnavailable; EREMOTEIO: of 500 InternalError.
    {errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE, errno.EAGAIN, errno.EREMOTEIO, errno.EBUSY}
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "TooManyRequests",
    }
)
_TRANSIENT_TEXT = ("SlowDown", "reduce your request rate", "Service Unavailable", "InternalError")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it was raised from: ``raise ... from cause``, and the implicit context unless
    ``from None`` suppressed it (each exception once, so a cycle ends)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status one store error carries: azure-core's ``status_code``, aiohttp's ``status``,
    gcsfs's ``code``, botocore's ``ResponseMetadata``; ``None`` when it names none."""
    for attr in ("status_code", "status", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def error_code(exc: BaseException) -> str | None:
    """The store's error code in one error: botocore's ``Error.Code``, azure-core's ``error_code`` (a str
    enum); ``None`` when it names none. Access errors (:mod:`.access`) and retries read the same fields."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if isinstance(code, str):
            return code
    code = getattr(exc, "error_code", None)
    code = getattr(code, "value", code)
    return code if isinstance(code, str) and code else None


def _one_is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(exc).__mro__):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    status = http_status(exc)
    if status is not None and (status >= 500 or status == 429):
        return True
    code = error_code(exc)
    if code is not None:
        return code in _TRANSIENT_CODES
    text = str(exc)
    return isinstance(exc, OSError) and any(marker in text for marker in _TRANSIENT_TEXT)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is worth retrying."""
    for current in error_chain(exc):
        # Our own errors are decisions already taken (a TransportError means retries were exhausted;
        # retrying it again would multiply the attempts), whatever they were raised from.
        if isinstance(current, (DcpStorageError, *_PERMANENT)):
            return False
        if _one_is_transient(current):
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to retry one storage operation.

    ``max_attempts`` counts the first try. ``deadline`` (seconds, ``None`` for no limit) bounds the whole
    operation including backoff sleeps, so a permanent fault surfaces in bounded time. Backoff doubles
    from ``initial_backoff`` up to ``max_backoff``, each sleep scaled by a random factor in
    ``[1 - jitter, 1]`` so that many ranks do not retry in lockstep.
    """

    max_attempts: int = 6
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    jitter: float = 0.5
    deadline: float | None = 300.0
    classify: Callable[[BaseException], bool] = field(default=is_transient, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff < 0 or self.max_backoff < 0:
            raise ValueError("RetryPolicy backoff values must be >= 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"RetryPolicy.deadline must be > 0 or None, got {self.deadline}")

    def backoff(self, attempt: int) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        base = min(self.max_backoff, self.initial_backoff * (2 ** (attempt - 1)))
        return base * (1.0 - self.jitter * random.random())


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    describe: Callable[[], str],
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Call ``fn`` until it succeeds, fails permanently, or the policy gives up.

    ``describe()`` names the operation for the final error, e.g. ``"read s3://b/k bytes [0, 4096)"``.
    The final error is a :class:`TransportError` chained to the last failure; permanent errors and our
    own project errors propagate unchanged so callers can still catch ``FileNotFoundError``.
    """
    with operation_deadline(policy.deadline):  # bounds each attempt in flight too (see .deadline)
        return _retry_loop(fn, policy, describe, on_retry)


def _retry_loop(
    fn: Callable[[], T],
    policy: RetryPolicy,
    describe: Callable[[], str],
    on_retry: Callable[[BaseException], None] | None,
) -> T:
    started = time.monotonic()
    attempt = 0
    longest = 0.0  # the longest attempt so far: the best guess of how long the next one takes
    while True:
        attempt += 1
        began = time.monotonic()
        try:
            return fn()
        except Exception as exc:  # classified below, never swallowed
            if not policy.classify(exc):
                raise
            now = time.monotonic()
            elapsed = now - started
            longest = max(longest, now - began)
            sleep = policy.backoff(attempt)
            out_of_time = policy.deadline is not None and elapsed + sleep + longest > policy.deadline
            if attempt >= policy.max_attempts or out_of_time:
                if out_of_time and attempt < policy.max_attempts:
                    why = f"deadline, {policy.deadline:g}s"
                else:
                    why = f"attempts, max_attempts={policy.max_attempts}"
                raise TransportError(
                    f"{describe()} failed after {attempt} attempt(s) in {elapsed:.1f}s "
                    f"(gave up: {why}); last error: {type(exc).__name__}: {exc}"
                ) from exc
            if on_retry is not None:
                on_retry(exc)
            time.sleep(sleep)


# Protocols whose fsspec client sits on botocore, and the option that turns botocore's retries down.
_BOTOCORE_PROTOCOLS = frozenset({"s3", "s3a"})
_GCSFS_PROTOCOLS = frozenset({"gs", "gcs"})
# gcsfs's per-request aiohttp timeout when the caller gave none (its own default is no timeout at all).
GCS_CONNECT_TIMEOUT = 30.0
GCS_READ_TIMEOUT = 60.0


def single_layer_client_options(url: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """``storage_options`` for ``url`` with the client's own retries set to one attempt, and timeouts bounded.

    Our layer then owns retries (module docstring). S3: a caller who set ``config_kwargs["retries"]`` keeps
    it. GCS: gcsfs's retries are bypassed per request (not through options); a ``requests_timeout`` is added
    unless the caller gave one.
    """
    options = dict(storage_options)
    protocol = url.split("://", 1)[0].lower() if "://" in url else ""
    if protocol in _BOTOCORE_PROTOCOLS:
        config = dict(options.get("config_kwargs") or {})
        if "retries" not in config:
            config["retries"] = {"mode": "standard", "total_max_attempts": 1}
            options["config_kwargs"] = config
    elif protocol in _GCSFS_PROTOCOLS and options.get("requests_timeout") is None:
        import aiohttp  # gcsfs depends on it

        options["requests_timeout"] = aiohttp.ClientTimeout(
            sock_connect=GCS_CONNECT_TIMEOUT, sock_read=GCS_READ_TIMEOUT
        )
    return options


def cut_at_deadline(left: float | None, used: list[socket.socket]) -> threading.Timer | None:
    """Shut the sockets in ``used`` down when the ``left`` seconds of the operation's deadline pass: a socket
    timeout bounds each wait for bytes, not a server that sends one byte now and then."""
    if left is None:
        return None

    def cut() -> None:
        for sock in used:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(left, cut)
    timer.daemon = True
    timer.start()
    return timer


def raise_if_past_deadline(left: float | None, cause: BaseException | None = None) -> None:
    """The deadline's own error (as :func:`bounded_sync` raises it) once the operation's time is up."""
    now = remaining()
    if left is not None and now is not None and now <= 0:
        raise AttemptTimeoutError(
            f"no complete answer within the {left:.1f}s left to the operation's deadline (a stalled server or "
            "connection; RetryPolicy(deadline=...) sets it)"
        ) from cause
