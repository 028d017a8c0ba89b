"""Bounded whole-file reads over HTTP: a server that gives no size, or ignores ``Range``, costs no memory.

``read_file(path, max_bytes=...)`` promises at most ``max_bytes + 1`` bytes held for a hostile ``.metadata``
or index file. fsspec's ``HTTPFileSystem.cat_file(url, start, end)`` reads whatever body comes back, so a
server that answers the range with ``200`` and a huge body (with or without ``Content-Length``) must be read
by a streamed GET that stops at the limit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dcp_storage.errors import FileTooLargeError
from dcp_storage.transports import FsspecTransport, RetryPolicy, TransportConfig

HUGE = 32 * 1024 * 1024  # what the server streams, whatever was asked
LIMIT = 1_000


class _HugeServer(ThreadingHTTPServer):
    """Serves ``/blob``: ``HEAD`` claims ``head_size`` (or no size), ``GET`` ignores ``Range`` and sends 200."""

    daemon_threads = True

    def __init__(self, head_size: int | None, with_length: bool) -> None:
        super().__init__(("127.0.0.1", 0), _HugeHandler)
        self.head_size = head_size
        self.with_length = with_length
        self.sent = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/blob"


class _HugeHandler(BaseHTTPRequestHandler):
    server: _HugeServer
    protocol_version = "HTTP/1.0"  # without Content-Length the body ends with the connection

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        if self.server.head_size is not None:
            self.send_header("Content-Length", str(self.server.head_size))
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)  # Range ignored
        if self.server.with_length:
            self.send_header("Content-Length", str(HUGE))
        self.end_headers()
        piece = bytes(1024 * 1024)
        with contextlib.suppress(OSError):  # the client may stop reading and close
            for _ in range(HUGE // len(piece)):
                self.wfile.write(piece)
                self.server.sent += len(piece)


@contextlib.contextmanager
def _huge_server(head_size: int | None, with_length: bool) -> Iterator[_HugeServer]:
    server = _HugeServer(head_size, with_length)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize(
    ("head_size", "with_length"),
    [(None, False), (None, True), (100, False), (100, True)],
    ids=["no-size-chunked", "no-size-then-huge-length", "small-head-chunked", "small-head-huge-length"],
)
def test_http_whole_read_with_a_limit_holds_no_more_than_the_limit(head_size: int | None, with_length: bool) -> None:
    pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp")
    with _huge_server(head_size, with_length) as server:
        retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.05, max_attempts=2, deadline=20.0)
        t, path = FsspecTransport.from_url(
            server.url, {"skip_instance_cache": True}, config=TransportConfig(retry=retry)
        )
        with pytest.raises(FileTooLargeError, match="blob"):
            t.read_file(path, max_bytes=LIMIT)
        assert t.counters.bytes_read <= LIMIT + 1
