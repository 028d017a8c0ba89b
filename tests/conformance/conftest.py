"""Backends for the conformance suite: one fixture per backend, each a fresh, empty location.

A backend plugs in here and nowhere else: a ``<name>_location`` fixture that yields ``(url,
storage_options)`` of a location that does not exist yet (its bucket/container does) and cleans up after
the test, plus its name in :data:`BACKENDS`. The ``location`` fixture is parametrised over
:data:`BACKENDS`, so every test of :class:`~conformance.mixin.StorageConformance` runs on every backend
(``shared_location``, for multi-process tests, over those that several processes can share).

Servers start once per session (per xdist worker): moto and azurite from the root ``conftest.py``
(``s3_url``, ``azurite_server``), fake-gcs-server from here. Tests isolate by bucket/container, never by restarting a server.
A server that cannot start skips its backend's tests with the reason, or fails them when ``CI=true``.
"""

from __future__ import annotations

import os

# Must precede any import of gcsfs (fsspec imports it on the first gs:// URL): otherwise gs:// resolves to
# gcsfs's ExtendedGcsFileSystem, which waits ~60 s per bucket on a gRPC/TLS probe the emulator cannot
# answer. FakeGcsServer.start() checks this and says so. Rank processes inherit os.environ.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import contextlib
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import pytest

from dcp_storage_testing._server_process import StartStop
from dcp_storage_testing.azurite import AzuriteServer
from dcp_storage_testing.conformance import Location
from dcp_storage_testing.gcs_server import FakeGcsServer, FakeGcsServerError
from dcp_storage_testing.serving import serving

BACKENDS = ("local", "file", "memory", "s3", "gs", "az")
# Backends every process on the host sees alike (memory:// lives inside one process): multi-rank tests.
SHARED_BACKENDS = tuple(b for b in BACKENDS if b != "memory")
# Startup times, for the report at the end of the session (pytest -s, or the "startup" terminal line).
STARTUP_SECONDS: dict[str, float] = {}

S = TypeVar("S", bound=StartStop)


@contextlib.contextmanager
def _timed_serving(name: str, make: Callable[[], S], errors: tuple[type[BaseException], ...]) -> Iterator[S]:
    """:func:`serving`, recording how long the server took to start (reported at the end of the session)."""
    began = time.monotonic()
    with serving(name, make, errors) as server:
        STARTUP_SECONDS[name] = time.monotonic() - began
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGcsServer]:
    """fake-gcs-server for the whole session (in memory, plain HTTP, 127.0.0.1)."""
    with _timed_serving("fake-gcs-server", FakeGcsServer, (FakeGcsServerError, OSError)) as server:
        yield server


# ------------------------------------------------------------------------------------- one per backend
# Object-store options opt out of fsspec's instance cache and listing cache: a cached instance or listing
# would let a test see another test's (or its own earlier) view of the store.
_NO_CACHES = {"skip_instance_cache": True, "use_listings_cache": False}


@pytest.fixture
def local_location(tmp_path: Path) -> Location:
    return Location(str(tmp_path / "ckpt"), {}, "local")


@pytest.fixture
def file_location(tmp_path: Path) -> Location:
    return Location((tmp_path / "ckpt").as_uri(), {}, "file")


@pytest.fixture
def memory_location() -> Iterator[Location]:
    root = f"/conformance-{uuid.uuid4().hex}"
    yield Location(f"memory://{root}/ckpt", {}, "memory")
    fs = fsspec.filesystem("memory")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(root, recursive=True)


@pytest.fixture
def s3_location(s3_url: Any) -> Location:
    """The root conftest's fresh moto bucket (it also deletes it)."""
    url, options = s3_url
    return Location(url, options, "s3")


@pytest.fixture
def gs_location(gcs_server: FakeGcsServer) -> Iterator[Location]:
    url, options = gcs_server.new_location("ckpt", **_NO_CACHES)
    yield Location(url, options, "gs")
    bucket = url.split("/")[2]
    try:
        gcs_server.delete_bucket(bucket)
    except Exception as exc:  # noqa: BLE001 - cleanup must not mask the test result
        warnings.warn(f"could not delete test bucket {bucket}: {exc!r}", stacklevel=1)


@pytest.fixture
def az_location(azurite_server: AzuriteServer) -> Iterator[Location]:
    url, options = azurite_server.new_location("ckpt", **_NO_CACHES)
    yield Location(url, options, "az")
    container = url.split("/")[2]
    try:
        azurite_server.delete_container(container)
    except Exception as exc:  # noqa: BLE001 - cleanup must not mask the test result
        warnings.warn(f"could not delete test container {container}: {exc!r}", stacklevel=1)


@pytest.fixture(params=BACKENDS)
def location(request: pytest.FixtureRequest) -> Location:
    """A fresh, empty location on each backend in turn."""
    return request.getfixturevalue(f"{request.param}_location")


@pytest.fixture(params=SHARED_BACKENDS)
def shared_location(request: pytest.FixtureRequest) -> Location:
    """Like ``location``, on the backends that rank processes can share."""
    return request.getfixturevalue(f"{request.param}_location")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STARTUP_SECONDS:
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in STARTUP_SECONDS.items())
        terminalreporter.write_line(f"conformance server start-up: {parts}")
