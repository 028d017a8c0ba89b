"""Checkpoints written through ``ZstdSeekable``: round trips, ranged reads, torch interop, discovery, errors.

Real files and real readers/writers: dcp-storage's ``FsspecWriter``/``FsspecReader`` and torch's
``FileSystemWriter``/``FileSystemReader``. The plugin is found only through its entry point.
"""

from __future__ import annotations

import json
import pickle
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.formats.dcp_native.item_loader import DcpItemLoader
from dcp_storage.plugin_api import CorruptCheckpointError, DcpStorageError, open_transport
from dcp_storage.plugin_api import registry as plugin_registry
from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcp_storage_zstd import ZstdSeekable
from dcp_storage_zstd.testing import same_bits

DESCRIPTOR = "stream.zstd_seekable/1"
FRAME = 64 * 1024


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def trained_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def state() -> dict[str, Any]:
    return {
        "w_bf16": trained_like((512, 1024), torch.bfloat16, 1),  # 1 MiB: framed, read by ranges when partial
        "w_fp32": trained_like((256, 1024), torch.float32, 2),
        "bias": trained_like((1024,), torch.float32, 3),  # small: whole-item path
        "ids": torch.arange(1000, dtype=torch.int64),
        "odd": trained_like((7, 13, 5), torch.float16, 4),
        "step": 1234,  # BYTE_IO
        "name": "run-7",  # BYTE_IO
    }


