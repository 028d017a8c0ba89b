"""Rank bodies for ``test_safetensors_checksums.py`` (module-level, so ``run_ranks`` can unpickle them)."""

from __future__ import annotations

from typing import Any

import torch

SEED = 7


def reference() -> dict[str, torch.Tensor]:
    """Full tensors: Shard(0) and Shard(1) DTensors, an uneven split, a replicated and a plain tensor."""
    g = torch.Generator().manual_seed(SEED)
    return {
        "embed": torch.randn(64, 32, generator=g),  # Shard(0)
        "proj": torch.randn(24, 40, generator=g).to(torch.bfloat16),  # Shard(1): strided chunks
        "uneven": torch.randn(6, 7, generator=g),  # Shard(1): 4 + 3 columns
        "norm": torch.randn(96, generator=g),  # Replicate(): written once
        "ids": torch.arange(50),  # a plain tensor on every rank
    }


def save_dtensors(rank: int, world: int, path: str, storage_options: dict[str, Any] | None = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcp_storage import SafetensorsWriter

    mesh = init_device_mesh("cpu", (world,))
    placements = {"embed": Shard(0), "proj": Shard(1), "uneven": Shard(1), "norm": Replicate()}
    sd: dict[str, Any] = {}
    for key, full in reference().items():
        sd[key] = distribute_tensor(full, mesh, [placements[key]]) if key in placements else full
    dcp.save(sd, storage_writer=SafetensorsWriter(path, storage_options, max_shard_size=6000))


def load_resharded_verified(rank: int, world: int, path: str) -> bool:
    """Load with ``verify=True`` into the opposite shardings (slices of the checked tensors); True if exact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_storage import SafetensorsReader

    mesh = init_device_mesh("cpu", (world,))
    ref = reference()
    flipped = {"embed": Shard(1), "proj": Shard(0), "uneven": Shard(0), "norm": Shard(0)}
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh, [flipped[k]]) for k, v in ref.items() if k in flipped}
    dcp.load(sd, storage_reader=SafetensorsReader(path, verify=True))
    return all(torch.equal(sd[k].full_tensor(), ref[k]) for k in sd)
