"""``checksum_algorithm=None`` means the same on every writer: nothing is hashed, nothing recorded, and
``verify`` and verified loads say so instead of failing; an unknown algorithm is refused by every writer
in its constructor, before any planning."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecReader, FsspecWriter, SafetensorsReader, SafetensorsWriter, verify
from dcp_storage.integrity.checksums import ChecksumAlgorithmError, HashingWriter
from dcp_storage.integrity.manifest import MANIFEST_FILE, Manifest

WRITERS = {"dcp": (FsspecWriter, FsspecReader), "safetensors": (SafetensorsWriter, SafetensorsReader)}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(16, 8, generator=g), "b": torch.randn(40, generator=g).to(torch.bfloat16)}


def _save(kind: str, path: Path, algorithm: str | None) -> None:
    writer_cls, _ = WRITERS[kind]
    dcp.save(_state(), storage_writer=writer_cls(str(path), checksum_algorithm=algorithm), no_dist=True)


def _recorded_algorithm(kind: str, path: Path) -> str | None:
    if kind == "dcp":
        manifest = Manifest.from_json((path / MANIFEST_FILE).read_bytes(), str(path))
        assert manifest.writer.startswith("dcp-storage/")  # provenance stays: only checksums are off
        return manifest.algorithm if manifest.files else None
    data = (path / "model.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])
    return header["__metadata__"].get("dcp_storage.checksum_algorithm")


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_none_records_no_checksums_and_verify_says_so(kind: str, tmp_path: Path) -> None:
    _save(kind, tmp_path / "on", "xxh3_64")
    assert _recorded_algorithm(kind, tmp_path / "on") == "xxh3_64"  # the attack's control: on by default

    path = tmp_path / "off"
    _save(kind, path, None)
    assert _recorded_algorithm(kind, path) is None
    for deep in (False, True):
        report = verify(path, deep=deep)
        assert report.ok, report.problems
        assert any("no checksums recorded" in n for n in report.notes), report.notes
    _, reader_cls = WRITERS[kind]
    out = {k: torch.zeros_like(v) for k, v in _state().items()}
    with pytest.warns(RuntimeWarning, match="records no checksums"):
        dcp.load(out, storage_reader=reader_cls(str(path), verify=True), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in _state().items())


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_unknown_algorithm_is_refused_by_every_writer(kind: str, tmp_path: Path) -> None:
    writer_cls, _ = WRITERS[kind]
    with pytest.raises(ChecksumAlgorithmError, match="md5"):
        writer_cls(str(tmp_path / "x"), checksum_algorithm="md5")
    assert not (tmp_path / "x").exists()


def test_hashing_writer_without_algorithm_counts_only() -> None:
    import io

    w = HashingWriter(io.BytesIO(), None)
    w.begin()
    w.write(b"abc")
    assert w.end() == (0, 3, None)
    with pytest.raises(RuntimeError, match="not be covered"):
        w.write(b"x")
