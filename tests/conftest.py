"""Shared pytest fixtures: an in-memory S3 endpoint and fresh per-test buckets, and the session's azurite.

Hooks
-----
``pytest_sessionstart`` pre-starts :func:`~dcp_storage_testing.distributed.run_ranks`'
forkserver in the background, so the first multi-rank test does not pay for
its ``import torch``; likewise the CLI tests' zygote (``tests/cli/_zygote.py``) when the run holds them.

``pytest_collection_finish`` starts azurite (installing it with npm on a fresh clone, which takes tens of
seconds) in a background thread when a collected test will need it, so the first Azure test finds it
running instead of waiting for it.

Fixtures
--------
``azurite_server`` (session)
    The one :class:`~dcp_storage_testing.azurite.AzuriteServer` of the session (the conformance and the
    fault tests share it; tests isolate by container). Skipped with the reason if it cannot start, failed
    when ``CI=true``.

``rank_zygote`` (session)
    The crash tests' rank-launching zygote, shared with the manager's kill tests.

``moto_server`` (session)
    A running :class:`~dcp_storage_testing.s3_server.MotoS3Server`. One per
    session (per xdist worker) because start-up costs ~1 s; tests isolate by
    bucket instead. If it cannot start, dependent tests are skipped with the
    reason -- or failed when ``CI=true``, so CI never goes green by skipping.

``s3_url`` (function)
    An :class:`~dcp_storage_testing.s3_server.S3Location`, i.e. the 2-tuple
    ``(url, storage_options)``: ``url`` is ``"s3://<fresh-bucket>/ckpt"`` (the
    prefix does not exist yet) and ``storage_options`` is a new dict of
    s3fs/fsspec options for the server, safe for the test to mutate and to
    pickle into rank processes. Use as ``url, storage_options = s3_url``.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from dcp_storage_testing.azurite import AzuriteError, AzuriteServer
from dcp_storage_testing.distributed import warm_up
from dcp_storage_testing.s3_server import MotoS3Server, MotoServerError, S3Location
from dcp_storage_testing.serving import in_ci, serving

# Tests must never reach the Hugging Face Hub (or wait on its timeouts).
os.environ["HF_HUB_OFFLINE"] = "1"
# gcsfs probes for hierarchical-namespace buckets over TLS on every call unless told not to (set before any
# test module imports gcsfs; the emulator cannot answer the probe).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


# A run started in the background by a shell without job control (`pytest ... &` in a script) inherits
# SIGINT ignored, Python keeps it so, and every process the tests start inherits it too: the Ctrl-C tests
# would see no Ctrl-C at all (the save sleeps on, the conversion finishes). They test our handling of it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Where the tests that run CLI commands (through tests/cli/_helpers.py's zygote) live.
_CLI_DIRS = ("tests/cli", "tests/credentials")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start_cli_zygote() -> None:
    """Start the CLI tests' zygote (``tests/cli/_zygote.py``: one ``import torch`` for every CLI command) in
    the background; a test that needs it before it is ready waits for it."""
    try:
        from tests.cli._zygote import zygote
    except ImportError:  # the repository root is not on sys.path (pytest run as a script): start on first use
        return
    threading.Thread(target=zygote, name="cli-zygote-start", daemon=True).start()


def _runs_cli_tests(session: pytest.Session) -> bool:
    """Whether the command line names a path that holds CLI tests (no path: the testpaths, which do)."""
    args = [a.split("::")[0] for a in session.config.args if not a.startswith("-")]
    if not args:
        return True
    for arg in args:
        path = os.path.relpath(os.path.abspath(arg), _ROOT)
        if any(d == path or d.startswith(path.rstrip("/") + "/") or path == "." for d in _CLI_DIRS):
            return True
    return False


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start run_ranks' forkserver (which imports torch), and the CLI zygote when the run holds CLI tests,
    while collection runs."""
    try:
        warm_up()
    except Exception as exc:  # noqa: BLE001 - an optimisation; run_ranks retries
        warnings.warn(f"could not pre-start the run_ranks forkserver: {exc!r}", stacklevel=1)
    spawn = os.environ.get("DCP_STORAGE_CLI_TESTS_SPAWN", "") not in ("", "0")  # tests/cli/_helpers.py
    if not session.config.option.collectonly and not spawn and _runs_cli_tests(session):
        _start_cli_zygote()


