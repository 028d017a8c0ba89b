"""ObstoreTransport against a real S3 endpoint (moto), and through a proxy that fails on purpose."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import obstore
import pytest
from dcp_storage.plugin_api import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RangeRequest,
    RetryPolicy,
    TransportConfig,
    TransportError,
    open_transport,
)
from dcp_storage_testing.fault_proxy import FaultProxy, FaultRule
from obstore.store import S3Store

from dcp_storage_obstore import ObstoreOptionsError, ObstoreTransport

MiB = 1024 * 1024
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.005, max_backoff=0.02, deadline=20.0)
CONFIG = TransportConfig(
    max_workers=8, coalesce_gap=4096, max_request_bytes=1 * MiB, part_size=5 * MiB, retry=FAST_RETRY
)
SECRET = "s3cr3t-DO-NOT-PRINT-" + uuid.uuid4().hex[:8]


def random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def t_root(s3_url: Any) -> Iterator[tuple[ObstoreTransport, str]]:
    url, options = s3_url
    transport, root = ObstoreTransport.from_url(url, options, CONFIG)
    with transport:
        yield transport, root


def _raw_store(transport: ObstoreTransport, path: str) -> tuple[S3Store, str]:
    return transport._locate(path)


# --------------------------------------------------------------------------------------------- selection


def test_selected_by_transport_option_with_s3fs_style_options(s3_url: Any) -> None:
    url, options = s3_url
    transport, path = open_transport(url, {**options, "transport": "obstore"})
    assert isinstance(transport, ObstoreTransport)
    assert path == url.removeprefix("s3://")
    assert transport.strip_url(url + "/x") == path + "/x"
    assert transport.url(transport.join(path, "a", "b")) == url + "/a/b"


def test_unknown_option_refused_by_name_and_secrets_never_shown(s3_url: Any) -> None:
    url, options = s3_url
    with pytest.raises(ObstoreOptionsError, match="'requester_pays'") as info:
        ObstoreTransport.from_url(url, {**options, "secret": SECRET, "requester_pays": SECRET})
    assert SECRET not in str(info.value)
    transport, path = ObstoreTransport.from_url(url, {**options, "secret": SECRET}, CONFIG)
    with transport:
        assert SECRET not in repr(transport) and SECRET not in repr(transport.settings)
        transport.write_file(transport.join(path, "x"), b"x")  # moto accepts any secret
        with pytest.raises(CheckpointNotFoundError) as missing:
            transport.read_file(transport.join(path, "nothing"))
        other, _ = ObstoreTransport.from_url(
            "s3://no-such-bucket-" + uuid.uuid4().hex[:8], {**options, "secret": SECRET}
        )
        with other, pytest.raises(Exception) as failed:
            other.read_range("no-such-bucket-x/k", 0, 10)
    for exc in (missing.value, failed.value):
        assert SECRET not in str(exc) and SECRET not in repr(exc)


# ------------------------------------------------------------------------------------------ whole files


def test_write_read_roundtrip(t_root: tuple[ObstoreTransport, str]) -> None:
    t, root = t_root
    path = t.join(root, "meta.json")
    data = random_bytes(10_000)
    t.write_file(path, data)
    assert t.read_file(path) == data and t.exists(path) and t.size(path) == len(data)
    assert t.counters.bytes_written == len(data) and t.counters.bytes_read == len(data)
    for value in (bytearray(b"second"), memoryview(b"third!"), b""):
        t.write_file(path, value)
        assert t.read_file(path) == bytes(value)
    assert t.size(path) == 0


def test_pickles_without_stores_and_works_after(t_root: tuple[ObstoreTransport, str]) -> None:
    """async_save's PROCESS mode pickles writers with their transport: settings travel, stores do not."""
    import pickle

    transport, root = t_root
    transport.write_file(transport.join(root, "p"), b"before")  # the original holds a live store now
    copy = pickle.loads(pickle.dumps(transport))
    assert copy is not transport and copy._stores == {} and copy.config == transport.config
    assert bytes(copy.read_file(copy.join(root, "p"))) == b"before"
    copy.close()


def test_exists_size_listdir_remove(t_root: tuple[ObstoreTransport, str]) -> None:
    t, root = t_root
    assert not t.exists(root) and t.listdir(root) == []
    t.makedirs(root)
    for name in ("b.bin", "a.bin", "sub/c.bin"):
        t.write_file(t.join(root, name), b"12345")
    assert t.exists(root) and t.exists(t.join(root, "sub")) and t.exists(t.join(root, "a.bin"))
    assert t.listdir(root) == ["a.bin", "b.bin", "sub"]
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        t.size(t.join(root, "nope"))
    t.remove(t.join(root, "a.bin"))
    t.remove(t.join(root, "never-existed"))
    assert t.listdir(root) == ["b.bin", "sub"]


