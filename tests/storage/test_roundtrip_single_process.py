"""Single-process conformance of ``FsspecWriter``/``FsspecReader`` on every backend we support.

One mixin, :class:`RoundtripConformance`, holds every check; a subclass per backend (a plain local
directory, ``file://``, ``memory://``, ``s3://`` on moto) supplies the location. Everything goes through
``torch.distributed.checkpoint.save``/``load`` without a process group, except the slice checks, which
drive ``FsspecReader.read_data`` with hand-made plans (a single process cannot reshard through DCP).

Bit-exactness is checked on raw bytes, so NaN payloads, ``-0.0`` and the like must survive.
Interop with torch's own readers and writers, and the extension path, are local-only tests at the end.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from dcp_storage.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpStorageError,
    UnsafeCheckpointError,
)
from dcp_storage.formats.dcp_native.item_loader import DcpLoaderConfig
from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.writer import FsspecWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ------------------------------------------------------------------------------------------ helpers
def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    # A fresh 1-d copy: a size-1 view may keep an odd stride through reshape/contiguous.
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def assert_bit_exact(actual: Any, expected: Any, key: str) -> None:
    assert isinstance(actual, torch.Tensor), f"{key}: got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{key}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{key}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.equal(raw_bytes(actual), raw_bytes(expected)), f"{key}: bytes differ"


def unwrap(exc: BaseException) -> BaseException:
    """The reader's/writer's own exception inside DCP's ``CheckpointException`` (rank 0's)."""
    if isinstance(exc, CheckpointException):
        (inner, _trace), *_ = exc.failures.values()
        return inner
    return exc


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (NaN payloads, denormals, -0.0, ...) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, nbytes), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def sample_state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    fp32 = random_bits((33, 17), torch.float32, 1)
    fp32[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    return {
        "fp32": fp32,
        "bf16": random_bits((40, 8), torch.bfloat16, 2),
        "fp16": random_bits((5, 7, 3), torch.float16, 3),
        "int64": torch.randint(-(2**62), 2**62, (100,), generator=g, dtype=torch.int64),
        "bool": torch.rand(7, 9, generator=g) > 0.5,
        "fp8": random_bits((16, 12), torch.float8_e4m3fn, 4),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "scalar_int": torch.tensor(-7, dtype=torch.int32),
        "empty": torch.empty(0, 5),
        "empty_mid": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "transposed": torch.randn(24, 10, generator=g).t(),
        "sliced_view": torch.randn(50, 8, generator=g)[10:20, 2:6],
        # Larger than DcpLoaderConfig.small_item_bytes: fetched by header probe + ranged data read.
        "big": random_bits((300, 400), torch.float32, 5),
        "big_bf16": random_bits((700, 300), torch.bfloat16, 6),
        "big_transposed": torch.randn(400, 300, generator=g).t(),  # a strided record, ranged read
        # Overlapping rows with a storage offset whose storage is exactly numel elements: saved as is.
        "overlapping": torch.arange(4, dtype=torch.float32).as_strided((2, 2), (1, 1), 1),
        "overlapping_big": random_bits((90000,), torch.float32, 7).as_strided((300, 300), (200, 1), 100),
        "nested": {"w": torch.randn(6, 6, generator=g), "meta": {"epoch": 3}},
        # BYTE_IO items: anything DCP cannot treat as a tensor is torch.save'd as bytes.
        "step": 7,
        "names": ["a", "b", 3, (4.5, None)],
        "note": "hello",
    }


BYTE_IO_KEYS = {"step": 7, "names": ["a", "b", 3, (4.5, None)], "note": "hello"}


def destination_like(sd: Any, *, preserve_strides: bool = False) -> Any:
    """A state dict of the same shapes, filled with a sentinel, for ``dcp.load`` to overwrite."""
    if isinstance(sd, dict):
        return {k: destination_like(v, preserve_strides=preserve_strides) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        if preserve_strides and torch._debug_has_internal_overlap(sd) == 0:  # can't write into overlap
            out = torch.empty_strided(sd.shape, sd.stride(), dtype=sd.dtype)
        else:
            out = torch.empty(sd.shape, dtype=sd.dtype)
        torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage()).fill_(0xA5)  # sentinel bytes
        return out
    return None  # BYTE_IO: replaced by the load


def flatten(sd: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def assert_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    a, e = flatten(actual), flatten(expected)
    assert set(a) == set(e)
    for key, value in e.items():
        if isinstance(value, torch.Tensor):
            assert_bit_exact(a[key], value, key)
        else:
            assert a[key] == value, key


class SlicePlanner(LoadPlanner):
    """Minimal planner for hand-made plans: destinations given per item, commits recorded."""

    def __init__(self, dests: dict[int, torch.Tensor]) -> None:
        self.dests = dests
        self.committed: list[ReadItem] = []
        self.loaded_bytes: dict[str, bytes] = {}

    def set_up_planner(self, *a: Any, **k: Any) -> None:  # pragma: no cover - unused
        pass

    def create_local_plan(self) -> LoadPlan:  # pragma: no cover - unused
        raise NotImplementedError

    def create_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:  # pragma: no cover - unused
        raise NotImplementedError

    def finish_plan(self, plan: LoadPlan) -> LoadPlan:  # pragma: no cover - unused
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded_bytes[read_item.dest_index.fqn] = value.read()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.dests[id(read_item)]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(read_item)


def slice_item(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    zeros = torch.Size([0] * len(offsets))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, zeros),
        dest_offsets=torch.Size([0] * len(offsets)),
        storage_index=MetadataIndex(fqn, zeros),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


def evil_reduce(marker: Path) -> Any:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    return Evil()


# ------------------------------------------------------------------------------------------ conformance
class RoundtripConformance:
    """Every backend runs these. Subclasses provide the ``location`` fixture: ``(url, storage_options)``."""

    # -- raw access to the backend, for fault injection
    def fs(self, location: tuple[str, dict[str, Any]]) -> tuple[fsspec.AbstractFileSystem, str]:
        url, options = location
        return fsspec.core.url_to_fs(url, **options)

    def file_path(self, location: tuple[str, dict[str, Any]], name: str) -> str:
        _fs, root = self.fs(location)
        return f"{root.rstrip('/')}/{name}"

    def read_raw(self, location: tuple[str, dict[str, Any]], name: str) -> bytes:
        fs, _ = self.fs(location)
        return fs.cat_file(self.file_path(location, name))

    def write_raw(self, location: tuple[str, dict[str, Any]], name: str, data: bytes) -> None:
        fs, _ = self.fs(location)
        fs.pipe_file(self.file_path(location, name), data)

    def remove_raw(self, location: tuple[str, dict[str, Any]], name: str) -> None:
        fs, _ = self.fs(location)
        fs.rm_file(self.file_path(location, name))

    def read_pickled_metadata(self, location: tuple[str, dict[str, Any]]) -> Any:
        return pickle.loads(self.read_raw(location, ".metadata"))  # we just wrote it: trusted

    def save(self, sd: dict[str, Any], location: tuple[str, dict[str, Any]], **kw: Any) -> FsspecWriter:
        url, options = location
        writer = FsspecWriter(url, options, **kw)
        dcp.save(sd, storage_writer=writer)
        return writer

    def load(self, dest: dict[str, Any], location: tuple[str, dict[str, Any]], **kw: Any) -> FsspecReader:
        url, options = location
        reader = FsspecReader(url, options, **kw)
        dcp.load(dest, storage_reader=reader)
        return reader

    # -- round trips
    @pytest.mark.parametrize("preserve_strides", [False, True], ids=["contiguous_dest", "strided_dest"])
    def test_roundtrip_bit_exact(self, location: Any, preserve_strides: bool) -> None:
        sd = sample_state_dict()
        self.save(sd, location)
        dest = destination_like(sd, preserve_strides=preserve_strides)
        self.load(dest, location)
        assert_state_equal(dest, sd)
        for key, value in BYTE_IO_KEYS.items():
            assert dest[key] == value
        assert dest["nested"]["meta"] == {"epoch": 3}

    @pytest.mark.parametrize("single_file_per_rank,thread_count", [(True, 1), (True, 3), (False, 2)])
    def test_file_layouts(self, location: Any, single_file_per_rank: bool, thread_count: int) -> None:
        sd = sample_state_dict()
        self.save(sd, location, single_file_per_rank=single_file_per_rank, thread_count=thread_count)
        fs, root = self.fs(location)
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
        data_files = [n for n in names if n.endswith(".distcp")]
        assert ".metadata" in names
        assert not [n for n in names if n.endswith(".tmp")], names
        if single_file_per_rank:
            assert len(data_files) == thread_count
        else:
            assert len(data_files) == len(flatten(sd))
        dest = destination_like(sd)
        self.load(dest, location)
        assert_state_equal(dest, sd)

    def test_tiny_loader_limits(self, location: Any) -> None:
        """Force every tensor through probing, re-probing and small staging batches."""
        sd = sample_state_dict()
        self.save(sd, location)
        dest = destination_like(sd, preserve_strides=True)
        cfg = DcpLoaderConfig(probe_bytes=512, small_item_bytes=0, staging_bytes=1)
        self.load(dest, location, loader_config=cfg)
        assert_state_equal(dest, sd)

    def test_load_casts_to_destination_dtype(self, location: Any) -> None:
        sd = {"w": torch.randn(300, 300, dtype=torch.float32), "h": torch.randn(4, 4, dtype=torch.bfloat16)}
        self.save(sd, location)
        dest = {"w": torch.zeros(300, 300, dtype=torch.bfloat16), "h": torch.zeros(4, 4, dtype=torch.float32)}
        self.load(dest, location)
        assert_bit_exact(dest["w"], sd["w"].to(torch.bfloat16), "w")
        assert_bit_exact(dest["h"], sd["h"].to(torch.float32), "h")

    def test_slices_of_a_saved_tensor(self, location: Any) -> None:
        """Sub-slices (Shard(0)-, Shard(1)-, block- and element-shaped) read with ranged requests only."""
        g = torch.Generator().manual_seed(7)
        full = torch.randn(64, 48, generator=g)
        big = random_bits((1024, 256), torch.float32, 9)  # 1 MiB: ranged path
        strided = torch.randn(512, 300, generator=g).t()  # saved as a transposed record
        fp8 = random_bits((64, 48), torch.float8_e4m3fn, 10)
        sd = {"full": full, "big": big, "strided": strided, "fp8": fp8}
        self.save(sd, location)
        url, options = location
        kinds = {
            "whole": lambda r, c: ((0, 0), (r, c)),
            "shard0": lambda r, c: ((r // 8, 0), (r // 2, c)),
            "shard1": lambda r, c: ((0, c // 7), (r, c // 2)),
            "block": lambda r, c: ((r // 20, c // 5), (r // 2, c // 2)),
            "last_element": lambda r, c: ((r - 1, c - 1), (1, 1)),
            "empty": lambda r, c: ((r // 3, 0), (0, c)),
        }
        for config in (DcpLoaderConfig(), DcpLoaderConfig(small_item_bytes=0, probe_bytes=512)):
            reader = FsspecReader(url, options, loader_config=config)
            reader.set_up_storage_reader(reader.read_metadata(), True)
            # One plan per kind: like a real load plan, no two items of a plan read overlapping bytes.
            for kind, make in kinds.items():
                items, dests, expected = [], {}, []
                for fqn, tensor in sd.items():
                    offsets, lengths = make(*tensor.shape)
                    item = slice_item(fqn, offsets, lengths)
                    dest = torch.empty(lengths, dtype=tensor.dtype)
                    items.append(item)
                    dests[id(item)] = dest
                    ref = tensor[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
                    expected.append((f"{kind} {fqn}{offsets}{lengths}", dest, ref))
                planner = SlicePlanner(dests)
                reader.read_data(LoadPlan(items), planner).wait()
                assert len(planner.committed) == len(items)
                for key, dest, ref in expected:
                    assert_bit_exact(dest, ref, key)

    def test_shard0_slice_reads_only_its_bytes(self, location: Any) -> None:
        big = random_bits((2048, 512), torch.float32, 11)  # 4 MiB
        self.save({"big": big}, location)
        url, options = location
        reader = FsspecReader(url, options)
        reader.set_up_storage_reader(reader.read_metadata(), True)
        before = reader.counters["bytes_read"]
        item = slice_item("big", (512, 0), (256, 512))  # 512 KiB of rows
        dest = torch.empty(256, 512)
        reader.read_data(LoadPlan([item]), SlicePlanner({id(item): dest})).wait()
        assert_bit_exact(dest, big[512:768], "big[512:768]")
        read = reader.counters["bytes_read"] - before
        assert read <= 256 * 512 * 4 + 64 * 1024, read

    # -- overwrite
    def test_overwrite_refused_by_default(self, location: Any) -> None:
        first = {"w": torch.arange(10, dtype=torch.float32)}
        self.save(first, location)
        with pytest.raises(CheckpointException) as info:
            self.save({"w": torch.zeros(10)}, location)
        err = unwrap(info.value)
        assert isinstance(err, CheckpointExistsError)
        assert isinstance(err, FileExistsError) and isinstance(err, DcpStorageError)
        assert ".metadata" in str(err) and self.file_path(location, ".metadata").lstrip("/") in str(err)
        dest = {"w": torch.empty(10)}
        self.load(dest, location)  # the refused save did not damage the old checkpoint
        assert_bit_exact(dest["w"], first["w"], "w")

    def test_overwrite_true_replaces(self, location: Any) -> None:
        self.save({"w": torch.arange(10, dtype=torch.float32), "old": torch.ones(3)}, location)
        second = {"w": torch.arange(10, 20, dtype=torch.float32), "n": 5}
        self.save(second, location, overwrite=True)
        dest: dict[str, Any] = {"w": torch.empty(10), "n": None}
        self.load(dest, location)
        assert_bit_exact(dest["w"], second["w"], "w")
        assert dest["n"] == 5
        metadata = self.read_pickled_metadata(location)
        assert "old" not in metadata.state_dict_metadata

    # -- rank-local metadata (dcp.save(use_collectives=False))
    def test_rank_local_metadata_roundtrip(self, location: Any) -> None:
        sd = sample_state_dict()
        url, options = location
        dcp.save(sd, storage_writer=FsspecWriter(url, options), use_collectives=False)
        fs, root = self.fs(location)
        names = {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
        assert "__0.metadata" in names and ".metadata" not in names
        dest = destination_like(sd)
        self.load(dest, location)  # DCP falls back to read_metadata(rank=0)
        assert_state_equal(dest, sd)

    def test_rank_local_save_over_collective_checkpoint(self, location: Any) -> None:
        """A global .metadata left behind would shadow the rank-local one and point at rewritten files."""
        url, options = location
        self.save({"a": torch.zeros(100, 100), "b": torch.ones(3)}, location)
        new = {"a": torch.full((100, 100), 2.0), "b": torch.full((3,), 7.0), "c": torch.full((200, 200), 5.0)}
        with pytest.raises((CheckpointException, CheckpointExistsError)) as info:
            dcp.save(new, storage_writer=FsspecWriter(url, options), use_collectives=False)
        assert isinstance(unwrap(info.value), CheckpointExistsError)
        assert ".metadata" in str(info.value)
        dest = {"a": torch.empty(100, 100), "b": torch.empty(3)}
        self.load(dest, location)  # the refused save left the old checkpoint intact
        assert_bit_exact(dest["a"], torch.zeros(100, 100), "a")

        dcp.save(new, storage_writer=FsspecWriter(url, options, overwrite=True), use_collectives=False)
        dest = {"a": torch.empty(100, 100), "b": torch.empty(3), "c": torch.empty(200, 200)}
        self.load(dest, location)
        assert_state_equal(dest, new)

    # -- safety
    def _save_simple(self, location: Any) -> dict[str, torch.Tensor]:
        sd = {"small": torch.arange(16, dtype=torch.float32), "big": random_bits((512, 512), torch.float32, 12)}
        self.save(sd, location, thread_count=1)
        return sd

    @pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
    def test_malicious_metadata_is_refused(self, location: Any, tmp_path: Path, protocol: int) -> None:
        self._save_simple(location)
        marker = tmp_path / "MARKER"
        metadata = self.read_pickled_metadata(location)
        metadata.planner_data = evil_reduce(marker)  # hidden inside an otherwise valid Metadata
        self.write_raw(location, ".metadata", pickle.dumps(metadata, protocol=protocol))
        url, options = location
        with pytest.raises(UnsafeCheckpointError) as info:
            FsspecReader(url, options).read_metadata()
        message = str(info.value)
        assert ".metadata" in message
        assert f"{os.system.__module__}.system" in message and info.value.forbidden == f"{os.system.__module__}.system"
        assert not marker.exists()
        with pytest.raises((CheckpointException, Exception)) as info2:
            self.load({"small": torch.empty(16), "big": torch.empty(512, 512)}, location)
        assert message in str(info2.value)
        assert not marker.exists()

    @pytest.mark.parametrize("size", ["small", "big"])
    def test_malicious_data_record_is_refused(self, location: Any, tmp_path: Path, size: str) -> None:
        self._save_simple(location)
        marker = tmp_path / "MARKER"
        buf = io.BytesIO()
        payload: Any = evil_reduce(marker)
        if size == "big":
            payload = [torch.zeros(100_000), payload]  # longer than small_item_bytes: header probe path
        torch.save(payload, buf)  # a genuine torch.save zip whose data.pkl names posix.system
        record = buf.getvalue()
        metadata = self.read_pickled_metadata(location)
        index = next(i for i in metadata.storage_data if i.fqn == "small")
        metadata.storage_data[index] = _StorageInfo("evil.distcp", 0, len(record))
        self.write_raw(location, "evil.distcp", record)
        self.write_raw(location, ".metadata", pickle.dumps(metadata))
        with pytest.raises(CheckpointException) as info:
            self.load({"small": torch.empty(16), "big": torch.empty(512, 512)}, location)
        err = unwrap(info.value)
        assert isinstance(err, UnsafeCheckpointError), repr(err)
        assert "evil.distcp" in str(err) and "system" in str(err)
        assert "evil.distcp" in str(info.value)
        assert not marker.exists()

    # -- missing and truncated files
    def test_missing_metadata(self, location: Any) -> None:
        self._save_simple(location)
        self.remove_raw(location, ".metadata")
        url, options = location
        with pytest.raises(CheckpointNotFoundError) as info:
            FsspecReader(url, options).read_metadata()
        assert isinstance(info.value, FileNotFoundError)
        assert ".metadata" in str(info.value)
        with pytest.raises(CheckpointException) as info2:
            self.load({"small": torch.empty(16), "big": torch.empty(512, 512)}, location)
        # Data files without .metadata: an interrupted save, named as such (IncompleteCheckpointError).
        assert "incomplete checkpoint" in str(info2.value) and "no .metadata" in str(info2.value)

    def test_missing_checkpoint_dir(self, location: Any) -> None:
        url, options = location
        with pytest.raises(CheckpointNotFoundError, match=r"\.metadata"):
            FsspecReader(url, options).read_metadata()

    def test_missing_data_file(self, location: Any) -> None:
        self._save_simple(location)
        data_file = next(n for n in self._data_files(location))
        self.remove_raw(location, data_file)
        with pytest.raises(CheckpointException) as info:
            self.load({"small": torch.empty(16), "big": torch.empty(512, 512)}, location)
        err = unwrap(info.value)
        assert isinstance(err, CheckpointNotFoundError), repr(err)
        assert data_file in str(err)
        assert data_file in str(info.value)

    @pytest.mark.parametrize("where", ["data", "header", "record_start"])
    def test_truncated_data_file(self, location: Any, where: str) -> None:
        self._save_simple(location)
        metadata = self.read_pickled_metadata(location)
        info_big = next(v for k, v in metadata.storage_data.items() if k.fqn == "big")
        name = info_big.relative_path
        data = self.read_raw(location, name)
        cut = {
            "data": info_big.offset + info_big.length // 2,  # in the middle of the tensor's bytes
            "header": info_big.offset + 200,  # inside the zip local headers / data.pkl
            # the file's last record is missing entirely (the writer's order puts either one last)
            "record_start": max(v.offset for v in metadata.storage_data.values()),
        }[where]
        assert 0 < cut < len(data)
        self.write_raw(location, name, data[:cut])
        with pytest.raises(CheckpointException) as info:
            self.load({"small": torch.empty(16), "big": torch.empty(512, 512)}, location)
        err = unwrap(info.value)
        assert isinstance(err, CorruptCheckpointError), repr(err)
        assert name in str(err)
        assert name in str(info.value)

    @pytest.mark.parametrize("damage", ["garbage", "truncated"])
    def test_damaged_metadata(self, location: Any, damage: str) -> None:
        self._save_simple(location)
        data = self.read_raw(location, ".metadata")
        bad = b"\x80\x04not a pickle at all" if damage == "garbage" else data[: len(data) // 2]
        self.write_raw(location, ".metadata", bad)
        url, options = location
        with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
            FsspecReader(url, options).read_metadata()

    def test_garbled_record_header(self, location: Any) -> None:
        self._save_simple(location)
        metadata = self.read_pickled_metadata(location)
        info_big = next(v for k, v in metadata.storage_data.items() if k.fqn == "big")
        data = bytearray(self.read_raw(location, info_big.relative_path))
        data[info_big.offset : info_big.offset + 4] = b"XXXX"  # the zip local header signature
        self.write_raw(location, info_big.relative_path, bytes(data))
        with pytest.raises(CheckpointException) as info:
            self.load({"small": torch.empty(16), "big": torch.empty(512, 512)}, location)
        err = unwrap(info.value)
        assert isinstance(err, CorruptCheckpointError), repr(err)
        assert info_big.relative_path in str(err)

    def _data_files(self, location: Any) -> list[str]:
        fs, root = self.fs(location)
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if p.endswith(".distcp"))


# ------------------------------------------------------------------------------------------ backends
class TestLocalDir(RoundtripConformance):
    @pytest.fixture
    def location(self, tmp_path: Path) -> tuple[str, dict[str, Any]]:
        return str(tmp_path / "ckpt"), {}


class TestFileUrl(RoundtripConformance):
    @pytest.fixture
    def location(self, tmp_path: Path) -> tuple[str, dict[str, Any]]:
        return f"file://{tmp_path / 'ckpt'}", {}


class TestMemory(RoundtripConformance):
    @pytest.fixture
    def location(self) -> Iterator[tuple[str, dict[str, Any]]]:
        root = f"/dcp-storage-tests/{uuid.uuid4().hex}"
        yield f"memory://{root}", {}
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


class TestS3(RoundtripConformance):
    @pytest.fixture
    def location(self, s3_url: Any) -> tuple[str, dict[str, Any]]:
        url, options = s3_url
        return url, options


# ------------------------------------------------------------------------------------------ torch interop
def test_torch_filesystem_writer_to_our_reader(tmp_path: Path) -> None:
    sd = sample_state_dict()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=2))
    dest = destination_like(sd)
    dcp.load(dest, storage_reader=FsspecReader(str(tmp_path)))
    assert_state_equal(dest, sd)


def test_our_writer_to_torch_filesystem_reader(tmp_path: Path) -> None:
    sd = sample_state_dict()
    dcp.save(sd, storage_writer=FsspecWriter(str(tmp_path)))
    dest = destination_like(sd)
    dcp.load(dest, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert_state_equal(dest, sd)


def test_torch_fsspec_interop_on_memory() -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as TorchFsspecReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as TorchFsspecWriter

    sd = sample_state_dict()
    fs = fsspec.filesystem("memory")
    base = f"/dcp-storage-tests/{uuid.uuid4().hex}"
    try:
        theirs, ours = f"memory://{base}/theirs", f"memory://{base}/ours"
        dcp.save(sd, storage_writer=TorchFsspecWriter(theirs))
        dest = destination_like(sd)
        dcp.load(dest, storage_reader=FsspecReader(theirs))
        assert_state_equal(dest, sd)

        dcp.save(sd, storage_writer=FsspecWriter(ours))
        dest = destination_like(sd)
        dcp.load(dest, storage_reader=TorchFsspecReader(ours))
        assert_state_equal(dest, sd)
    finally:
        if fs.exists(base):
            fs.rm(base, recursive=True)


def test_torch_zstandard_extension(tmp_path: Path) -> None:
    try:
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:
        pytest.skip("torch.distributed.checkpoint._extension.ZStandard does not exist in this torch")
    if not ZStandard.is_available():
        pytest.skip("ZStandard extension unavailable: neither zstandard nor pyzstd is importable")
    sd = sample_state_dict()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path), _extensions=[ZStandard()]))
    dest = destination_like(sd)
    dcp.load(dest, storage_reader=FsspecReader(str(tmp_path)))
    assert_state_equal(dest, sd)


class _ZlibStream(io.RawIOBase):
    def __init__(self, output: Any) -> None:
        self.output = output
        self.compressor = zlib.compressobj()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.output.write(self.compressor.compress(bytes(b)))
        return memoryview(b).nbytes

    def flush(self) -> None:
        if self.compressor is not None:
            self.output.write(self.compressor.flush())
            self.compressor = None  # type: ignore[assignment]
        self.output.flush()


def _zlib_extension() -> Any:
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Zlib(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return "test.zlib"

        @staticmethod
        def from_descriptor(version: str) -> Zlib:
            assert version == "1"
            return Zlib()

        def get_descriptor(self) -> str:
            return f"{self.registry_name()}/1"

        def transform_to(self, output: Any) -> Any:
            return _ZlibStream(output)

        def transform_from(self, input: Any) -> Any:
            return io.BytesIO(zlib.decompress(input.read()))

    return Zlib


def test_stream_extension_records(tmp_path: Path) -> None:
    """Records written through a stream extension (compression) load via the extension registry."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    zlib_ext = _zlib_extension()
    sd = sample_state_dict()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path), _extensions=[zlib_ext()]))
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    assert any(getattr(v, "transform_descriptors", None) for v in metadata.storage_data.values())
    registry = ExtensionRegistry()
    registry.register(zlib_ext)
    dest = destination_like(sd)
    dcp.load(dest, storage_reader=FsspecReader(str(tmp_path), extension_registry=registry))
    assert_state_equal(dest, sd)


