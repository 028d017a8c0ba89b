"""The storage conformance mixin: what every backend must do, written once.

:class:`StorageConformance` holds the tests; a suite collects them through one subclass and these fixtures:

* ``location`` (required, function scope): a fresh location that does not exist yet (its bucket does),
  cleaned up after the test: a plain ``(url, storage_options)`` pair, or a :class:`~.helpers.Location`
  ``(url, storage_options, backend)`` whose ``backend`` (default: the URL's scheme, ``"local"`` for a path)
  adapts a few checks (``"local"``: torch's ``FileSystemWriter``; ``"s3"``: no multipart upload left
  pending, which needs a ``moto_server`` fixture);
* ``shared_location`` (only for ``test_fsdp2_save_2_ranks_load_3_ranks``): the same, but reachable by
  every process on the host (not ``memory://``); a suite without it sees that one test error out, so define
  it as ``location`` when that holds, or override the test with a skip;
* ``transport`` (provided): the location's transport from the factory, with :data:`TEST_CONFIG`.

A URL scheme fsspec does not know (a plugin transport's own, ``kvflat://``) works: what landed in storage is
then seen through the transport, and the test that needs torch's fsspec writer skips. The core's
``tests/conformance`` runs each on a local directory, ``file://``, ``memory://``, ``s3://`` (moto),
``gs://`` (fake-gcs-server) and ``az://`` (azurite); a transport plugin runs it with
``{"transport": NAME}`` in the storage options (the obstore plugin's ``tests/test_obstore_conformance.py``).
Everything goes through the public API (``FsspecWriter``/``FsspecReader``, ``SafetensorsWriter``/
``open_reader``, transports from the factory); the backend's own fsspec filesystem is used only to look at
what landed in storage. Needs pytest.

Modelled on fsspec's ``fsspec/tests/abstract`` mixins: a new backend adds a fixture, not tests.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage import FsspecReader, FsspecWriter, SafetensorsWriter, open_reader
from dcp_storage._torch import torch_fsspec_classes
from dcp_storage.errors import CheckpointExistsError, CheckpointNotFoundError, DcpStorageError, FileTooLargeError
from dcp_storage.transports import RangeRequest, RetryPolicy, TransportConfig, open_transport
from dcp_storage_testing.conformance import _rank_fns as R
from dcp_storage_testing.conformance.helpers import (
    as_location,
    assert_state_equal,
    child,
    counted_since,
    dcp_state_dict,
    destination_like,
    fsspec_knows,
    fsspec_options,
    random_bytes,
    safetensors_state_dict,
    shown_url,
    stored,
    tensor_bytes,
    unwrap,
)
from dcp_storage_testing.distributed import run_ranks

MiB = 1024 * 1024
TEST_CONFIG = TransportConfig(
    max_workers=8,
    coalesce_gap=0,
    max_request_bytes=8 * MiB,
    part_size=5 * MiB,  # the smallest allowed, so multi-part uploads are cheap to provoke
    retry=RetryPolicy(max_attempts=3, initial_backoff=0.005, max_backoff=0.02, deadline=10.0),
)
RANKS_TIMEOUT_S = 120.0


# ------------------------------------------------------------------------------------------ the mixin
class StorageConformance:
    """Behaviour every backend shares. Not collected itself (no ``Test`` prefix); subclass it."""

    def extensions(self) -> list[Any]:
        """Stream extensions the suite's DCP saves use (an extension plugin's suite returns its own)."""
        return []

    def dcp_writer(self, url: str, options: dict[str, Any], **kwargs: Any) -> FsspecWriter:
        return FsspecWriter(url, options, extensions=self.extensions() or None, **kwargs)

    @pytest.fixture
    def transport(self, location: Any) -> Any:
        url, options, _backend = as_location(location)
        t, root = open_transport(url, options, config=TEST_CONFIG)
        with t:
            yield t, root

    # ---------------------------------------------------------------------------- checkpoint level
    def test_dcp_roundtrip_bit_exact(self, location: Any) -> None:
        url, options, _ = as_location(location)
        sd = dcp_state_dict()
        writer = self.dcp_writer(url, options)
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
        url, options, _ = as_location(location)
        first = {"w": torch.arange(10, dtype=torch.float32)}
        dcp.save(first, storage_writer=self.dcp_writer(url, options))
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.zeros(10)}, storage_writer=self.dcp_writer(url, options))
        err = unwrap(info.value)
        assert isinstance(err, CheckpointExistsError) and isinstance(err, DcpStorageError), repr(err)
        assert shown_url(location, ".metadata") in str(err), str(err)
        dest = {"w": torch.empty(10)}
        dcp.load(dest, storage_reader=FsspecReader(url, options))  # the refused save changed nothing
        assert_state_equal(dest, first)

        second = {"w": torch.arange(10, 20, dtype=torch.float32)}
        dcp.save(second, storage_writer=self.dcp_writer(url, options, overwrite=True))
        dcp.load(dest, storage_reader=FsspecReader(url, options))
        assert_state_equal(dest, second)

    def test_torch_writer_output_read_by_ours(self, location: Any) -> None:
        """torch's own writer for the backend (FileSystemWriter locally, its FsspecWriter elsewhere)."""
        TorchFsspecReader, TorchFsspecWriter = torch_fsspec_classes()

        url, options, backend = as_location(location)
        if not fsspec_knows(location):
            pytest.skip(f"torch's writer and reader reach storage through fsspec, which does not know {url}")
        sd = dcp_state_dict()
        theirs, ours = child(url, "theirs"), child(url, "ours")
        if backend == "local":
            torch_writer: Any = dcp.FileSystemWriter(theirs, thread_count=2)
        else:
            torch_writer = TorchFsspecWriter(theirs, thread_count=2, sync_files=False, **fsspec_options(options))
        dcp.save(sd, storage_writer=torch_writer)
        dest = destination_like(sd)
        dcp.load(dest, storage_reader=FsspecReader(theirs, options))
        assert_state_equal(dest, sd)

        dcp.save(sd, storage_writer=self.dcp_writer(ours, options))
        torch_reader = (
            dcp.FileSystemReader(ours) if backend == "local" else TorchFsspecReader(ours, **fsspec_options(options))
        )
        dest = destination_like(sd)
        dcp.load(dest, storage_reader=torch_reader)
        assert_state_equal(dest, sd)

    def test_safetensors_roundtrip(self, location: Any) -> None:
        url, options, _ = as_location(location)
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
        url, options, _ = as_location(location)
        with pytest.raises(CheckpointNotFoundError) as info:
            FsspecReader(url, options).read_metadata()
        assert isinstance(info.value, FileNotFoundError)
        assert shown_url(location, ".metadata") in str(info.value), str(info.value)

    def test_fsdp2_save_2_ranks_load_3_ranks(self, shared_location: Any) -> None:
        url, options, _ = as_location(shared_location)
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

    def test_read_file_with_a_limit_reads_no_more_than_the_limit(self, transport: Any) -> None:
        """A huge (hostile) metadata or index file costs no more memory than its limit, on every store."""
        t, root = transport
        path = t.join(root, "huge.bin")
        t.write_file(path, bytes(4 * 1024 * 1024))
        before = t.counters.bytes_read
        with pytest.raises(FileTooLargeError, match="huge.bin"):
            t.read_file(path, max_bytes=1_000)
        assert t.counters.bytes_read - before <= 1_001

    def test_read_ranges_with_coalescing(self, transport: Any) -> None:
        t, root = transport
        path = t.join(root, "f.bin")
        data = random_bytes(50_000, seed=5)
        t.write_file(path, data)
        strided = [RangeRequest(path, i * 200, i * 200 + 100) for i in range(40)]
        # Transports on the same store and counters (``reconfigured``): the counts are deltas of ``t``'s.
        with t.reconfigured(TEST_CONFIG) as apart:  # coalesce_gap=0: one request per range
            before = t.counters.snapshot()
            out = apart.read_ranges(strided)
            assert [bytes(b) for b in out] == [data[r.start : r.end] for r in strided]
            assert counted_since(t, before) == {"requests": 40, "bytes_read": 40 * 100}

        with t.reconfigured(TransportConfig(coalesce_gap=100, part_size=5 * MiB)) as merged:
            buffers = [bytearray(100) for _ in strided]
            into = [RangeRequest(r.path, r.start, r.end, into=memoryview(b)) for r, b in zip(strided, buffers)]
            before = t.counters.snapshot()
            out = merged.read_ranges(into)
            assert [bytes(b) for b in buffers] == [data[r.start : r.end] for r in strided]
            assert all(view is not None and view.obj is buf for view, buf in zip(out, buffers))
            # one GET, gaps read and dropped
            assert counted_since(t, before) == {"requests": 1, "bytes_read": 40 * 100 + 39 * 100}

        with t.reconfigured(TransportConfig(max_request_bytes=10_000, part_size=5 * MiB)) as split:
            before = t.counters.snapshot()
            (whole,) = split.read_ranges([RangeRequest(path, 0, 50_000)])
            assert bytes(whole) == data and counted_since(t, before)["requests"] == 5

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
        if as_location(location).backend == "s3":
            bucket = as_location(location).url.split("/")[2]
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
        url, options, _ = as_location(location)
        t, root = open_transport(url, options)
        with t:
            shown = t.url(t.join(root, "x.bin"))
        assert shown == (os.path.join(root, "x.bin") if t.is_local else child(url, "x.bin"))
