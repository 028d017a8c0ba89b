"""The storage conformance mixin: what every backend must do, written once.

:class:`StorageConformance` holds the tests; ``test_conformance.py`` collects them through one subclass,
and the ``location`` fixture (``conftest.py``) runs each on every backend: a local directory, ``file://``,
``memory://``, ``s3://`` (moto), ``gs://`` (fake-gcs-server) and ``az://`` (azurite). Everything goes
through the public API (``FsspecWriter``/``FsspecReader``, ``SafetensorsWriter``/``open_reader``,
``FsspecTransport``); the backend's own fsspec filesystem is used only to look at what landed in storage.

Modelled on fsspec's ``fsspec/tests/abstract`` mixins: a new backend adds a fixture, not tests.
"""

from __future__ import annotations

import gc
import os
import random
import sys
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage import FsspecReader, FsspecWriter, SafetensorsWriter, open_reader
from dcp_storage.errors import CheckpointExistsError, CheckpointNotFoundError, DcpStorageError, FileTooLargeError
from dcp_storage.testing.compare import raw_bytes as _raw
from dcp_storage.testing.distributed import run_ranks
from dcp_storage.transports import FsspecTransport, RangeRequest, RetryPolicy, TransportConfig

from . import _rank_fns as R

MiB = 1024 * 1024
TEST_CONFIG = TransportConfig(
    max_workers=8,
    coalesce_gap=0,
    max_request_bytes=8 * MiB,
    part_size=5 * MiB,  # the smallest allowed, so multi-part uploads are cheap to provoke
    retry=RetryPolicy(max_attempts=3, initial_backoff=0.005, max_backoff=0.02, deadline=10.0),
)
RANKS_TIMEOUT_S = 120.0


