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


def write_checkpoints(root: str) -> dict[str, str]:
    """Every format the readers read, holding :func:`reference`, written by this (single) process."""
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter, SafetensorsWriter

    ref = reference()
    paths = {
        "dcp": f"{root}/dcp",
        "safetensors": f"{root}/st/model.safetensors",
        "hf_index": f"{root}/hf/model.safetensors.index.json",
        "torch_save": f"{root}/model.pt",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in a single process"
        dcp.save(ref, storage_writer=FsspecWriter(paths["dcp"]), no_dist=True)
        dcp.save(ref, storage_writer=SafetensorsWriter(f"{root}/st"), no_dist=True)
        dcp.save(ref, storage_writer=SafetensorsWriter(f"{root}/hf", max_shard_size=600), no_dist=True)
    torch.save(ref, paths["torch_save"])
    return paths


def readers(paths: dict[str, str]) -> dict[str, Callable[[], Any]]:
    """A fresh reader for each case, by name: every reader class, ``Broadcasting`` around each, ``open_reader``."""
    from dcp_storage import (
        Broadcasting,
        BroadcastingTorchSaveReader,
        FsspecReader,
        SafetensorsReader,
        open_reader,
    )

    return {
        "FsspecReader": lambda: FsspecReader(paths["dcp"]),
        "SafetensorsReader": lambda: SafetensorsReader(paths["safetensors"]),
        "SafetensorsReader(index)": lambda: SafetensorsReader(paths["hf_index"]),
        "BroadcastingTorchSaveReader": lambda: BroadcastingTorchSaveReader(paths["torch_save"]),
        "Broadcasting(FsspecReader)": lambda: Broadcasting(FsspecReader(paths["dcp"])),
        "Broadcasting(SafetensorsReader)": lambda: Broadcasting(SafetensorsReader(paths["hf_index"])),
        "Broadcasting(BroadcastingTorchSaveReader)": lambda: Broadcasting(
            BroadcastingTorchSaveReader(paths["torch_save"])
        ),
        "open_reader(dcp)": lambda: open_reader(paths["dcp"]),
        "open_reader(hf_index)": lambda: open_reader(paths["hf_index"]),
        "open_reader(torch_save)": lambda: open_reader(paths["torch_save"]),
    }


def _load(make: Callable[[], Any], no_dist: bool) -> str:
    import torch.distributed.checkpoint as dcp

    ref = reference()
    dest = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
    try:
        dcp.load(dest, storage_reader=make(), no_dist=no_dist)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names the reader
        return f"{type(exc).__name__}: {exc}"
    bad = [k for k, v in ref.items() if not torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8))]
    return f"wrong bits in {bad}" if bad else "ok"


def load_every_reader(rank: int, world: int, paths: dict[str, str], pattern: str) -> dict[str, str]:
    """``pattern``: ``"rank0"`` (only rank 0 loads, ``no_dist=True``), ``"every"`` (every rank, ``no_dist=True``)
    or ``"dist"`` (every rank, a distributed load)."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    out: dict[str, str] = {}
    if pattern != "rank0" or rank == 0:
        for name, make in readers(paths).items():
            out[name] = _load(make, no_dist=pattern != "dist")
    dist.barrier()  # the other ranks wait here, as an eval script's would, outside any collective of the load
    return out
