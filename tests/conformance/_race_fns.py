"""Rank bodies for the racing-groups test: two 2-rank jobs in one 4-process gloo world save to one place.

Module-level functions, because ``run_ranks`` unpickles them by name in the rank processes.
"""

from __future__ import annotations

from typing import Any

import torch


def group_state(group: int) -> dict[str, Any]:
    """What group ``group`` saves: the same keys and shapes for both groups, other bytes."""
    g = torch.Generator().manual_seed(100 + group)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g).to(torch.bfloat16),
        "step": 10 + group,
    }


def racing_groups(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Ranks 0-1 and 2-3 each run ``dcp.save`` over their own group, released together by a barrier."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_storage import FsspecWriter

    torch.set_num_threads(1)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    mine = rank // 2
    dist.barrier()
    try:
        dcp.save(group_state(mine), storage_writer=FsspecWriter(url, options), process_group=groups[mine])
    except CheckpointException as exc:
        return {"group": mine, "ok": False, "types": sorted({type(e).__name__ for e, _ in exc.failures.values()})}
    return {"group": mine, "ok": True, "types": []}
