"""Object stores behind a :class:`FaultProxy` that only counts: what the *server* was asked for and served.

``counted_s3`` / ``counted_gcs`` (module): ``(proxy, new_prefix)``; ``new_prefix(name)`` gives a URL under a
fresh bucket, the storage options that reach the server through the proxy, and ``upload(local_dir)`` to
copy a checkpoint written locally into it (directly, not counted). The tests read through the proxy and
count requests and body bytes per object from ``proxy.counters()``, not from the library's own counters.
"""

from __future__ import annotations

import os

# Before anything imports gcsfs (see dcp_storage_testing.gcs_server): plain GCSFileSystem for gs://.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest

from dcp_storage_testing.fault_proxy import FaultProxy
from dcp_storage_testing.gcs_server import FakeGcsServer, FakeGcsServerError
from dcp_storage_testing.serving import serving


@dataclass(frozen=True)
class Counted:
    """One store behind a counting proxy; ``location(name)`` makes a fresh bucket for a case."""

    proxy: FaultProxy
    scheme: str
    direct_options: dict[str, Any]
    proxied_options: dict[str, Any]
    make_bucket: Callable[[], str]

    def location(self, prefix: str) -> tuple[str, dict[str, Any]]:
        bucket = self.make_bucket()
        return f"{self.scheme}://{bucket}/{prefix}", dict(self.proxied_options)

    def upload(self, local: str, url: str) -> None:
        """Copy the file or directory ``local`` to ``url`` without going through the proxy."""
        self.upload_many([(local, url)])

    def upload_many(self, copies: list[tuple[str, str]]) -> None:
        """:meth:`upload` for each ``(local, url)``, as one batch of concurrent PUTs from one client (one
        client per copy, each one file at a time, cost ~15 s of the scale tests' set-up on 2 cores)."""
        fs = fsspec.filesystem(self.scheme, **self.direct_options)
        sources: list[str] = []
        targets: list[str] = []
        for local, url in copies:
            if not os.path.isdir(local):
                sources.append(local)
                targets.append(url)
                continue
            for dirpath, _dirs, files in os.walk(local):
                rel = os.path.relpath(dirpath, local)
                for name in files:
                    target = url if rel == "." else f"{url}/{rel}"
                    sources.append(os.path.join(dirpath, name))
                    targets.append(f"{target}/{name}")
        if sources:
            fs.put(sources, targets)


@pytest.fixture(scope="module")
def counted_s3(moto_server: Any) -> Iterator[Counted]:
    with FaultProxy(moto_server.endpoint_url) as proxy:
        direct = moto_server.storage_options(skip_instance_cache=True, use_listings_cache=False)
        proxied = moto_server.storage_options(
            client_kwargs={"endpoint_url": proxy.url}, skip_instance_cache=True, use_listings_cache=False
        )
        buckets: list[str] = []

        def make() -> str:
            buckets.append(moto_server.create_bucket(moto_server.unique_bucket_name("scale")))
            return buckets[-1]

        yield Counted(proxy, "s3", direct, proxied, make)
        for bucket in buckets:
            moto_server.delete_bucket(bucket)


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[FakeGcsServer]:
    with serving("fake-gcs-server", FakeGcsServer, (FakeGcsServerError, OSError)) as server:
        yield server


@pytest.fixture(scope="module")
def counted_gcs(gcs_server: FakeGcsServer) -> Iterator[Counted]:
    with FaultProxy(gcs_server.endpoint_url, dialect="gcs", rewrite_location=True) as proxy:
        direct = gcs_server.storage_options(skip_instance_cache=True, use_listings_cache=False)
        proxied = gcs_server.storage_options(endpoint_url=proxy.url, skip_instance_cache=True, use_listings_cache=False)
        buckets: list[str] = []

        def make() -> str:
            buckets.append(gcs_server.create_bucket(gcs_server.unique_bucket_name("scale")))
            return buckets[-1]

        yield Counted(proxy, "gs", direct, proxied, make)
        for bucket in buckets:
            gcs_server.delete_bucket(bucket)
