"""Fixtures for fault-injection tests: a :class:`FaultProxy` in front of the session's moto server.

``fault_proxy`` (module): the proxy, its rules cleared and its counters reset before each test.
``azurite`` and ``az_proxy`` (package): the session's azurite (root ``conftest.py``; its start-up takes
seconds), and a proxy in front of it.
``proxied_s3`` (function) and ``proxied_s3_module`` (module): ``(s3://bucket/ckpt, storage_options)``
where the options reach moto *through the proxy*; the bucket is created and deleted on moto directly, so
bucket admin never meets a fault.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from dcp_storage_testing.azurite import AzuriteServer
from dcp_storage_testing.fault_proxy import FaultProxy
from dcp_storage_testing.s3_server import S3Location

# botocore's socket read timeout in these tests: a "slow" fault (held back longer) makes the client time
# out and retry; a healthy response from moto on a busy 2-core machine comes well within it.
READ_TIMEOUT = 0.4
SLOW_DELAY = 0.6


@pytest.fixture(scope="package")
def azurite(azurite_server: AzuriteServer) -> AzuriteServer:
    """The session's azurite (root ``conftest.py``): its start-up takes seconds, so one serves every test."""
    return azurite_server


@pytest.fixture(scope="package")
def az_proxy(azurite: AzuriteServer) -> Iterator[FaultProxy]:
    with FaultProxy(azurite.endpoint_url.rsplit("/", 1)[0]) as proxy:  # the account is in the path
        yield proxy


@pytest.fixture(scope="module")
def fault_proxy(moto_server: Any) -> Iterator[FaultProxy]:
    with FaultProxy(moto_server.endpoint_url) as proxy:
        yield proxy


def _proxied_options(moto_server: Any, proxy: FaultProxy) -> dict[str, Any]:
    return moto_server.storage_options(
        client_kwargs={"endpoint_url": proxy.url},
        config_kwargs={"connect_timeout": 2, "read_timeout": READ_TIMEOUT},
        skip_instance_cache=True,
        use_listings_cache=False,
    )


@contextlib.contextmanager
def _proxied_bucket(moto_server: Any, proxy: FaultProxy) -> Iterator[S3Location]:
    proxy.clear_rules()
    proxy.reset_counters()
    bucket = moto_server.create_bucket(moto_server.unique_bucket_name("fault"))
    try:
        yield S3Location(f"s3://{bucket}/ckpt", _proxied_options(moto_server, proxy))
    finally:
        proxy.clear_rules()
        moto_server.delete_bucket(bucket)


@pytest.fixture
def proxied_s3(moto_server: Any, fault_proxy: FaultProxy) -> Iterator[S3Location]:
    """A fresh bucket for this test, reached through the proxy."""
    with _proxied_bucket(moto_server, fault_proxy) as location:
        yield location


@pytest.fixture(scope="module")
def proxied_s3_module(moto_server: Any, fault_proxy: FaultProxy) -> Iterator[S3Location]:
    """A bucket shared by a module's tests (one checkpoint saved once, loaded under many faults)."""
    with _proxied_bucket(moto_server, fault_proxy) as location:
        yield location
