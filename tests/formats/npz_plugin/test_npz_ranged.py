"""A format plugin built on ``RawTensorReader`` reads only the bytes of the slices a rank needs.

The ``npz`` test plugin (``site/dcp_storage_npz``) is a scan of the archive's headers and nothing else; its
reader is the core's. Counted by the transport: 2 gloo ranks loading ``Shard(0)`` DTensors together read
about the bytes their slices hold (not each array whole, as the plugin did when it decoded members with
``numpy.load``), a replicated load under ``read_once`` reads each byte once for both ranks, and the values
are numpy's own. Hostile archives (a compressed member, a truncated member, a header claiming more bytes
than the member or the file holds, pickled object arrays) get our errors naming the file and the member.
"""

from __future__ import annotations

import io
import struct
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import open_reader, registry, verify
from dcp_storage.errors import CorruptCheckpointError, DcpStorageError
from dcp_storage.plugin_api import RawTensor, RawTensorReader, open_transport
from dcp_storage_testing.distributed import run_ranks
from tests.formats.npz_plugin import _rank_fns as R

SITE = Path(__file__).with_name("site")


@pytest.fixture
def npz_plugin() -> Iterator[None]:
    sys.path.insert(0, str(SITE))
    registry.reload()
    try:
        yield
    finally:
        sys.path.remove(str(SITE))
        for name in [m for m in sys.modules if m.split(".")[0] == "dcp_storage_npz"]:
            del sys.modules[name]
        registry.reload()


def _native(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), order="C"))  # keeps 0-d arrays 0-d


def _header_bytes(path: Path) -> int:
    """What the plugin's scan alone reads (zip tail, directory, local and .npy headers), counted."""
    from dcp_storage_npz.archive import scan_npz

    transport, at = open_transport(str(path))
    with transport:
        scan_npz(transport, at)
        return transport.counters.snapshot()["bytes_read"]


# ------------------------------------------------------------------------------------- 2 ranks, counted
def test_two_ranks_shard0_read_the_bytes_of_their_slices(npz_plugin: None, tmp_path: Path) -> None:
    path = tmp_path / "big.npz"
    np.savez(path, **R.arrays())
    data = sum(a.nbytes for a in R.arrays().values())
    headers = _header_bytes(path)

    ranks = run_ranks(R.load_both, 2, str(path), str(SITE), timeout=120.0)
    per_rank = [r["shard0"] for r in ranks]
    read = sum(r["bytes_read"] for r in per_rank)
    needed = sum(r["needed"] for r in per_rank)
    assert needed == data  # Shard(0) over 2 ranks: together they need every byte once
    print(
        f"npz Shard(0), 2 ranks: read {read} bytes ({headers} of them headers), needed {needed}: {read / needed:.4f}x"
    )
    assert read - headers <= 1.05 * needed, (read, headers, needed)
    assert read <= 1.05 * needed, (read, headers, needed)  # headers included: the bar
    assert headers < 0.01 * needed
    assert per_rank[1]["bytes_read"] <= 1.05 * per_rank[1]["needed"]  # not the arrays whole: half of them

    # Replicate(): each rank needs everything; read_once fetches each byte once for both ranks.
    once = [r["replicate"] for r in ranks]
    assert sum(r["needed"] for r in once) == 2 * data
    assert sum(r["bytes_read"] for r in once) <= 1.05 * data, once


# ----------------------------------------------------------------------------------- one process, exact
def _zoo() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((33, 17)).astype(np.float32),
        "f64_big": rng.standard_normal((5, 6)).astype(">f8"),
        "f16": rng.standard_normal(40).astype(np.float16),
        "i16_big": np.arange(-12, 12, dtype=">i2").reshape(4, 6),
        "u8": np.arange(200, dtype=np.uint8),
        "bool": rng.random((3, 5)) > 0.5,
        "c64": (rng.standard_normal(6) + 1j * rng.standard_normal(6)).astype(np.complex64),
        "fortran": np.asfortranarray(rng.standard_normal((7, 9)).astype(np.float32)),
        "fortran3": np.asfortranarray(np.arange(60, dtype=np.int32).reshape(3, 4, 5)),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def test_values_equal_numpys_own_load(npz_plugin: None, tmp_path: Path) -> None:
    path = tmp_path / "zoo.npz"
    np.savez(path, **_zoo())
    with np.load(path, allow_pickle=False) as npz:
        want = {k: _native(npz[k]) for k in npz.files}
    state = {k: torch.full_like(v, 7) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in want.items()}
    dcp.load(state, storage_reader=open_reader(path))
    for key, expected in want.items():
        assert state[key].dtype == expected.dtype and torch.equal(state[key], expected), key


