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


def load_sharded(rank: int, world: int, path: str, site: str, placement: str, strategy: str) -> dict[str, int]:
    """Load every array as a DTensor (``Shard(0)`` or ``Replicate()``) through the plugin; this rank's counters.

    Returns the bytes and requests this rank's reader read, and the bytes this rank's slices hold.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sys.path.insert(0, site)
    from dcp_storage import open_reader, registry

    registry.reload()
    mesh = init_device_mesh("cpu", (world,))
    place = Shard(0) if placement == "shard0" else Replicate()
    want = {k: torch.from_numpy(a.astype(a.dtype.newbyteorder("="))) for k, a in arrays().items()}
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh, [place]) for k, v in want.items()}
    reader = open_reader(path, read_strategy=strategy) if strategy else open_reader(path)
    dcp.load(sd, storage_reader=reader)
    if not all(torch.equal(sd[k].full_tensor(), want[k]) for k in want):
        raise AssertionError(f"rank {rank}: loaded values differ from numpy's")
    needed = sum(math.prod(sd[k].to_local().shape) * 4 for k in sd)
    counters = reader.transport.counters.snapshot()
    return {"bytes_read": counters["bytes_read"], "requests": counters["requests"], "needed": needed}