# ------------------------------------------------------------------------------------------ hardening
def _zip_record(data_pkl: bytes) -> bytes:
    """A torch.save-shaped zip whose ``data.pkl`` is ``data_pkl``."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
    return out.getvalue()


def _point_item_at(ckpt: Path, fqn: str, record: bytes) -> None:
    (ckpt / "evil.distcp").write_bytes(record)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    metadata.storage_data[index] = _StorageInfo("evil.distcp", 0, len(record))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize(
    "data_pkl",
    [
        # BUILD with a dict state on the allow-list's shared ``torch.FloatStorage`` stand-in ...
        b"\x80\x02ctorch\nFloatStorage\n}X\x05\x00\x00\x00dtypectorch\nint32\nsb0N.",
        # ... and with a (None, slot-state) pair, which BUILD applies with setattr.
        b"\x80\x02ctorch\nFloatStorage\nN}X\x05\x00\x00\x00dtypectorch\nint32\ns\x86b0N.",
    ],
    ids=["dict_state", "slot_state"],
)
def test_malicious_record_cannot_poison_later_loads(tmp_path: Path, data_pkl: bytes) -> None:
    """A record's data.pkl must not be able to rewrite the allow-list (legit float32 would read as int32)."""
    from dcp_storage.formats.dcp_native import torch_record

    good = {"w": torch.randn(8, 8)}
    dcp.save(good, storage_writer=FsspecWriter(str(tmp_path / "good")))
    dcp.save({"w": torch.randn(8, 8)}, storage_writer=FsspecWriter(str(tmp_path / "bad")))
    _point_item_at(tmp_path / "bad", "w", _zip_record(data_pkl))
    try:
        with pytest.raises(CheckpointException) as info:
            dcp.load({"w": torch.empty(8, 8)}, storage_reader=FsspecReader(str(tmp_path / "bad")))
        assert isinstance(unwrap(info.value), (CorruptCheckpointError, UnsafeCheckpointError))
        assert "evil.distcp" in str(info.value)
        dest = {"w": torch.empty(8, 8)}
        dcp.load(dest, storage_reader=FsspecReader(str(tmp_path / "good")))
        assert_bit_exact(dest["w"], good["w"], "w")
    finally:  # never leave a poisoned allow-list behind for the rest of the session
        truth = torch_record._legacy_storage_dtypes()
        for (_module, name), value in torch_record._ALLOWED.items():
            if isinstance(value, torch_record._StorageType) and name in truth and value.dtype != truth[name]:
                object.__setattr__(value, "dtype", truth[name])


