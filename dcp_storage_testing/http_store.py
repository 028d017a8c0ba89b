"""A small loopback HTTP object server for tests: ranged GETs, ETags, ``If-Match``, redirects, request log.

:class:`HttpStore` serves ``objects`` (name -> bytes) at ``http://127.0.0.1:PORT/NAME`` on port 0 (read
back), as a static file server or a CDN does: ``HEAD`` and ``GET`` with ``Range``, a strong ``ETag`` per
object version, ``412`` on an ``If-Match`` that does not hold (unless ``honour_if_match`` is off, like a
server that ignores conditions), ``302`` answers for names in ``redirects``, error statuses for names
in ``refuse``. Every request is logged
with its method, path and headers (:attr:`HttpStore.log`), so tests count requests and see which
headers reached which server. Objects may be replaced while it serves (:meth:`HttpStore.put`).
"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

__all__ = ["HttpStore", "Request"]


class Request(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]


class HttpStore(ThreadingHTTPServer):
    """Serves ``objects`` over HTTP on a loopback port; use as a context manager (started on a thread)."""

    daemon_threads = True

    def __init__(self, objects: dict[str, bytes] | None = None, *, honour_if_match: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.objects: dict[str, bytes] = dict(objects or {})
        self.honour_if_match = honour_if_match
        self.redirects: dict[str, str] = {}  # name -> Location of a 302 answer
        self.refuse: dict[str, int] = {}  # name -> error status it is answered with (403, 500, ...)
        self.log: list[Request] = []
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def put(self, name: str, data: bytes) -> None:
        """Create or replace one object (a new ETag)."""
        with self.lock:
            self.objects[name] = bytes(data)

    @staticmethod
    def etag(data: bytes) -> str:
        return '"' + hashlib.sha256(data).hexdigest()[:24] + '"'

    def requests(self, method: str | None = None) -> list[Request]:
        with self.lock:
            return [r for r in self.log if method is None or r.method == method]

    def __enter__(self) -> HttpStore:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    server: HttpStore
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _answer(self, send_body: bool) -> None:
        srv = self.server
        name = self.path.lstrip("/").split("?", 1)[0]
        with srv.lock:
            srv.log.append(Request(self.command, self.path, dict(self.headers.items())))
            data = srv.objects.get(name)
            location = srv.redirects.get(name)
            refused = srv.refuse.get(name)
        if refused is not None:
            self._empty(refused)
            return
        if location is not None:
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if data is None:
            self._empty(404)
            return
        etag = srv.etag(data)
        wanted = self.headers.get("If-Match")
        if srv.honour_if_match and wanted is not None and wanted.strip() not in ("*", etag):
            self._empty(412)
            return
        start, end, ranged = 0, len(data), False
        spec = self.headers.get("Range")
        if spec and spec.startswith("bytes="):
            first, _, last = spec[len("bytes=") :].partition("-")
            start, end, ranged = int(first), min(len(data), int(last) + 1) if last else len(data), True
            if start >= len(data):
                self._empty(416, {"Content-Range": f"bytes */{len(data)}"})
                return
        body = data[start:end]
        self.send_response(206 if ranged else 200)
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)
