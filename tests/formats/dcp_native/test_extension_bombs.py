"""Stream extensions (compression) decode at most what the metadata and the stored bytes allow.

A zstd frame of zeros is a decompression bomb: 260 KB stored decode to gigabytes, and torch's own
``ZStandard`` extension would inflate all of it before anything is checked. A decoded item may be at most
its chunk's bytes (tensors, from ``.metadata``) or ``MAX_INFLATION_RATIO`` times what is stored, plus
``DCP_STORAGE_MAX_INFLATED_BYTES``; a genuine tensor of zeros, which compresses far beyond 100x, still loads.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.errors import CorruptCheckpointError

zstandard = pytest.importorskip("zstandard")
ZStandard = pytest.importorskip("torch.distributed.checkpoint._extension").ZStandard

MiB = 1 << 20


def _replace_item(root: Path, fqn: str, stored: bytes) -> str:
    """Append ``stored`` to the item's data file and point the item's storage entry at it."""
    md = pickle.loads((root / ".metadata").read_bytes())
    ((index, info),) = [(k, v) for k, v in md.storage_data.items() if k.fqn == fqn]
    path = root / info.relative_path
    offset = path.stat().st_size
    with path.open("ab") as f:
        f.write(stored)
    md.storage_data[index] = type(info)(info.relative_path, offset, len(stored), info.transform_descriptors)
    (root / ".metadata").write_bytes(pickle.dumps(md))
    (root / ".dcp_storage.json").unlink()  # its checksums no longer match; not what this test is about
    return info.relative_path


def _zeros_frame(n: int) -> bytes:
    compressor = zstandard.ZstdCompressor(level=3).compressobj()
    chunk = bytes(MiB)
    return b"".join(compressor.compress(chunk) for _ in range(n // MiB)) + compressor.flush()


def _load(root: Path, dest: dict[str, Any]) -> BaseException:
    """The error of loading ``root`` into ``dest`` (torch wraps a reader's error, keeping its message)."""
    try:
        dcp.load(dest, storage_reader=FsspecReader(str(root)), no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        assert "CorruptCheckpointError" in str(exc) or isinstance(exc, CorruptCheckpointError), exc
        return exc
    raise AssertionError("the load succeeded")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_of(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the peak resident memory (bytes) above the level before it (Linux: ``VmHWM``, reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _kib("VmRSS")
    result = fn()
    return result, (_kib("VmHWM") - before) * 1024


def test_a_zstd_bomb_in_a_non_tensor_item_is_refused_before_it_inflates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_STORAGE_MAX_INFLATED_BYTES", str(4 * MiB))
    dcp.save({"w": torch.ones(4), "step": 7}, storage_writer=FsspecWriter(str(tmp_path), extensions=[ZStandard()]))
    bomb = _zeros_frame(256 * MiB)
    assert len(bomb) < 64 * 1024  # ~ 8 KB stored, 256 MiB decoded
    file = _replace_item(tmp_path, "step", bomb)
    dest = {"w": torch.zeros(4), "step": 0}

    error, peak = _peak_of(lambda: _load(tmp_path, dest))
    text = str(error)
    assert "decompression bomb" in text and file in text and "'step'" in text, text
    assert "DCP_STORAGE_MAX_INFLATED_BYTES" in text
    assert peak < 32 * MiB, f"peak traced memory {peak / MiB:.0f} MiB"


def test_a_genuine_tensor_of_zeros_far_beyond_the_ratio_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_STORAGE_MAX_INFLATED_BYTES", "0")  # only the metadata's chunk size allows it
    sd = {"zeros": torch.zeros(2 * MiB), "step": 7}  # 8 MiB of zeros: stored in a few KB
    dcp.save(sd, storage_writer=FsspecWriter(str(tmp_path), extensions=[ZStandard()]))
    stored = sum(p.stat().st_size for p in tmp_path.glob("*.distcp"))
    assert stored * 100 < 8 * MiB
    dest = {"zeros": torch.ones(2 * MiB), "step": 0}
    dcp.load(dest, storage_reader=FsspecReader(str(tmp_path)), no_dist=True)
    assert torch.equal(dest["zeros"], sd["zeros"]) and dest["step"] == 7


def test_a_tensor_record_that_decodes_past_its_chunk_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_STORAGE_MAX_INFLATED_BYTES", str(MiB))
    dcp.save({"w": torch.ones(4)}, storage_writer=FsspecWriter(str(tmp_path), extensions=[ZStandard()]))
    file = _replace_item(tmp_path, "w", _zeros_frame(64 * MiB))
    text = str(_load(tmp_path, {"w": torch.zeros(4)}))
    assert "decompression bomb" in text and file in text and "'w'" in text, text