# Tests that reach azurite: by fixture, or as the "az" case of a parametrised backend (whose fixture is looked
# up by name at run time, so it is not in the item's fixture closure).
_AZURITE_FIXTURES = frozenset({"azurite_server", "azurite", "az_location", "az_proxy"})
_AZ_PARAM = re.compile(r"\[(?:[^\]]*-)?az(?:-[^\]]*)?\]$")
_azurite_start: concurrent.futures.Future[tuple[AzuriteServer, float]] | None = None
_azurite_report: list[str] = []  # for the terminal summary


def _needs_azurite(item: pytest.Item) -> bool:
    return bool(_AZURITE_FIXTURES.intersection(getattr(item, "fixturenames", ()))) or bool(
        _AZ_PARAM.search(item.nodeid)
    )


def _start_azurite() -> tuple[AzuriteServer, float]:
    began = time.monotonic()
    server = AzuriteServer()
    server.start()
    return server, time.monotonic() - began


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start azurite in the background when a collected test needs it (npm install + start, off the clock)."""
    global _azurite_start
    if session.config.option.collectonly or _azurite_start is not None:
        return
    if any(_needs_azurite(item) for item in session.items):
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="azurite-start")
        _azurite_start = pool.submit(_start_azurite)
        pool.shutdown(wait=False)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop an azurite started in the background that no test came to use (an interrupted run)."""
    global _azurite_start
    start, _azurite_start = _azurite_start, None
    if start is not None:
        try:
            server, _ = start.result()
        except Exception:  # noqa: BLE001 - nothing started, nothing to stop
            return
        server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _azurite_report:
        terminalreporter.write_line(line)


def _clear_s3fs_instances() -> None:
    """Drop s3fs's cached filesystem objects (and with them, cached listings)."""
    try:
        from s3fs import S3FileSystem
    except ImportError:
        return
    S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3Server]:
    """A moto S3 server for the whole session; skipped (failed on CI) if unavailable."""
    with serving("moto S3 server", MotoS3Server, (MotoServerError, OSError, ImportError)) as server:
        yield server


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[AzuriteServer]:
    """azurite's blob service for the whole session (installed with npm into ``.servers/`` on first use);
    skipped (failed on CI) if it cannot start. Usually already started by ``pytest_collection_finish``."""
    global _azurite_start
    start, _azurite_start = _azurite_start, None
    if start is None:  # not foreseen (a test asking for it by name at run time): start it now
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        start = pool.submit(_start_azurite)
        pool.shutdown(wait=False)
    waited = time.monotonic()
    try:
        server, seconds = start.result()
    except (AzuriteError, OSError) as exc:
        message = f"azurite unavailable: {exc}"
        if in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    _azurite_report.append(
        f"azurite start-up {seconds:.2f} s, of which a test waited {time.monotonic() - waited:.2f} s"
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def rank_zygote() -> Iterator[Any]:
    """``tests/crash/_launcher.py``'s ``Zygote`` (torch, dcp_storage and s3fs imported once; jobs of ranks forked
    from it), one for the session: the crash tests and the manager's kill tests share it."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the kill tests fork ranks from a zygote and use PR_SET_PDEATHSIG and /proc (Linux only)")
    from crash._launcher import Zygote  # tests/ is on sys.path (rootdir-relative packages, as pytest imports them)

    z = Zygote()
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def s3_url(moto_server: MotoS3Server) -> Iterator[S3Location]:
    """A fresh, empty bucket for this test: ``(s3://bucket/ckpt, storage_options)``.

    s3fs caches filesystem *instances* keyed by their options, and each
    instance caches directory listings. Either cache can make a test see
    another test's (or its own earlier) view of the bucket, so the options
    opt out of both, and the instance cache is cleared around each test.
    """
    _clear_s3fs_instances()
    location = moto_server.new_location("ckpt", skip_instance_cache=True, use_listings_cache=False)
    try:
        yield location
    finally:
        _clear_s3fs_instances()
        bucket = location.url.split("/")[2]
        try:
            moto_server.delete_bucket(bucket)  # moto is in-memory: give it back
        except Exception as exc:  # noqa: BLE001 - cleanup must not mask the test result
            warnings.warn(f"could not delete test bucket {bucket}: {exc!r}", stacklevel=1)
