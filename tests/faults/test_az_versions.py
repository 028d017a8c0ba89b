"""An Azure blob replaced during a load is refused, never read as a mix (issue 20; see
``tests/transports/test_version_pinning.py`` for s3, gs and http). azurite answers a stale ``If-Match`` 412."""

from __future__ import annotations

import os
from typing import Any

import pytest

from dcp_storage.errors import ObjectChangedError
from dcp_storage.transports import FsspecTransport, RangeRequest, TransportConfig


def test_blob_replaced_between_ranged_reads_is_refused(azurite: Any) -> None:
    url, opts = azurite.new_location("ckpt")
    reader, root = FsspecTransport.from_url(url, opts, TransportConfig(coalesce_gap=0))
    writer, _ = FsspecTransport.from_url(url, opts)
    with reader, writer:
        path = reader.join(root, "blob")
        v1, v2 = os.urandom(1 << 20), os.urandom(1 << 20)
        writer.write_file(path, v1)
        requests = [RangeRequest(path, i * 65536, i * 65536 + 4096) for i in range(8)]
        before = reader.counters.snapshot()["requests"]
        views = reader.read_ranges(requests)
        assert reader.counters.snapshot()["requests"] - before == 8  # pinning adds no request
        assert all(bytes(v) == v1[r.start : r.end] for v, r in zip(views, requests))  # type: ignore[arg-type]
        writer.write_file(path, v2)
        with pytest.raises(ObjectChangedError, match="changed during the load"):
            reader.read_range(path, 0, 4096)
        reader.begin_load()
        assert bytes(reader.read_range(path, 0, 4096)) == v2[:4096]
