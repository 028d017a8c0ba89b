"""Rank bodies for the plugin's multi-process tests (2-rank save, 3-rank resharded load).

They live in the package, not in ``tests/``, because :func:`dcp_storage_testing.distributed.run_ranks`
unpickles a rank body by module name inside a forkserver whose ``sys.path`` was fixed when it started
(often before pytest put the plugin's ``tests/`` directory on the path, and a directory named
``dcp-storage-obstore`` is not importable as a package). Each body checks bit-exactness itself and
returns a plain report.
"""

from __future__ import annotations

from typing import Any

import torch
from dcp_storage_testing.compare import same_bits as _same_bits

SEED = 97
SHAPE = {"vocab": 512, "dim": 64, "hidden": 256, "layers": 2}


def save_sharded(rank: int, world: int, url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """Save a ``Shard(0)`` DTensor state dict of the reference model through the obstore transport."""
    import torch.distributed.checkpoint as dcp
    from dcp_storage import FsspecWriter
    from dcp_storage_testing.models import reference_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    reference = reference_state_dict(SEED, **SHAPE)
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in reference.items()}
    writer = FsspecWriter(url, storage_options, overwrite=True)
    dcp.save(state, storage_writer=writer)
    return {"transport": type(writer.transport).__name__, "counters": dict(writer.counters)}


def load_resharded(rank: int, world: int, url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """Load into ``Shard(1)`` (2-D) / ``Shard(0)`` (1-D) DTensors at this world size; compare every local shard."""
    import torch.distributed.checkpoint as dcp
    from dcp_storage import FsspecReader
    from dcp_storage_testing.models import reference_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    reference = reference_state_dict(SEED, **SHAPE)
    expected = {k: distribute_tensor(v, mesh, [Shard(1 if v.dim() == 2 else 0)]) for k, v in reference.items()}
    state = {
        k: distribute_tensor(torch.zeros_like(v), mesh, e.placements)
        for (k, v), e in zip(reference.items(), expected.values())
    }
    reader = FsspecReader(url, storage_options)
    dcp.load(state, storage_reader=reader)
    wrong = [k for k in state if not _same_bits(state[k].to_local(), expected[k].to_local())]
    needed = sum(v.to_local().numel() * v.element_size() for v in state.values())
    return {
        "transport": type(reader.transport).__name__,
        "wrong": wrong,
        "needed": needed,
        "counters": dict(reader.counters),
    }
