"""A fault-injecting HTTP/1.1 reverse proxy for tests: put it between a client and an emulator.

Object stores throttle, fail, reset connections and cut bodies short; emulators (moto, fake-gcs-server)
do none of that. :class:`FaultProxy` listens on ``127.0.0.1`` (port 0, read back), forwards every request
*verbatim* to one upstream (request line, headers including ``Host``, body bytes), and on the requests its
:class:`FaultRule` s select, misbehaves in one of these ways (:data:`FAULT_MODES`):

``slowdown_503``
    ``503`` with an S3 ``SlowDown`` XML body (or, with ``dialect="gcs"``, a GCS JSON error); upstream
    never sees the request.
``error_500``
    ``500 InternalError``, likewise never forwarded.
``reset``
    A TCP reset before any response byte (``SO_LINGER`` 0, then close); never forwarded.
``truncate``
    Forwarded; the client gets the upstream's headers (full ``Content-Length``) and half of the body, then
    a reset. The upstream *did* act on the request, as a real store may have before a connection dies.
``slow``
    Forwarded; the response is held back for ``delay`` seconds (a client with a shorter read timeout gives
    up; the upstream acted on the request either way).

Why a byte-level proxy rather than an HTTP framework: S3 SigV4 signs the ``Host`` header, so the client
must talk to the proxy's address and the proxy must pass the head on untouched; and resets and truncated
bodies need control of the socket that frameworks hide. Bodies are streamed in 64 KiB pieces, never
buffered whole.

It runs an asyncio loop in a daemon thread, so synchronous tests and pytest fixtures use it directly::

    with FaultProxy(moto.endpoint_url) as proxy:
        proxy.set_rules([FaultRule("truncate", every=3, method="GET")])
        ...  # point the client's endpoint_url at proxy.url
        assert proxy.counters().faults["truncate"] > 0

Rules can be replaced at any time from any thread (:meth:`FaultProxy.set_rules`); :meth:`counters`
returns a consistent snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import struct
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ._server_process import StartStop

__all__ = ["FAULT_MODES", "FaultCounters", "FaultMode", "FaultProxy", "FaultProxyError", "FaultRule"]

FaultMode = Literal["slowdown_503", "error_500", "reset", "truncate", "slow"]
FAULT_MODES: tuple[FaultMode, ...] = ("slowdown_503", "error_500", "reset", "truncate", "slow")

_HOST = "127.0.0.1"
_CHUNK = 64 * 1024
_MAX_HEAD = 64 * 1024
# After a truncated body, wait this long before the reset so the client reads the half body first (a
# reset can make the peer's kernel drop data it has not read yet, which would look like a plain reset).
_TRUNCATE_GRACE = 0.05


class FaultProxyError(RuntimeError):
    """The proxy could not start, or was used while not running."""


@dataclass(frozen=True)
class FaultRule:
    """Which requests to fault and how.

    A request *matches* when every given filter matches: ``method`` (case-insensitive, exact),
    ``path`` and ``query`` (regular expressions searched in the URL-decoded path and in the raw query
    string). Every ``every``-th matching request (the ``every``-th, ``2*every``-th, ...) is faulted in
    ``mode``; ``every=1`` faults all of them. ``limit`` stops the rule after that many faults.
    ``delay`` is the hold-back of ``slow``.
    """

    mode: FaultMode
    every: int = 1
    method: str | None = None
    path: str | None = None
    query: str | None = None
    delay: float = 1.0
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"FaultRule.mode must be one of {FAULT_MODES}, got {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"FaultRule.every must be >= 1, got {self.every}")
        if self.delay < 0:
            raise ValueError(f"FaultRule.delay must be >= 0, got {self.delay}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"FaultRule.limit must be >= 0 or None, got {self.limit}")
        for name in ("path", "query"):
            pattern = getattr(self, name)
            if pattern is not None:
                re.compile(pattern)  # fail here, not inside the proxy thread

    def matches(self, method: str, path: str, query: str) -> bool:
        if self.method is not None and method.upper() != self.method.upper():
            return False
        if self.path is not None and re.search(self.path, path) is None:
            return False
        return self.query is None or re.search(self.query, query) is not None


@dataclass(frozen=True)
class FaultCounters:
    """A snapshot of what the proxy has done since it started (or since :meth:`FaultProxy.reset_counters`).

    ``faults`` has every mode as a key. ``faulted`` lists ``(method, path, mode)`` of each fault, oldest
    first (the last 10,000). ``bytes_to_upstream`` / ``bytes_to_client`` count forwarded bytes (heads
    and bodies).
    """

    requests: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_MODES, 0))
    faulted: tuple[tuple[str, str, str], ...] = ()
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())


class _State:
    """Rules and counters, shared between the proxy thread and callers; every access holds the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rules: list[FaultRule] = []
        self.seen: list[int] = []
        self.fired: list[int] = []
        self.reset_counters()

    def reset_counters(self) -> None:
        self.requests = 0
        self.faults = dict.fromkeys(FAULT_MODES, 0)
        self.faulted: list[tuple[str, str, str]] = []
        self.up = 0
        self.down = 0

    def decide(self, method: str, target: str) -> FaultRule | None:
        split = urllib.parse.urlsplit(target)
        path = urllib.parse.unquote(split.path)
        with self.lock:
            self.requests += 1
            for i, rule in enumerate(self.rules):
                if not rule.matches(method, path, split.query):
                    continue
                self.seen[i] += 1
                if self.seen[i] % rule.every or (rule.limit is not None and self.fired[i] >= rule.limit):
                    continue
                self.fired[i] += 1
                self.faults[rule.mode] += 1
                self.faulted.append((method, path, rule.mode))
                del self.faulted[:-10_000]
                return rule
            return None


