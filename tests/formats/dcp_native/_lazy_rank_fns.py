"""Rank bodies for ``test_lazy_metadata.py`` (module-level: ranks unpickle them by name)."""

from __future__ import annotations

from typing import Any

import torch


def save_and_reshard(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save DTensors sharded on dim 0 plus a replicated tensor and a value, then load them sharded on dim 1
    through ``FsspecReader`` (its metadata as views of columns when the environment says so)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcp_storage.formats.columns import columns_of
    from dcp_storage.formats.dcp_native.reader import FsspecReader
    from dcp_storage.formats.dcp_native.writer import FsspecWriter

    mesh = init_device_mesh("cpu", (world,))
    full = {f"w{k}": torch.arange(24 * 6, dtype=torch.float32).reshape(24, 6) * (k + 1) for k in range(3)}
    state: dict[str, Any] = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    state["norm"] = distribute_tensor(torch.ones(6), mesh, [Replicate()])
    state["step"] = 7
    dcp.save(state, storage_writer=FsspecWriter(root))

    into: dict[str, Any] = {k: distribute_tensor(torch.zeros(24, 6), mesh, [Shard(1)]) for k in full}
    into["norm"] = distribute_tensor(torch.zeros(6), mesh, [Replicate()])
    into["step"] = 0
    reader = FsspecReader(root)
    dcp.load(into, storage_reader=reader)
    lazy = columns_of(FsspecReader(root).read_metadata()) is not None
    bad = [k for k, v in full.items() if not torch.equal(into[k].full_tensor(), v)]
    if not torch.equal(into["norm"].full_tensor(), torch.ones(6)):
        bad.append("norm")
    return {"lazy": lazy, "mismatched": bad, "step": into["step"]}
