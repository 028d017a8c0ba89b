"""Rank bodies for the plugin's multi-process tests and benchmark.

:func:`dcp_storage_testing.distributed.run_ranks` starts ranks from a forkserver and unpickles these
functions by module and name, so they live in this importable module rather than in ``tests/``. Each rank
rebuilds the seeded reference weights itself and checks its own shard bit-exactly; only small reports
(mismatching keys, byte counts, seconds) come back.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from dcp_storage_testing.compare import same_bits

__all__ = ["load_resharded", "make_extension", "run_all", "same_bits", "save_fsdp2"]


def make_extension(kind: str | None, options: dict[str, Any] | None = None) -> list[Any] | None:
    """``"zstd-seekable"``: ``[ZstdSeekable(**options)]``; ``"torch-zstd"``: torch's ``[ZStandard()]``;
    ``None``: no extension (uncompressed)."""
    if kind is None:
        return None
    if kind == "zstd-seekable":
        from dcp_storage_zstd.extension import ZstdSeekable

        return [ZstdSeekable(**(options or {}))]
    if kind == "torch-zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        return [ZStandard()]
    raise ValueError(f"unknown extension kind {kind!r}")


def save_fsdp2(
    rank: int,
    world: int,
    path: str,
    seed: int,
    shape: dict[str, int],
    dtype: str,
    extension: str | None = "zstd-seekable",
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """FSDP2-shard the seeded model over ``world`` ranks and save it through :func:`make_extension`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from dcp_storage import FsspecWriter
    from dcp_storage_testing.models import build_model, fsdp2_shard

    model = fsdp2_shard(build_model(seed, getattr(torch, dtype), **shape))
    writer = FsspecWriter(path, extensions=make_extension(extension, options))
    dist.barrier()
    start = time.perf_counter()
    dcp.save({"model": model.state_dict()}, storage_writer=writer)
    dist.barrier()
    return {"seconds": time.perf_counter() - start, **writer.counters}


def load_resharded(
    rank: int,
    world: int,
    path: str,
    seed: int,
    shape: dict[str, int],
    dtype: str,
    small_item_bytes: int | None = None,
) -> dict[str, Any]:
    """Load into ``Shard(0)`` DTensors over ``world`` ranks; check every local shard against the seed.

    ``small_item_bytes``: the reader's threshold below which items are read whole (a huge value reads every
    item whole: the baseline that ranged reads of framed items are compared with).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from dcp_storage import FsspecReader
    from dcp_storage.plugin_api import DcpLoaderConfig
    from dcp_storage_testing.models import reference_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (world,))
    reference = reference_state_dict(seed, getattr(torch, dtype), **shape)
    state = {
        k: distribute_tensor(torch.full_like(v, float("nan")), mesh, [Shard(0)], src_data_rank=None)
        for k, v in reference.items()
    }
    config = DcpLoaderConfig() if small_item_bytes is None else DcpLoaderConfig(small_item_bytes=small_item_bytes)
    reader = FsspecReader(path, loader_config=config)
    dist.barrier()
    start = time.perf_counter()
    dcp.load({"model": state}, storage_reader=reader)
    seconds = time.perf_counter() - start
    bad, needed = [], 0
    for key, full in reference.items():
        local = state[key].to_local()
        lshape, offset = compute_local_shape_and_global_offset(full.shape, mesh, state[key].placements)
        expected = full
        for dim, (off, n) in enumerate(zip(offset, lshape)):
            expected = expected.narrow(dim, off, n)
        needed += local.numel() * local.element_size()
        if not same_bits(local, expected):
            bad.append(key)
    dist.barrier()
    return {"mismatched": bad, "needed": needed, "seconds": seconds, **reader.counters}


def run_all(rank: int, world: int, calls: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
    """Several of the functions above in one set of rank processes (process start-up is the slow part)."""
    table = {"save_fsdp2": save_fsdp2, "load_resharded": load_resharded}
    return [table[name](rank, world, *args) for name, args in calls]