# ------------------------------------------------------------------------------------------ helpers
def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, denormals, -0.0) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (*shape, itemsize), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def dcp_state_dict() -> dict[str, Any]:
    """Tensors of several dtypes and layouts, one above the reader's small-item size, and BYTE_IO values."""
    g = torch.Generator().manual_seed(7)
    return {
        "fp32": random_bits((33, 17), torch.float32, 1),
        "bf16": random_bits((40, 8), torch.bfloat16, 2),
        "fp16": random_bits((5, 7, 3), torch.float16, 3),
        "fp8": random_bits((16, 12), torch.float8_e4m3fn, 4),
        "int64": torch.randint(-(2**62), 2**62, (100,), generator=g, dtype=torch.int64),
        "bool": torch.rand(7, 9, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(24, 10, generator=g).t(),
        "big": random_bits((300, 400), torch.float32, 5),  # ranged read: header probe + data range
        "nested": {"w": torch.randn(6, 6, generator=g), "meta": {"epoch": 3}},
        "step": 7,  # BYTE_IO from here on
        "names": ["a", "b", 3, (4.5, None)],
        "note": "hello",
    }


def safetensors_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    sd: dict[str, torch.Tensor] = {"embed.weight": random_bits((64, 32), torch.float32, 20)}
    for layer in range(2):
        sd[f"layers.{layer}.attn.weight"] = torch.randn(32, 32, generator=g)
        sd[f"layers.{layer}.norm.weight"] = random_bits((32,), torch.bfloat16, 21 + layer)
        sd[f"layers.{layer}.mlp.weight"] = torch.randn(48, 32, generator=g).to(torch.float16)
    return sd


def destination_like(sd: Any) -> Any:
    """Same shapes and dtypes, filled with a sentinel byte, for ``dcp.load`` to overwrite."""
    if isinstance(sd, dict):
        return {k: destination_like(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        out = torch.empty(sd.shape, dtype=sd.dtype)
        torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage()).fill_(0xA5)
        return out
    return None  # BYTE_IO: replaced by the load


def assert_state_equal(actual: Any, expected: Any, key: str = "") -> None:
    """Bit-exact comparison of nested state dicts (tensors by raw bytes, dtype and shape)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{key}: keys differ"
        for k, v in expected.items():
            assert_state_equal(actual[k], v, f"{key}.{k}" if key else k)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{key}: got {type(actual).__name__}"
        assert (actual.dtype, tuple(actual.shape)) == (expected.dtype, tuple(expected.shape)), key
        assert torch.equal(_raw(actual), _raw(expected)), f"{key}: bytes differ"
    else:
        assert actual == expected, key


def tensor_bytes(sd: Any) -> int:
    if isinstance(sd, dict):
        return sum(tensor_bytes(v) for v in sd.values())
    return sd.numel() * sd.element_size() if isinstance(sd, torch.Tensor) else 0


def unwrap(exc: BaseException) -> BaseException:
    """The reader's/writer's own exception inside DCP's ``CheckpointException``."""
    if isinstance(exc, CheckpointException):
        (inner, _trace), *_ = exc.failures.values()
        return inner
    return exc


def child(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def shown_url(location: Any, name: str) -> str:
    """How errors must name ``name`` in the location: the local path, or the URL with the scheme the user wrote."""
    url, options, backend = location
    if backend in ("local", "file"):
        return child(fsspec.core.url_to_fs(url, **options)[1], name)
    return child(url, name)


def stored(location: Any) -> dict[str, int]:
    """``{name: size}`` of every object directly under the location, seen through the backend's own fs."""
    url, options, _backend = location
    fs, root = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries if e["type"] == "file"}


def random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# ------------------------------------------------------------------------------------------ the mixin
class StorageConformance:
    """Behaviour every backend shares. Not collected itself (no ``Test`` prefix); subclass it."""

    @pytest.fixture
    def transport(self, location: Any) -> Any:
        url, options, _backend = location
        t, root = FsspecTransport.from_url(url, options, config=TEST_CONFIG)
        with t:
            yield t, root

    # ---------------------------------------------------------------------------- checkpoint level
    def test_dcp_roundtrip_bit_exact(self, location: Any) -> None:
        url, options, _ = location
        sd = dcp_state_dict()
        writer = FsspecWriter(url, options)
        dcp.save(sd, storage_writer=writer)

        files = stored(location)
        assert ".metadata" in files and any(n.endswith(".distcp") for n in files), files
        assert not [n for n in files if n.endswith(".tmp")], f"temp files left behind: {files}"
        assert writer.counters["bytes_written"] == sum(files.values()), (writer.counters, files)
        assert writer.counters["requests"] >= 2 and writer.counters["retries"] == 0

        dest = destination_like(sd)
        reader = FsspecReader(url, options)
        dcp.load(dest, storage_reader=reader)
        assert_state_equal(dest, sd)
        counters = reader.counters
        assert counters["retries"] == 0 and counters["requests"] >= 2
        # Every tensor byte, and not much more than the files hold (record headers are probed, then read).
        assert tensor_bytes(sd) <= counters["bytes_read"] <= 1.05 * sum(files.values()), (counters, files)

    def test_overwrite_false_refuses(self, location: Any) -> None:
        url, options, _ = location
        first = {"w": torch.arange(10, dtype=torch.float32)}
        dcp.save(first, storage_writer=FsspecWriter(url, options))
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.zeros(10)}, storage_writer=FsspecWriter(url, options))
        err = unwrap(info.value)
        assert isinstance(err, CheckpointExistsError) and isinstance(err, DcpStorageError), repr(err)
        assert shown_url(location, ".metadata") in str(err), str(err)
        dest = {"w": torch.empty(10)}
        dcp.load(dest, storage_reader=FsspecReader(url, options))  # the refused save changed nothing
        assert_state_equal(dest, first)

        second = {"w": torch.arange(10, 20, dtype=torch.float32)}
        dcp.save(second, storage_writer=FsspecWriter(url, options, overwrite=True))
        dcp.load(dest, storage_reader=FsspecReader(url, options))
        assert_state_equal(dest, second)

    def test_torch_writer_output_read_by_ours(self, location: Any) -> None:
        """torch's own writer for the backend (FileSystemWriter locally, its FsspecWriter elsewhere)."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as TorchFsspecReader
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as TorchFsspecWriter

        url, options, backend = location
        sd = dcp_state_dict()
        theirs, ours = child(url, "theirs"), child(url, "ours")
        if backend == "local":
            torch_writer: Any = dcp.FileSystemWriter(theirs, thread_count=2)
        else:
            torch_writer = TorchFsspecWriter(theirs, thread_count=2, sync_files=False, **options)
        dcp.save(sd, storage_writer=torch_writer)
        dest = destination_like(sd)
        dcp.load(dest, storage_reader=FsspecReader(theirs, options))
        assert_state_equal(dest, sd)

        dcp.save(sd, storage_writer=FsspecWriter(ours, options))
        torch_reader = dcp.FileSystemReader(ours) if backend == "local" else TorchFsspecReader(ours, **options)
        dest = destination_like(sd)
        dcp.load(dest, storage_reader=torch_reader)
        assert_state_equal(dest, sd)

    def test_safetensors_roundtrip(self, location: Any) -> None:
        url, options, _ = location
        sd = safetensors_state_dict()
        writer = SafetensorsWriter(url, options, max_shard_size=12_000)  # several shards and an index
        dcp.save(sd, storage_writer=writer)
        files = stored(location)
        shards = sorted(n for n in files if n.endswith(".safetensors"))
        assert len(shards) > 1 and "model.safetensors.index.json" in files, files
        assert set(files) == {*shards, "model.safetensors.index.json"}, f"unexpected files: {files}"
        assert writer.counters["bytes_written"] == sum(files.values())

        reader = open_reader(url, storage_options=options)
        dest = destination_like(sd)
        dcp.load(dest, storage_reader=reader)
        assert_state_equal(dest, sd)
        with pytest.raises(CheckpointException) as info:  # overwrite=False is the default here too
            dcp.save(sd, storage_writer=SafetensorsWriter(url, options, max_shard_size=12_000))
        assert isinstance(unwrap(info.value), CheckpointExistsError)

    def test_missing_checkpoint_names_the_url(self, location: Any) -> None:
        url, options, _ = location
        with pytest.raises(CheckpointNotFoundError) as info:
            FsspecReader(url, options).read_metadata()
        assert isinstance(info.value, FileNotFoundError)
        assert shown_url(location, ".metadata") in str(info.value), str(info.value)

    def test_fsdp2_save_2_ranks_load_3_ranks(self, shared_location: Any) -> None:
        url, options, _ = shared_location
        saved = run_ranks(R.save_fsdp2, 2, url, options, timeout=RANKS_TIMEOUT_S)
        assert all(c["bytes_written"] > 0 and c["retries"] == 0 for c in saved), saved
        reports = run_ranks(R.load_resharded, 3, url, options, timeout=RANKS_TIMEOUT_S)
        for rank, rep in enumerate(reports):
            assert rep["mismatched"] == [], f"rank {rank}/3: tensors differ: {rep['mismatched']}"
            assert rep["step"] == 17 and rep["keys"] > 0
            assert rep["bytes_read"] > 0 and rep["retries"] == 0

    # ---------------------------------------------------------------------------- transport level
    def test_write_file_exists_size_listdir_remove(self, transport: Any) -> None:
        t, root = transport
        assert t.listdir(root) == [] and t.listdir(t.join(root, "nope")) == []
        a, b, c = t.join(root, "a.bin"), t.join(root, "b.bin"), t.join(root, "dir", "c.bin")
        assert not t.exists(a)
        data = random_bytes(10_000)
        t.write_file(a, data)
        t.write_file(b, bytearray(b"bbbbb"))
        t.write_file(c, memoryview(b"c"))
        assert t.counters.bytes_written == 10_006
        assert t.exists(a) and t.exists(b) and t.exists(c)
        assert (t.size(a), t.size(b), t.size(c)) == (10_000, 5, 1)
        assert t.read_file(a) == data and t.counters.bytes_read == 10_000
        assert t.listdir(root) == ["a.bin", "b.bin", "dir"]
        assert t.listdir(t.join(root, "dir")) == ["c.bin"]
        t.write_file(a, b"")  # overwrite, with nothing
        assert t.read_file(a) == b"" and t.size(a) == 0
        t.remove(a)
        assert not t.exists(a) and t.listdir(root) == ["b.bin", "dir"]
        t.remove(a)  # a missing file is not an error
        url = t.url(a)
        assert url.startswith(root) if t.is_local else url.endswith(a.split("/", 1)[1])
        assert t.counters.retries == 0

    def test_read_file_with_a_limit_refuses_a_larger_file(self, transport: Any) -> None:
        t, root = transport
        path = t.join(root, "limited.bin")
        data = random_bytes(10_000, seed=3)
        t.write_file(path, data)
        assert t.read_file(path, max_bytes=10_000) == data
        before = t.counters.bytes_read
        with pytest.raises(FileTooLargeError, match="limited.bin") as err:
            t.read_file(path, max_bytes=9_999)
        assert err.value.limit == 9_999 and err.value.size in (10_000, None)
        assert t.counters.bytes_read - before <= 10_000  # at most limit + 1 bytes read

    def test_read_ranges_with_coalescing(self, transport: Any) -> None:
        t, root = transport
        path = t.join(root, "f.bin")
        data = random_bytes(50_000, seed=5)
        t.write_file(path, data)
        strided = [RangeRequest(path, i * 200, i * 200 + 100) for i in range(40)]
        apart = FsspecTransport(t.fs, TEST_CONFIG)  # coalesce_gap=0: one request per range
        out = apart.read_ranges(strided)
        assert [bytes(b) for b in out] == [data[r.start : r.end] for r in strided]
        assert apart.counters.snapshot()["requests"] == 40 and apart.counters.bytes_read == 40 * 100

        merged = FsspecTransport(t.fs, TransportConfig(coalesce_gap=100, part_size=5 * MiB))
        buffers = [bytearray(100) for _ in strided]
        into = [RangeRequest(r.path, r.start, r.end, into=memoryview(b)) for r, b in zip(strided, buffers)]
        out = merged.read_ranges(into)
        assert [bytes(b) for b in buffers] == [data[r.start : r.end] for r in strided]
        assert all(view is not None and view.obj is buf for view, buf in zip(out, buffers))
        assert merged.counters.requests == 1, merged.counters  # one GET, gaps read and dropped
        assert merged.counters.bytes_read == 40 * 100 + 39 * 100

        split = FsspecTransport(t.fs, TransportConfig(max_request_bytes=10_000, part_size=5 * MiB))
        (whole,) = split.read_ranges([RangeRequest(path, 0, 50_000)])
        assert bytes(whole) == data and split.counters.requests == 5

    @pytest.mark.parametrize("nbytes", [1000, 6 * MiB], ids=["small", "multipart"])
    def test_open_atomic_commits_only_on_success(self, transport: Any, nbytes: int) -> None:
        t, root = transport
        path = t.join(root, "sub", "data.bin")
        data = random_bytes(nbytes, seed=nbytes)
        with t.open_atomic(path) as f:
            view = memoryview(data)
            for pos in range(0, nbytes, 2 * MiB):
                f.write(view[pos : pos + 2 * MiB])
            assert f.tell() == nbytes
            assert not t.exists(path), "a partially written object is visible at its final path"
            assert t.listdir(t.join(root, "sub")) == []
        assert t.size(path) == nbytes
        assert bytes(t.read_range(path, 0, nbytes)) == data
        assert t.counters.bytes_written == nbytes

    @pytest.mark.parametrize("nbytes", [1000, 6 * MiB], ids=["small", "multipart"])
    def test_open_atomic_failure_leaves_nothing(
        self,
        transport: Any,
        nbytes: int,
        location: Any,
        request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """An exception inside leaves no new object, keeps an old one, and nothing commits later in ``__del__``.

        At 6 MiB (> the 5 MiB part size) an upload is in progress when the body raises: an S3 multipart
        upload with one part, a GCS resumable upload with one chunk, Azure staged blocks.
        """
        t, root = transport
        t.makedirs(root)
        fresh, kept = t.join(root, "doomed.bin"), t.join(root, "kept.bin")
        t.write_file(kept, b"old contents")
        unraisable: list[Any] = []
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        for path in (fresh, kept):
            with pytest.raises(RuntimeError, match="body failed"), t.open_atomic(path) as f:
                f.write(random_bytes(nbytes))
                raise RuntimeError("body failed")
        del f  # collected here, with the traceback gone, not in a later test
        gc.collect()
        assert not t.exists(fresh)
        assert t.listdir(root) == ["kept.bin"], "a failed atomic write left something behind"
        assert t.read_file(kept) == b"old contents"
        assert not unraisable, [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable]
        if location.backend == "s3":
            bucket = location.url.split("/")[2]
            uploads = request.getfixturevalue("moto_server").client().list_multipart_uploads(Bucket=bucket)
            assert uploads.get("Uploads", []) == [], "multipart upload left pending"

    def test_missing_file_raises_not_found_naming_url(self, transport: Any) -> None:
        t, root = transport
        present, missing = t.join(root, "present.bin"), t.join(root, "absent.bin")
        t.write_file(present, b"x" * 100)
        for call in (
            lambda: t.read_ranges([RangeRequest(present, 0, 10), RangeRequest(missing, 0, 10)]),
            lambda: t.read_file(missing),
            lambda: t.size(missing),
        ):
            with pytest.raises(CheckpointNotFoundError) as info:
                call()
            assert isinstance(info.value, FileNotFoundError)
            assert t.url(missing) in str(info.value), str(info.value)
        assert t.counters.retries == 0

    def test_url_keeps_the_scheme_given(self, location: Any) -> None:
        """Errors name objects by the URL the user wrote (``az://``, not the filesystem's ``abfs://``)."""
        url, options, _ = location
        t, root = FsspecTransport.from_url(url, options)
        with t:
            shown = t.url(t.join(root, "x.bin"))
        assert shown == (os.path.join(root, "x.bin") if t.is_local else child(url, "x.bin"))
