"""FsspecTransport against real filesystems: a local dir, ``file://``, ``memory://`` and ``s3://`` (moto).

The conformance tests are written once (:class:`TransportConformance`) and run for every backend through
the parametrized ``transport_root`` fixture. A tiny ``http.server`` that fails on purpose drives the
retry tests over real HTTP through fsspec's HTTP filesystem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, FileTooLargeError, TransportError
from dcp_storage.transports import FsspecTransport, RangeRequest, RetryPolicy, TransportConfig

MiB = 1024 * 1024
BACKENDS = ["local", "file", "memory", "s3"]

# Retries fast enough for tests, bounded so a bug cannot hang the suite.
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.005, max_backoff=0.02, deadline=10.0)
BASE_CONFIG = TransportConfig(
    max_workers=8,
    coalesce_gap=4096,
    max_request_bytes=8 * MiB,
    part_size=5 * MiB,  # the S3 minimum, so multipart uploads are cheap to provoke
    retry=FAST_RETRY,
)


def with_config(t: FsspecTransport, **changes: Any) -> FsspecTransport:
    """A second transport over the same filesystem with some settings changed (fresh counters)."""
    return FsspecTransport(t.fs, dataclasses.replace(BASE_CONFIG, **changes))


def random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture(scope="module")
def shared_s3(moto_server: Any) -> Iterator[tuple[Any, str]]:
    """One s3fs filesystem and bucket for the module: ``(fs, bucket)``.

    Creating an s3fs client costs a few hundred ms, more than most tests here; tests isolate by a fresh
    prefix instead (and still see no listing cache: ``use_listings_cache=False``).
    """
    url, storage_options = moto_server.new_location("unused", skip_instance_cache=True, use_listings_cache=False)
    transport, root = FsspecTransport.from_url(url, storage_options, config=BASE_CONFIG)
    bucket = _bucket_of(root)
    try:
        yield transport.fs, bucket
    finally:
        transport.close()
        moto_server.delete_bucket(bucket)


@pytest.fixture(params=BACKENDS)
def transport_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[FsspecTransport, str]]:
    """``(transport, root)``: an empty, writable root on the parametrized backend."""
    kind = request.param
    if kind == "s3":
        fs, bucket = request.getfixturevalue("shared_s3")
        transport, root = FsspecTransport(fs, BASE_CONFIG), f"{bucket}/{uuid.uuid4().hex}/root"
    else:
        if kind == "local":
            url = str(tmp_path / "root")
        elif kind == "file":
            url = (tmp_path / "root").as_uri()
        else:
            url = f"memory://dcp-test-{uuid.uuid4().hex}/root"
        transport, root = FsspecTransport.from_url(url, config=BASE_CONFIG)
    if kind in ("local", "file"):
        assert transport.is_local and root == str(tmp_path / "root")
    else:
        assert not transport.is_local and transport.protocol == kind
    try:
        yield transport, root
    finally:
        transport.close()
        if kind in ("memory", "s3"):
            with contextlib.suppress(FileNotFoundError):
                transport.fs.rm(root.rsplit("/", 1)[0], recursive=True)


def _bucket_of(root: str) -> str:
    return root.split("/", 1)[0]


class TransportConformance:
    """Behaviour every backend must share. Subclasses are collected; this mixin is not (no ``Test``)."""

    # ------------------------------------------------------------------------------------ whole files

    def test_write_read_roundtrip(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "meta.json")
        data = random_bytes(10_000)
        t.write_file(path, data)
        assert t.read_file(path) == data
        assert t.exists(path)
        assert t.size(path) == len(data)
        assert t.counters.bytes_written == len(data)
        assert t.counters.bytes_read == len(data)
        # bytearray / memoryview inputs, and overwriting
        t.write_file(path, bytearray(b"second"))
        assert t.read_file(path) == b"second"
        t.write_file(path, memoryview(b"third!"))
        assert t.read_file(path) == b"third!"
        t.write_file(path, b"")
        assert t.read_file(path) == b""
        assert t.size(path) == 0

    def test_open_atomic_roundtrip(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "sub", "data.bin")
        chunks = [random_bytes(1000, seed) for seed in range(5)]
        with t.open_atomic(path) as f:
            for chunk in chunks:
                assert f.write(memoryview(chunk)) == len(chunk)
            assert f.tell() == 5000
        assert t.read_file(path) == b"".join(chunks)
        assert t.counters.bytes_written == 5000

    def test_open_atomic_multipart_roundtrip(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "big.bin")
        data = random_bytes(11 * MiB + 17)  # three parts of 5 MiB on S3
        with t.open_atomic(path) as f:
            view = memoryview(data)
            for pos in range(0, len(data), 3 * MiB):
                f.write(view[pos : pos + 3 * MiB])
        assert t.size(path) == len(data)
        assert t.read_range(path, 0, len(data)) == data

    def test_open_atomic_not_visible_while_writing(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "pending.bin")
        with t.open_atomic(path) as f:
            f.write(b"x" * 1000)
            assert not t.exists(path), "a partially written file is visible at its final path"
            assert "pending.bin" not in t.listdir(root)
        assert t.read_file(path) == b"x" * 1000

    @pytest.mark.parametrize("nbytes", [1000, 6 * MiB], ids=["small", "multipart"])
    def test_open_atomic_failure_leaves_nothing(
        self,
        transport_root: tuple[FsspecTransport, str],
        nbytes: int,
        request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A body that raises mid-write leaves no file (and on S3 no completed object nor pending upload).

        6 MiB > part_size (5 MiB), so on S3 a multipart upload with one uploaded part is in progress when the
        body raises. The transport must abort it, and the file object must not try to commit it later
        when it is garbage collected (that would surface as an "Exception ignored in __del__").
        """
        t, root = transport_root
        t.makedirs(root)
        path = t.join(root, "doomed.bin")
        unraisable: list[Any] = []
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        try:
            with t.open_atomic(path) as f:
                f.write(random_bytes(nbytes))
                raise RuntimeError("body failed")
        except RuntimeError as exc:
            assert str(exc) == "body failed"
        del f  # with the traceback gone too, the file object is collected here, not in a later test
        gc.collect()
        assert not t.exists(path)
        assert t.listdir(root) == [], "a failed atomic write left something behind"
        assert not unraisable, [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable]
        if t.protocol == "s3":
            client = request.getfixturevalue("moto_server").client()
            uploads = client.list_multipart_uploads(Bucket=_bucket_of(root)).get("Uploads", [])
            assert uploads == [], f"multipart upload left pending: {uploads}"

    def test_open_atomic_failure_keeps_previous_version(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "state.bin")
        t.write_file(path, b"old contents")
        with pytest.raises(KeyError):
            with t.open_atomic(path) as f:
                f.write(b"new contents that never land")
                raise KeyError("stop")
        assert t.read_file(path) == b"old contents"

    # ------------------------------------------------------------------------------------ ranged reads

    def test_read_ranges_random(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        data = random_bytes(300_000, seed=1)
        paths = [t.join(root, f"shard{i}.bin") for i in range(2)]
        for p in paths:
            t.write_file(p, data)
        rng = random.Random(1234)
        reqs = []
        for _ in range(300):
            start = rng.randrange(0, len(data))
            length = rng.choice([0, 1, rng.randrange(1, 64), rng.randrange(1, 5000), rng.randrange(1, 40_000)])
            reqs.append(RangeRequest(rng.choice(paths), start, min(len(data), start + length)))
        # small max_request_bytes forces splitting of the larger ranges into concurrent parts
        tr = with_config(t, max_request_bytes=16 * 1024, coalesce_gap=2048)
        out = tr.read_ranges(reqs)
        assert len(out) == len(reqs)
        for req, buf in zip(reqs, out):
            assert buf is not None
            assert bytes(buf) == data[req.start : req.end], req

    def test_read_range_whole_file_and_convenience(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "f.bin")
        data = random_bytes(5000, seed=2)
        t.write_file(path, data)
        assert bytes(t.read_range(path, 0, 5000)) == data
        assert bytes(t.read_range(path, 4999, 5000)) == data[-1:]
        assert bytes(t.read_range(path, 5000, 5000)) == b""

    def test_read_ranges_into_buffers(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "f.bin")
        data = random_bytes(100_000, seed=3)
        t.write_file(path, data)
        rng = random.Random(7)
        spans = [(s, s + rng.randrange(1, 9000)) for s in (rng.randrange(0, 90_000) for _ in range(40))]
        buffers = [bytearray(e - s) for s, e in spans]
        reqs = [RangeRequest(path, s, e, into=memoryview(b)) for (s, e), b in zip(spans, buffers)]
        out = with_config(t, max_request_bytes=4096).read_ranges(reqs)
        for (s, e), buf, view in zip(spans, buffers, out):
            assert bytes(buf) == data[s:e], "into= buffer not filled in place"
            assert view is not None and view.obj is buf, "the result should be the caller's own buffer"

    def test_read_ranges_into_typed_buffer(self, transport_root: tuple[FsspecTransport, str]) -> None:
        import array

        t, root = transport_root
        path = t.join(root, "ints.bin")
        values = array.array("i", range(1000))
        t.write_file(path, values.tobytes())
        dest = array.array("i", [0] * 250)
        t.read_ranges([RangeRequest(path, 100 * 4, 350 * 4, into=memoryview(dest))])
        assert list(dest) == list(range(100, 350))

    def test_on_complete_called_once_per_request(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "f.bin")
        data = random_bytes(200_000, seed=4)
        t.write_file(path, data)
        lock = threading.Lock()
        calls: dict[int, list[bytes]] = {}
        threads: set[str] = set()

        def callback(i: int):
            def done(view: memoryview) -> None:
                with lock:
                    calls.setdefault(i, []).append(bytes(view))
                    threads.add(threading.current_thread().name)

            return done

        spans = [(0, 0), (10, 20), (15, 25), (0, 200_000), (1000, 1000), (50_000, 90_000), (199_999, 200_000)]
        reqs = []
        for i, (s, e) in enumerate(spans):
            into = memoryview(bytearray(e - s)) if i % 2 else None
            reqs.append(RangeRequest(path, s, e, into=into, on_complete=callback(i)))
        plain = RangeRequest(path, 5, 9)
        out = with_config(t, max_request_bytes=16 * 1024).read_ranges([*reqs, plain])
        assert out[:-1] == [None] * len(reqs), "buffers handed to on_complete are not kept"
        assert bytes(out[-1]) == data[5:9]
        assert sorted(calls) == list(range(len(spans)))
        for i, (s, e) in enumerate(spans):
            assert calls[i] == [data[s:e]], f"request {i} callback calls: {len(calls[i])}"

    def test_coalescing_reduces_requests(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "f.bin")
        data = random_bytes(50_000, seed=5)
        t.write_file(path, data)

        adjacent = [RangeRequest(path, i * 100, i * 100 + 100) for i in range(100)]
        tr = with_config(t, coalesce_gap=0)
        out = tr.read_ranges(adjacent)
        assert b"".join(bytes(b) for b in out) == data[:10_000]
        assert tr.counters.requests <= 2, tr.counters
        assert tr.counters.bytes_read == 10_000

        # 100-byte ranges every 200 bytes: without coalescing one request each, with it one request that
        # also reads (and drops) the 99 gaps
        strided = [RangeRequest(path, i * 200, i * 200 + 100) for i in range(100)]
        apart = with_config(t, coalesce_gap=0)
        apart.read_ranges(strided)
        assert apart.counters.requests == 100
        assert apart.counters.bytes_read == 100 * 100
        merged = with_config(t, coalesce_gap=100)
        out = merged.read_ranges(strided)
        assert all(bytes(b) == data[r.start : r.end] for r, b in zip(strided, out))
        assert merged.counters.requests <= 2
        assert merged.counters.bytes_read == 100 * 100 + 99 * 100

    def test_split_large_request_counts_parts(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "f.bin")
        data = random_bytes(100_000, seed=6)
        t.write_file(path, data)
        tr = with_config(t, max_request_bytes=10_000)
        (buf,) = tr.read_ranges([RangeRequest(path, 0, 100_000)])
        assert bytes(buf) == data
        assert tr.counters.requests == 10
        assert tr.counters.bytes_read == 100_000

    def test_read_past_eof_raises_corrupt(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "short.bin")
        t.write_file(path, b"a" * 1000)
        url = t.url(path)
        for start, end in [(500, 1500), (2000, 3000)]:
            started = time.monotonic()
            with pytest.raises(CorruptCheckpointError) as info:
                t.read_ranges([RangeRequest(path, 0, 10), RangeRequest(path, start, end)])
            assert url in str(info.value)
            assert time.monotonic() - started < 5
        # a truncated file is not a transient fault: no retries
        assert t.counters.retries == 0

    def test_missing_file_raises_not_found(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        t.write_file(t.join(root, "present.bin"), b"x" * 100)
        missing = t.join(root, "absent.bin")
        for call in (
            lambda: t.read_ranges([RangeRequest(t.join(root, "present.bin"), 0, 10), RangeRequest(missing, 0, 10)]),
            lambda: t.read_file(missing),
            lambda: t.size(missing),
        ):
            with pytest.raises(CheckpointNotFoundError) as info:
                call()
            assert isinstance(info.value, FileNotFoundError)
            assert "absent.bin" in str(info.value)
        assert t.counters.retries == 0

    def test_inflight_budget_respected(self, transport_root: tuple[FsspecTransport, str]) -> None:
        """The budget is held until a group's callbacks return, so concurrent callbacks measure it."""
        t, root = transport_root
        path = t.join(root, "f.bin")
        data = random_bytes(100_000, seed=8)
        t.write_file(path, data)
        budget = 2500
        tr = with_config(t, max_workers=8, coalesce_gap=0, max_inflight_bytes=budget)
        lock = threading.Lock()
        active = 0
        peak = 0
        got: dict[int, bytes] = {}

        def callback(i: int):
            def done(view: memoryview) -> None:
                nonlocal active, peak
                with lock:
                    active += view.nbytes
                    peak = max(peak, active)
                    got[i] = bytes(view)
                time.sleep(0.02)  # hold the budget long enough for other groups to run meanwhile
                with lock:
                    active -= view.nbytes

            return done

        reqs = [RangeRequest(path, i * 2000, i * 2000 + 1000, on_complete=callback(i)) for i in range(24)]
        tr.read_ranges(reqs)
        assert got == {i: data[i * 2000 : i * 2000 + 1000] for i in range(24)}
        assert peak <= budget, f"{peak} bytes in flight with a budget of {budget}"
        assert peak >= 2000, "reads never overlapped: the test does not measure the budget"

    def test_request_larger_than_budget_still_completes(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "f.bin")
        data = random_bytes(50_000, seed=9)
        t.write_file(path, data)
        tr = with_config(t, max_inflight_bytes=1, coalesce_gap=0, max_request_bytes=8000)
        reqs = [RangeRequest(path, s, s + 3000) for s in range(0, 45_000, 4000)] + [RangeRequest(path, 0, 50_000)]
        out = tr.read_ranges(reqs)
        assert all(bytes(b) == data[r.start : r.end] for r, b in zip(reqs, out))

    def test_failure_in_one_group_does_not_hang(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "f.bin")
        t.write_file(path, random_bytes(20_000))
        reqs = [RangeRequest(path, i * 1000, i * 1000 + 500) for i in range(20)]
        reqs.insert(7, RangeRequest(t.join(root, "gone.bin"), 0, 10))
        tr = with_config(t, coalesce_gap=0, max_inflight_bytes=1000, max_workers=2)
        with pytest.raises(CheckpointNotFoundError, match="gone.bin"):
            tr.read_ranges(reqs)
        # the transport stays usable
        assert bytes(tr.read_range(path, 0, 4)) == t.read_file(path)[:4]

    # ------------------------------------------------------------------------------------ namespace

    def test_exists_size_listdir_remove(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        assert t.listdir(root) == []
        assert t.listdir(t.join(root, "nope")) == []
        a, b, c = t.join(root, "a.bin"), t.join(root, "b.bin"), t.join(root, "dir", "c.bin")
        assert not t.exists(a)
        t.write_file(a, b"aaa")
        t.write_file(b, b"bbbbb")
        t.write_file(c, b"c")
        assert t.exists(a) and t.exists(b) and t.exists(c)
        assert (t.size(a), t.size(b), t.size(c)) == (3, 5, 1)
        assert t.listdir(root) == ["a.bin", "b.bin", "dir"]
        assert t.listdir(t.join(root, "dir")) == ["c.bin"]
        t.remove(a)
        assert not t.exists(a)
        assert t.listdir(root) == ["b.bin", "dir"]
        t.remove(a)  # removing a missing file is not an error
        t.remove(t.join(root, "never-existed"))
        with pytest.raises(CheckpointNotFoundError, match="a.bin"):
            t.size(a)

    def test_join_and_url(self, transport_root: tuple[FsspecTransport, str]) -> None:
        t, root = transport_root
        path = t.join(root, "x", "y.bin")
        assert path.endswith("y.bin") and path.startswith(root)
        url = t.url(path)
        if t.is_local:
            assert url == path
        else:
            assert url.startswith(f"{t.protocol}://") and url.endswith("x/y.bin")


class TestFsspecTransport(TransportConformance):
    """The conformance suite on local, file://, memory:// and s3:// (via ``transport_root``)."""


# ---------------------------------------------------------------------------------------- local only


@pytest.fixture
def local(tmp_path: Path) -> Iterator[tuple[FsspecTransport, str]]:
    t, root = FsspecTransport.from_url(str(tmp_path), config=BASE_CONFIG)
    with t:
        yield t, root


def test_local_atomic_write_uses_temp_file_and_rename(local: tuple[FsspecTransport, str]) -> None:
    t, root = local
    path = os.path.join(root, "data.bin")
    with t.open_atomic(path) as f:
        f.write(b"hello")
        f.flush()
        during = os.listdir(root)
        assert len(during) == 1 and "data.bin" not in during
        (tmp,) = during
        assert tmp.startswith(".data.bin.") and tmp.endswith(".tmp"), tmp
        inode = os.stat(os.path.join(root, tmp)).st_ino  # its bytes are staged until the commit
    assert os.listdir(root) == ["data.bin"]
    assert os.stat(path).st_ino == inode, "the temp file should have been renamed into place"
    assert open(path, "rb").read() == b"hello"


def test_local_atomic_write_failure_removes_temp(local: tuple[FsspecTransport, str]) -> None:
    t, root = local
    path = os.path.join(root, "data.bin")
    with pytest.raises(OSError, match="disk on fire"):
        with t.open_atomic(path) as f:
            f.write(b"x" * 100_000)
            assert len(os.listdir(root)) == 1
            raise OSError("disk on fire")
    assert os.listdir(root) == []


def test_local_truncated_file_error_names_file_and_sizes(local: tuple[FsspecTransport, str]) -> None:
    t, root = local
    path = os.path.join(root, "short.bin")
    Path(path).write_bytes(b"z" * 100)
    with pytest.raises(CorruptCheckpointError) as info:
        t.read_ranges([RangeRequest(path, 50, 150)])
    msg = str(info.value)
    assert path in msg and "100" in msg and "150" in msg


def test_local_whole_read_with_a_limit_allocates_the_file_not_the_limit(local: tuple[FsspecTransport, str]) -> None:
    """A small ``.metadata`` read under the 1 GiB limit must not reserve 1 GiB (``read(n)`` allocates ``n``
    up front: under strict overcommit or an address-space limit every load failed with MemoryError)."""
    t, root = local
    path = os.path.join(root, ".metadata")
    Path(path).write_bytes(b"m" * 1000)
    tracemalloc.start()
    try:
        data = t.read_file(path, max_bytes=1 << 30)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data == b"m" * 1000
    assert peak < 1 << 20, f"reading a 1000-byte file under a 1 GiB limit peaked at {peak} traced bytes"


def test_local_reads_use_few_syscalls(local: tuple[FsspecTransport, str]) -> None:
    """1000 adjacent ranges become one vectored read (preadv), not 1000 reads."""
    t, root = local
    path = os.path.join(root, "f.bin")
    data = random_bytes(64_000)
    Path(path).write_bytes(data)
    reqs = [RangeRequest(path, i * 64, i * 64 + 64) for i in range(1000)]
    tr = with_config(t, coalesce_gap=0)
    out = tr.read_ranges(reqs)
    assert b"".join(bytes(b) for b in out) == data
    assert tr.counters.requests == 1


def test_transport_config_validation() -> None:
    for kwargs in (
        {"max_workers": 0},
        {"max_inflight_bytes": 0},
        {"max_request_bytes": 0},
        {"coalesce_gap": -1},
        {"part_size": 5 * MiB - 1},
        {"part_size": 5 * 1024 * MiB + 1},  # past S3's largest part
    ):
        with pytest.raises(ValueError):
            TransportConfig(**kwargs)


# ---------------------------------------------------------------------------------------- HTTP retries


class _BlobServer(ThreadingHTTPServer):
    """Serves ``/blob`` with Range support; misbehaves for the first ``fail_first`` GETs.

    ``mode``: ``"503"`` answers 503 Service Unavailable; ``"truncate"`` promises the full Content-Length
    but sends half of the body and closes the connection.
    """

    daemon_threads = True

    def __init__(self, blob: bytes, mode: str = "503", fail_first: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), _BlobHandler)
        self.blob = blob
        self.mode = mode
        self.fail_first = fail_first
        self.lock = threading.Lock()
        self.gets = 0
        self.failed = 0
        self.ranges: list[str | None] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/blob"


class _BlobHandler(BaseHTTPRequestHandler):
    server: _BlobServer
    protocol_version = "HTTP/1.0"  # one request per connection: a truncated body ends with the connection

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _slice(self) -> tuple[int, int, bool]:
        header = self.headers.get("Range")
        size = len(self.server.blob)
        if not header:
            return 0, size, False
        spec = header.removeprefix("bytes=")
        first, _, last = spec.partition("-")
        start = int(first)
        end = min(size, int(last) + 1) if last else size
        return start, end, True

    def do_HEAD(self) -> None:
        if self.path != "/blob":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.server.blob)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        srv = self.server
        if self.path != "/blob":
            self.send_error(404)
            return
        with srv.lock:
            srv.gets += 1
            srv.ranges.append(self.headers.get("Range"))
            fail = srv.gets <= srv.fail_first
            if fail:
                srv.failed += 1
        start, end, ranged = self._slice()
        if fail and srv.mode == "503":
            body = b"Service Unavailable"
            self.send_response(503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(body)
            return
        if start >= len(srv.blob):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(srv.blob)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = srv.blob[start:end]
        self.send_response(206 if ranged else 200)
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(srv.blob)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if fail and srv.mode == "truncate":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)


@contextlib.contextmanager
def blob_server(blob: bytes, mode: str = "503", fail_first: int = 0) -> Iterator[_BlobServer]:
    with serving(_BlobServer(blob, mode, fail_first)) as server:
        yield server


S = TypeVar("S", bound=ThreadingHTTPServer)


@contextlib.contextmanager
def serving(server: S) -> Iterator[S]:
    """Run ``server`` on a thread for the block."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _http_transport(url: str, **config: Any) -> tuple[FsspecTransport, str]:
    pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp")
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.05, max_attempts=5, deadline=20.0)
    # skip_instance_cache: a fresh HTTPFileSystem (and aiohttp session) per test, no cross-test state
    return FsspecTransport.from_url(
        url, {"skip_instance_cache": True}, config=TransportConfig(retry=retry, coalesce_gap=0, **config)
    )


@pytest.mark.parametrize("mode", ["503", "truncate"])
def test_http_transient_failures_are_retried(mode: str) -> None:
    blob = random_bytes(200_000, seed=11)
    k = 3
    with blob_server(blob, mode=mode, fail_first=k) as server:
        t, path = _http_transport(server.url)
        with t:
            assert path == server.url
            rng = random.Random(5)
            spans = [(s, s + rng.randrange(1, 20_000)) for s in sorted(rng.sample(range(0, 180_000, 20_000), 6))]
            reqs = [RangeRequest(path, s, e) for s, e in spans]
            out = t.read_ranges(reqs)
            for (s, e), buf in zip(spans, out):
                assert bytes(buf) == blob[s:e]
        assert server.failed == k
        assert t.counters.retries >= k
        assert all(r is not None and r.startswith("bytes=") for r in server.ranges), server.ranges


def test_http_truncated_body_single_range_retried_into_caller_buffer() -> None:
    blob = random_bytes(1_000_000, seed=12)
    with blob_server(blob, mode="truncate", fail_first=2) as server:
        t, path = _http_transport(server.url)
        with t:
            dest = bytearray(600_000)
            t.read_ranges([RangeRequest(path, 300_000, 900_000, into=memoryview(dest))])
        assert dest == blob[300_000:900_000]
        assert t.counters.retries == 2
        assert server.gets == 3


def test_http_permanent_failure_raises_transport_error() -> None:
    blob = random_bytes(10_000, seed=13)
    with blob_server(blob, mode="503", fail_first=10**9) as server:
        t, path = _http_transport(server.url)
        started = time.monotonic()
        with t, pytest.raises(TransportError) as info:
            t.read_ranges([RangeRequest(path, 100, 4196)])
        elapsed = time.monotonic() - started
        msg = str(info.value)
        assert server.url in msg
        assert "[100, 4196)" in msg
        assert "5 attempt(s)" in msg
        assert "503" in msg
        assert server.gets == 5
        assert t.counters.retries == 4
        assert elapsed < 5, f"gave up after {elapsed:.1f}s"


def test_http_missing_object_is_not_retried() -> None:
    with blob_server(b"abc") as server:
        t, _ = _http_transport(server.url)
        missing = server.url.replace("/blob", "/nothing")
        with t, pytest.raises(CheckpointNotFoundError, match="nothing"):
            t.read_ranges([RangeRequest(missing, 0, 2)])
        assert t.counters.retries == 0


def test_http_range_past_end_is_corrupt_not_retried() -> None:
    """A short body from an object that really is short (206 with fewer bytes, or 416) is a truncated file."""
    blob = random_bytes(1000, seed=14)
    with blob_server(blob) as server:
        t, path = _http_transport(server.url)
        with t:
            for start, end in [(500, 1500), (2000, 3000)]:
                with pytest.raises(CorruptCheckpointError, match="ends at byte 1000") as info:
                    t.read_ranges([RangeRequest(path, start, end)])
                assert server.url in str(info.value)
        assert t.counters.retries == 0


# ------------------------------------------------------------------ HTTP whole-file reads with a limit
# ``read_file(path, max_bytes=...)`` holds at most ``max_bytes + 1`` bytes of a hostile ``.metadata`` or index
# file: a server that gives no size, or ignores ``Range`` and sends 200 with a huge body, included.

HUGE = 32 * 1024 * 1024  # what the server streams, whatever was asked
LIMIT = 1_000


class _HugeServer(ThreadingHTTPServer):
    """Serves ``/blob``: ``HEAD`` claims ``head_size`` (or no size), ``GET`` ignores ``Range`` and sends 200."""

    daemon_threads = True

    def __init__(self, head_size: int | None, with_length: bool) -> None:
        super().__init__(("127.0.0.1", 0), _HugeHandler)
        self.head_size = head_size
        self.with_length = with_length

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/blob"


class _HugeHandler(BaseHTTPRequestHandler):
    server: _HugeServer
    protocol_version = "HTTP/1.0"  # without Content-Length the body ends with the connection

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        if self.server.head_size is not None:
            self.send_header("Content-Length", str(self.server.head_size))
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)  # Range ignored
        if self.server.with_length:
            self.send_header("Content-Length", str(HUGE))
        self.end_headers()
        piece = bytes(1024 * 1024)
        with contextlib.suppress(OSError):  # the client may stop reading and close
            for _ in range(HUGE // len(piece)):
                self.wfile.write(piece)


@pytest.mark.parametrize(
    ("head_size", "with_length"),
    [(None, False), (None, True), (100, False), (100, True)],
    ids=["no-size-chunked", "no-size-then-huge-length", "small-head-chunked", "small-head-huge-length"],
)
def test_http_whole_read_with_a_limit_holds_no_more_than_the_limit(head_size: int | None, with_length: bool) -> None:
    with serving(_HugeServer(head_size, with_length)) as server:
        t, path = _http_transport(server.url)
        with t, pytest.raises(FileTooLargeError, match="blob"):
            t.read_file(path, max_bytes=LIMIT)
        assert t.counters.bytes_read <= LIMIT + 1
