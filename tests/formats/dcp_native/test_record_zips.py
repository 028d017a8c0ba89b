"""DCP records are zips inside ``.distcp`` files: what the record parser refuses, what ``verify=True`` adds,
and chunk sets that must tile their tensor (checked with the metadata, before any I/O)."""

from __future__ import annotations

import io
import pickle
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import tests.hostile.zip_mutations as zm
from dcp_storage import FsspecReader
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.dcp_native.metadata_checks import check_metadata
from dcp_storage.formats.dcp_native.torch_record import parse_tensor_record


def record(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_walker_refuses_duplicate_local_names() -> None:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(record(torch.arange(8.0)))) as zf:
        entries = [(i.filename, zf.read(i)) for i in zf.infolist()]
    order = [e for e in entries if e[0].endswith("byteorder")] + entries  # "byteorder" twice, first of all
    dup = zm.stored_zip(order)
    with pytest.raises(CorruptCheckpointError, match="two zip entries named"):
        parse_tensor_record(dup, len(dup), "mem://__0_0.distcp [0, n)")


def test_walker_refuses_a_short_zip64_field() -> None:
    """A zip64 extra field that claims 16 bytes of sizes in an extra area holding fewer (was struct.error)."""
    rec = bytearray(record(torch.arange(8.0)))
    nlen, xlen = struct.unpack_from("<HH", rec, 26)
    assert 4 <= xlen < 20  # torch pads data.pkl's local header with a short extra field
    struct.pack_into("<H", rec, 6, 0x800)  # data.pkl without a data descriptor...
    struct.pack_into("<II", rec, 18, 0xFFFFFFFF, 0xFFFFFFFF)  # ...its sizes in a zip64 field...
    struct.pack_into("<HH", rec, 30 + nlen, 1, 16)  # ...that claims 16 bytes
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp"):
        parse_tensor_record(bytes(rec), len(rec), "mem://__0_0.distcp [0, n)")


@pytest.fixture
def torch_written(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint from torch's own writer (no manifest): small records, read whole on load."""
    sd = {"a": torch.randn(64), "b": torch.randn(8, 8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(str(tmp_path / "ckpt")), no_dist=True)
    return tmp_path / "ckpt", sd


def _flip_first_storage_byte(root: Path) -> str:
    data_file = next(root.glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    at = raw.find(b"data/0") + len(b"data/0")
    start = at + struct.unpack_from("<H", raw, at - len(b"archive/data/0") - 2)[0]  # skip the extra field
    raw[start + 5] ^= 0x20
    data_file.write_bytes(bytes(raw))
    return data_file.name


def test_verify_checks_zip_crcs_of_records_read_whole(torch_written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, sd = torch_written
    name = _flip_first_storage_byte(root)

    def load(verify: bool) -> dict[str, torch.Tensor]:
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # verify=True without a manifest says so
            dcp.load(dest, storage_reader=FsspecReader(str(root), verify=verify), no_dist=True)
        return dest

    with pytest.raises(CheckpointException) as info:
        load(verify=True)
    inner = next(iter(info.value.failures.values()))
    inner = inner[0] if isinstance(inner, tuple) else inner
    assert isinstance(inner, CorruptCheckpointError) and name in str(inner) and "CRC32" in str(inner), inner
    got = load(verify=False)  # the default reads no central directory and no CRC (README: cost)
    assert any(not torch.equal(got[k], v) for k, v in sd.items())


def test_overlapping_chunks_are_named_with_the_metadata(torch_written: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, _sd = torch_written
    md = pickle.loads((root / ".metadata").read_bytes())
    info = md.storage_data.pop(MetadataIndex("b", torch.Size([0, 0])))
    spans = (([0, 0], [6, 8]), ([2, 0], [2, 8]))  # 48 + 16 = 64 elements, rows 6-7 missing, 2-3 twice
    md.state_dict_metadata["b"].chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in spans]
    for o, _n in spans:
        md.storage_data[MetadataIndex("b", torch.Size(o))] = info
    where = str(root / ".metadata")
    with pytest.raises(CorruptCheckpointError) as err:
        check_metadata(md, where)
    text = str(err.value)
    assert where in text and "'b'" in text and "[0, 0] of size [6, 8]" in text and "[2, 0] of size [2, 8]" in text
