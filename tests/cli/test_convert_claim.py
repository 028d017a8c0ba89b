"""``convert`` and ``merge`` into a directory claim it as a save does (``.dcp_storage.lock``).

A conversion writes the same file names as a save of its format (``__0_0.distcp``, ``model.safetensors``):
without the lock, a conversion into a location another save holds went on and replaced that save's files,
and a save started during a conversion mixed its files with the conversion's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage.errors import CheckpointExistsError
from dcp_storage.formats.commit_claim import LOCK_FILE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HOLDER = b'{"save_id": "feedface", "host": "elsewhere", "pid": 7, "since": "2026-01-01T00:00:00Z"}'


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src.safetensors"
    save_file({"w": torch.arange(8.0), "b": torch.ones(3)}, str(path))
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


@pytest.mark.parametrize("to", ["dcp", "safetensors"])
def test_a_conversion_into_a_location_another_save_holds_is_refused(tmp_path: Path, source: Path, to: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_bytes(HOLDER)
    with pytest.raises(CheckpointExistsError) as info:
        ds.convert(source, out, to=to)
    assert "another save holds" in str(info.value) and "feedface" in str(info.value)
    assert _files(out) == {LOCK_FILE: HOLDER}
    ds.convert(source, out, to=to, overwrite=True)  # takes the lock over, as a save with overwrite=True does
    assert LOCK_FILE not in os.listdir(out)


def test_a_save_during_a_conversion_is_refused(tmp_path: Path, source: Path) -> None:
    out = tmp_path / "out"
    outcome: dict[str, Any] = {}

    def progress(_nbytes: int) -> None:  # after the first tensor is written: the conversion is under way
        if "save" not in outcome:
            try:
                dcp.save({"w": torch.zeros(8)}, storage_writer=ds.FsspecWriter(out), no_dist=True)
                outcome["save"] = "succeeded"
            except CheckpointException as exc:
                outcome["save"] = exc

    ds.convert(source, out, to="dcp", progress=progress)
    (inner, _trace), *_ = outcome["save"].failures.values()
    assert isinstance(inner, CheckpointExistsError) and "another save holds" in str(inner), inner
    dest = {"w": torch.empty(8), "b": torch.empty(3)}
    dcp.load(dest, storage_reader=ds.FsspecReader(out, verify=True), no_dist=True)
    assert torch.equal(dest["w"], torch.arange(8.0)) and torch.equal(dest["b"], torch.ones(3))
    assert LOCK_FILE not in os.listdir(out)


def test_a_refused_conversion_leaves_no_lock(tmp_path: Path, source: Path) -> None:
    out = tmp_path / "out"
    ds.convert(source, out, to="dcp")
    before = _files(out)
    with pytest.raises(CheckpointExistsError):
        ds.convert(source, out, to="dcp")  # a checkpoint exists: refused by the format's writer
    assert _files(out) == before


def test_merge_into_a_location_another_save_holds_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.arange(4.0)}}, storage_writer=ds.FsspecWriter(ckpt), no_dist=True)
    out = tmp_path / "merged"
    out.mkdir()
    (out / LOCK_FILE).write_bytes(HOLDER)
    with pytest.raises(CheckpointExistsError) as info:
        ds.merge_fsdp_weights(ckpt, out, overwrite=False)
    assert "feedface" in str(info.value) and _files(out) == {LOCK_FILE: HOLDER}
