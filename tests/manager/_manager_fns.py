"""Rank bodies of ``test_manager.py``'s multi-rank test (module-level, for ``run_ranks``)."""

from __future__ import annotations

from typing import Any

import torch


def same_answer(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every rank saves a (replicated) state, then asks latest_step/all_steps and restores."""
    import dcp_storage as ds

    mgr = ds.CheckpointManager(root, keep=ds.KeepPolicy(last=2), async_mode="thread")
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((4, 4), float(step))})
    mgr.wait()
    out = {"latest": mgr.latest_step(), "all": mgr.all_steps()}
    target = {"w": torch.zeros(4, 4)}
    out["restored"] = mgr.restore(target)
    out["value"] = float(target["w"][0, 0])
    mgr.close()
    return out


def process_mode(rank: int, world: int, root: str) -> dict[str, Any]:
    """async_mode="process": torch's checkpoint process writes; the manager keeps, indexes and restores."""
    import os

    from torch.distributed.checkpoint import _async_process_executor as executor

    import dcp_storage as ds

    os.environ["MASTER_ADDR"] = "127.0.0.1"  # the checkpoint process's group (torch falls back to the FQDN)
    try:
        with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=1), async_mode="process") as mgr:
            for step in (1, 2):
                mgr.save(step, {"w": torch.full((4, 4), float(step))})
        with ds.CheckpointManager(root) as mgr:
            target = {"w": torch.zeros(4, 4)}
            return {"all": mgr.all_steps(), "restored": mgr.restore(target), "value": float(target["w"][0, 0])}
    finally:
        process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None  # stop it now (a global)
        del process


def mixed_settings(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1 asks for another async mode, then another interval: every rank raises at construction."""
    import time

    import dcp_storage as ds

    out: dict[str, Any] = {}
    for name, kwargs in (("async_mode", {"async_mode": "thread"}), ("interval", {"save_interval_steps": 5})):
        start = time.monotonic()
        try:
            ds.CheckpointManager(root, **(kwargs if rank == 1 else {})).close()
            out[name] = None
        except ds.errors.RankMismatchError as exc:
            out[name] = {"text": str(exc), "seconds": time.monotonic() - start}
    return out


def staging_fails_on_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """A save that rank 1 alone cannot start: in thread mode copying the state to host memory fails (out of
    memory), without a thread its state is not one. Every rank must raise at ``save``; rank 0 used to start
    the save and wait in its collectives for rank 1."""
    import dcp_storage as ds

    out = {}
    for mode in ("thread", None):
        mgr = ds.CheckpointManager(f"{root}-{mode}", async_mode=mode)
        if rank == 1:

            def no_memory(_state: Any) -> Any:
                raise torch.OutOfMemoryError("simulated out of memory while staging")

            mgr._stager.stage = no_memory  # type: ignore[method-assign]
        # without a thread, nothing is staged: a state that cannot be saved on rank 1 only fails there first
        state: Any = {"w": torch.ones(4, 4)} if mode == "thread" or rank == 0 else ["not a state dict"]
        out[str(mode)] = _save_once(mgr, state)
    return out


def _save_once(mgr: Any, state: Any) -> dict[str, Any]:
    import time

    start = time.monotonic()
    try:
        mgr.save(1, state)
        mgr.wait()
        text = ""
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        text = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    mgr.close()
    return {"text": text, "seconds": seconds}
