"""Fixtures for the obstore transport tests: a moto S3 server and a fault-injecting proxy in front of it.

The plugin's tests do not rely on the core's ``tests/conftest.py`` (a separately installed plugin has no
access to it); they start their own moto server, the same way: a subprocess on 127.0.0.1, port 0. When
``CI=true`` a server that fails to start fails the tests instead of skipping them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from dcp_storage_testing.fault_proxy import FaultProxy
from dcp_storage_testing.s3_server import MotoS3Server, MotoServerError, S3Location
from dcp_storage_testing.serving import serving


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3Server]:
    with serving("moto S3 server", MotoS3Server, (MotoServerError, OSError, ImportError)) as server:
        yield server


@pytest.fixture
def s3_url(moto_server: MotoS3Server) -> Iterator[S3Location]:
    """A fresh bucket: ``(s3://bucket/ckpt, s3fs-style storage options)``."""
    location = moto_server.new_location("ckpt", skip_instance_cache=True, use_listings_cache=False)
    try:
        yield location
    finally:
        bucket = location.url.split("/")[2]
        try:
            moto_server.delete_bucket(bucket)
        except Exception as exc:  # noqa: BLE001 - cleanup must not mask the test result
            warnings.warn(f"could not delete test bucket {bucket}: {exc!r}", stacklevel=1)


@pytest.fixture(scope="session")
def fault_proxy(moto_server: MotoS3Server) -> Iterator[FaultProxy]:
    """The project's fault-injecting reverse proxy in front of moto (no rules until a test sets some)."""
    with FaultProxy(moto_server.endpoint_url) as proxy:
        yield proxy


@pytest.fixture
def faults(fault_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """``fault_proxy`` with rules and counters cleared before and after the test."""
    fault_proxy.clear_rules()
    fault_proxy.reset_counters()
    try:
        yield fault_proxy
    finally:
        fault_proxy.clear_rules()
