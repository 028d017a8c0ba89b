"""Rank bodies for ``test_npz_ranged.py`` (module-level, so ``run_ranks`` can unpickle them)."""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

SHAPES = {"embed": (512, 256), "proj": (256, 512), "bias": (1024,)}  # float32: 1.0 MiB of data in all


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    out = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in SHAPES.items()}
    out["bias"] = out["bias"].astype(">f4")  # big-endian: swapped on load, read by range all the same
    return out


def load_both(rank: int, world: int, path: str, site: str) -> dict[str, dict[str, int]]:
    """Two loads through the plugin, each with a reader of its own: ``Shard(0)`` DTensors under ``per_rank``,
    then ``Replicate()`` ones under ``read_once``. This rank's counters for each (one call: the imports and
    the process group are paid for once)."""
    sys.path.insert(0, site)
    from dcp_storage import registry

    registry.reload()
    return {
        "shard0": _load(rank, world, path, "shard0", "per_rank"),
        "replicate": _load(rank, world, path, "replicate", "read_once"),
    }


def _load(rank: int, world: int, path: str, placement: str, strategy: str) -> dict[str, int]:
    """Load every array as a DTensor; the bytes and requests this rank's reader read, and what its slices hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from dcp_storage import open_reader

    mesh = init_device_mesh("cpu", (world,))
    want = {k: torch.from_numpy(a.astype(a.dtype.newbyteorder("="))) for k, a in arrays().items()}
    sd = {}
    for k, full in want.items():
        if placement == "shard0":  # from_local: no collective, no dispatch of a scatter (seconds on a busy box)
            local, place = torch.zeros_like(full.tensor_split(world)[rank]), Shard(0)
        else:
            local, place = torch.zeros_like(full), Replicate()
        sd[k] = DTensor.from_local(local, mesh, [place], run_check=False, shape=full.shape, stride=full.stride())
    reader = open_reader(path, read_strategy=strategy) if strategy else open_reader(path)
    dcp.load(sd, storage_reader=reader)
    mine = {k: full.tensor_split(world)[rank] if placement == "shard0" else full for k, full in want.items()}
    if not all(torch.equal(sd[k].to_local(), mine[k]) for k in want):
        raise AssertionError(f"rank {rank}: loaded values differ from numpy's")
    counters = reader.transport.counters.snapshot()
    needed = sum(math.prod(sd[k].to_local().shape) * 4 for k in sd)
    return {"bytes_read": counters["bytes_read"], "requests": counters["requests"], "needed": needed}
