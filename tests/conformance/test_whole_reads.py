"""Whole-file reads with a limit (``.metadata``, an index) read the file as it is now, or fail with our error.

fsspec filesystems cache listings by default (adlfs answers ``size`` from them), and a checkpoint directory
is listed before its ``.metadata`` or index is read. Another process may write or rewrite the file in
between (a save finishing on another rank, an overwrite): the read must return its current bytes, never a
prefix cut at a stale size, and never a non-library error for a file the listing did not have yet. A name
that is a directory (a prefix of other objects) is refused with one of our errors on every backend.
"""

from __future__ import annotations

from typing import Any

import pytest

from dcp_storage.errors import DcpStorageError
from dcp_storage.transports import FsspecTransport

from .conftest import Location

_SERVERS = {"az": "azurite_server", "gs": "gcs_server", "s3": "moto_server"}


@pytest.mark.parametrize("backend", sorted(_SERVERS))
def test_a_file_rewritten_or_created_after_a_listing_reads_whole(backend: str, request: pytest.FixtureRequest) -> None:
    server: Any = request.getfixturevalue(_SERVERS[backend])
    url, options = server.new_location("ckpt", skip_instance_cache=True)  # listings cache on, as users have it
    reader, root = FsspecTransport.from_url(url, options)
    writer, _ = FsspecTransport.from_url(url, dict(options))  # another process: its own filesystem and cache
    with reader, writer:
        grown, late = reader.join(root, ".metadata"), reader.join(root, "model.safetensors.index.json")
        writer.write_file(grown, b"a" * 100)
        assert reader.listdir(root) == [".metadata"]  # the listing (and its sizes) is cached now
        writer.write_file(grown, b"b" * 200)
        writer.write_file(late, b"c" * 10)
        assert reader.read_file(grown, max_bytes=1_000) == b"b" * 200
        assert reader.read_file(late, max_bytes=1_000) == b"c" * 10


def test_a_directory_where_a_file_is_read_is_one_of_our_errors(location: Location) -> None:
    """``.metadata`` that is a directory (a prefix of other objects on a store) is refused with our error."""
    t, root = FsspecTransport.from_url(location.url, location.storage_options)
    with t:
        t.write_file(t.join(root, ".metadata", "x"), b"not a file")
        for limit in (None, 1_000):
            with pytest.raises(DcpStorageError, match=r"\.metadata"):
                t.read_file(t.join(root, ".metadata"), max_bytes=limit)
