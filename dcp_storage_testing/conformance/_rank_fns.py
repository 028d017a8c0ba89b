"""Rank bodies for the conformance suite's multi-process test (FSDP2 save at 2 ranks, load at 3).

Module-level functions of an importable module, because ``run_ranks`` unpickles them by name in the
rank processes. They check in place and return plain reports, so no tensors cross process boundaries.
The model is small on purpose: the test is about each backend carrying a sharded save and a resharding
load, not about throughput, and it runs once per backend.
"""

from __future__ import annotations

from typing import Any

import torch

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage._torch import local_shape_and_offset
from dcp_storage_testing.models import build_model, fsdp2_shard, reference_state_dict

SEED = 2024
SHAPE = {"vocab": 512, "dim": 64, "hidden": 256, "layers": 2}  # ~0.4 MB of fp32 in 11 tensors


def save_fsdp2(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``dcp.save`` an FSDP2-sharded model (Shard(0) DTensors) plus a step counter (a BYTE_IO item)."""
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    model = fsdp2_shard(build_model(SEED, **SHAPE))
    writer = FsspecWriter(url, options)
    dcp.save({"model": model.state_dict(), "step": 17}, storage_writer=writer)
    return writer.counters


def load_resharded(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Load into ``Shard(1)`` DTensors over ``world`` ranks (a different sharding from the save's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    reference = reference_state_dict(SEED, **SHAPE)
    state: dict[str, Any] = {}
    for key, full in reference.items():
        sentinel = torch.full_like(full, float("nan"))  # a slice the load misses stays NaN
        state[key] = distribute_tensor(sentinel, mesh, [Shard(full.dim() - 1)], src_data_rank=None)
    loaded: dict[str, Any] = {"model": state, "step": None}
    reader = FsspecReader(url, options)
    dcp.load(loaded, storage_reader=reader)

    mismatched = []
    for key, full in reference.items():
        local = state[key].to_local()
        shape, offset = local_shape_and_offset(full.shape, mesh, state[key].placements)
        expected = full
        for dim, (off, length) in enumerate(zip(offset, shape)):
            expected = expected.narrow(dim, off, length)
        same = local.dtype == expected.dtype and tuple(local.shape) == tuple(expected.shape)
        if not (same and torch.equal(local.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))):
            mismatched.append(key)
    return {"mismatched": mismatched, "step": loaded["step"], "keys": len(reference), **reader.counters}