def test_a_partial_load_reads_only_its_members(npz_plugin: None, tmp_path: Path) -> None:
    """One key of many: the bytes read are its data and the headers, never the other members."""
    path = tmp_path / "zoo.npz"
    arrays = {
        "big_a": np.ones((256, 256), np.float32),
        "big_b": np.arange(65536, dtype=np.float32),
        "small": np.ones(3),
    }
    np.savez(path, **arrays)
    reader = open_reader(path)
    state = {"big_b": torch.zeros(65536)}
    dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(state["big_b"], _native(arrays["big_b"]))
    assert reader.counters["bytes_read"] == arrays["big_b"].nbytes + _header_bytes(path)


# ---------------------------------------------------------------------------------------------- hostile
def _load_all(path: Path) -> None:
    reader = open_reader(path, format="npz")
    metadata = reader.read_metadata()
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}
    dcp.load(state, storage_reader=open_reader(path, format="npz"))


def test_a_compressed_member_is_refused_naming_file_key_and_fix(npz_plugin: None, tmp_path: Path) -> None:
    path = tmp_path / "packed.npz"
    np.savez_compressed(path, w=np.ones(1000))
    with pytest.raises(
        DcpStorageError, match=r"packed\.npz \(member 'w\.npy'\): the member is compressed.*numpy\.savez"
    ):
        open_reader(path).read_metadata()
    report = verify(path)
    assert not report.ok and any("w.npy" in p and "compressed" in p for p in report.problems), report


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=False)
    return buf.getvalue()


def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """A ``.npy`` 1.0 header as numpy writes it (padded to 64 bytes), claiming whatever shape it is given."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    text += " " * (-(10 + len(text) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


def _zip(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, body in members.items():
            zf.writestr(name, body)


def test_a_truncated_member_is_refused(npz_plugin: None, tmp_path: Path) -> None:
    """A consistent zip whose ``.npy`` member holds fewer bytes than its header's shape: refused, never half-read."""
    path = tmp_path / "short.npz"
    _zip(path, {"ok.npy": _npy(np.ones(4)), "w.npy": _npy(np.arange(100.0))[:-80]})
    with pytest.raises(CorruptCheckpointError, match=r"short\.npz \(member 'w\.npy'\): holds 720 data bytes.*says 800"):
        _load_all(path)
    report = verify(path)
    assert [p for p in report.problems if "w.npy" in p] and report.checked["tensors"] == 1, report


def test_a_header_claiming_more_bytes_than_the_member_or_file_is_refused(npz_plugin: None, tmp_path: Path) -> None:
    # a .npy header whose length field runs past its member
    head = bytearray(_npy(np.ones(4)))
    struct.pack_into("<H", head, 8, 60_000)
    path = tmp_path / "long_header.npz"
    _zip(path, {"w.npy": bytes(head)})
    with pytest.raises(
        CorruptCheckpointError, match=r"long_header\.npz \(member 'w\.npy'\): its \.npy header claims 60000"
    ):
        _load_all(path)
    # a shape of 2**40 float64s in a 32-byte member: refused before anything is allocated or read
    huge = tmp_path / "huge.npz"
    _zip(huge, {"w.npy": _npy_header("<f8", (1 << 40,)) + bytes(32)})
    with pytest.raises(
        CorruptCheckpointError, match=r"huge\.npz \(member 'w\.npy'\): holds 32 data bytes.*8796093022208"
    ):
        _load_all(huge)


def test_a_zip_directory_claiming_more_bytes_than_the_file_is_refused(npz_plugin: None, tmp_path: Path) -> None:
    path = tmp_path / "grown.npz"
    np.savez(path, a=np.arange(100.0), b=np.ones(10))
    raw = bytearray(path.read_bytes())
    record = raw.rfind(b"PK\x01\x02")  # b.npy's central record: its sizes now say a megabyte
    struct.pack_into("<II", raw, record + 20, 1 << 20, 1 << 20)
    path.write_bytes(bytes(raw))
    with pytest.raises(
        CorruptCheckpointError, match=r"grown\.npz: zip entry 'b\.npy' .* overlaps the central directory"
    ):
        _load_all(path)


def _past_the_end(transport: object, path: str) -> list[RawTensor]:
    return [RawTensor("w", 16, torch.float32, (1000,))]


def _outside(transport: object, path: str) -> list[RawTensor]:
    return [RawTensor("w", 0, torch.float32, (1,), file="../secret.bin")]


def test_the_reader_bounds_every_row_a_scan_gives(tmp_path: Path) -> None:
    """The seam checks what any plugin's scan read from a checkpoint: bytes inside the file, files under it."""
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(1000))
    (tmp_path / "secret.bin").write_bytes(bytes(64))
    with pytest.raises(
        CorruptCheckpointError,
        match=r"blob\.bin \(tensor 'w'\): .* end at byte 4016, past the end of the 1000-byte file",
    ):
        RawTensorReader(path, _past_the_end, format_name="blob").read_metadata()
    with pytest.raises(CorruptCheckpointError, match=r"secret\.bin"):
        RawTensorReader(tmp_path, _outside).read_metadata()
