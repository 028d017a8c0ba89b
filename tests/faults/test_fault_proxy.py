"""The fault proxy itself, against a small upstream that echoes what it received."""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dcp_storage_testing.fault_proxy import RANGE_FAULT_MODES, FaultProxy, FaultRule


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


OBJECT = bytes(range(256)) * 4  # what _Ranged serves at every path


class _Ranged(BaseHTTPRequestHandler):
    """Serves ``OBJECT``, honouring a single ``Range: bytes=FIRST-[LAST]`` as a store does (206)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if match is None:
            self.send_response(200)
            body = OBJECT
        else:
            first = int(match.group(1))
            last = min(int(match.group(2) or len(OBJECT) - 1), len(OBJECT) - 1)
            body = OBJECT[first : last + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(OBJECT)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    yield from _serve(_Echo)


@pytest.fixture(scope="module")
def ranged_upstream() -> Iterator[str]:
    yield from _serve(_Ranged)


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


def test_requests_and_body_bytes_are_counted_per_object(proxy: FaultProxy) -> None:
    """What the server was asked for, object by object: the count tests of "read once" rely on."""
    proxy.reset_counters()
    for path in ("/b/ckpt/.metadata", "/b/ckpt/.metadata", "/b/ckpt/x%20y.distcp?part=1"):
        status, body = request(proxy, "GET", path)
        assert status == 200 and len(body) > 4000
    assert request(proxy, "HEAD", "/b/ckpt/.metadata")[0] == 200
    counters = proxy.counters()
    assert counters.requests_to("/.metadata") == 2
    assert counters.requests_to("/.metadata", method="HEAD") == 1
    assert counters.requests_to("/x y.distcp") == 1  # URL-decoded, query left out
    assert counters.by_path[("HEAD", "/b/ckpt/.metadata")] == [1, 0]  # a HEAD has no body
    served = counters.by_path[("GET", "/b/ckpt/.metadata")][1]
    assert served > 2 * 4000 and counters.body_bytes() == served + counters.by_path[("GET", "/b/ckpt/x y.distcp")][1]
    assert counters.body_bytes() < counters.bytes_to_client  # heads are not body bytes
    assert [entry[1] for entry in counters.log] == ["/b/ckpt/.metadata"] * 2 + [
        "/b/ckpt/x y.distcp",
        "/b/ckpt/.metadata",
    ]
    proxy.reset_counters()
    assert proxy.counters().by_path == {}


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


def ranged_get(proxy: FaultProxy, byte_range: str | None) -> tuple[int, str | None, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        conn.request("GET", "/b/k", headers={"Range": byte_range} if byte_range else {})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Range"), response.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("mode", "asked", "status", "content_range", "body"),
    [
        (None, "bytes=100-199", 206, "bytes 100-199/1024", OBJECT[100:200]),
        ("ignore_range", "bytes=100-199", 200, None, OBJECT),
        ("shift_range", "bytes=100-199", 206, "bytes 99-198/1024", OBJECT[99:199]),
        ("shift_range", "bytes=0-9", 206, "bytes 1-10/1024", OBJECT[1:11]),
        ("shift_range", "bytes=1000-", 206, "bytes 999-1023/1024", OBJECT[999:]),
        ("short_range", "bytes=100-199", 206, "bytes 100-149/1024", OBJECT[100:150]),
        ("short_range", "bytes=1000-", 206, "bytes 1000-1000/1024", OBJECT[1000:1001]),
    ],
)
def test_range_modes_answer_other_bytes_than_asked(
    ranged_upstream: str, mode: str | None, asked: str, status: int, content_range: str | None, body: bytes
) -> None:
    with FaultProxy(ranged_upstream, [FaultRule(mode)] if mode else []) as proxy:  # type: ignore[arg-type]
        assert ranged_get(proxy, asked) == (status, content_range, body)
        assert proxy.counters().total_faults == (1 if mode else 0)


@pytest.mark.parametrize("mode", RANGE_FAULT_MODES)
def test_range_modes_leave_requests_they_cannot_fault_alone(ranged_upstream: str, mode: str) -> None:
    with FaultProxy(ranged_upstream, [FaultRule(mode)]) as proxy:  # type: ignore[arg-type]
        assert ranged_get(proxy, None) == (200, None, OBJECT)  # no Range
        assert ranged_get(proxy, "bytes=-10")[2] == OBJECT  # a suffix range: _Ranged ignores it, so does the proxy
        one_byte = ranged_get(proxy, "bytes=5-5")
        if mode == "short_range":  # no shorter half of one byte
            assert one_byte == (206, "bytes 5-5/1024", OBJECT[5:6]) and proxy.counters().total_faults == 0
        else:
            assert proxy.counters().faults[mode] == 1 and one_byte[2] != OBJECT[5:6]
