"""Rank bodies for the merge tests (run inside ``run_ranks`` processes)."""

from __future__ import annotations

import os
from typing import Any

SEED = 2024
SHAPE: dict[str, int] = {"vocab": 256, "dim": 64, "hidden": 128, "layers": 2}


def save_accelerate_fsdp(rank: int, world: int, output_dir: str) -> None:
    """What accelerate's ``save_fsdp_model`` writes for ``SHARDED_STATE_DICT`` (FSDP2, torch's writer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_storage_testing.models import build_model, fsdp2_shard

    model = fsdp2_shard(build_model(SEED, **SHAPE))
    ckpt_dir = os.path.join(output_dir, "pytorch_model_fsdp_0")
    os.makedirs(ckpt_dir, exist_ok=True)
    state: dict[str, Any] = {"model": model.state_dict()}
    dcp.save(state_dict=state, storage_writer=dcp.FileSystemWriter(ckpt_dir), planner=DefaultSavePlanner())
