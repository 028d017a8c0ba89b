"""Fixtures for the obstore transport tests: a moto S3 server and a fault-injecting proxy in front of it.

The plugin's tests do not rely on the core's ``tests/conftest.py`` (a separately installed plugin has no
access to it); they start their own moto server, the same way: a subprocess on 127.0.0.1, port 0. When
``CI=true`` a server that fails to start fails the tests instead of skipping them.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import threading
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from dcp_storage.testing.s3_server import MotoS3Server, MotoServerError, S3Location


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3Server]:
    try:
        server = MotoS3Server()
        server.start()
    except (MotoServerError, OSError, ImportError) as exc:
        if _in_ci():
            pytest.fail(f"moto S3 server unavailable: {exc}", pytrace=False)
        pytest.skip(f"moto S3 server unavailable: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(moto_server: MotoS3Server) -> Iterator[S3Location]:
    """A fresh bucket: ``(s3://bucket/ckpt, s3fs-style storage options)``."""
    location = moto_server.new_location("ckpt", skip_instance_cache=True, use_listings_cache=False)
    try:
        yield location
    finally:
        bucket = location.url.split("/")[2]
        try:
            moto_server.delete_bucket(bucket)
        except Exception as exc:  # noqa: BLE001 - cleanup must not mask the test result
            warnings.warn(f"could not delete test bucket {bucket}: {exc!r}", stacklevel=1)


class FaultProxy(ThreadingHTTPServer):
    """A reverse proxy to an S3 endpoint that misbehaves on the first ``fail_first`` ranged GETs.

    ``mode``: ``"503"`` answers 503 SlowDown without contacting the server; ``"truncate"`` forwards the
    answer but sends only half of its body, then closes the connection. Everything else is forwarded.
    """

    daemon_threads = True

    def __init__(self, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream_port = upstream_port
        self.mode = "503"
        self.fail_first = 0
        self.lock = threading.Lock()
        self.ranged_gets = 0
        self.failed = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def arm(self, mode: str, fail_first: int) -> None:
        with self.lock:
            self.mode, self.fail_first, self.ranged_gets, self.failed = mode, fail_first, 0, 0


class _ProxyHandler(BaseHTTPRequestHandler):
    server: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        srv = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        fail = False
        if self.command == "GET" and self.headers.get("Range"):
            with srv.lock:
                srv.ranged_gets += 1
                fail = srv.ranged_gets <= srv.fail_first
                srv.failed += fail
        if fail and srv.mode == "503":
            payload = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        conn = http.client.HTTPConnection("127.0.0.1", srv.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        if fail and srv.mode == "truncate":
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


@pytest.fixture(scope="session")
def fault_proxy(moto_server: MotoS3Server) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_server.port)
    thread = threading.Thread(target=proxy.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=5)
        with contextlib.suppress(Exception):
            proxy.arm("503", 0)
