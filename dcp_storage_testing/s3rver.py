"""A local S3 endpoint for benchmarks: the npm ``s3rver`` server (3.7.x) in a subprocess.

Why s3rver rather than moto (which :mod:`dcp_storage_testing.s3_server` uses for tests): moto reads the
whole object for every ranged GET, so its read throughput says nothing about a client that reads ranges.
s3rver serves a range at a cost that depends on the range, not the object, and stores objects as plain
files (``<dir>/<bucket>/<key>._S3rver_object``). It is slow at writes (MD5 and part concatenation on the
server), so upload once and reuse the data directory. See ``benchmarks/NOTES-s3-throughput.md``.

Like the moto launcher it binds port 0 and parses the port the server reports
(``S3rver listening on 127.0.0.1:PORT``), so parallel runs never collide. Credentials are
``S3RVER``/``S3RVER``; unsigned requests are accepted too (handy for plain-HTTP baselines).

Needs ``node`` (>= 12). :func:`ensure_installed` runs ``npm install --prefix PREFIX s3rver@VERSION`` when
the package is missing (serialised by a file lock, see :mod:`dcp_storage_testing._npm`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from dcp_storage_testing._npm import npm_install, npm_script
from dcp_storage_testing._server_process import HOST as _HOST
from dcp_storage_testing._server_process import Launcher, ServerProcess

__all__ = ["S3RVER_VERSION", "S3rverError", "S3rverServer", "ensure_installed"]

S3RVER_VERSION = "3.7.1"
_KEY = "S3RVER"
_SECRET = "S3RVER"
_LISTENING = r"listening on [\d.]+:(\d+)"
_ENTRY = ("bin", "s3rver.js")


class S3rverError(RuntimeError):
    """s3rver could not be installed or started (the message carries its output tail)."""


def _script(prefix: str) -> str:
    return npm_script(prefix, "s3rver", _ENTRY)


def ensure_installed(prefix: str, version: str = S3RVER_VERSION, timeout: float = 600.0) -> str:
    """Return the path of ``s3rver.js`` under ``prefix``, installing ``s3rver@version`` with npm if missing."""
    return npm_install(prefix, "s3rver", version, _ENTRY, S3rverError, timeout=timeout)


class S3rverServer(Launcher):
    """Run s3rver on 127.0.0.1 with an OS-chosen port.

    Args:
        prefix: the npm prefix holding ``node_modules/s3rver`` (see :func:`ensure_installed`).
        data_dir: where objects live; a fresh temp directory (removed on stop) when ``None``. A given
            directory is kept, so objects survive a restart.
        buckets: created at start-up (``--configure-bucket``); existing ones are kept.
    """

    def __init__(
        self,
        prefix: str,
        data_dir: str | None = None,
        buckets: tuple[str, ...] = ("bench",),
        startup_timeout: float = 30.0,
        log_lines: int = 200,
    ) -> None:
        super().__init__(startup_timeout, log_lines)
        self.prefix = prefix
        self._given_dir = data_dir
        self.data_dir: str | None = None
        self.buckets = tuple(buckets)
        self._tmp: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def _launch(self, deadline: float) -> ServerProcess:
        script = _script(self.prefix)
        if not os.path.exists(script):
            raise S3rverError(f"s3rver is not installed under {self.prefix} (call ensure_installed)")
        if self._given_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="s3rver-")
            self.data_dir = self._tmp
        else:
            os.makedirs(self._given_dir, exist_ok=True)
            self.data_dir = self._given_dir
        cmd = ["node", script, "-d", self.data_dir, "-a", _HOST, "-p", "0", "-s"]
        for bucket in self.buckets:
            cmd += ["--configure-bucket", bucket]
        server = ServerProcess("s3rver", cmd, S3rverError, port_pattern=_LISTENING, log_lines=self._log_lines)
        server.wait_ready("/", deadline)
        return server

    def _release(self) -> None:
        """Remove a temp data dir (a given one is kept)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # ------------------------------------------------------------------ accessors
    @property
    def host(self) -> str:
        return _HOST

    @property
    def endpoint_url(self) -> str:
        return f"http://{_HOST}:{self.port}"

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs options for this server; ``extra`` is merged on top (``client_kwargs`` merged too)."""
        options: dict[str, Any] = {
            "key": _KEY,
            "secret": _SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }
        client_kwargs = extra.pop("client_kwargs", None)
        if client_kwargs:
            options["client_kwargs"].update(client_kwargs)
        options.update(extra)
        return options

    def object_path(self, bucket: str, key: str) -> str:
        """The file s3rver keeps an object's bytes in (for warming the page cache)."""
        assert self.data_dir is not None
        return os.path.join(self.data_dir, bucket, key + "._S3rver_object")
