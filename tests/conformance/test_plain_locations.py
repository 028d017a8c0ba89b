"""The conformance suite takes a plain ``(url, storage_options)`` pair, and a URL scheme fsspec does not know
(a plugin transport's own) does not break its helpers."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from dcp_storage import registry
from dcp_storage.transports import open_transport
from dcp_storage_testing.conformance import Location, as_location, fsspec_knows, shown_url, stored


class KvflatTransport:
    """``kvflat://PATH`` mounted on ``memory:///kvflat/PATH``: a scheme only the registry knows."""

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any] | None = None, config: Any = None) -> Any:
        return open_transport("memory:///kvflat/" + os.fspath(url).split("://", 1)[1], {}, config)


def test_a_plain_pair_is_a_location() -> None:
    assert as_location(("s3://b/ckpt", {"anon": True})) == Location("s3://b/ckpt", {"anon": True}, "s3")
    assert as_location(("/tmp/x", {})).backend == "local"
    given = Location("memory://x", {}, "memory")
    assert as_location(given) is given
    assert shown_url(("memory://m/ckpt", {}), ".metadata") == "memory://m/ckpt/.metadata"


def test_an_unknown_scheme_is_seen_through_its_transport() -> None:
    url = f"kvflat://{uuid.uuid4().hex}/ckpt"
    with registry.registered("transports", "kvflat", KvflatTransport):
        assert not fsspec_knows((url, {}))
        assert stored((url, {})) == {}
        transport, root = open_transport(url)
        with transport:
            transport.write_file(transport.join(root, "a.bin"), b"abc")
            transport.write_file(transport.join(root, "sub", "b.bin"), b"b")
        assert stored((url, {})) == {"a.bin": 3}, "files directly under the location, not directories"
    assert fsspec_knows(("memory://x", {}))


@pytest.mark.parametrize("location", [("memory://m", {}), Location("memory://m", {}, "memory")])
def test_unpacking_either_shape(location: Any) -> None:
    url, options, backend = as_location(location)
    assert (url, options, backend) == ("memory://m", {}, "memory")
