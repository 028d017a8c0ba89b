"""Each backend of the conformance suite is served by its own transport class (so the suite, which opens
its transports through the factory, runs every one of them: local, S3 on moto, GCS on fake-gcs-server,
Azure on azurite, and the generic fsspec transport on ``memory://``)."""

from __future__ import annotations

from dcp_storage.transports import (
    AzureTransport,
    FsspecTransport,
    GcsTransport,
    LocalTransport,
    S3Transport,
    open_transport,
)
from dcp_storage_testing.conformance import TEST_CONFIG, Location

EXPECTED = {
    "local": LocalTransport, "file": LocalTransport, "memory": FsspecTransport, "s3": S3Transport,
    "gs": GcsTransport, "az": AzureTransport,
}  # fmt: skip


def test_each_backend_gets_its_transport(location: Location) -> None:
    url, options, backend = location
    transport, root = open_transport(url, options, config=TEST_CONFIG)
    with transport:
        assert type(transport) is EXPECTED[backend], (backend, type(transport))
        transport.write_file(transport.join(root, "probe"), b"probe")
        assert transport.read_file(transport.join(root, "probe")) == b"probe"