def blank(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        out[k] = torch.full_like(v, 77) if isinstance(v, torch.Tensor) else type(v)()
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert same_bits(got[k], v), k
        else:
            assert got[k] == v, k


def save(path: Path, sd: dict[str, Any] | None = None, **ext: Any) -> dict[str, Any]:
    sd = sd or state()
    dcp.save(sd, storage_writer=FsspecWriter(str(path), extensions=[ZstdSeekable(frame_bytes=FRAME, **ext)]))
    return sd


def metadata(path: Path) -> Any:
    return pickle.loads((path / ".metadata").read_bytes())


def entry(path: Path, fqn: str) -> tuple[MetadataIndex, Any]:
    return next((i, s) for i, s in metadata(path).storage_data.items() if i.fqn == fqn)


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("url_kind", ["local", "memory"])
def test_round_trip_bit_exact_and_smaller(tmp_path: Path, url_kind: str) -> None:
    url = str(tmp_path) if url_kind == "local" else f"memory://zstd-{tmp_path.name}"
    sd = state()
    dcp.save(sd, storage_writer=FsspecWriter(url, extensions=[ZstdSeekable(frame_bytes=FRAME)]))
    reader = FsspecReader(url)
    dest = blank(sd)
    dcp.load(dest, storage_reader=reader)
    bytes_read = reader.counters["bytes_read"]
    assert_same(dest, sd)
    md = reader.read_metadata()
    assert {tuple(s.transform_descriptors) for s in md.storage_data.values()} == {(DESCRIPTOR,)}
    stored = sum(s.length for s in md.storage_data.values())
    metadata_bytes = len(dcp_metadata_bytes(reader))
    fs, root = fsspec.core.url_to_fs(url)
    manifest_bytes = fs.size(f"{root}/.dcp_storage.json")  # a default load is verified: it reads the manifest
    assert bytes_read == stored + metadata_bytes + manifest_bytes  # whole items: no index or header probes
    w = md.storage_data[next(i for i in md.storage_data if i.fqn == "w_bf16")]
    assert w.length < 0.85 * sd["w_bf16"].numel() * 2  # bf16 weights: the exponent bytes compress


def dcp_metadata_bytes(reader: FsspecReader) -> bytes:
    return reader.transport.read_file(reader.transport.join(reader.root, ".metadata"))


def test_writer_exposes_extensions_and_refuses_others(tmp_path: Path) -> None:
    ext = ZstdSeekable(level=5)
    writer = FsspecWriter(str(tmp_path), extensions=[ext])
    assert writer.extensions == (ext,)
    assert FsspecWriter(str(tmp_path)).extensions == ()
    with pytest.raises(TypeError, match="StreamTransformExtension"):
        FsspecWriter(str(tmp_path), extensions=[object()])  # type: ignore[list-item]


def test_manifest_names_the_distribution(tmp_path: Path) -> None:
    save(tmp_path)
    manifest = json.loads((tmp_path / ".dcp_storage.json").read_text())
    assert {"descriptor": DESCRIPTOR, "distribution": "dcp-storage-zstd", "version": "0.1.0"} in manifest["extensions"]


# ------------------------------------------------------------------------------------------ ranged reads
class _Planner:
    """The two LoadPlanner calls DcpItemLoader makes for tensors."""

    def __init__(self, dest: dict[str, torch.Tensor]) -> None:
        self.dest = dest
        self.committed: list[str] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.dest[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item.dest_index.fqn)


def read_slice(
    path: Path, fqn: str, offsets: list[int], lengths: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    """Load ``stored[fqn][offsets : offsets + lengths]`` the way a resharding rank does; returns bytes read."""
    md = metadata(path)
    index, _ = entry(path, fqn)
    transport, root = open_transport(str(path))
    planner = _Planner({fqn: torch.full(lengths, 77, dtype=dtype)})
    item = ReadItem(
        LoadItemType.TENSOR, MetadataIndex(fqn, [0] * len(lengths)), [0] * len(lengths), index, offsets, lengths
    )
    DcpItemLoader(transport, root, md.storage_data, metadata=md).load([item], planner)
    assert planner.committed == [fqn]
    return planner.dest[fqn], transport.counters.snapshot()["bytes_read"]


@pytest.mark.parametrize(
    ("fqn", "offsets", "lengths"),
    [
        ("w_bf16", [0, 0], [256, 1024]),  # first half (FSDP-style Shard(0) at 2 ranks)
        ("w_bf16", [341, 0], [171, 1024]),  # last third, across frame boundaries
        ("w_bf16", [100, 3], [9, 17]),  # a small block in the middle
        ("w_fp32", [128, 0], [64, 1024]),
        ("w_fp32", [0, 512], [256, 512]),  # columns: every frame, still exact
    ],
)
def test_partial_reads_fetch_only_covering_frames(
    tmp_path: Path, fqn: str, offsets: list[int], lengths: list[int]
) -> None:
    sd = save(tmp_path)
    full = sd[fqn]
    got, bytes_read = read_slice(tmp_path, fqn, offsets, lengths, full.dtype)
    want = full[offsets[0] : offsets[0] + lengths[0], offsets[1] : offsets[1] + lengths[1]]
    assert same_bits(got, want.contiguous())
    stored = entry(tmp_path, fqn)[1].length
    fraction = (lengths[0] * lengths[1]) / full.numel()
    if lengths[1] == full.shape[1]:  # row blocks: the covering frames, the header frame and the seek table
        frame_stored = stored / (full.numel() * full.element_size() / FRAME)
        assert bytes_read <= fraction * stored + 3 * frame_stored + 4096, (bytes_read, stored)
        assert bytes_read < stored
    else:
        assert bytes_read <= stored + 4096


def test_partial_read_casts_dtype(tmp_path: Path) -> None:
    sd = save(tmp_path)
    got, _ = read_slice(tmp_path, "w_bf16", [10, 0], [20, 1024], torch.float32)
    assert torch.equal(got, sd["w_bf16"][10:30].float())


@pytest.mark.parametrize("lie", ["dtype", "shape"])
def test_partial_read_of_a_record_that_is_not_its_chunk_is_refused(tmp_path: Path, lie: str) -> None:
    """The frame-by-frame path checks the record against .metadata as the other read paths do: a .metadata
    saying int32 for a float32 record (same element size), or fewer rows than the record holds, is refused."""
    save(tmp_path)
    md = metadata(tmp_path)
    item = md.state_dict_metadata["w_fp32"]
    if lie == "dtype":
        item.properties.dtype = torch.int32
    else:
        item.size = torch.Size([200, 1024])
        item.chunks[0].sizes = torch.Size([200, 1024])
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=r"__0_\d\.distcp.*'w_fp32'.*do not belong together"):
        read_slice(tmp_path, "w_fp32", [128, 0], [64, 1024], torch.int32 if lie == "dtype" else torch.float32)


def test_whole_chunk_reads_skip_the_index(tmp_path: Path) -> None:
    sd = save(tmp_path)
    got, bytes_read = read_slice(tmp_path, "w_bf16", [0, 0], [512, 1024], torch.bfloat16)
    assert same_bits(got, sd["w_bf16"])
    assert bytes_read == entry(tmp_path, "w_bf16")[1].length


# ------------------------------------------------------------------------------------------ torch interop
def test_torch_reader_reads_ours(tmp_path: Path) -> None:
    sd = save(tmp_path)
    registry = ExtensionRegistry()
    registry.register(ZstdSeekable)
    dest = blank(sd)
    dcp.load(dest, storage_reader=dcp.FileSystemReader(str(tmp_path), _extension_registry=registry))
    assert_same(dest, sd)


@pytest.mark.parametrize("extension", [ZStandard, ZstdSeekable])
def test_we_read_torch_writer_output(tmp_path: Path, extension: type) -> None:
    sd = state()
    ext = ZstdSeekable(frame_bytes=FRAME) if extension is ZstdSeekable else ZStandard()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path), _extensions=[ext]))
    dest = blank(sd)
    dcp.load(dest, storage_reader=FsspecReader(str(tmp_path)))  # no registry: torch's defaults + the entry point
    assert_same(dest, sd)
    if extension is ZstdSeekable:  # torch wrote the seekable format: our ranged reads work on it too
        got, bytes_read = read_slice(tmp_path, "w_bf16", [256, 0], [256, 1024], torch.bfloat16)
        assert same_bits(got, sd["w_bf16"][256:]) and bytes_read < entry(tmp_path, "w_bf16")[1].length


