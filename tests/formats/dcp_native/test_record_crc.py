"""DCP records are torch.save archives whose CRC-32s we compute (ISA-L) instead of torch's writer: the same
entries, offsets, sizes and CRC-32s as ``torch.save`` writes, checked by ``zipfile`` and by a load with
torch's own reader; a layout the filler does not know is refused, never written with a missing CRC-32."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecWriter, verify
from dcp_storage.formats.writing import ZipCrcFiller, ZipLayoutError, save_record

OBJECTS = {
    "matrix": torch.randn(256, 300),
    "pieces": torch.randn(3 * ZipCrcFiller.PIECE // 4 + 5),  # elements passed on in 3 whole pieces and a part
    "empty": torch.empty(0),
    "empty_2d": torch.empty(0, 3),
    "scalar": torch.tensor(3.0),
    "transposed": torch.randn(7, 3).t(),
    "bf16": torch.ones(5, dtype=torch.bfloat16),
    "view": torch.randn(100)[10:20],
    "nested": {"a": torch.arange(10), "b": [1, 2], "c": (torch.zeros(3), torch.zeros(0))},
    "no_tensor": "a string",
}


def _layout(raw: bytes) -> list[tuple[str, int, int, int]]:
    """Every entry but the random serialization id: name, CRC-32, size, header offset."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        assert z.testzip() is None  # every CRC-32 (the serialization id's too) matches its bytes
        return [
            (i.filename, i.CRC, i.file_size, i.header_offset)
            for i in z.infolist()
            if "serialization_id" not in i.filename
        ]


@pytest.mark.parametrize("name", list(OBJECTS))
def test_the_same_archive_as_torch_save(name: str) -> None:
    obj = OBJECTS[name]
    theirs, ours = io.BytesIO(), io.BytesIO()
    torch.save(obj, theirs)
    save_record(obj, ours)
    assert len(ours.getvalue()) == len(theirs.getvalue())
    assert _layout(ours.getvalue()) == _layout(theirs.getvalue())
    loaded = torch.load(io.BytesIO(ours.getvalue()), weights_only=True)
    assert type(loaded) is type(obj)
    if isinstance(obj, torch.Tensor):
        assert torch.equal(loaded, obj)


def test_a_saved_checkpoint_passes_the_zip_checks_without_its_manifest(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(64, 1000 + i) for i in range(3)} | {"e": torch.empty(0), "step": 7}
    dcp.save(state, storage_writer=FsspecWriter(str(tmp_path)), no_dist=True)
    (tmp_path / ".dcp_storage.json").unlink()  # the zip CRC-32s are what is left to check
    report = verify(str(tmp_path), deep=True)
    assert report.ok, report.problems
    assert report.checked.get("crc32_records", 0) >= 4
    back = {k: torch.empty_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)} | {"step": 0}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)  # torch's reader
    assert back["step"] == 7 and all(torch.equal(back[k], state[k]) for k in back if k != "step")


def test_an_unknown_layout_is_refused() -> None:
    out = io.BytesIO()
    filler = ZipCrcFiller(out)
    with pytest.raises(ZipLayoutError, match="unexpected"):
        filler.write(b"not a zip header")
    filler = ZipCrcFiller(io.BytesIO())
    header = bytearray(30)
    header[:4] = b"PK\x03\x04"
    header[6:8] = (0x808).to_bytes(2, "little")
    header[14:18] = (123).to_bytes(4, "little")  # a CRC-32 already there: the writer did compute one
    with pytest.raises(ZipLayoutError, match="CRC-32 already"):
        filler.write(bytes(header))
    filler = ZipCrcFiller(io.BytesIO())
    header[14:18] = bytes(4)
    header[26:28] = (4).to_bytes(2, "little")  # a 4-byte name
    filler.write(bytes(header))
    with pytest.raises(ZipLayoutError, match="name and extra"):
        filler.write(b"name and more")  # name and data in one call: not torch's writer
    filler = ZipCrcFiller(io.BytesIO())
    filler.write(bytes(header))
    filler.write(b"name")
    filler.write(b"data")
    with pytest.raises(ZipLayoutError, match="ended"):
        filler.finished()  # no descriptor, no central directory
