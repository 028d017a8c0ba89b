"""Shared pytest fixtures: an in-memory S3 endpoint and fresh per-test buckets.

Hooks
-----
``pytest_sessionstart`` pre-starts :func:`~dcp_storage_testing.distributed.run_ranks`'
forkserver in the background, so the first multi-rank test does not pay for
its ``import torch``.

Fixtures
--------
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

import os
import warnings
from collections.abc import Iterator

import pytest

from dcp_storage_testing.distributed import warm_up
from dcp_storage_testing.s3_server import MotoS3Server, MotoServerError, S3Location
from dcp_storage_testing.serving import serving

# Tests must never reach the Hugging Face Hub (or wait on its timeouts).
os.environ["HF_HUB_OFFLINE"] = "1"
# gcsfs probes for hierarchical-namespace buckets over TLS on every call unless told not to (set before any
# test module imports gcsfs; the emulator cannot answer the probe).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start run_ranks' forkserver (which imports torch) while collection runs."""
    try:
        warm_up()
    except Exception as exc:  # noqa: BLE001 - an optimisation; run_ranks retries
        warnings.warn(f"could not pre-start the run_ranks forkserver: {exc!r}", stacklevel=1)


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
