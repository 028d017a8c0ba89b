"""A local S3 endpoint for benchmarks: the npm ``s3rver`` server (3.7.x) in a subprocess.

Why s3rver rather than moto (which :mod:`dcp_storage.testing.s3_server` uses for tests): moto reads the
whole object for every ranged GET, so its read throughput says nothing about a client that reads ranges.
s3rver serves a range at a cost that depends on the range, not the object, and stores objects as plain
files (``<dir>/<bucket>/<key>._S3rver_object``). It is slow at writes (MD5 and part concatenation on the
server), so upload once and reuse the data directory. See ``benchmarks/NOTES-s3-throughput.md``.

Like the moto launcher it binds port 0 and parses the port the server reports
(``S3rver listening on 127.0.0.1:PORT``), so parallel runs never collide. Credentials are
``S3RVER``/``S3RVER``; unsigned requests are accepted too (handy for plain-HTTP baselines).

Needs ``node`` (>= 12). :func:`ensure_installed` runs ``npm install --prefix PREFIX s3rver@VERSION`` when
the package is missing.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["S3RVER_VERSION", "S3rverError", "S3rverServer", "ensure_installed"]

S3RVER_VERSION = "3.7.1"
_HOST = "127.0.0.1"
_KEY = "S3RVER"
_SECRET = "S3RVER"
_LISTENING_RE = re.compile(r"listening on ([\d.]+):(\d+)")


class S3rverError(RuntimeError):
    """s3rver could not be installed or started (the message carries its output tail)."""


def _script(prefix: str) -> str:
    return os.path.join(prefix, "node_modules", "s3rver", "bin", "s3rver.js")


def ensure_installed(prefix: str, version: str = S3RVER_VERSION, timeout: float = 600.0) -> str:
    """Return the path of ``s3rver.js`` under ``prefix``, installing ``s3rver@version`` with npm if missing."""
    script = _script(prefix)
    if os.path.exists(script):
        return script
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise S3rverError("s3rver needs node and npm on PATH (node >= 12)")
    os.makedirs(prefix, exist_ok=True)
    proc = subprocess.run(
        [npm, "install", "--prefix", prefix, "--no-audit", "--no-fund", "--save-exact", f"s3rver@{version}"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0 or not os.path.exists(script):
        raise S3rverError(f"npm install s3rver@{version} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return script


class S3rverServer:
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
        self.prefix = prefix
        self._given_dir = data_dir
        self.data_dir: str | None = None
        self.buckets = tuple(buckets)
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen[str] | None = None
        self._port: int | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._port_seen = threading.Event()
        self._reader: threading.Thread | None = None
        self._tmp: str | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("S3rverServer already started")
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
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._drain, args=(self._proc.stdout,), name="s3rver-log", daemon=True)
        self._reader.start()
        try:
            self._wait_ready(time.monotonic() + self._startup_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s); remove a temp data dir. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if self._reader is not None:
                self._reader.join(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()
        self._port = None
        self._port_seen.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self._log.append(line.rstrip("\n"))
            if self._port is None:
                match = _LISTENING_RE.search(line)
                if match:
                    self._port = int(match.group(2))
                    self._port_seen.set()

    def _wait_ready(self, deadline: float) -> None:
        proc = self._proc
        assert proc is not None
        while not self._port_seen.wait(timeout=0.05):
            if proc.poll() is not None:
                raise self._error(f"exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise self._error("did not report its port in time")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            try:
                with opener.open(self.endpoint_url + "/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # any HTTP status means it is serving
            except OSError as exc:
                if proc.poll() is not None:
                    raise self._error(f"exited with code {proc.returncode}") from exc
                if time.monotonic() > deadline:
                    raise self._error(f"not answering HTTP: {exc!r}") from exc
                time.sleep(0.05)

    def _error(self, what: str) -> S3rverError:
        tail = "\n".join(list(self._log)[-30:]) or "<no output>"
        return S3rverError(f"s3rver {what} (timeout {self._startup_timeout}s); output tail:\n{tail}")

    # ------------------------------------------------------------------ accessors
    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("S3rverServer is not running")
        return self._proc.pid

    @property
    def port(self) -> int:
        if self._proc is None or self._port is None:
            raise RuntimeError("S3rverServer is not running")
        return self._port

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
