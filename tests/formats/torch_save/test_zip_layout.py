"""Zip layouts a torch.save reader must refuse, and the ones it must keep reading.

Every attack is made from a valid ``torch.save`` file by one edit (:mod:`tests.hostile.zip_mutations`) and
must fail at :meth:`TorchSaveArchive.open` with :class:`CorruptCheckpointError` naming the file and saying
what is wrong. Valid archives of other zip writers (deflated ``data.pkl``, zip64 fields everywhere) still
load bit-exact. Deflate bombs cost their declared size, never what they would inflate to.
"""

from __future__ import annotations

import io
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tests.hostile.zip_mutations as zm
from dcp_storage import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.torch_save import TorchSaveArchive
from dcp_storage.formats.torch_save.zip_layout import check_zip_bytes
from dcp_storage.transports import FsspecTransport

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(16, 8, generator=g), "big": torch.randn(4096, generator=g), "ids": torch.arange(10)}


@pytest.fixture(scope="module")
def good() -> bytes:
    buf = io.BytesIO()
    torch.save(state(), buf)
    return buf.getvalue()


def open_bytes(tmp_path: Path, data: bytes, name: str = "model.pt") -> TorchSaveArchive:
    path = tmp_path / name
    path.write_bytes(data)
    transport, p = FsspecTransport.from_url(str(path))
    archive = TorchSaveArchive.open(transport, p)
    archive._data_starts()  # every storage record's local header
    return archive


