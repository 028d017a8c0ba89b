"""torch's ``Metadata`` as views of columns: the same maps as the dicts they replace, and loads through them.

The views must answer every question a dict of the same entries answers (lookups, membership, order,
length, items), pickle as their columns, and serve ``dcp.load`` (torch's ``DefaultLoadPlanner``, its
``_load_state_dict_from_keys``, this library's planner, a 2-rank resharding DTensor load) when
``load_metadata`` hands them out: ``DCP_STORAGE_METADATA_DECODER=python`` builds columns without the native
decoder and ``DCP_STORAGE_LAZY_METADATA_ENTRIES=0`` serves views at any size.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage.formats.columns import columns_from_metadata, columns_of, metadata_from_columns
from dcp_storage.formats.dcp_native import native as metadata_io
from dcp_storage.formats.dcp_native.native import StateDictView, StorageDataView, lazy_metadata
from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage_testing.distributed import run_ranks

from . import _lazy_rank_fns


@pytest.fixture
def lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_metadata`` serves views of columns for every checkpoint (rank processes inherit it)."""
    monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", "python")
    monkeypatch.setenv("DCP_STORAGE_LAZY_METADATA_ENTRIES", "0")


def _metadata() -> Metadata:
    """Tensors of one chunk, of a row of 12 chunks (past the views' linear search), a scalar, a value, and a
    record with transform descriptors."""
    props = TensorProperties(torch.float32)
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    offset = 0

    def add(fqn: str, shape: list[int], boxes: list[tuple[list[int], list[int]]], transform: Any = None) -> None:
        nonlocal offset
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
        state[fqn] = TensorStorageMetadata(props, torch.Size(shape), chunks)
        for n, (o, s) in enumerate(boxes):
            length = 4 * int(torch.Size(s).numel()) + 100
            storage[MetadataIndex(fqn, o, n)] = _StorageInfo(f"__{n % 2}_0.distcp", offset, length, transform)
            offset += length

    add("a.weight", [4, 3], [([0, 0], [4, 3])])
    add("b.weight", [12, 2], [([k, 0], [1, 2]) for k in range(12)])
    add("scalar", [], [([], [])], ["stream.zstd/1"])
    state["step"] = BytesStorageMetadata()
    storage[MetadataIndex("step")] = _StorageInfo("__0_0.distcp", offset, 10)
    return Metadata(state, planner_data={"step": ("step",)}, storage_data=storage, storage_meta=StorageMeta())  # type: ignore[arg-type]


def test_views_equal_the_dicts_they_replace() -> None:
    md = _metadata()
    cols = columns_from_metadata(md)
    assert cols is not None
    plain, view = metadata_from_columns(cols), lazy_metadata(cols)
    assert isinstance(view.state_dict_metadata, StateDictView) and isinstance(view.storage_data, StorageDataView)
    assert columns_of(view) is cols and columns_of(plain) is None
    for want, got in ((plain.state_dict_metadata, view.state_dict_metadata), (plain.storage_data, view.storage_data)):
        assert len(got) == len(want)
        assert list(got) == list(want)
        assert list(got.keys()) == list(want.keys())
        assert list(got.items()) == list(want.items())
        assert dict(got) == want
        for key in want:
            assert key in got and got[key] == want[key] and got.get(key) == want[key]
    # the plain metadata is the original's (storage keys compare by fqn and offset)
    assert plain.state_dict_metadata == md.state_dict_metadata
    assert plain.storage_data == md.storage_data
    absent = ["nope", 3, None, MetadataIndex("a.weight", [1, 0]), MetadataIndex("step", [0]), MetadataIndex("a.weight")]
    for key in absent:
        assert key not in view.state_dict_metadata and key not in view.storage_data
        assert view.storage_data.get(key) is None  # type: ignore[call-overload]
    with pytest.raises(KeyError):
        view.state_dict_metadata["nope"]
    with pytest.raises(KeyError):
        view.storage_data[MetadataIndex("b.weight", [12, 0])]
    with pytest.raises(TypeError):
        view.state_dict_metadata["x"] = BytesStorageMetadata()  # type: ignore[index]


