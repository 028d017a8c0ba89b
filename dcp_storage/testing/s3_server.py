"""A throw-away, in-memory S3 endpoint for tests: moto's server in a subprocess.

Why a subprocess rather than ``moto.mock_aws`` or moto's ``ThreadedMotoServer``:
checkpoint tests run real worker *processes* (see
:mod:`dcp_storage.testing.distributed`), and an in-process mock is invisible
to them. A separate server process is reachable from every rank over HTTP and
keeps moto's request handling off the test process's GIL.

Why port 0: fixed ports collide when test sessions run in parallel (xdist,
several CI jobs on one host). moto's CLI hands the port straight to
werkzeug's ``run_simple``, which binds port 0 for real and logs the port the
OS picked (`` * Running on http://127.0.0.1:PORT``); we parse that line, so
there is no probe-then-rebind race.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["MotoS3Server", "MotoServerError", "S3Location"]

_HOST = "127.0.0.1"
_REGION = "us-east-1"
_KEY = "testing"
_SECRET = "testing"
# werkzeug's startup banner; may be wrapped in ANSI colour codes.
_RUNNING_RE = re.compile(r"Running on https?://[^\s:/]+:(\d+)")
# The environment the parent and the server share. The region is pinned
# because moto (like AWS) rejects CreateBucket without a LocationConstraint
# outside us-east-1; the metadata switch stops botocore from ever probing
# 169.254.169.254 for credentials or region, keeping traffic on 127.0.0.1.
_SHARED_ENV = {"AWS_DEFAULT_REGION": _REGION, "AWS_EC2_METADATA_DISABLED": "true"}


class MotoServerError(RuntimeError):
    """The moto server could not be started (message includes its output tail)."""


class S3Location(NamedTuple):
    """Where a test may write: an ``s3://`` URL plus the fsspec options to reach it.

    A 2-tuple on purpose, so that ``url, storage_options = location`` works.
    """

    url: str
    storage_options: dict[str, Any]


class MotoS3Server:
    """Run ``python -m moto.server`` on 127.0.0.1 with an OS-chosen port.

    Use as a context manager (or call :meth:`start` / :meth:`stop`)::

        with MotoS3Server() as server:
            bucket = server.create_bucket(server.unique_bucket_name())
            fs = s3fs.S3FileSystem(**server.storage_options())

    All state lives in the server's memory and vanishes with it; call
    :meth:`reset` to wipe it while keeping the process (cheaper than a restart).
    """

    def __init__(self, startup_timeout: float = 30.0, log_lines: int = 200) -> None:
        self._startup_timeout = startup_timeout
        self._proc: subprocess.Popen[str] | None = None
        self._port: int | None = None
        # Last lines of server output, kept for error messages. The pipe must be
        # drained continuously anyway: moto logs every request, and a full pipe
        # would block the server.
        self._log: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._port_seen = threading.Event()
        self._reader: threading.Thread | None = None
        self._saved_env: dict[str, str | None] = {}
        self._s3_client: Any = None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and block until it answers HTTP, or raise MotoServerError."""
        if self._proc is not None:
            raise RuntimeError("MotoS3Server already started")
        for name, value in _SHARED_ENV.items():
            self._saved_env[name] = os.environ.get(name)
            os.environ[name] = value
        env = dict(os.environ)
        env.update(
            AWS_ACCESS_KEY_ID=_KEY,
            AWS_SECRET_ACCESS_KEY=_SECRET,
            PYTHONUNBUFFERED="1",
        )
        env.pop("AWS_SESSION_TOKEN", None)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", _HOST, "-p", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
        )
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._drain, args=(self._proc.stdout,), name="moto-log", daemon=True)
        self._reader.start()
        try:
            self._wait_ready(time.monotonic() + self._startup_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s). Idempotent."""
        proc, self._proc = self._proc, None
        self._s3_client = None
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
        for name, old in self._saved_env.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        self._saved_env.clear()

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self._log.append(line.rstrip("\n"))
            if self._port is None:
                match = _RUNNING_RE.search(line)
                if match:
                    self._port = int(match.group(1))
                    self._port_seen.set()

    def _wait_ready(self, deadline: float) -> None:
        proc = self._proc
        assert proc is not None
        while not self._port_seen.wait(timeout=0.05):
            if proc.poll() is not None:
                raise self._startup_error(f"exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise self._startup_error("did not report its port in time")
        # The socket is listening once the banner is printed; still confirm a
        # real HTTP round-trip so callers never race the first request.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            try:
                with opener.open(self.endpoint_url + "/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # any HTTP status means the server is serving
            except OSError as exc:
                if proc.poll() is not None:
                    raise self._startup_error(f"exited with code {proc.returncode}") from exc
                if time.monotonic() > deadline:
                    raise self._startup_error(f"not answering HTTP: {exc!r}") from exc
                time.sleep(0.05)

    def _startup_error(self, what: str) -> MotoServerError:
        tail = "\n".join(list(self._log)[-30:]) or "<no output>"
        return MotoServerError(f"moto S3 server {what} (timeout {self._startup_timeout}s); output tail:\n{tail}")

    # ----------------------------------------------------------------- accessors

    @property
    def port(self) -> int:
        """The TCP port the OS assigned to the server."""
        if self._proc is None or self._port is None:
            raise RuntimeError("MotoS3Server is not running")
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``, for boto3 ``endpoint_url`` / s3fs ``client_kwargs``."""
        return f"http://{_HOST}:{self.port}"

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """fsspec/s3fs options pointing at this server; ``extra`` is merged on top.

        ``region_name`` is deliberately absent from ``client_kwargs``: the
        region comes from ``AWS_DEFAULT_REGION`` (set while the server runs), so
        code under test sees the same configuration shape as against real S3.
        A ``client_kwargs`` in ``extra`` is merged, not replaced, so it cannot
        drop the endpoint by accident.
        """
        options: dict[str, Any] = {
            "key": _KEY,
            "secret": _SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }
        client_kwargs = extra.pop("client_kwargs", None)
        if client_kwargs:
            options["client_kwargs"].update(client_kwargs)
        options.update(extra)
        return options

    # --------------------------------------------------------------- bucket ops

    @staticmethod
    def unique_bucket_name(prefix: str = "test") -> str:
        """A fresh, valid bucket name, so tests isolate without a server restart."""
        return f"{prefix}-{uuid.uuid4().hex[:16]}".lower()

    def client(self) -> Any:
        """A boto3 S3 client for this server (created lazily, then reused)."""
        if self._s3_client is None:
            import boto3  # deferred: ~0.3 s import, only needed for bucket admin

            self._s3_client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=_REGION,
                aws_access_key_id=_KEY,
                aws_secret_access_key=_SECRET,
            )
        return self._s3_client

    def create_bucket(self, name: str) -> str:
        """Create ``name`` on the server and return it."""
        self.client().create_bucket(Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        """Empty and delete ``name`` (objects and pending multipart uploads).

        moto keeps everything in memory, so tests that write checkpoints should
        give the space back rather than let it accumulate over a session.
        """
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        uploads = client.list_multipart_uploads(Bucket=name).get("Uploads", [])
        for upload in uploads:
            client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        client.delete_bucket(Bucket=name)

    def reset(self) -> None:
        """Wipe all state on the server (every bucket, every service)."""
        request = urllib.request.Request(self.endpoint_url + "/moto-api/reset", method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=10) as response:
            response.read()

    def new_location(self, prefix: str = "ckpt", **extra: Any) -> S3Location:
        """Create a fresh bucket and return ``(s3://bucket/prefix, storage_options)``."""
        bucket = self.create_bucket(self.unique_bucket_name())
        return S3Location(f"s3://{bucket}/{prefix}", self.storage_options(**extra))
