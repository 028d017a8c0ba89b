"""Fixtures for the torch_checkpointing storage tests: one fresh, empty root per backend.

A separately installed plugin has no access to the core's ``tests/conftest.py``, so the servers start
here, the same way (subprocesses on 127.0.0.1, port 0; skipped with the reason when one cannot start, failed
when ``CI=true``): moto for ``s3://``, fake-gcs-server for ``gs://``. ``root`` is parametrised over
:data:`BACKENDS`; each yields ``(root_url, storage_options)``.
"""

from __future__ import annotations

import os

# Before anything imports gcsfs: plain GCSFileSystem for gs:// (see dcp_storage_testing.gcs_server).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import contextlib
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from dcp_storage_testing.gcs_server import FakeGcsServer, FakeGcsServerError
from dcp_storage_testing.s3_server import MotoS3Server, MotoServerError
from dcp_storage_testing.serving import serving

BACKENDS = ("local", "memory", "s3", "gs")
_NO_CACHES = {"skip_instance_cache": True, "use_listings_cache": False}


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3Server]:
    with serving("moto S3 server", MotoS3Server, (MotoServerError, OSError, ImportError)) as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGcsServer]:
    with serving("fake-gcs-server", FakeGcsServer, (FakeGcsServerError, OSError)) as server:
        yield server


def _cleanup(delete: Any, bucket: str) -> None:
    try:
        delete(bucket)
    except Exception as exc:  # noqa: BLE001 - cleanup must not mask the test result
        warnings.warn(f"could not delete test bucket {bucket}: {exc!r}", stacklevel=1)


@pytest.fixture
def s3_root(moto_server: MotoS3Server) -> Iterator[tuple[str, dict[str, Any]]]:
    url, options = moto_server.new_location("run", **_NO_CACHES)
    yield url, options
    _cleanup(moto_server.delete_bucket, url.split("/")[2])


@pytest.fixture
def gs_root(gcs_server: FakeGcsServer) -> Iterator[tuple[str, dict[str, Any]]]:
    url, options = gcs_server.new_location("run", **_NO_CACHES)
    yield url, options
    _cleanup(gcs_server.delete_bucket, url.split("/")[2])


@pytest.fixture
def local_root(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return str(tmp_path / "run"), {}


@pytest.fixture
def memory_root() -> Iterator[tuple[str, dict[str, Any]]]:
    root = f"/tc-{uuid.uuid4().hex}"
    yield f"memory://{root}/run", {}
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.fixture(params=BACKENDS)
def root(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """``(root_url, storage_options)`` of a fresh root on each backend."""
    return request.getfixturevalue(f"{request.param}_root")