def test_malicious_byte_item_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.randn(3), "step": 5}, storage_writer=FsspecWriter(str(ckpt)))
    buf = io.BytesIO()
    torch.save(evil_reduce(marker), buf)
    _point_item_at(ckpt, "step", buf.getvalue())
    try:
        with pytest.raises(CheckpointException) as info:
            dcp.load({"w": torch.empty(3), "step": None}, storage_reader=FsspecReader(str(ckpt)))
        assert isinstance(unwrap(info.value), UnsafeCheckpointError)
    finally:
        assert not marker.exists(), "the BYTE_IO payload ran"


def test_malicious_metadata_cannot_mutate_allowed_classes(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    from dcp_storage.formats.dcp_native.native import load_metadata

    # GLOBAL Metadata; (None, {"dcp_storage_test_pwned": 1}); BUILD; POP; None; STOP
    payload = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x16\x00\x00\x00dcp_storage_test_pwnedK\x01s\x86b0N."
    try:
        with pytest.raises(DcpStorageError):
            load_metadata(payload, str(tmp_path / ".metadata"))
        assert not hasattr(Metadata, "dcp_storage_test_pwned"), "a .metadata pickle set an attribute on Metadata"
    finally:
        if "dcp_storage_test_pwned" in vars(Metadata):
            delattr(Metadata, "dcp_storage_test_pwned")


@pytest.mark.parametrize(("rows", "columns"), [(64, 24), (17, 270_000)])  # 96 B runs (map), 1 MiB runs (preadv)
def test_many_run_slice_of_a_truncated_file_names_it(tmp_path: Path, rows: int, columns: int) -> None:
    """Shard(1)-style slices of local files take the many-run path; a short file is still named."""
    full = torch.arange(rows * 2 * columns, dtype=torch.float32).reshape(rows, 2 * columns)
    dcp.save({"w": full}, storage_writer=FsspecWriter(str(tmp_path)))
    offsets, lengths = (0, columns // 2), (rows, columns)
    reader = FsspecReader(str(tmp_path), loader_config=DcpLoaderConfig(small_item_bytes=0))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    dest = torch.empty(lengths)
    item = slice_item("w", offsets, lengths)
    reader.read_data(LoadPlan([item]), SlicePlanner({id(item): dest})).wait()
    assert torch.equal(dest, full[:, columns // 2 : columns // 2 + columns])
    data_file = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp" and p.stat().st_size > 1000)
    with open(data_file, "r+b") as f:
        f.truncate(data_file.stat().st_size // 2)
    reader = FsspecReader(str(tmp_path), loader_config=DcpLoaderConfig(small_item_bytes=0))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    with pytest.raises(CorruptCheckpointError, match=data_file.name):
        reader.read_data(LoadPlan([item]), SlicePlanner({id(item): torch.empty(lengths)})).wait()
