"""The proxy itself: an asyncio server in a daemon thread that forwards, or misbehaves as its rules say."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Literal

from dcp_storage_testing._server_process import StartStop
from dcp_storage_testing.fault_proxy.bodies import ANSWERED_MODES, error_body
from dcp_storage_testing.fault_proxy.link import LinkModel
from dcp_storage_testing.fault_proxy.rewrite import rewritten
from dcp_storage_testing.fault_proxy.rules import (
    BODY_FAULT_MODES,
    CONDITION_FAULT_MODES,
    CONDITION_HEADERS,
    CORRUPT_BODY_MODES,
    RANGE_FAULT_MODES,
    FaultCounters,
    FaultMode,
    FaultRule,
    RuleBook,
    faulted_range,
    parse_range,
)
from dcp_storage_testing.fault_proxy.wire import CHUNK, MAX_HEAD, Head, read_head, relay_body, reset, response_has_body

__all__ = ["FaultProxy", "FaultProxyError"]

_HOST = "127.0.0.1"
# After a truncated body, wait this long before the reset so the client reads the half body first (a
# reset can make the peer's kernel drop data it has not read yet, which would look like a plain reset).
_TRUNCATE_GRACE = 0.05


class FaultProxyError(RuntimeError):
    """The proxy could not start, or was used while not running."""


class FaultProxy(StartStop):
    """Reverse proxy from ``127.0.0.1:<port>`` to ``upstream`` (``http://host:port``) with fault rules.

    ``dialect`` shapes the error bodies of ``slowdown_503``, ``error_500`` and ``forbidden_403``
    (:mod:`.bodies`): ``"s3"`` (XML, what botocore parses into ``SlowDown`` / ``InternalError`` /
    ``AccessDenied``) or ``"gcs"`` (JSON, what gcsfs reads).
    ``rewrite_location``: a response ``Location`` header that points at the upstream is rewritten to point
    at the proxy. fake-gcs-server names its own address there for every resumable upload, so without it
    the upload's chunks would go around the proxy.
    ``link``: a :class:`~.link.LinkModel` (bandwidth per connection, latency to first byte) applied to every
    forwarded request, so an emulator behaves like a store whose throughput grows with the connections in
    flight (benchmarks use it; tests of faults leave it off).
    """

    def __init__(
        self,
        upstream: str,
        rules: Iterable[FaultRule] = (),
        *,
        dialect: Literal["s3", "gcs"] = "s3",
        rewrite_location: bool = False,
        link: LinkModel | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or parsed.port is None:
            raise ValueError(f"FaultProxy upstream must be http://host:port, got {upstream!r}")
        if dialect not in ("s3", "gcs"):
            raise ValueError(f"FaultProxy dialect must be 's3' or 'gcs', got {dialect!r}")
        self.upstream = upstream
        self.dialect = dialect
        self.rewrite_location = rewrite_location
        self.link = link
        self._up_host, self._up_port = parsed.hostname, parsed.port
        self._state = RuleBook()
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
                    asyncio.start_server(self._serve_client, _HOST, 0, limit=MAX_HEAD)
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
            by_path = {key: list(value) for key, value in s.by_path.items()}
            return FaultCounters(s.requests, dict(s.faults), tuple(s.faulted), s.up, s.down, by_path, tuple(s.log))

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
                head = await read_head(reader)
                if head is None:
                    return
                parts = head.start_line.split(" ")
                if len(parts) != 3:
                    raise ValueError(f"malformed request line {head.start_line!r}")
                method, target = parts[0].upper(), parts[1]
                range_header = "x-ms-range" if head.get("x-ms-range") is not None else "Range"  # Azure's wins
                byte_range = parse_range(head.get(range_header))
                rule = self._state.decide(method, target, byte_range)
                mode = rule.mode if rule is not None else None
                if mode == "reset":
                    reset(writer)
                    return
                if mode in ANSWERED_MODES:
                    if not await self._answer_error(reader, writer, head, method, mode):
                        return
                    continue
                if upstream is None or upstream[1].is_closing():
                    upstream = await asyncio.open_connection(self._up_host, self._up_port, limit=MAX_HEAD)
                if rule is not None and rule.mode in CONDITION_FAULT_MODES:
                    for name in CONDITION_HEADERS:
                        head = head.with_header(name, None)
                if rule is not None and byte_range is not None and rule.mode in RANGE_FAULT_MODES:
                    head = head.with_header(range_header, faulted_range(rule.mode, *byte_range))
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
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: Head, method: str, mode: str
    ) -> bool:
        """Answer an injected 503/500 without forwarding; returns whether the connection stays usable."""
        # A client waiting for "100 Continue" has not sent its body: answer now and close (RFC 9110 15.2.1).
        keep = not head.has_token("expect", "100-continue")
        if keep:
            await relay_body(reader, None, head, until_eof=False)
        status, reason, body, ctype = error_body(mode, self.dialect)
        if method == "HEAD":  # no body, and (as S3 does) no length of one either
            body = b""
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
        if not keep:
            lines.append("Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        return keep

    async def _forward(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        head: Head,
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
            response = await read_head(up_reader)
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
        if self.link is not None:
            await self.link.first_byte()
        has_body = response_has_body(method, status)
        if mode in BODY_FAULT_MODES + CORRUPT_BODY_MODES and has_body and status == 206:
            await self._rewrite(up_reader, writer, response, mode)  # type: ignore[arg-type]
            return False
        if mode in ("truncate", "stall_body"):
            stall = rule.delay if rule is not None and mode == "stall_body" else 0.0
            await self._truncate(up_reader, writer, response, has_body, stall=stall)
            return False
        if mode == "trickle_body" and has_body:
            await self._trickle(up_reader, writer, response, rule.delay)  # type: ignore[union-attr]
            return False
        self._count(down=len(response.raw))
        writer.write(response.raw)
        await writer.drain()
        if has_body:
            key = self._state.key_of(method, head.start_line.split(" ")[1])

            def count(n: int) -> None:
                self._count(down=n)
                self._state.count_body(key, n)

            await relay_body(up_reader, writer, response, until_eof=True, count=count, pace=self._pacer())
        closes = response.has_token("connection", "close") or head.has_token("connection", "close")
        delimited = (
            not has_body
            or response.get("content-length") is not None
            or response.has_token("transfer-encoding", "chunked")
        )
        return not closes and delimited

    async def _rewrite(
        self, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: Head, mode: FaultMode
    ) -> None:
        """The upstream's ``206`` head with another body (:mod:`.rewrite`), then the connection closed."""
        body = bytearray()

        class _Collect:
            def write(self, data: bytes) -> None:
                body.extend(data)

            async def drain(self) -> None:
                return None

        await relay_body(up_reader, _Collect(), response, until_eof=True)  # type: ignore[arg-type]
        if response.has_token("transfer-encoding", "chunked"):
            raise ValueError("body fault modes need an upstream answer with Content-Length")
        head, data = rewritten(mode, response.with_header("Connection", "close"), bytes(body))
        self._count(down=len(head.raw) + len(data))
        writer.write(head.raw + data)
        await writer.drain()

    def _local_location(self, response: Head) -> Head:
        """``response`` with a ``Location`` under the upstream's URL moved to the proxy's (else unchanged)."""
        location = response.get("location")
        if location is None or not location.startswith(self.upstream):
            return response
        return response.with_header("Location", self.url + location[len(self.upstream) :])

    async def _pump_request(self, reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter, head: Head) -> None:
        await relay_body(
            reader, up_writer, head, until_eof=False, count=lambda n: self._count(up=n), pace=self._pacer()
        )

    def _pacer(self) -> Callable[[int], Awaitable[None]] | None:
        """A fresh pacer for one body under :attr:`link`, or ``None`` (no link, or no bandwidth cap)."""
        return None if self.link is None else self.link.pacer()

    async def _trickle(
        self, up_reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: Head, delay: float
    ) -> None:
        """Headers and half the body at once, then one byte every ``delay`` seconds until the body ends (or
        the client goes): each wait is shorter than any socket timeout, the whole far longer."""
        length = int(response.get("content-length") or 0)
        writer.write(response.raw)
        sent = 0
        while sent < length:
            data = await up_reader.read(min(CHUNK, max(1, length // 2 - sent)) if sent < length // 2 else 1)
            if not data:
                break
            writer.write(data)
            sent += len(data)
            await writer.drain()
            if sent >= length // 2:
                await asyncio.sleep(delay)
        self._count(down=len(response.raw) + sent)
        reset(writer)

    async def _truncate(
        self,
        up_reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        response: Head,
        has_body: bool,
        stall: float = 0.0,
    ) -> None:
        """Headers and half the body (half the head when there is no body), then a reset; with ``stall``,
        that many seconds of silence on the open connection first (``stall_body``)."""
        length = response.get("content-length")
        chunked = response.has_token("transfer-encoding", "chunked")
        if has_body and length is not None and int(length) > 1:
            half = int(length) // 2
            writer.write(response.raw)
            sent = 0
            while sent < half:
                data = await up_reader.read(min(CHUNK, half - sent))
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
        await asyncio.sleep(stall or _TRUNCATE_GRACE)
        reset(writer)
