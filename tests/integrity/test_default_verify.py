"""Verified by default: a local bit flip is refused without ``verify=True``; a torch-overwritten checkpoint
(stale manifest) loads with ``verify=True`` and ``verify`` reports no problem; ``verify --deep`` catches a
flip in a torch-written checkpoint through the zip CRC-32. Each of these failed before: flips loaded
silently, the stale manifest gave a "checksum mismatch" per record, and ``--deep`` said "OK"."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage.cli import main as cli_main
from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.writer import FsspecWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(768, 1024, generator=g), "small": torch.randn(50, generator=g), "step": seed}


def _blank() -> dict[str, object]:
    return {"big": torch.zeros(768, 1024), "small": torch.zeros(50), "step": 0}


def _flip(ckpt: Path) -> None:
    f = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside 'big''s elements
    f.write_bytes(data)


@pytest.mark.parametrize("writer", ["ours", "torch"])
def test_a_flipped_bit_at_rest_is_refused_by_default(tmp_path: Path, writer: str) -> None:
    ckpt = tmp_path / "c"
    make = FsspecWriter(str(ckpt)) if writer == "ours" else dcp.FileSystemWriter(str(ckpt))
    dcp.save(_state(1), storage_writer=make, no_dist=True)
    _flip(ckpt)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_blank(), storage_reader=FsspecReader(str(ckpt)), no_dist=True)
    text = str(info.value)
    assert "CorruptCheckpointError" in text and ".distcp" in text and "'big'" in text and "restore the file" in text
    dcp.load(_blank(), storage_reader=FsspecReader(str(ckpt), verify=False), no_dist=True)  # the opt-out


def test_the_manifest_records_the_metadata_digest_and_blocks(tmp_path: Path) -> None:
    dcp.save(_state(1), storage_writer=FsspecWriter(str(tmp_path)), no_dist=True)
    doc = json.loads((tmp_path / ".dcp_storage.json").read_bytes())
    assert doc["metadata"]["size"] == (tmp_path / ".metadata").stat().st_size
    assert doc["checksums"]["block_size"] == 1 << 20
    blocks = [b for f in doc["checksums"]["files"].values() for b in f.get("blocks", ())]
    assert [b[3] for b in blocks] == [64 * 1024]  # 'big' (3 MiB): blocks of 1/64 of it; 'small' has none


def test_a_torch_overwritten_checkpoint_loads_verified_and_verifies_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp.save(_state(1), storage_writer=FsspecWriter(str(tmp_path)), no_dist=True)
    new = _state(2)
    dcp.save(new, storage_writer=dcp.FileSystemWriter(str(tmp_path), overwrite=True), no_dist=True)
    out = _blank()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dcp.load(out, storage_reader=FsspecReader(str(tmp_path), verify=True), no_dist=True)
    assert torch.equal(out["big"], new["big"])  # type: ignore[arg-type]
    stale = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(stale) == 1 and ".dcp_storage.json" in stale[0] and ".metadata" in stale[0], stale
    for args in ([str(tmp_path)], [str(tmp_path), "--deep"]):
        assert cli_main(["verify", *args]) == 0
        text = capsys.readouterr().out
        assert "PROBLEM" not in text and text.count("does not describe") == 1, text


def test_verify_deep_catches_a_flip_in_a_torch_written_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp.save(_state(1), storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert cli_main(["verify", str(tmp_path), "--deep"]) == 0
    capsys.readouterr()
    _flip(tmp_path)
    assert cli_main(["verify", str(tmp_path), "--deep"]) == 1
    text = capsys.readouterr().out
    assert text.count("PROBLEM") == 1 and "CRC-32" in text and "'big'" in text, text