def test_open_atomic_single_put_and_multipart(t_root: tuple[ObstoreTransport, str]) -> None:
    t, root = t_root
    small = [random_bytes(1000, s) for s in range(5)]
    big = random_bytes(12 * MiB + 123, seed=9)  # > 2 parts of 5 MiB
    for name, chunks in (
        ("small.bin", small),
        ("big.bin", [big[i : i + 3 * MiB] for i in range(0, len(big), 3 * MiB)]),
    ):
        path = t.join(root, name)
        before = t.counters.requests
        with t.open_atomic(path) as f:
            for chunk in chunks:
                f.write(chunk)
            assert not t.exists(path), "nothing may be visible before the block ends"
        assert t.read_file(path) == b"".join(chunks)
        assert t.counters.requests - before == (1 if name == "small.bin" else 3 + 2) + 1  # + the read_file


def test_open_atomic_failure_aborts_and_keeps_previous(t_root: tuple[ObstoreTransport, str], moto_server: Any) -> None:
    t, root = t_root
    path = t.join(root, "data.bin")
    t.write_file(path, b"old")
    for size in (1000, 11 * MiB):  # single-PUT buffer, and a multipart upload already under way
        with pytest.raises(RuntimeError, match="disk on fire"), t.open_atomic(path) as f:
            f.write(random_bytes(size))
            raise RuntimeError("disk on fire")
        assert t.read_file(path) == b"old"
    bucket = root.split("/")[0]
    assert moto_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


# ----------------------------------------------------------------------------- the obstore 0.12 buffer bug


def test_raw_obstore_writer_keeps_callers_buffer(t_root: tuple[ObstoreTransport, str]) -> None:
    """Documents the bug the transport works around; skips once obstore copies by itself."""
    t, root = t_root
    store, key = _raw_store(t, t.join(root, "raw.bin"))
    buf = bytearray(b"A" * 1000)
    writer = obstore.open_writer(store, key)
    writer.write(buf)
    buf[:] = b"B" * 1000
    writer.close()
    if bytes(obstore.get(store, key).bytes()) == b"A" * 1000:
        pytest.skip(f"obstore {obstore.__version__} copies written buffers now; CopyingWriter could go")
    assert bytes(obstore.get(store, key).bytes()) == b"B" * 1000


@pytest.mark.parametrize("size", [1000, 3 * MiB, 6 * MiB])
def test_open_atomic_copies_every_buffer(t_root: tuple[ObstoreTransport, str], size: int) -> None:
    """A caller refilling one buffer between writes must get what it wrote, not the buffer's last state."""
    t, root = t_root
    path = t.join(root, f"reused-{size}.bin")
    buf = bytearray(size)
    expected = []
    with t.open_atomic(path) as f:
        for round_ in range(3):
            buf[:] = bytes([65 + round_]) * size
            expected.append(bytes(buf))
            f.write(memoryview(buf))
        buf[:] = b"Z" * size  # after the last write, before the commit
    assert t.read_file(path) == b"".join(expected)


# ---------------------------------------------------------------------------------------------- ranges


def test_read_ranges_random_into_buffers_and_callbacks(t_root: tuple[ObstoreTransport, str]) -> None:
    t, root = t_root
    paths = [t.join(root, f"f{i}.bin") for i in range(3)]
    blobs = [random_bytes(3 * MiB + i * 7919, seed=i) for i in range(3)]
    for p, b in zip(paths, blobs):
        t.write_file(p, b)
    rng = random.Random(1)
    reqs, want, seen = [], [], {}
    lock = threading.Lock()
    for i in range(60):
        k = rng.randrange(3)
        s = rng.randrange(len(blobs[k]) - 1)
        e = min(len(blobs[k]), s + rng.choice([1, 100, 5000, 300_000, 2 * MiB]))
        into = memoryview(bytearray(e - s)) if i % 3 == 0 else None

        def done(view: memoryview, i: int = i) -> None:
            with lock:
                seen.setdefault(i, []).append(bytes(view))

        reqs.append(RangeRequest(paths[k], s, e, into=into, on_complete=done if i % 3 == 1 else None))
        want.append(blobs[k][s:e])
    out = t.read_ranges(reqs)
    for i, (req, data) in enumerate(zip(reqs, want)):
        if req.on_complete is not None:
            assert out[i] is None and seen[i] == [data], i
        else:
            assert bytes(out[i]) == data, i
            if req.into is not None:
                assert out[i] is req.into


def test_coalescing_and_splitting_count_requests(t_root: tuple[ObstoreTransport, str]) -> None:
    t, root = t_root
    path = t.join(root, "f.bin")
    blob = random_bytes(3 * MiB + 5)
    t.write_file(path, blob)
    t.counters.reset()
    reqs = [RangeRequest(path, i * 1000, i * 1000 + 900) for i in range(100)]  # 100-byte gaps
    assert [bytes(b) for b in t.read_ranges(reqs)] == [blob[r.start : r.end] for r in reqs]
    assert t.counters.requests == 1
    t.counters.reset()
    assert bytes(t.read_range(path, 0, len(blob))) == blob
    assert t.counters.requests == 4  # 1 MiB max_request_bytes
    assert t.counters.bytes_read == len(blob)


