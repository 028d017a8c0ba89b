"""An object replaced during a load is refused, never loaded as a mix of two versions (issue 20).

Each object's first read in a load pins its version (ETag on S3 and HTTP, generation on GCS); every later
ranged read is conditional on it and its answer's version is compared (:mod:`dcp_storage.transports.guards`).
The attack: replace the object between the first read (a header, the metadata) and the data reads, on a
real server (moto, fake-gcs-server, a loopback HTTP server), at the transport and through ``dcp.load``.
The pins cost no request: the counts are asserted.
"""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported (see gcs_server)

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import dcp_storage as ds
from dcp_storage.errors import ObjectChangedError
from dcp_storage.transports import FsspecTransport, RangeRequest, RetryPolicy, TransportConfig
from dcp_storage_testing.gcs_server import FakeGcsServer, FakeGcsServerError
from dcp_storage_testing.http_store import HttpStore
from dcp_storage_testing.serving import serving

SIZE = 1 << 20
CONFIG = TransportConfig(retry=RetryPolicy(max_attempts=3, initial_backoff=0.01, deadline=30.0), coalesce_gap=0)


def _blob(seed: int) -> bytes:
    return (
        torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        .numpy()
        .tobytes()
    )


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[FakeGcsServer]:
    with serving("fake-gcs-server", FakeGcsServer, (FakeGcsServerError, OSError)) as server:
        yield server


@pytest.fixture(params=["http", "http-ignoring-if-match", "s3", "gs"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any], Callable[[str, bytes], None]]]:
    """``(url of a directory, storage_options, put(name, bytes))`` on a real server of each kind."""
    kind = request.param
    if kind.startswith("http"):
        with HttpStore(honour_if_match=kind == "http") as server:
            yield server.base, {"skip_instance_cache": True}, server.put
        return
    if kind == "s3":
        url, opts = request.getfixturevalue("s3_url")
    else:
        url, opts = request.getfixturevalue("gcs_server").new_location("ckpt")
    writer, root = FsspecTransport.from_url(url, opts)

    def put(name: str, data: bytes) -> None:
        writer.write_file(writer.join(root, name), data)

    yield url, opts, put
    writer.close()


def _transport(url: str, opts: dict[str, Any]) -> tuple[FsspecTransport, str]:
    return FsspecTransport.from_url(url, opts, CONFIG)  # type: ignore[return-value]


def test_object_replaced_between_ranged_reads_is_refused(store: Any) -> None:
    url, opts, put = store
    put("blob", _blob(1))
    transport, root = _transport(url, opts)
    with transport:
        path = transport.join(root, "blob")
        assert bytes(transport.read_range(path, 0, 4096)) == _blob(1)[:4096]  # the first read pins v1
        put("blob", _blob(2))  # replaced mid-load
        with pytest.raises(ObjectChangedError, match="changed during the load") as info:
            transport.read_range(path, 4096, 8192)
        assert "blob" in str(info.value) and "retry the load" in str(info.value)
        assert transport.counters.retries == 0  # refused at once, not retried into a mix
        transport.begin_load()  # a new load reads the new version whole
        assert bytes(transport.read_range(path, 4096, 8192)) == _blob(2)[4096:8192]


def test_size_pins_the_version_too(store: Any) -> None:
    url, opts, put = store
    put("blob", _blob(3))
    transport, root = _transport(url, opts)
    with transport:
        path = transport.join(root, "blob")
        assert transport.size(path) == SIZE  # a HEAD / metadata answer pins
        put("blob", _blob(4))
        with pytest.raises(ObjectChangedError):
            transport.read_range(path, 0, 100)


def test_concurrent_first_reads_of_two_versions_are_refused(store: Any) -> None:
    """Reads made before any pin (one ``read_ranges`` call) still compare the versions their answers name."""
    url, opts, put = store
    put("blob", _blob(5))
    transport, root = _transport(url, opts)
    with transport:
        path = transport.join(root, "blob")
        done = []

        def replace_after_first(_view: memoryview) -> None:
            if not done:
                done.append(1)
                put("blob", _blob(6))

        requests = [RangeRequest(path, 0, 1000, on_complete=replace_after_first)]
        requests += [RangeRequest(path, i * 100_000, i * 100_000 + 1000) for i in range(1, 8)]
        cfg = TransportConfig(retry=CONFIG.retry, coalesce_gap=0, max_workers=1)  # one after another
        with transport.reconfigured(cfg) as serial, pytest.raises(ObjectChangedError):
            serial.read_ranges(requests)


def test_pinning_adds_no_request(store: Any) -> None:
    url, opts, put = store
    put("blob", _blob(7))
    transport, root = _transport(url, opts)
    with transport:
        path = transport.join(root, "blob")
        requests = [RangeRequest(path, i * 65536, i * 65536 + 4096) for i in range(16)]
        for _ in range(2):  # the second pass runs with every read conditional
            before = transport.counters.snapshot()["requests"]
            views = transport.read_ranges(requests)
            assert transport.counters.snapshot()["requests"] - before == 16
            assert all(bytes(v) == _blob(7)[r.start : r.end] for v, r in zip(views, requests))  # type: ignore[arg-type]
        assert len(transport.versions) == 1


def test_http_server_sees_if_match_and_no_extra_request() -> None:
    with HttpStore({"blob": _blob(8)}) as server:
        transport, path = _transport(server.url("blob"), {"skip_instance_cache": True})
        with transport:
            for i in range(4):
                transport.read_range(path, i * 1000, i * 1000 + 10)
        gets = server.requests("GET")
        assert len(gets) == 4 and not server.requests("HEAD")
        assert "If-Match" not in gets[0].headers
        assert all(r.headers.get("If-Match") == HttpStore.etag(_blob(8)) for r in gets[1:])


class _ReplacingPlanner(DefaultLoadPlanner):
    """Replaces the checkpoint's file after its metadata (the header) was read, before the data reads."""

    def __init__(self, replace: Callable[[], None]) -> None:
        super().__init__()
        self._replace = replace

    def create_local_plan(self) -> Any:
        self._replace()
        return super().create_local_plan()


def test_dcp_load_of_a_file_replaced_after_its_header_is_refused(store: Any) -> None:
    url, opts, put = store
    v1 = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(2048)}
    v2 = {"w": -torch.arange(4096, dtype=torch.float32), "b": torch.zeros(2048)}  # same layout, other values
    put("model.safetensors", st_save(v1))
    dest = {"w": torch.empty(4096), "b": torch.empty(2048)}
    file_url = url.rstrip("/") + "/model.safetensors"
    reader = ds.SafetensorsReader(file_url, opts, transport_config=CONFIG)
    planner = _ReplacingPlanner(lambda: put("model.safetensors", st_save(v2)))
    with pytest.raises((ObjectChangedError, CheckpointException)) as info:
        dcp.load(dest, storage_reader=reader, planner=planner, no_dist=True)
    assert "changed during the load" in str(info.value)
    dcp.load(dest, storage_reader=reader, no_dist=True)  # the retried load reads v2 whole
    assert torch.equal(dest["w"], v2["w"]) and torch.equal(dest["b"], v2["b"])
