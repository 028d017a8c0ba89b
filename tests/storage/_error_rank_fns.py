"""Rank bodies for ``test_load_save_errors.py``: a load that fails on one rank only."""

from __future__ import annotations

from typing import Any

import torch

import dcp_storage as ds


def _state(rank: int, bad_rank: int) -> dict[str, Any]:
    state: dict[str, Any] = {"w": torch.zeros(8)}
    if rank == bad_rank:
        state["not_in_the_checkpoint"] = torch.zeros(2)
    return state


def ds_load_failing_on(rank: int, world: int, url: str, bad_rank: int) -> dict[str, Any]:
    """``ds.load`` where only ``bad_rank``'s state dict has a key the checkpoint lacks."""
    try:
        ds.load(_state(rank, bad_rank), url)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"type": type(exc).__name__, "ours": isinstance(exc, ds.DcpStorageError), "notes": exc.__notes__}
    return {"type": None}


def dcp_load_unwrapped(rank: int, world: int, url: str, bad_rank: int) -> dict[str, Any]:
    """Plain ``dcp.load`` (a ``CheckpointException`` on every rank), then ``ds.errors.unwrap``."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(_state(rank, bad_rank), storage_reader=ds.FsspecReader(url))
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        inner = ds.errors.unwrap(exc)
        return {
            "outer": type(exc).__name__,
            "inner": type(inner).__name__,
            "ours": isinstance(inner, ds.DcpStorageError),
        }
    return {"outer": None}


def save_to_own_url(rank: int, world: int, root: str, writer: str) -> dict[str, Any]:
    """Plain ``dcp.save`` where each rank's writer names another location: refused on every rank."""
    import torch.distributed.checkpoint as dcp

    make = ds.FsspecWriter if writer == "dcp" else ds.SafetensorsWriter
    try:
        dcp.save({f"w{rank}": torch.full((4,), float(rank))}, storage_writer=make(f"{root}/step-{rank}"))
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        inner = ds.errors.unwrap(exc)
        return {"type": type(inner).__name__, "text": str(inner)}
    return {"type": None}


def ds_load_probe_failing_on(rank: int, world: int, url: str, bad_rank: int) -> dict[str, Any]:
    """``ds.load`` without ``format=`` where probing the URL fails on ``bad_rank`` only (a storage error that
    outlived its retries): the coordinator detects the format for every rank, so only its probe counts."""
    import time

    from dcp_storage import opening
    from dcp_storage.errors import TransportError

    real = opening.probe_or_refuse

    def probe(*args: Any, **kwargs: Any) -> Any:
        if rank == bad_rank:
            raise TransportError(f"simulated storage error probing on rank {rank}")
        return real(*args, **kwargs)

    opening.probe_or_refuse = probe  # type: ignore[assignment]
    start = time.monotonic()
    try:
        state = {"w": torch.zeros(8)}
        ds.load(state, url)
        return {"error": None, "loaded": state["w"].tolist(), "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    finally:
        opening.probe_or_refuse = real  # type: ignore[assignment]


def ds_load_format_on_one_rank(rank: int, world: int, url: str) -> list[float]:
    """``ds.load`` with ``format="dcp"`` on rank 0 only: every rank still takes part in sharing the format."""
    state = {"w": torch.zeros(8)}
    ds.load(state, url, **({"format": "dcp"} if rank == 0 else {}))
    return state["w"].tolist()