def test_past_eof_is_corrupt_and_missing_is_not_found(t_root: tuple[ObstoreTransport, str]) -> None:
    t, root = t_root
    path = t.join(root, "short.bin")
    t.write_file(path, b"z" * 1000)
    for start, end in ((500, 1500), (2000, 3000)):
        with pytest.raises(CorruptCheckpointError, match="ends at byte 1000") as info:
            t.read_ranges([RangeRequest(path, start, end)])
        assert t.url(path) in str(info.value)
    assert t.counters.retries == 0
    with pytest.raises(CheckpointNotFoundError, match="nothing.bin"):
        t.read_ranges([RangeRequest(t.join(root, "nothing.bin"), 0, 10)])


def test_inflight_budget_respected(s3_url: Any) -> None:
    url, options = s3_url
    cfg = TransportConfig(
        max_workers=8, coalesce_gap=0, max_request_bytes=64 * 1024, max_inflight_bytes=200 * 1024, retry=FAST_RETRY
    )
    t, root = ObstoreTransport.from_url(url, options, cfg)
    path = t.join(root, "f.bin")
    blob = random_bytes(2 * MiB)
    t.write_file(path, blob)
    peak = 0
    current = 0
    lock = threading.Lock()
    original = t._fetch_group

    def tracking(group: Any, views: Any) -> None:
        nonlocal peak, current
        with lock:
            current += group.length
            peak = max(peak, current)
        try:
            original(group, views)
        finally:
            with lock:
                current -= group.length

    t._fetch_group = tracking  # type: ignore[method-assign]
    with t:
        out = t.read_ranges([RangeRequest(path, i * 65536, (i + 1) * 65536) for i in range(32)])
    assert b"".join(bytes(b) for b in out) == blob
    assert 0 < peak <= 200 * 1024


# --------------------------------------------------------------------------------------- real failures


def _via_proxy(s3_url: Any, proxy: FaultProxy) -> tuple[ObstoreTransport, ObstoreTransport, str]:
    url, options = s3_url
    direct, root = ObstoreTransport.from_url(url, options, CONFIG)
    proxied_options = {**options, "client_kwargs": {"endpoint_url": proxy.url}, "secret": SECRET}
    config = TransportConfig(max_workers=4, coalesce_gap=0, max_request_bytes=4 * MiB, retry=FAST_RETRY)
    proxied, _ = ObstoreTransport.from_url(url, proxied_options, config)
    return direct, proxied, root


@pytest.mark.parametrize("mode", ["slowdown_503", "error_500", "reset", "truncate"])
def test_transient_failures_are_retried(s3_url: Any, faults: FaultProxy, mode: str) -> None:
    direct, t, root = _via_proxy(s3_url, faults)
    path = t.join(root, "blob.bin")
    blob = random_bytes(3 * MiB, seed=3)
    direct.write_file(path, blob)
    faults.set_rules([FaultRule(mode, method="GET", limit=3)])
    with direct, t:
        dest = bytearray(2 * MiB)
        out = t.read_ranges([RangeRequest(path, 0, 1000), RangeRequest(path, MiB, 3 * MiB, into=memoryview(dest))])
    assert bytes(out[0]) == blob[:1000] and dest == blob[MiB:]
    assert faults.counters().faults[mode] == 3
    assert t.counters.retries == 3


def test_permanent_failure_names_url_range_and_attempts(s3_url: Any, faults: FaultProxy) -> None:
    direct, t, root = _via_proxy(s3_url, faults)
    path = t.join(root, "blob.bin")
    direct.write_file(path, random_bytes(10_000))
    faults.set_rules([FaultRule("slowdown_503", method="GET")])
    with direct, t, pytest.raises(TransportError) as info:
        t.read_ranges([RangeRequest(path, 100, 4196)])
    msg = str(info.value)
    assert t.url(path) in msg and "[100, 4196)" in msg and "4 attempt(s)" in msg and "503" in msg
    assert t.counters.retries == 3 and faults.counters().faults["slowdown_503"] == 4
    assert SECRET not in msg and SECRET not in repr(info.value.__cause__)


def test_missing_object_and_past_end_are_not_retried_through_the_proxy(s3_url: Any, faults: FaultProxy) -> None:
    direct, t, root = _via_proxy(s3_url, faults)
    path = t.join(root, "short.bin")
    direct.write_file(path, b"z" * 1000)
    with direct, t:
        with pytest.raises(CheckpointNotFoundError):
            t.read_ranges([RangeRequest(t.join(root, "nothing"), 0, 10)])
        with pytest.raises(CorruptCheckpointError, match="ends at byte 1000"):
            t.read_ranges([RangeRequest(path, 2000, 3000)])
    assert t.counters.retries == 0
