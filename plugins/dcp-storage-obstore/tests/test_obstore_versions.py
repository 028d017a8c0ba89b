"""An object replaced during a load is refused through obstore too, never read as a mix (issue 20).

The first ranged GET of an object pins its ETag; later ones send ``If-Match`` and compare the ETag the
answer names (moto answers a stale ``If-Match`` with ``412``). No request is added.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from dcp_storage.plugin_api import ObjectChangedError, RangeRequest, TransportConfig

from dcp_storage_obstore import ObstoreTransport


def test_object_replaced_between_ranged_reads_is_refused(s3_url: Any) -> None:
    url, opts = s3_url
    reader, root = ObstoreTransport.from_url(url, opts, TransportConfig(coalesce_gap=0))
    writer, _ = ObstoreTransport.from_url(url, opts)  # another process's writer
    with reader, writer:
        path = reader.join(root, "blob")
        v1, v2 = os.urandom(1 << 20), os.urandom(1 << 20)
        writer.write_file(path, v1)
        requests = [RangeRequest(path, i * 65536, i * 65536 + 4096) for i in range(8)]
        views = reader.read_ranges(requests)
        assert reader.counters.snapshot()["requests"] == 8  # pinning adds no request
        assert all(bytes(v) == v1[r.start : r.end] for v, r in zip(views, requests))  # type: ignore[arg-type]
        writer.write_file(path, v2)  # replaced mid-load
        with pytest.raises(ObjectChangedError, match="changed during the load"):
            reader.read_range(path, 0, 4096)
        assert reader.counters.retries == 0
        reader.begin_load()  # the next load reads the new version
        assert bytes(reader.read_range(path, 0, 4096)) == v2[:4096]