# ------------------------------------------------------------------------------------------ discovery
def test_found_only_through_the_entry_point() -> None:
    (info,) = [i for i in plugin_registry.list("extensions") if i.name == "stream.zstd_seekable"]
    assert info.distribution == "dcp-storage-zstd" and info.target == "dcp_storage_zstd:ZstdSeekable"
    assert plugin_registry.get("extensions", "stream.zstd_seekable") is ZstdSeekable
    assert "stream.zstd_seekable" not in ExtensionRegistry().extensions  # torch alone does not know it


_FRESH_LOAD = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from dcp_storage import FsspecReader
assert "dcp_storage_zstd" not in sys.modules
dest = {"w": torch.zeros(300, 1000)}
dcp.load(dest, storage_reader=FsspecReader(sys.argv[1]))
assert "dcp_storage_zstd" in sys.modules  # imported by the registry, for the descriptor it met
print(float(dest["w"].double().sum()))
"""


def test_a_fresh_process_finds_the_plugin_by_itself(tmp_path: Path) -> None:
    """No import of dcp_storage_zstd and no registry argument: the entry point is the only way in."""
    import subprocess
    import sys

    sd = save(tmp_path, {"w": trained_like((300, 1000), torch.float32, 7)})
    cmd = [sys.executable, "-c", _FRESH_LOAD, str(tmp_path)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip()) == float(sd["w"].double().sum())


@pytest.fixture
def plugin_missing() -> Iterator[None]:
    """As if dcp-storage-zstd were not installed (its entry point gone), restored afterwards."""
    plugin_registry.unregister("extensions", "stream.zstd_seekable")
    try:
        yield
    finally:
        plugin_registry.reload()


def _load_error(path: Path, sd: dict[str, Any]) -> BaseException:
    with pytest.raises(CheckpointException) as info:
        dcp.load(blank(sd), storage_reader=FsspecReader(str(path)))
    (inner, _trace), *_ = info.value.failures.values()
    return inner


def test_unknown_descriptor_names_file_key_and_distribution(tmp_path: Path, plugin_missing: None) -> None:
    sd = save(tmp_path, {"w": trained_like((300, 1000), torch.float32, 5)})
    err = _load_error(tmp_path, sd)
    assert isinstance(err, DcpStorageError) and isinstance(err, LookupError), repr(err)
    message = str(err)
    assert "__0_" in message and ".distcp" in message and "'w'" in message and DESCRIPTOR in message
    assert "pip install 'dcp-storage-zstd==0.1.0'" in message, message


def test_unknown_descriptor_without_manifest(tmp_path: Path, plugin_missing: None) -> None:
    sd = save(tmp_path, {"w": trained_like((30, 10), torch.float32, 6)})
    (tmp_path / ".dcp_storage.json").unlink()
    message = str(_load_error(tmp_path, sd))
    assert DESCRIPTOR in message and "no manifest" in message and "'w'" in message, message


def test_verify_names_the_missing_plugin_once(tmp_path: Path, plugin_missing: None) -> None:
    """verify used to say OK without the plugin, and --deep repeated the problem for every item."""
    from dcp_storage import verify

    save(tmp_path)
    for deep in (False, True):
        report = verify(tmp_path, deep=deep)
        assert len(report.problems) == 1, report.problems
        assert DESCRIPTOR in report.problems[0] and "pip install 'dcp-storage-zstd==0.1.0'" in report.problems[0]
        assert f"{len(state())} item(s)" in report.problems[0], report.problems[0]


_SHADOW = "raise ImportError('dcp_storage_zstd needs zstandard >= 0.22')\n"


def test_cli_verify_without_an_importable_plugin(tmp_path: Path) -> None:
    """The plugin installed but failing to import (a shadowing package here): one problem with the reason."""
    import os
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    save(ckpt)
    shadow = tmp_path / "shadow" / "dcp_storage_zstd"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(_SHADOW)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "dcp_storage.cli", "verify", str(ckpt), "--deep"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    problems = [line for line in done.stdout.splitlines() if line.startswith("PROBLEM:")]
    assert len(problems) == 1, done.stdout
    assert DESCRIPTOR in problems[0] and "needs zstandard >= 0.22" in problems[0], problems[0]


# ------------------------------------------------------------------------------------------ corruption
def _damage(path: Path, fqn: str, where: float) -> None:
    """Flip 16 bytes at fraction ``where`` of the stored item (negative: that many bytes before its end)."""
    _, info = entry(path, fqn)
    data_file = path / info.relative_path
    raw = bytearray(data_file.read_bytes())
    pos = info.offset + (int(info.length * where) if where >= 0 else info.length + int(where))
    raw[pos : pos + 16] = bytes(b ^ 0x5A for b in raw[pos : pos + 16])
    data_file.write_bytes(bytes(raw))


def test_corrupt_frames_raise_our_error_whole_path(tmp_path: Path) -> None:
    sd = save(tmp_path)
    _damage(tmp_path, "w_bf16", 0.5)
    err = _load_error(tmp_path, sd)
    assert isinstance(err, CorruptCheckpointError), repr(err)
    assert "'w_bf16'" in str(err) and ".distcp" in str(err)


@pytest.mark.parametrize("where", [0.3, -40, -16])  # a frame; seek table entries; the table's footer
def test_corrupt_frames_raise_our_error_ranged_path(tmp_path: Path, where: float) -> None:
    save(tmp_path)
    _damage(tmp_path, "w_bf16", where)
    with pytest.raises(CorruptCheckpointError) as info:
        read_slice(tmp_path, "w_bf16", [0, 0], [400, 1024], torch.bfloat16)
    assert "'w_bf16'" in str(info.value) and ".distcp" in str(info.value)


# ------------------------------------------------------------------------------------------ bombs
def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.parametrize("fqn", ["step", "w_bf16"])
def test_a_seek_table_claiming_gigabytes_is_refused_before_allocating(
    tmp_path: Path, fqn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item of ~100 stored bytes whose seek table claims 512 MiB of empty frames: refused from the
    table alone (a non-tensor value: 100x its stored size plus DCP_STORAGE_MAX_INFLATED_BYTES; a tensor:
    its chunk's bytes), nothing allocated for it."""
    monkeypatch.setenv("DCP_STORAGE_MAX_INFLATED_BYTES", str(1 << 20))
    sd = save(tmp_path, {"w_bf16": torch.ones(8, dtype=torch.bfloat16), "step": 7})
    n, claimed = 8, 64 << 20
    body = b"".join(struct.pack("<II", 0, claimed) for _ in range(n)) + struct.pack("<IBI", n, 0, 0x8F92EAB1)
    table = struct.pack("<II", 0x184D2A5E, len(body)) + body
    index, info = entry(tmp_path, fqn)
    data_file = tmp_path / info.relative_path
    offset = data_file.stat().st_size
    data_file.write_bytes(data_file.read_bytes() + table)
    md = metadata(tmp_path)
    md.storage_data[index] = type(info)(info.relative_path, offset, len(table), info.transform_descriptors)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    (tmp_path / ".dcp_storage.json").unlink()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM
    before = _kib("VmRSS")
    err = _load_error(tmp_path, sd)
    assert (_kib("VmHWM") - before) < 64 * 1024, "the claimed size was allocated"
    assert isinstance(err, CorruptCheckpointError), repr(err)
    assert "decompression bomb" in str(err) and f"'{fqn}'" in str(err) and ".distcp" in str(err), str(err)
