"""A DCP native record must hold the chunk ``.metadata`` says it holds (dtype and shape).

torch's reader narrows whatever tensor a record holds to the slice it wants, so a ``.metadata`` that lies
about a chunk's shape or dtype (edited, or paired with another save's data files) loads without an error.
Every read path refuses it: records read whole, records read by slices (also with their layout guessed from
the metadata and fetched with the data, as on object stores), records verified in place, and ``verify --deep``; the error names the data file, the key and both descriptions.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from dcp_storage import FsspecReader, FsspecWriter, open_reader
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.dcp_native.item_loader import DcpLoaderConfig
from dcp_storage.inspection import verify

# Record layouts guessed from the metadata (as on object stores): the header read with the data must agree.
GUESSING = DcpLoaderConfig(guess_layouts=True)
BIG = 70_000  # float32 elements: above the loader's small-record size, so it is read by slices


def _state() -> dict[str, torch.Tensor]:
    return {"ids": torch.arange(10, dtype=torch.int64), "big": torch.arange(BIG, dtype=torch.float32)}


def _lying(root: Path, edit: Callable[[Any], None]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=FsspecWriter(str(root)), no_dist=True)
    md = pickle.loads((root / ".metadata").read_bytes())
    edit(md)
    (root / ".metadata").write_bytes(pickle.dumps(md))
    return root


def _dtype(md: Any) -> None:
    md.state_dict_metadata["ids"].properties.dtype = torch.float64  # same byte count as int64


def _shape_small(md: Any) -> None:
    item = md.state_dict_metadata["ids"]
    item.size = torch.Size([4])
    item.chunks[0] = ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))


def _shape_big(md: Any) -> None:
    item = md.state_dict_metadata["big"]
    item.size = torch.Size([10])
    item.chunks[0] = ChunkStorageMetadata(torch.Size([0]), torch.Size([10]))


def _dtype_big(md: Any) -> None:
    md.state_dict_metadata["big"].properties.dtype = torch.int32  # same byte count, same record length


CASES = {
    "dtype": (_dtype, {"ids": torch.zeros(10, dtype=torch.float64)}),
    "dtype-sliced-record": (_dtype_big, {"big": torch.zeros(BIG, dtype=torch.int32)}),
    "shape-whole-record": (_shape_small, {"ids": torch.zeros(4, dtype=torch.int64)}),
    "shape-sliced-record": (_shape_big, {"big": torch.zeros(10)}),
}


def _loads(root: Path, dest: dict[str, torch.Tensor], make: Callable[[str], Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, storage_reader=make(str(root)), no_dist=True)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize(
    "make",
    [open_reader, lambda u: FsspecReader(u, verify=True), lambda u: FsspecReader(u, loader_config=GUESSING)],
    ids=["open_reader", "verify=True", "guessed-layouts"],
)
def test_a_record_that_is_not_its_chunk_is_refused(tmp_path: Path, name: str, make: Callable[[str], Any]) -> None:
    edit, dest = CASES[name]
    root = _lying(tmp_path / "ckpt", edit)
    key = next(iter(dest))
    with pytest.raises(BaseException) as info:  # dcp.load wraps it in CheckpointException (a BaseException)
        _loads(root, {k: v.clone() for k, v in dest.items()}, make)
    inner = info.value
    while not isinstance(inner, CorruptCheckpointError):
        failures = getattr(inner, "failures", None)
        assert failures, f"not our error: {type(inner).__name__}: {inner}"
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
    text = str(inner)
    assert ".distcp" in text and repr(key) in text and ".metadata says" in text, text


@pytest.mark.parametrize("name", sorted(CASES))
def test_verify_deep_reports_the_mismatch(tmp_path: Path, name: str) -> None:
    root = _lying(tmp_path / "ckpt", CASES[name][0])
    report = verify(str(root), deep=True)
    assert not report.ok
    assert any(".distcp" in p and ".metadata says" in p for p in report.problems), report.problems


def test_an_honest_checkpoint_still_loads_every_way(tmp_path: Path) -> None:
    root = _lying(tmp_path / "ckpt", lambda md: None)
    for make in (
        open_reader,
        lambda u: FsspecReader(u, verify=True),
        lambda u: FsspecReader(u, loader_config=GUESSING),
    ):
        dest = {k: torch.zeros_like(v) for k, v in _state().items()}
        _loads(root, dest, make)
        for k, v in _state().items():
            assert torch.equal(dest[k], v)
    assert verify(str(root), deep=True).ok