@dataclass
class _Head:
    """A parsed HTTP/1.x message head; ``raw`` is the exact bytes received (forwarded as they are)."""

    raw: bytes
    start_line: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def has_token(self, name: str, token: str) -> bool:
        value = self.get(name)
        return value is not None and token in (t.strip().lower() for t in value.split(","))


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    """The next message head, or ``None`` on a clean end of stream before any byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    except asyncio.LimitOverrunError as exc:
        raise ValueError(f"message head larger than {_MAX_HEAD} bytes") from exc
    lines = raw[:-4].decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line {line!r}")
        headers.append((name.strip(), value.strip()))
    return _Head(raw, lines[0], headers)


async def _relay_body(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter | None,
    head: _Head,
    *,
    until_eof: bool,
    count: Callable[[int], None] | None = None,
) -> int:
    """Copy one message body (``Content-Length``, chunked, or to EOF) as raw bytes; ``writer=None`` drops it.

    ``count(n)`` is called before each piece is written, so counters never lag what the peer has seen.
    """

    async def put(data: bytes) -> None:
        if count is not None:
            count(len(data))
        if writer is not None:
            writer.write(data)
            await writer.drain()

    moved = 0
    if head.has_token("transfer-encoding", "chunked"):
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            await put(size_line)
            moved += len(size_line)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = await reader.readuntil(b"\r\n")
                    await put(line)
                    moved += len(line)
                    if line == b"\r\n":
                        return moved
            left = size + 2  # the chunk and its CRLF
            while left:
                data = await reader.readexactly(min(_CHUNK, left))
                await put(data)
                moved += len(data)
                left -= len(data)
    length = head.get("content-length")
    if length is not None:
        left = int(length)
        while left:
            data = await reader.read(min(_CHUNK, left))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            await put(data)
            moved += len(data)
            left -= len(data)
        return moved
    if until_eof:
        while data := await reader.read(_CHUNK):
            await put(data)
            moved += len(data)
    return moved


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST instead of a FIN: ``SO_LINGER`` on with a zero timeout, then close."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _response_has_body(method: str, status: int) -> bool:
    return method != "HEAD" and not (100 <= status < 200 or status in (204, 304))


class FaultProxy(StartStop):
    """Reverse proxy from ``127.0.0.1:<port>`` to ``upstream`` (``http://host:port``) with fault rules.

    ``dialect`` shapes the error bodies of ``slowdown_503`` and ``error_500``: ``"s3"`` (XML, what
    botocore parses into ``SlowDown`` / ``InternalError``) or ``"gcs"`` (JSON, what gcsfs reads).
    ``rewrite_location``: a response ``Location`` header that points at the upstream is rewritten to point
    at the proxy. fake-gcs-server names its own address there for every resumable upload, so without it
    the upload's chunks would go around the proxy.
    """

    def __init__(
        self,
        upstream: str,
        rules: Iterable[FaultRule] = (),
        *,
        dialect: Literal["s3", "gcs"] = "s3",
        rewrite_location: bool = False,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
            raise ValueError(f"FaultProxy upstream must be http://host:port, got {upstream!r}")
        if dialect not in ("s3", "gcs"):
            raise ValueError(f"FaultProxy dialect must be 's3' or 'gcs', got {dialect!r}")
        self.upstream = upstream
        self.dialect = dialect
        self.rewrite_location = rewrite_location
        self._up_host, self._up_port = parsed.hostname, parsed.port
        self._state = _State()
        self.set_rules(rules)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Bind port 0 and serve from a daemon thread; returns once the port is known."""
        if self._thread is not None:
            raise FaultProxyError("FaultProxy already started")
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve_client, _HOST, 0, limit=_MAX_HEAD)
                )
                self._port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = self._loop = None
            raise FaultProxyError(f"FaultProxy could not listen on {_HOST}: {failure[0]!r}") from failure[0]

    def stop(self) -> None:
        """Close the listener and every open connection, then end the thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._loop = self._thread = self._server = None
        self._port = None

    # ------------------------------------------------------------------ control
    @property
    def port(self) -> int:
        if self._port is None:
            raise FaultProxyError("FaultProxy is not running")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: give this to the client as its endpoint."""
        return f"http://{_HOST}:{self.port}"

    def set_rules(self, rules: Iterable[FaultRule]) -> None:
        """Replace the rules (and their every-N counts); safe from any thread, effective for the next request."""
        rules = list(rules)
        for rule in rules:
            if not isinstance(rule, FaultRule):
                raise TypeError(f"FaultProxy rules must be FaultRule, got {type(rule).__name__}")
        with self._state.lock:
            self._state.rules = rules
            self._state.seen = [0] * len(rules)
            self._state.fired = [0] * len(rules)

    def clear_rules(self) -> None:
        self.set_rules(())

    @property
    def rules(self) -> Sequence[FaultRule]:
        with self._state.lock:
            return tuple(self._state.rules)

    def counters(self) -> FaultCounters:
        s = self._state
        with s.lock:
            return FaultCounters(s.requests, dict(s.faults), tuple(s.faulted), s.up, s.down)

    def reset_counters(self) -> None:
        with self._state.lock:
            self._state.reset_counters()

    def _count(self, up: int = 0, down: int = 0) -> None:
        with self._state.lock:
            self._state.up += up
            self._state.down += down

    # ------------------------------------------------------------------ serving
    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                parts = head.start_line.split(" ")
                if len(parts) != 3:
                    raise ValueError(f"malformed request line {head.start_line!r}")
                method, target = parts[0].upper(), parts[1]
                rule = self._state.decide(method, target)
                mode = rule.mode if rule is not None else None
                if mode == "reset":
                    _reset(writer)
                    return
                if mode in ("slowdown_503", "error_500"):
                    if not await self._answer_error(reader, writer, head, method, mode):
                        return
                    continue
                if upstream is None or upstream[1].is_closing():
                    upstream = await asyncio.open_connection(self._up_host, self._up_port, limit=_MAX_HEAD)
                keep = await self._forward(reader, writer, upstream, head, method, rule)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, OSError):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        finally:
            if upstream is not None:
                upstream[1].transport.abort()
            if not writer.is_closing():
                writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _answer_error(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: _Head, method: str, mode: str
    ) -> bool:
        """Answer an injected 503/500 without forwarding; returns whether the connection stays usable."""
        # A client waiting for "100 Continue" has not sent its body: answer now and close (RFC 9110 15.2.1).
        keep = not head.has_token("expect", "100-continue")
        if keep:
            await _relay_body(reader, None, head, until_eof=False)
        status, reason, body, ctype = self._error_body(mode)
        if method == "HEAD":  # no body, and (as S3 does) no length of one either
            body = b""
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
        if not keep:
            lines.append("Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        return keep

    def _error_body(self, mode: str) -> tuple[int, str, bytes, str]:
        slow = mode == "slowdown_503"
        status, reason = (503, "Slow Down") if slow else (500, "Internal Server Error")
        if self.dialect == "gcs":
            message = (
                "We encountered an internal error. Please try again."
                if not slow
                else "Please reduce your request rate."
            )
            payload = {
                "error": {
                    "code": status,
                    "message": message,
                    "errors": [{"message": message, "reason": "backendError"}],
                }
            }
            return status, reason, json.dumps(payload).encode(), "application/json; charset=UTF-8"
        code = "SlowDown" if slow else "InternalError"
        message = "Please reduce your request rate." if slow else "We encountered an internal error. Please try again."
        xml = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>fault-proxy</RequestId></Error>"
        )
        return status, reason, xml.encode(), "application/xml"

    async def _forward(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        head: _Head,
        method: str,
        rule: FaultRule | None,
    ) -> bool:
        """Send one request upstream and its response back; returns whether both connections stay open."""
        up_reader, up_writer = upstream
        up_writer.write(head.raw)
        self._count(up=len(head.raw))
        expect_continue = head.has_token("expect", "100-continue")
        body_sent = not expect_continue
        if body_sent:
            await self._pump_request(reader, up_writer, head)
        while True:
            response = await _read_head(up_reader)
            if response is None:
                raise ConnectionResetError("upstream closed the connection before responding")
            status = int(response.start_line.split(" ", 2)[1])
            if 100 <= status < 200 and status != 101:
                writer.write(response.raw)  # "100 Continue": relay, then the body, then the real response
                await writer.drain()
                if status == 100 and not body_sent:
                    body_sent = True
                    await self._pump_request(reader, up_writer, head)
                continue
            break
        if not body_sent:  # the final answer came without "100 Continue": the body is never sent
            return False
        if self.rewrite_location:
            response = self._local_location(response)
        mode = rule.mode if rule is not None else None
        if mode == "slow":
            await asyncio.sleep(rule.delay)  # type: ignore[union-attr]
        has_body = _response_has_body(method, status)
        if mode == "truncate":
            await self._truncate(up_reader, writer, response, has_body)
            return False
        self._count(down=len(response.raw))
        writer.write(response.raw)
        await writer.drain()
        if has_body:
            await _relay_body(up_reader, writer, response, until_eof=True, count=lambda n: self._count(down=n))
        closes = response.has_token("connection", "close") or head.has_token("connection", "close")
        delimited = (
            not has_body
            or response.get("content-length") is not None
            or response.has_token("transfer-encoding", "chunked")
        )
        return not closes and delimited

    def _local_location(self, response: _Head) -> _Head:
        """``response`` with a ``Location`` under the upstream's URL moved to the proxy's (else unchanged)."""
        location = response.get("location")
        if location is None or not location.startswith(self.upstream):
            return response
        headers = [
            (k, self.url + v[len(self.upstream) :] if k.lower() == "location" else v) for k, v in response.headers
        ]
        lines = [response.start_line, *(f"{k}: {v}" for k, v in headers)]
        return _Head(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), response.start_line, headers)

    async def _pump_request(self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, head: _Head) -> None:
        await _relay_body(reader, up_writer, head, until_eof=False, count=lambda n: self._count(up=n))

    async def _truncate(
        self, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: _Head, has_body: bool
    ) -> None:
        """Headers and half the body (half the head when there is no body), then a reset."""
        length = response.get("content-length")
        chunked = response.has_token("transfer-encoding", "chunked")
        if has_body and length is not None and int(length) > 1:
            half = int(length) // 2
            writer.write(response.raw)
            sent = 0
            while sent < half:
                data = await up_reader.read(min(_CHUNK, half - sent))
                if not data:
                    break
                writer.write(data)
                sent += len(data)
            moved = len(response.raw) + sent
        elif has_body and chunked:  # no length to halve: the first chunk's size line and half its data
            first = await up_reader.readuntil(b"\r\n")
            size = int(first.split(b";", 1)[0].strip(), 16)
            data = await up_reader.readexactly(size // 2)
            writer.write(response.raw + first + data)
            moved = len(response.raw) + len(first) + len(data)
        else:
            moved = len(response.raw) // 2
            writer.write(response.raw[:moved])
        await writer.drain()
        self._count(down=moved)
        await asyncio.sleep(_TRUNCATE_GRACE)
        _reset(writer)
