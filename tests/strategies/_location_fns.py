"""Rank bodies for ``test_same_checkpoint.py`` (module-level, so ranks import them by name)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

KEYS = {"a": 256, "b": 256, "c": 100}


def state(value: float) -> dict[str, torch.Tensor]:
    """The saved state: the same keys and shapes whatever ``value``, so only the bytes tell two apart."""
    return {key: torch.full((n,), value + i) for i, (key, n) in enumerate(KEYS.items())}


def _reader(kind: str, path: str) -> Any:
    import dcp_storage as ds

    if kind == "read_once":
        return ds.FsspecReader(path, read_strategy=ds.ReadStrategies.read_once())
    if kind == "per_rank":
        return ds.FsspecReader(path, read_strategy=ds.ReadStrategies.per_rank())
    if kind == "broadcasting":
        return ds.Broadcasting(ds.FsspecReader(path))
    if kind == "safetensors":
        return ds.SafetensorsReader(path)
    return ds.BroadcastingTorchSaveReader(path)


def load_own_path(rank: int, world: int, kind: str, paths: list[str]) -> tuple[str, str]:
    """Load ``paths[rank]``: what the load did on this rank, as ``(outcome class, message)``."""
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    target = {key: torch.zeros(n) for key, n in KEYS.items()}
    try:
        dcp.load(target, storage_reader=_reader(kind, paths[rank]))
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        failures = getattr(exc, "failures", None)
        inner = next(iter(failures.values()))[0] if failures else exc
        return type(inner).__name__, str(inner)
    return "loaded", repr({key: value[0].item() for key, value in target.items()})