ATTACKS = {
    "duplicate name": (lambda b: zm.duplicate_entry(b, "data/0", bytes(512)), "two entries named"),
    "local name": (lambda b: zm.patch_local(b, "data/0", name_bytes=b"archive/data/X"), "name b'archive/data/X'"),
    "central offset": (lambda b: zm.edit_entry(b, "data/2", offset=zm.local_offset(b, "data/0")), "overlaps"),
    "local method": (lambda b: zm.patch_local(b, "data/0", method=8), "compression method 8"),
    "local sizes": (lambda b: zm.patch_local(b, "data/0", flags=0x800, csize=4, usize=4), "disagrees"),
    "local flags": (lambda b: zm.patch_local(b, "data/2", flags=0x800), "flags 0x0800"),
    "descriptor sizes": (lambda b: zm.patch_local(b, "data/1", csize=7, usize=7), "sizes 7/7"),
    "local extra +4": (lambda b: zm.shift_local_data(b, "data/0"), "'archive/data/0' (local header at byte"),
    "stored sizes": (lambda b: zm.edit_entry(b, "data/2", csize=16), "stored uncompressed"),
    "encrypted": (lambda b: zm.edit_entry(b, "data/0", flags=0x809), "encrypted"),
    "overlap": (lambda b: zm.overlapping_entry(b, "data/2", "data/1"), "overlaps entry"),
    "zip64 empty": (lambda b: zm.edit_entry(b, "data/0", usize=0xFFFFFFFF, extra=b"\x01\x00\x00\x00"), "zip64"),
    "zip64 short": (
        lambda b: zm.edit_entry(b, "data/0", csize=0xFFFFFFFF, usize=0xFFFFFFFF, extra=b"\x01\x00\x08\x00" + bytes(8)),
        "needs 2 zip64 values",
    ),  # fmt: skip
    "zip64 overrun": (lambda b: zm.edit_entry(b, "data/0", offset=0xFFFFFFFF, extra=b"\x01\x00\xff\xff"), "runs past"),
    "zip64 missing": (lambda b: zm.edit_entry(b, "data/0", offset=0xFFFFFFFF, extra=b""), "has none"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_layout_attacks_are_refused(tmp_path: Path, good: bytes, attack: str) -> None:
    mutate, says = ATTACKS[attack]
    with pytest.raises(CorruptCheckpointError) as info:
        open_bytes(tmp_path, mutate(good))
    assert "model.pt" in str(info.value) and says in str(info.value), str(info.value)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_the_same_attacks_on_a_record_in_memory(good: bytes, attack: str) -> None:
    """DCP records are zips read whole: the in-memory check refuses the same layouts."""
    mutate, says = ATTACKS[attack]
    with pytest.raises(CorruptCheckpointError) as info:
        check_zip_bytes(mutate(good), "mem://__0_0.distcp [0, n)")
    assert "__0_0.distcp" in str(info.value) and says in str(info.value), str(info.value)


@pytest.mark.parametrize("reader", ["open_reader", "broadcasting"])
def test_a_local_header_with_4_undeclared_extra_bytes_is_refused_on_load(
    tmp_path: Path, good: bytes, reader: str
) -> None:
    """Issue 20 (turn 2): the tensor's bytes were read 4 bytes late and loaded silently as wrong values."""
    from dcp_storage import open_reader

    path = tmp_path / "model.pt"
    path.write_bytes(zm.shift_local_data(good, "data/0"))
    storage = open_reader(str(path)) if reader == "open_reader" else BroadcastingTorchSaveReader(str(path))
    dest = {k: torch.empty_like(v) for k, v in state().items()}
    with pytest.raises(CheckpointException) as info:
        dcp.load(dest, storage_reader=storage, planner=DynamicMetaLoadPlanner(), no_dist=True)
    text = str(info.value)
    assert "CorruptCheckpointError" in text and "model.pt" in text and "archive/data/0" in text, text


def _entries(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def test_deflate_bomb_costs_its_declared_size_only(tmp_path: Path, good: bytes) -> None:
    """data.pkl inflating to 2 GiB while it declares its real size: refused after producing one byte more."""
    bomb = zm.deflate_bomb_zip(_entries(good), "archive/data.pkl", inflated=2 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="inflates to more than the .* bytes it declares"):
            open_bytes(tmp_path, bomb)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak {peak / 2**20:.0f} MiB while refusing a 2 GiB bomb"


def test_declared_ratio_above_the_limit_is_refused_before_inflating(tmp_path: Path, good: bytes) -> None:
    bomb = zm.deflate_bomb_zip(_entries(good), "archive/data.pkl", inflated=300 << 20, declared=300 << 20)
    with pytest.raises(CorruptCheckpointError, match="a ratio above 100"):
        open_bytes(tmp_path, bomb)


def test_deflated_data_pkl_and_zip64_fields_still_load(tmp_path: Path, good: bytes) -> None:
    """Archives rewritten by Python's zipfile: data.pkl deflated, then every entry with zip64 fields."""
    entries = _entries(good)
    deflated = io.BytesIO()
    with zipfile.ZipFile(deflated, "w") as zf:
        for name, data in entries:
            zf.writestr(
                name, data, compress_type=zipfile.ZIP_DEFLATED if name.endswith("data.pkl") else zipfile.ZIP_STORED
            )
    wide = io.BytesIO()
    with zipfile.ZipFile(wide, "w") as zf:
        for name, data in entries:
            with zf.open(zipfile.ZipInfo(name), "w", force_zip64=True) as out:
                out.write(data)
    for tag, data in (("deflated", deflated.getvalue()), ("zip64", wide.getvalue())):
        check_zip_bytes(data, tag)
        path = tmp_path / f"{tag}.pt"
        path.write_bytes(data)
        dest = {k: torch.zeros_like(v) for k, v in state().items()}
        dcp.load(dest, storage_reader=BroadcastingTorchSaveReader(str(path), verify=True), planner=DynamicMetaLoadPlanner(), no_dist=True)  # fmt: skip
        assert all(torch.equal(dest[k], v) for k, v in state().items()), tag


def _flip_tensor_byte(data: bytes, name: str, at: int) -> bytes:
    out = bytearray(data)
    head = zm.local_offset(data, name)
    out[head + 30 + int.from_bytes(data[head + 26 : head + 28], "little") + int.from_bytes(data[head + 28 : head + 30], "little") + at] ^= 0x04  # fmt: skip
    return bytes(out)


def test_verify_checks_the_crc_of_tensors_read_whole(tmp_path: Path, good: bytes) -> None:
    path = tmp_path / "flipped.pt"
    path.write_bytes(_flip_tensor_byte(good, "data/1", 999))  # tensor "big"

    def load(verify: bool) -> dict[str, torch.Tensor]:
        dest = {k: torch.zeros_like(v) for k, v in state().items()}
        reader = BroadcastingTorchSaveReader(str(path), verify=verify)
        dcp.load(dest, storage_reader=reader, planner=DynamicMetaLoadPlanner(), no_dist=True)
        return dest

    with pytest.raises(CheckpointException) as info:  # dcp.load wraps the reader's CorruptCheckpointError
        load(verify=True)
    inner = next(iter(info.value.failures.values()))
    inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback) in recent torch
    text = f"{type(inner).__name__}: {inner}"
    assert text.startswith("CorruptCheckpointError") and "flipped.pt" in text and "'big'" in text and "CRC32" in text, (
        text
    )
    assert not torch.equal(load(verify=False)["big"], state()["big"])  # the default does not check (README)


def test_valid_torch_save_archives_pass_the_in_memory_check() -> None:
    for obj in (state(), torch.ones(3), {"x": 1, "t": [torch.zeros(0), torch.arange(3).t()]}, torch.tensor(2.5)):
        buf = io.BytesIO()
        torch.save(obj, buf)
        entries = check_zip_bytes(buf.getvalue(), "mem")
        assert any(n.endswith("data.pkl") for n in entries)
