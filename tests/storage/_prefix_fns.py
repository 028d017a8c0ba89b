"""Rank body for ``test_prefix_strategies.py``: a ``Shard(0)`` save spread over hex prefixes."""

from __future__ import annotations

from typing import Any

import torch


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)}


def save_sharded(rank: int, world: int, url: str, storage_options: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_storage import FsspecWriter
    from dcp_storage.strategies import HexPrefixStrategy

    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state().items()}
    dcp.save(sd, storage_writer=FsspecWriter(url, storage_options, prefix_strategy=HexPrefixStrategy(min_length=4)))