def test_views_pickle_as_their_columns() -> None:
    cols = columns_from_metadata(_metadata())
    assert cols is not None
    view = lazy_metadata(cols)
    back = pickle.loads(pickle.dumps(view))
    assert isinstance(back.state_dict_metadata, StateDictView) and isinstance(back.storage_data, StorageDataView)
    assert dict(back.state_dict_metadata) == dict(view.state_dict_metadata)
    assert dict(back.storage_data) == dict(view.storage_data)
    assert back.planner_data == view.planner_data and back.storage_meta == view.storage_meta


def test_threshold_and_decoder_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    data = pickle.dumps(_metadata())
    monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", "python")
    monkeypatch.setenv("DCP_STORAGE_LAZY_METADATA_ENTRIES", "4")  # 4 entries: views
    assert columns_of(metadata_io.load_metadata(data, "x/.metadata")) is not None
    monkeypatch.setenv("DCP_STORAGE_LAZY_METADATA_ENTRIES", "5")  # fewer than 5: plain dicts
    md = metadata_io.load_metadata(data, "x/.metadata")
    assert type(md.state_dict_metadata) is dict and type(md.storage_data) is dict
    monkeypatch.setenv("DCP_STORAGE_LAZY_METADATA_ENTRIES", "0")
    monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", "off")
    assert type(metadata_io.load_metadata(data, "x/.metadata").storage_data) is dict
    for env, value, decoder in (
        ("DCP_STORAGE_LAZY_METADATA_ENTRIES", "-1", "python"),
        ("DCP_STORAGE_METADATA_DECODER", "fast", "fast"),
    ):
        monkeypatch.setenv("DCP_STORAGE_METADATA_DECODER", decoder)
        monkeypatch.setenv(env, value)
        with pytest.raises(ValueError, match=env):
            metadata_io.load_metadata(data, "x/.metadata")
        monkeypatch.setenv("DCP_STORAGE_LAZY_METADATA_ENTRIES", "0")


def _saved(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    state: dict[str, Any] = {
        "model": {f"layer{k}.weight": torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(4)},
        "step": 11,
        "extra": {"names": ["a", "b"]},
    }
    root = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: torch says so
        dcp.save(state, storage_writer=FsspecWriter(root), no_dist=True)
    return root, state


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": 0,
        "extra": {"names": []},
    }


@pytest.mark.usefixtures("lazy")
@pytest.mark.parametrize("planner", ["torch", "ours"])
def test_dcp_load_through_views(tmp_path: Path, planner: str) -> None:
    from dcp_storage.planners import RemappingLoadPlanner

    root, state = _saved(tmp_path)
    assert columns_of(FsspecReader(root).read_metadata()) is not None  # the views are what the load gets
    into = _zeros(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            into,
            storage_reader=FsspecReader(root),
            planner=RemappingLoadPlanner() if planner == "ours" else None,
            no_dist=True,
        )
    assert all(torch.equal(into["model"][k], v) for k, v in state["model"].items())
    assert into["step"] == 11 and into["extra"] == {"names": ["a", "b"]}


@pytest.mark.usefixtures("lazy")
def test_load_state_dict_from_keys_through_views(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    root, state = _saved(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _load_state_dict_from_keys({"model.layer2.weight", "step"}, storage_reader=FsspecReader(root))
        whole = _load_state_dict_from_keys(storage_reader=FsspecReader(root))
    assert torch.equal(got["model"]["layer2.weight"], state["model"]["layer2.weight"]) and got["step"] == 11
    assert sorted(got["model"]) == ["layer2.weight"]
    assert sorted(whole["model"]) == sorted(state["model"]) and whole["extra"] == {"names": ["a", "b"]}


@pytest.mark.usefixtures("lazy")
def test_two_rank_resharding_load_through_views(tmp_path: Path) -> None:
    reports = run_ranks(_lazy_rank_fns.save_and_reshard, 2, str(tmp_path / "ckpt"))
    for report in reports:
        assert report == {"lazy": True, "mismatched": [], "step": 7}
