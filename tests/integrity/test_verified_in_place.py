"""Verified loads of whole tensors read straight into their destinations and hashed there.

``FsspecReader(verify=True)`` reads a record whose whole tensor a rank needs in three pieces (header, the
elements into the destination, tail) and hashes them in order; everything else keeps the general path
(fetch the record whole, check it, decode). Both must load bit-exact and must catch every damaged byte,
naming the file, the key and the checksum.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.integrity.blocks import RecordVerifier

from ._flips import dcp_records, flipped, load_error

SEED = 20261130
FLIPS = 30


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "wq": torch.randn(512, 256, generator=g),  # 512 KiB: above small_item_bytes, read in place
        "wo": torch.randn(384, 512, generator=g).to(torch.bfloat16),  # 384 KiB, in place
        "ids": torch.arange(70_000),  # 547 KiB of int64, in place
        "norm": torch.randn(256, generator=g),  # 1 KiB: the general path
    }


def _blank(dtype_of_wq: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {
        "wq": torch.zeros(512, 256, dtype=dtype_of_wq),
        "wo": torch.zeros(384, 512, dtype=torch.bfloat16),
        "ids": torch.zeros(70_000, dtype=torch.int64),
        "norm": torch.zeros(256),
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("in-place") / "ckpt"
    dcp.save(_state(), storage_writer=FsspecWriter(path), no_dist=True)
    return path


class _Paths:
    """Counts which checks ran: ``check`` (general path, whole record) or ``check_digest`` alone (in place)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.general = 0
        self.digests = 0
        check, check_digest = RecordVerifier.check, RecordVerifier.check_digest

        def counting_check(verifier: RecordVerifier, *args: Any) -> None:
            self.general += 1
            check(verifier, *args)

        def counting_digest(verifier: RecordVerifier, *args: Any) -> None:
            self.digests += 1
            check_digest(verifier, *args)

        monkeypatch.setattr(RecordVerifier, "check", counting_check)
        monkeypatch.setattr(RecordVerifier, "check_digest", counting_digest)

    @property
    def in_place(self) -> int:
        return self.digests - self.general


def test_whole_tensors_are_checked_in_place(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _Paths(monkeypatch)
    out = _blank()
    reader = FsspecReader(ckpt, verify=True)
    dcp.load(out, storage_reader=reader, no_dist=True)
    for key, value in _state().items():
        assert torch.equal(out[key], value), key
    assert (paths.in_place, paths.general) == (3, 1)
    needed = sum(v.numel() * v.element_size() for v in _state().values())
    assert reader.counters["bytes_read"] < needed + 64 * 1024  # headers, tails and the small record on top


def test_a_cast_keeps_the_general_path(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _Paths(monkeypatch)
    out = _blank(dtype_of_wq=torch.float64)
    dcp.load(out, storage_reader=FsspecReader(ckpt, verify=True), no_dist=True)
    assert torch.equal(out["wq"], _state()["wq"].double()) and torch.equal(out["wo"], _state()["wo"])
    assert (paths.in_place, paths.general) == (2, 2)


@pytest.mark.parametrize("region", ["header", "data", "tail"])
def test_every_flipped_byte_is_caught_with_file_and_key(ckpt: Path, tmp_path: Path, region: str) -> None:
    """Flips in the zip header / data.pkl, the elements, and the zip index of records read in place."""
    work = tmp_path / "flips"
    shutil.copytree(ckpt, work)
    big = [r for r in dcp_records(work) if r[2] > 256 * 1024]
    rng = random.Random(f"{SEED}-{region}")
    caught = 0
    for _ in range(FLIPS):
        name, offset, length, key = rng.choice(big)
        if region == "header":
            pos = offset + rng.randrange(0, 700)
        elif region == "data":
            pos = offset + rng.randrange(1024, length - 1024)
        else:
            pos = offset + length - 1 - rng.randrange(0, 200)
        with flipped(work / name, pos, rng):
            text = load_error(lambda: dcp.load(_blank(), storage_reader=FsspecReader(work, verify=True), no_dist=True))
        if "CorruptCheckpointError" in text and name in text and repr(key) in text and "checksum" in text:
            caught += 1
    assert caught == FLIPS
