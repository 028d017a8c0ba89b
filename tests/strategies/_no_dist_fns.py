"""Rank bodies for ``test_no_dist.py``: every reader, loaded with ``no_dist=True`` by one rank or by all.

Module-level so that ranks import them by name. Each body returns, per reader, ``"ok"`` or what went
wrong (an error's text, or the keys whose bits differ from the reference); a hang is the caller's
``run_ranks`` timeout.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

SEED = 1313


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return {
        "embed.weight": torch.randn(32, 8, generator=g),
        "layer.weight": torch.randn(8, 8, generator=g),
        "layer.bias": torch.randn(8, generator=g),
        "head.weight": torch.randn(8, 32, generator=g).to(torch.bfloat16),
    }


def _load(make: Callable[[], Any], no_dist: bool, group: Any = None) -> str:
    import torch.distributed.checkpoint as dcp

    ref = reference()
    dest = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
    try:
        dcp.load(dest, storage_reader=make(), no_dist=no_dist, process_group=group)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names the reader
        return f"{type(exc).__name__}: {exc}"
    bad = [k for k, v in ref.items() if not torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8))]
    return f"wrong bits in {bad}" if bad else "ok"


def load_every_reader(rank: int, world: int, paths: dict[str, str], pattern: str) -> dict[str, str]:
    """``pattern``: ``"rank0"`` (only rank 0 loads, ``no_dist=True``), ``"every"`` (every rank, ``no_dist=True``)
    or ``"dist"`` (every rank, a distributed load)."""
    import torch.distributed as dist

    from dcp_storage_testing.every_format import every_reader

    warnings.filterwarnings("ignore")
    out: dict[str, str] = {}
    if pattern != "rank0" or rank == 0:
        for name, make in every_reader(paths).items():
            out[name] = _load(make, no_dist=pattern != "dist")
    dist.barrier()  # the other ranks wait here, as an eval script's would, outside any collective of the load
    return out


def load_on_a_subgroup(rank: int, world: int, paths: dict[str, str]) -> dict[str, str]:
    """Ranks 0 and 1 load over their own group (``dcp.load(process_group=...)``); the last rank does not load."""
    import torch.distributed as dist

    from dcp_storage_testing.every_format import every_reader

    warnings.filterwarnings("ignore")
    group = dist.new_group([0, 1])  # every rank takes part in creating it
    out: dict[str, str] = {}
    if rank in (0, 1):
        for name, make in every_reader(paths).items():
            out[name] = _load(make, no_dist=False, group=group)
    dist.barrier()
    return out
