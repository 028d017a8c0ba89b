"""torch_checkpointing's own ``CheckpointManager`` through the plugin: a 2-rank FSDP2 save (gloo, CPU) and
bit-exact loads at 2 and 3 ranks, on a local disk and on ``s3://`` (moto); and the ``O_DIRECT`` failure of
torch_checkpointing's ``LocalFileSystemStorage`` on an unaligned tail, which the plugin does not have."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dcp_storage_testing.distributed import run_ranks
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

from dcp_storage_torch_checkpointing import DcpStorageConfig
from dcp_storage_torch_checkpointing import _rank_checks as checks
from dcp_storage_torch_checkpointing._unstable import METADATA_FILE_NAME


def test_fsdp2_save_at_2_load_at_2_and_3(local_root: Any, s3_root: Any) -> None:
    """One 2-rank save to each of a local root and an s3:// root, then loads at 2 and at 3 ranks."""
    roots = [local_root, s3_root]
    run_ranks(checks.save_fsdp2, 2, roots, "step-1", timeout=240)
    for root_url, options in roots:
        storage = DcpStorageConfig(root_url, options).create_storage()
        assert storage.isdir(Path("step-1")) and storage.exists(Path("step-1", METADATA_FILE_NAME))
        assert not storage.exists(Path("tmp_step-1")), "the staged directory was renamed away"
    for world in (2, 3):
        for per_rank in run_ranks(checks.load_fsdp2, world, roots, "step-1", timeout=240):
            for report in per_rank:
                assert report["wrong"] == [] and report["keys"] == 20 and report["items"] == ["model"], (world, report)


def _save_one(storage_config: Any, path: str, tensor: torch.Tensor) -> None:
    mgr = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage_config))
    try:
        mgr.save(path, {"model": {"w": tensor}})
    finally:
        mgr.close()


def test_unaligned_tail_saves_where_local_filesystem_storage_fails(tmp_path: Path) -> None:
    tensor = torch.randn(64, 64)
    with pytest.raises(OSError) as theirs:  # their O_DIRECT stream: EINVAL when close() flushes the tail
        _save_one(None, str(tmp_path / "theirs" / "step-1"), tensor)
    if theirs.value.errno != 22:
        pytest.skip(f"this file system's O_DIRECT behaves otherwise: {theirs.value!r}")
    _save_one(DcpStorageConfig(str(tmp_path / "ours")), "step-1", tensor)
    mgr = CheckpointManager(
        CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(), storage_config=DcpStorageConfig(str(tmp_path / "ours"))
        )
    )
    try:
        out = mgr.load("step-1", into={"model": {"w": torch.zeros(64, 64)}})
    finally:
        mgr.close()
    assert torch.equal(out["model"]["w"], tensor)
    assert os.listdir(tmp_path / "ours") == ["step-1"]
