"""A throw-away, in-memory S3 endpoint for tests: moto's server in a subprocess.

Why a subprocess rather than ``moto.mock_aws`` or moto's ``ThreadedMotoServer``:
checkpoint tests run real worker *processes* (see
:mod:`dcp_storage_testing.distributed`), and an in-process mock is invisible
to them. A separate server process is reachable from every rank over HTTP and
keeps moto's request handling off the test process's GIL.

Why port 0: fixed ports collide when test sessions run in parallel (xdist,
several CI jobs on one host). moto's CLI hands the port straight to
werkzeug's ``run_simple``, which binds port 0 for real and logs the port the
OS picked (`` * Running on http://127.0.0.1:PORT``); we parse that line, so
there is no probe-then-rebind race.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any, NamedTuple

from dcp_storage_testing._server_process import HOST as _HOST
from dcp_storage_testing._server_process import Launcher, ServerProcess

__all__ = ["MotoS3Server", "MotoServerError", "S3Location"]

_REGION = "us-east-1"
_KEY = "testing"
_SECRET = "testing"
# werkzeug's startup banner; may be wrapped in ANSI colour codes.
_RUNNING = r"Running on https?://[^\s:/]+:(\d+)"
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


class MotoS3Server(Launcher):
    """Run ``python -m moto.server`` on 127.0.0.1 with an OS-chosen port.

    Use as a context manager (or call :meth:`start` / :meth:`stop`)::

        with MotoS3Server() as server:
            bucket = server.create_bucket(server.unique_bucket_name())
            fs = s3fs.S3FileSystem(**server.storage_options())

    All state lives in the server's memory and vanishes with it; call
    :meth:`reset` to wipe it while keeping the process (cheaper than a restart).
    The shared AWS settings (region, no metadata probing) are in ``os.environ``
    while the server runs and restored by :meth:`stop`.
    """

    def __init__(self, startup_timeout: float = 30.0, log_lines: int = 200) -> None:
        super().__init__(startup_timeout, log_lines)
        self._s3_client: Any = None

    # ------------------------------------------------------------------ lifecycle
    def _launch(self, deadline: float) -> ServerProcess:
        for name, value in _SHARED_ENV.items():
            self._set_env(name, value)
        env = dict(os.environ)
        env.update(AWS_ACCESS_KEY_ID=_KEY, AWS_SECRET_ACCESS_KEY=_SECRET, PYTHONUNBUFFERED="1")
        env.pop("AWS_SESSION_TOKEN", None)
        server = ServerProcess(
            "moto S3 server",
            [sys.executable, "-m", "moto.server", "-H", _HOST, "-p", "0"],
            MotoServerError,
            port_pattern=_RUNNING,
            env=env,
            log_lines=self._log_lines,
        )
        # The socket is listening once the banner is printed; still confirm a
        # real HTTP round-trip so callers never race the first request.
        server.wait_ready("/", deadline)
        return server

    def _release(self) -> None:
        self._s3_client = None

    # ----------------------------------------------------------------- accessors

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

    # ------------------------------------------------------------- credentials
    def create_access_key(self, user: str, policy: dict[str, Any] | None = None) -> tuple[str, str]:
        """Create IAM ``user`` (with ``policy`` attached; none: it may do nothing) and an access key for it.

        Returns ``(access key id, secret)``. Create users before :meth:`iam_auth`, which checks even this.
        """
        iam = self._iam_client()
        iam.create_user(UserName=user)
        if policy is not None:
            iam.put_user_policy(UserName=user, PolicyName=f"{user}-policy", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    @contextlib.contextmanager
    def iam_auth(self) -> Iterator[None]:
        """While inside, the server checks every request as AWS would: signature, key, IAM permissions.

        moto's IAM simulation (its ``INITIAL_NO_AUTH_ACTION_COUNT`` set to 0 through ``/moto-api/reset-auth``):
        unknown key ids get ``InvalidAccessKeyId``, wrong secrets ``SignatureDoesNotMatch``, users without a
        permission ``AccessDenied``. The default ``storage_options`` keys are then unknown, and bucket admin
        (:meth:`create_bucket`, :meth:`delete_bucket`) fails: do it outside. Server-wide: do not overlap with
        tests that expect anyone to get in.
        """
        self._set_auth("0")
        try:
            yield
        finally:
            self._set_auth("inf")

    def _set_auth(self, count: str) -> None:
        request = urllib.request.Request(
            self.endpoint_url + "/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form body would be parsed away before moto reads it
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=10) as response:
            response.read()

    def _iam_client(self) -> Any:
        import boto3  # deferred, as in client()

        return boto3.client(
            "iam",
            endpoint_url=self.endpoint_url,
            region_name=_REGION,
            aws_access_key_id=_KEY,
            aws_secret_access_key=_SECRET,
        )

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
