"""The fault proxy itself, against a small upstream that echoes what it received."""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dcp_storage.testing.fault_proxy import FaultProxy, FaultRule


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        payload = json.dumps(
            {"host": self.headers["Host"], "path": self.path, "sha": hashlib.sha256(body).hexdigest()}
        ).encode()
        payload += b" " * 4000  # long enough to be cut in half visibly
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_HEAD = _answer


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(upstream: str) -> Iterator[FaultProxy]:
    with FaultProxy(upstream) as p:
        yield p


def request(proxy: FaultProxy, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_forwards_head_and_body_verbatim_over_one_connection(proxy: FaultProxy) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB, streamed through
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        for i in range(3):  # keep-alive: three requests on one client connection
            conn.request("PUT", f"/b/k{i}?x=1", body=body)
            response = conn.getresponse()
            echoed = json.loads(response.read())
            assert response.status == 200
            assert echoed["host"] == f"127.0.0.1:{proxy.port}"  # the client's Host, untouched (SigV4 signs it)
            assert echoed["path"] == f"/b/k{i}?x=1"
            assert echoed["sha"] == hashlib.sha256(body).hexdigest()
    finally:
        conn.close()
    counters = proxy.counters()
    assert counters.requests == 3 and counters.total_faults == 0
    assert counters.bytes_to_upstream > 3 * len(body)
    assert counters.bytes_to_client > 3 * 4000


def test_every_nth_matching_request_and_filters(proxy: FaultProxy) -> None:
    proxy.set_rules([FaultRule("error_500", every=3, method="GET", path=r"^/data/", query=r"part=")])
    statuses = [request(proxy, "GET", f"/data/f?part={i}")[0] for i in range(7)]
    assert statuses == [200, 200, 500, 200, 200, 500, 200]
    assert request(proxy, "GET", "/other?part=1")[0] == 200  # path does not match
    assert request(proxy, "PUT", "/data/f?part=1", b"x")[0] == 200  # method does not match
    assert request(proxy, "GET", "/data/f")[0] == 200  # query does not match
    counters = proxy.counters()
    assert counters.faults["error_500"] == 2 and counters.requests == 10
    assert counters.faulted == (("GET", "/data/f", "error_500"),) * 2


def test_limit_and_reconfiguration_from_another_thread(proxy: FaultProxy) -> None:
    proxy.set_rules([FaultRule("slowdown_503", limit=2)])
    assert [request(proxy, "GET", "/a")[0] for _ in range(4)] == [503, 503, 200, 200]
    worker = threading.Thread(target=proxy.set_rules, args=([FaultRule("error_500")],))
    worker.start()
    worker.join()
    assert request(proxy, "GET", "/a")[0] == 500
    proxy.clear_rules()
    assert request(proxy, "GET", "/a")[0] == 200
    proxy.reset_counters()
    assert proxy.counters().requests == 0


def test_error_bodies_by_dialect(upstream: str) -> None:
    with FaultProxy(upstream, [FaultRule("slowdown_503")]) as s3:
        status, body = request(s3, "GET", "/k")
        assert status == 503 and b"<Code>SlowDown</Code>" in body
        status, body = request(s3, "HEAD", "/k")
        assert status == 503 and body == b""  # HEAD answers carry no body
    with FaultProxy(upstream, [FaultRule("error_500")], dialect="gcs") as gcs:
        status, body = request(gcs, "GET", "/k")
        assert status == 500 and json.loads(body)["error"]["code"] == 500


def test_reset_truncate_and_slow(proxy: FaultProxy) -> None:
    proxy.set_rules([FaultRule("reset")])
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        request(proxy, "GET", "/k")
    proxy.set_rules([FaultRule("truncate")])
    with pytest.raises((http.client.IncompleteRead, ConnectionResetError)) as info:
        request(proxy, "GET", "/k")
    if isinstance(info.value, http.client.IncompleteRead):
        assert 0 < len(info.value.partial) < 4000
    proxy.set_rules([FaultRule("slow", delay=0.3)])
    started = time.monotonic()
    assert request(proxy, "GET", "/k")[0] == 200
    assert time.monotonic() - started >= 0.3
    assert {m: n for m, n in proxy.counters().faults.items() if n} == {"reset": 1, "truncate": 1, "slow": 1}


def test_rule_validation() -> None:
    with pytest.raises(ValueError, match="mode"):
        FaultRule("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every"):
        FaultRule("reset", every=0)
    with pytest.raises(ValueError, match="upstream"):
        FaultProxy("https://example.com")
