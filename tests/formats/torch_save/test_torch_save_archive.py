"""The torch.save format on its own, in one process: index, safe decoding, Metadata, bad and malicious files.

Every tensor the archive describes is read back through ranged reads and compared bit for bit with
``torch.load(weights_only=True)`` of the same file. Loads through ``dcp.load`` without a process group use
:class:`~dcp_storage.BroadcastingTorchSaveReader` with torch's ``DynamicMetaLoadPlanner`` and with DCP's
default planner (which also loads the non-tensor values).
"""

from __future__ import annotations

import collections
import io
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from dcp_storage import BroadcastingTorchSaveReader
from dcp_storage.errors import CorruptCheckpointError, ShapeMismatchError, UnsafeCheckpointError
from dcp_storage.formats.reading import plan_slice_read, read_slices
from dcp_storage.formats.torch_save import TorchSaveArchive, UnsupportedFormatError
from dcp_storage.formats.torch_save.pickle_tree import LegacyNeedsMoreBytes, scan_legacy
from dcp_storage.planners import IncompatibleKeysError
from dcp_storage.transports import FsspecTransport
from dcp_storage_testing.s3_server import S3Location

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# ------------------------------------------------------------------------------------------ helpers
def raw(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def same_bits(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.dtype == b.dtype
        and tuple(a.shape) == tuple(b.shape)
        and torch.equal(raw(a), raw(b))
    )


def varied_state() -> dict[str, Any]:
    """Dtypes, views sharing storage, strides, a Parameter, nesting, values, bytes, sets, empties."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(12, 10, generator=g)
    bits = torch.randint(0, 256, (40, 8), generator=g, dtype=torch.uint8)
    state: dict[str, Any] = collections.OrderedDict()
    state["fp32"] = base
    state["view_rows"] = base[3:7]  # same storage, storage_offset 30
    state["transposed"] = base.t()  # non-row-major strides
    state["every_other"] = base[:, ::2]  # strided view
    state["bf16"] = torch.randn(33, 17, generator=g).to(torch.bfloat16)
    state["fp16"] = torch.randn(5, 3, generator=g).to(torch.float16)
    state["nan_payloads"] = bits.view(torch.float32)  # arbitrary bit patterns survive
    state["int64"] = torch.arange(-5, 20, dtype=torch.int64)
    state["bool"] = torch.tensor([True, False, True])
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.empty(0, 4)
    state["param"] = torch.nn.Parameter(torch.ones(3, 2))
    if hasattr(torch, "float8_e4m3fn"):
        state["fp8"] = torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn)
    state["nested"] = {"inner": {"w": torch.randn(4, 4, generator=g)}, "lst": [torch.ones(2), torch.zeros(3)]}
    state["step"] = 42
    state["name"] = "tiny"
    state["blob"] = b"\x00\xffbytes"
    state["pair_with_tensor"] = (1, torch.arange(3))  # a value (tuples are leaves) holding a tensor
    state["ids"] = {1, 2, 3}
    state["lr"] = 1e-3
    state["nothing"] = None
    return state


def open_archive(path: str | os.PathLike[str], **options: Any) -> TorchSaveArchive:
    transport, p = FsspecTransport.from_url(os.fspath(path), options)
    return TorchSaveArchive.open(transport, p)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path / "varied.pt")
    torch.save(varied_state(), path)
    return path, torch.load(path, weights_only=True)


# ------------------------------------------------------------------------------------------ index
def test_descriptors_read_back_bit_exact(saved: tuple[str, dict[str, Any]]) -> None:
    path, loaded = saved
    archive = open_archive(path)
    flat, _ = flatten_state_dict(loaded)
    assert set(archive.flat) == set(flat)
    for key, expected in flat.items():
        if isinstance(expected, torch.Tensor):
            desc = archive.tensors[key]
            assert (desc.dtype, desc.shape) == (expected.dtype, tuple(expected.shape)), key
            assert same_bits(archive.read_tensor(desc), expected), key
        else:
            assert key not in archive.tensors
    assert archive.tensors["view_rows"].storage_key == archive.tensors["fp32"].storage_key
    assert archive.tensors["view_rows"].storage_offset == 30
    assert archive.tensors["transposed"].stride == (1, 10)


def test_slices_of_strided_and_row_major_tensors(saved: tuple[str, dict[str, Any]]) -> None:
    path, loaded = saved
    archive = open_archive(path)
    for key, offsets, lengths in [
        ("fp32", (2, 0), (5, 10)),
        ("fp32", (0, 3), (12, 4)),
        ("transposed", (1, 2), (6, 7)),
        ("every_other", (4, 1), (3, 3)),
        ("bf16", (0, 16), (33, 1)),
    ]:
        dest = torch.empty(lengths, dtype=loaded[key].dtype)
        work = plan_slice_read(key, archive.stored(key), offsets, lengths, dest)
        read_slices(archive.transport, [work], lambda _w: None)
        expected = loaded[key][offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
        assert same_bits(dest, expected.contiguous()), (key, offsets, lengths)


def test_metadata_matches_dcp_flattening(saved: tuple[str, dict[str, Any]]) -> None:
    path, loaded = saved
    md = open_archive(path).metadata()
    flat, mappings = flatten_state_dict(loaded)
    assert md.planner_data == mappings
    for key, value in flat.items():
        entry = md.state_dict_metadata[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(entry, TensorStorageMetadata)
            assert entry.properties.dtype == value.dtype and tuple(entry.size) == tuple(value.shape)
            (chunk,) = entry.chunks
            assert tuple(chunk.offsets) == (0,) * value.dim() and tuple(chunk.sizes) == tuple(value.shape)
        else:
            assert isinstance(entry, BytesStorageMetadata), key


def test_index_reads_little(tmp_path: Path) -> None:
    """Indexing a 16 MB file reads a few KiB: end records, central directory, data.pkl."""
    path = str(tmp_path / "big.pt")
    torch.save({f"w{i}": torch.zeros(1024, 1024) for i in range(4)}, path)
    transport, p = FsspecTransport.from_url(path)
    TorchSaveArchive.open(transport, p).metadata()
    assert transport.counters.bytes_read < 16 * 1024, transport.counters


# ------------------------------------------------------------------------------------------ dcp.load, one process
def _sources(tmp_path: Path, path: str, s3_url: S3Location | None) -> list[tuple[str, dict[str, Any]]]:
    mem = f"memory://torch-save-{tmp_path.name}/model.pt"
    with fsspec.open(mem, "wb") as f, open(path, "rb") as src:
        shutil.copyfileobj(src, f)
    out = [(path, {}), (mem, {})]
    if s3_url is not None:
        url, options = s3_url
        fsspec.filesystem("s3", **options).put(path, url + "/model.pt")
        out.append((url + "/model.pt", options))
    return out


def test_dcp_load_without_process_group(saved: tuple[str, dict[str, Any]], tmp_path: Path, s3_url: S3Location) -> None:
    path, loaded = saved
    flat, _ = flatten_state_dict(loaded)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor) and k not in ("pair_with_tensor",)}
    for url, options in _sources(tmp_path, path, s3_url):
        # torch's DynamicMetaLoadPlanner: tensors only, into plain tensors (NaN-filled: misses show).
        state = {
            k: torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v)
            for k, v in tensors.items()
        }
        reader = BroadcastingTorchSaveReader(storage_options=options)
        dcp.load(state, storage_reader=reader, planner=DynamicMetaLoadPlanner(), checkpoint_id=url)
        bad = [k for k, v in tensors.items() if not same_bits(state[k], v)]
        assert bad == [], f"{url}: {bad}"
        assert reader.stats["bytes_received"] == 0 and reader.stats["storage"]["requests"] > 0

        # DCP's default planner with our Metadata: nested structure and non-tensor values too.
        target: dict[str, Any] = {
            "fp32": torch.zeros(12, 10),
            "bf16": torch.zeros(33, 17, dtype=torch.bfloat16),
            "nested": {"inner": {"w": torch.zeros(4, 4)}, "lst": [torch.zeros(2), torch.ones(3)]},
            "step": 0,
            "name": "",
            "blob": b"",
            "ids": set(),
            "pair_with_tensor": None,
            "nothing": 1,
        }
        dcp.load(target, storage_reader=BroadcastingTorchSaveReader(url, storage_options=options))
        assert same_bits(target["nested"]["inner"]["w"], loaded["nested"]["inner"]["w"])
        assert same_bits(target["nested"]["lst"][1], loaded["nested"]["lst"][1])
        assert (target["step"], target["name"], target["blob"], target["ids"], target["nothing"]) == (
            42,
            "tiny",
            b"\x00\xffbytes",
            {1, 2, 3},
            None,
        )
        assert target["pair_with_tensor"][0] == 1 and same_bits(target["pair_with_tensor"][1], torch.arange(3))


def test_load_whole_file_from_keys(saved: tuple[str, dict[str, Any]]) -> None:
    path, loaded = saved
    out = _load_state_dict_from_keys(storage_reader=BroadcastingTorchSaveReader(path))
    assert same_bits(out["nested"]["inner"]["w"], loaded["nested"]["inner"]["w"])
    assert same_bits(out["transposed"], loaded["transposed"]) and out["step"] == 42


def test_dtype_cast_on_load(saved: tuple[str, dict[str, Any]]) -> None:
    path, loaded = saved
    state = {"bf16": torch.zeros(33, 17, dtype=torch.float32)}
    dcp.load(state, storage_reader=BroadcastingTorchSaveReader(path), planner=DynamicMetaLoadPlanner())
    assert torch.equal(state["bf16"], loaded["bf16"].float())


def test_wrong_shape_and_missing_key_name_the_tensor(saved: tuple[str, dict[str, Any]]) -> None:
    path, _ = saved
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            {"fp32": torch.zeros(13, 10)},
            storage_reader=BroadcastingTorchSaveReader(path),
            planner=DynamicMetaLoadPlanner(),
        )
    ((exc, _),) = info.value.failures.values()
    assert isinstance(exc, ShapeMismatchError) and "'fp32'" in str(exc) and "[12, 10]" in str(exc)
    with pytest.raises(CheckpointException) as info:  # smaller than the file: no silent partial load
        dcp.load(
            {"fp32": torch.zeros(11, 10)},
            storage_reader=BroadcastingTorchSaveReader(path),
            planner=DynamicMetaLoadPlanner(),
        )
    ((exc, _),) = info.value.failures.values()
    assert isinstance(exc, ShapeMismatchError) and "[11, 10]" in str(exc) and "[12, 10]" in str(exc)
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            {"nope": torch.zeros(2)}, storage_reader=BroadcastingTorchSaveReader(path), planner=DynamicMetaLoadPlanner()
        )
    ((exc, _),) = info.value.failures.values()  # a key mismatch, reported as every planner reports one
    assert isinstance(exc, IncompatibleKeysError) and exc.missing_keys == ["nope"] and "'nope'" in str(exc)


# ------------------------------------------------------------------------------------------ malicious files
class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))  # unpickling creates the marker file


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_malicious_pickle_never_runs(tmp_path: Path, zip_format: bool) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "evil": _Payload(str(marker))}, path, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(UnsafeCheckpointError) as info:
        BroadcastingTorchSaveReader(str(path)).read_metadata()
    assert str(path) in str(info.value) and "open" in info.value.forbidden
    with pytest.raises(CheckpointException, match="forbidden global"):
        dcp.load(
            {"w": torch.zeros(2)},
            storage_reader=BroadcastingTorchSaveReader(str(path)),
            planner=DynamicMetaLoadPlanner(),
        )
    assert not marker.exists()
    # The payload is real: an unsafe load does run it.
    control = tmp_path / "control"
    torch.save({"evil": _Payload(str(control))}, tmp_path / "control.pt", _use_new_zipfile_serialization=zip_format)
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()


class _SubTensor(torch.Tensor):
    pass


def test_unlisted_torch_global_is_refused(tmp_path: Path) -> None:
    """Even torch's own functions are refused unless allow-listed (here: a tensor subclass rebuild)."""
    path = tmp_path / "sub.pt"
    torch.save({"w": torch.ones(2).as_subclass(_SubTensor)}, path)
    with pytest.raises(UnsafeCheckpointError, match="_rebuild_from_type_v2"):
        open_archive(path)


# ------------------------------------------------------------------------------------------ bad files
def test_bad_files_give_clear_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.randn(256, 256), "b": torch.randn(256)}, good)
    data = good.read_bytes()
    cases: dict[str, tuple[bytes, type[Exception], str]] = {
        "empty": (b"", CorruptCheckpointError, "empty"),
        "random": (os.urandom(50_000), CorruptCheckpointError, "not a torch.save archive"),
        "cut_in_data": (data[: len(data) // 2], CorruptCheckpointError, "truncated"),
        "cut_in_directory": (data[:-200], CorruptCheckpointError, "truncated"),
        "text": (b"hello, world\n" * 10, CorruptCheckpointError, "not a torch.save archive"),
    }
    for name, (content, cls, text) in cases.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(content)
        with pytest.raises(cls, match=text) as info:
            open_archive(path)
        assert str(path) in str(info.value), name

    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedFormatError, match="legacy torch.save format"):
        open_archive(legacy)

    plain_zip = tmp_path / "plain.zip"
    with zipfile.ZipFile(plain_zip, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(CorruptCheckpointError, match="data.pkl"):
        open_archive(plain_zip)

    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    with pytest.raises(UnsupportedFormatError, match="compressed"):
        open_archive(deflated)

    not_a_dict = tmp_path / "tensor.pt"
    torch.save(torch.ones(3), not_a_dict)
    with pytest.raises(UnsupportedFormatError, match="not a state dict"):
        open_archive(not_a_dict)


def test_corrupt_data_pkl_fails_crc(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    data[info.header_offset + 200] ^= 0xFF  # inside data.pkl (after the padded local header)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC"):
        open_archive(path)


def test_legacy_scan_asks_for_more_bytes(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({f"w{i}": torch.ones(1) for i in range(50)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    with pytest.raises(LegacyNeedsMoreBytes):
        scan_legacy(data[:300], str(path), complete=False)
    scan_legacy(data, str(path), complete=True)  # safe: returns


def test_reader_rejects_bad_arguments(saved: tuple[str, dict[str, Any]]) -> None:
    with pytest.raises(ValueError, match="checkpoint_id"):
        BroadcastingTorchSaveReader().read_metadata()
    with pytest.raises(ValueError, match="coordinator_rank"):
        BroadcastingTorchSaveReader(saved[0], coordinator_rank=1).read_metadata()
    assert BroadcastingTorchSaveReader.validate_checkpoint_id(saved[0])
    assert not BroadcastingTorchSaveReader.validate_checkpoint_id(os.path.dirname(saved[0]))


def test_value_bytes_are_plain_torch_save(saved: tuple[str, dict[str, Any]]) -> None:
    archive = open_archive(saved[0])
    assert torch.load(io.BytesIO(archive.value_bytes("ids")), weights_only=True) == {1, 2, 3}


@pytest.mark.parametrize("lazy", ["conj", "neg"])
def test_a_lazy_conjugate_or_negative_view_is_refused_not_loaded_wrong(tmp_path: Path, lazy: str) -> None:
    """``torch.save(t.conj())`` stores ``t``'s elements plus a bit; ranged reads of the raw elements would drop
    it and load other values, so the archive refuses such a tensor, saying what to do."""
    base = torch.randn(20, 20, dtype=torch.complex64)
    path = tmp_path / "lazy.pt"
    torch.save({"v": base.conj() if lazy == "conj" else base._neg_view(), "plain": base}, path)
    transport, root = FsspecTransport.from_url(str(path))
    with pytest.raises(CorruptCheckpointError, match=rf"lazy.pt.*\['{lazy}'\] bits set.*resolve_conj\(\)"):
        TorchSaveArchive.open(transport, root)
