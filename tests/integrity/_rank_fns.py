"""Rank bodies for ``test_integrity.py`` (importable, module-level: they run in ``run_ranks`` processes)."""

from __future__ import annotations

import torch


def save_sharded(rank: int, world: int, path: str) -> list[str]:
    """Save a Shard(0) DTensor plus a per-rank replicated tensor; return the data files this rank wrote."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_storage import FsspecWriter

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(5)}
    dcp.save(sd, storage_writer=FsspecWriter(path, thread_count=1))
    return sorted(n for n in os.listdir(path) if n.startswith(f"__{rank}_"))
