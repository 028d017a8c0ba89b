"""``DynamicMetaLoadPlanner`` against torch's: same metadata, same plans, same loaded values.

Planner-level parity runs in this process. torch's ``BroadcastingTorchSaveReader`` calls
``dist.get_rank()`` and ``dist.broadcast`` even on a single rank, so the end-to-end comparison needs a
process group: it runs on one gloo rank via ``run_ranks``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner as TorchDynamicMeta
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

import dcp_storage
from dcp_storage import DynamicMetaLoadPlanner, KeyMap
from dcp_storage.planners import KeyCollisionError, MetadataSource, UnsupportedValueError
from dcp_storage_testing.distributed import run_ranks

from . import _rank_fns as R


def state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "scale": torch.ones(()),
        "ids": torch.arange(5),
    }


def planned(planner: Any, sd: dict[str, Any]) -> tuple[Metadata, list[Any]]:
    planner.set_up_planner(sd, Metadata(state_dict_metadata={}), True)  # what BroadcastingTorchSaveReader gives
    plan = planner.create_local_plan()
    return planner.metadata, plan.items


@pytest.mark.parametrize("flatten", [True, False])
def test_same_metadata_and_plan_as_torch(flatten: bool) -> None:
    sd = state_dict() if flatten else {k: v for k, v in state_dict().items() if k != "model"}
    theirs = planned(TorchDynamicMeta(flatten_state_dict=flatten), sd)
    ours = planned(DynamicMetaLoadPlanner(flatten_state_dict=flatten), sd)
    assert ours[0].state_dict_metadata == theirs[0].state_dict_metadata
    assert ours[0].planner_data == theirs[0].planner_data and ours[0].storage_data == theirs[0].storage_data
    assert ours[1] == theirs[1]
    assert all(isinstance(md, TensorStorageMetadata) for md in ours[0].state_dict_metadata.values())


def test_metadata_from_state_dict_replaces_the_readers() -> None:
    """Like torch's: whatever the reader returned, the state dict describes the checkpoint."""
    sd = state_dict()
    reader_md = Metadata(state_dict_metadata={"other": BytesStorageMetadata()})
    for planner in (TorchDynamicMeta(), DynamicMetaLoadPlanner()):
        planner.set_up_planner(sd, reader_md, True)
        assert set(planner.metadata.state_dict_metadata) == {"model.w", "model.b", "scale", "ids"}
    keep = DynamicMetaLoadPlanner(metadata_source=MetadataSource.state_dict_if_empty())
    keep.set_up_planner(sd, reader_md, True)
    assert keep.metadata is reader_md


def test_non_tensor_values_raise_like_torch() -> None:
    sd = state_dict() | {"step": 3}
    with pytest.raises(RuntimeError, match="Non-tensor value identified at step") as theirs:
        TorchDynamicMeta().set_up_planner(sd, Metadata({}), True)
    with pytest.raises(UnsupportedValueError, match="Non-tensor value identified at step") as ours:
        DynamicMetaLoadPlanner().set_up_planner(sd, Metadata({}), True)
    assert isinstance(ours.value, RuntimeError) and isinstance(theirs.value, RuntimeError)


def test_key_map_names_the_described_keys() -> None:
    planner = DynamicMetaLoadPlanner(key_map=KeyMap.within("model.", KeyMap.add_prefix("module.")))
    md, items = planned(planner, state_dict())
    assert set(md.state_dict_metadata) == {"model.module.w", "model.module.b", "scale", "ids"}
    pairs = {(i.dest_index.fqn, i.storage_index.fqn) for i in items}
    assert ("model.w", "model.module.w") in pairs and ("scale", "scale") in pairs
    with pytest.raises(KeyCollisionError):
        planned(DynamicMetaLoadPlanner(key_map=KeyMap.callable(lambda k: "same")), state_dict())


def test_load_through_torchs_broadcasting_reader(tmp_path: Path) -> None:
    saved = R.saved_state_dict()  # {"model": {"module.<fqn>": bf16}}
    plain = {"model": {k[len("module.") :]: v for k, v in saved["model"].items() if isinstance(v, torch.Tensor)}}
    ddp = {"model": {k: v for k, v in saved["model"].items() if isinstance(v, torch.Tensor)}}
    torch.save(plain, tmp_path / "plain.pt")
    torch.save(ddp, tmp_path / "ddp.pt")
    (report,) = run_ranks(R.dynamic_meta_parity, 1, str(tmp_path / "plain.pt"), str(tmp_path / "ddp.pt"), timeout=120)
    assert report["ours_vs_theirs"] == []
    assert report["theirs_vs_expected"] == []  # bf16 file into fp32 tensors: exactly .to(float32)
    assert report["mapped_vs_expected"] == []
    assert report["missing"] == [] and report["mapped_renamed"] == len(plain["model"])


def test_no_process_group_with_the_projects_torch_save_reader(tmp_path: Path) -> None:
    """dcp_storage's BroadcastingTorchSaveReader needs no process group on one rank; key map + cast."""
    reader_cls = getattr(dcp_storage, "BroadcastingTorchSaveReader", None)
    if reader_cls is None:
        pytest.skip("dcp_storage.BroadcastingTorchSaveReader is not available in this tree")
    saved = {k: v for k, v in R.saved_state_dict()["model"].items() if isinstance(v, torch.Tensor)}
    torch.save(saved, tmp_path / "ddp.pt")  # {"module.<fqn>": bf16}
    expected = {k[len("module.") :]: v.to(torch.float32) for k, v in saved.items()}
    sd = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    planner = DynamicMetaLoadPlanner(key_map=KeyMap.add_prefix("module."))
    dcp.load(sd, storage_reader=reader_cls(str(tmp_path / "ddp.pt")), planner=planner)
    assert [k for k, v in expected.items() if not R.same_bits(sd[k], v)] == []
    assert planner.result is not None and len(planner.result.renamed) == len(expected)
