"""A training loop that saves with ``dcp.async_save`` and changes its parameters at once, for
``test_async_save.py``: in the test process (THREAD mode) and in :func:`run_ranks` ranks (PROCESS mode,
where torch pickles the writer into its checkpoint process)."""

from __future__ import annotations

import os
from typing import Any

import torch

SEED = 20261201
# Big enough that a save is still writing when the loop changes the parameters (a few MB), small enough
# to keep each save well under a second.
SHAPES = {"embed": ((1024, 1024), torch.float32), "proj": ((512, 768), torch.bfloat16), "bias": ((768,), torch.float32)}
# torch's StagingOptions fields in order: pinned memory, shared memory, async staging, non-blocking copy.
# ``None``: async_save's own default stager. Pinned memory and non-blocking copies need CUDA.
STAGERS: list[tuple[bool, bool, bool, bool] | None] = [None, (False, False, False, False), (False, True, True, False)]
if torch.cuda.is_available():
    STAGERS.append((True, True, True, True))


def initial_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return {k: torch.randn(shape, generator=g).to(dtype) for k, (shape, dtype) in SHAPES.items()}


def make_writer(kind: str, url: str, storage_options: dict[str, Any], **kwargs: Any) -> Any:
    from dcp_storage import FsspecWriter, SafetensorsWriter

    cls = {"dcp": FsspecWriter, "safetensors": SafetensorsWriter}[kind]
    return cls(url, storage_options, overwrite=True, **kwargs)


def make_reader(kind: str, url: str, storage_options: dict[str, Any]) -> Any:
    from dcp_storage import FsspecReader, SafetensorsReader

    return {"dcp": FsspecReader, "safetensors": SafetensorsReader}[kind](url, storage_options)


def train_and_save(
    kind: str,
    url: str,
    storage_options: dict[str, Any],
    mode: str,
    stagers: list[tuple[bool, bool, bool, bool] | None],
    **writer_kwargs: Any,
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """One step per stager: ``async_save`` to ``{url}/step-{i}``, then change every parameter in place at
    once (after staging, when the stager stages in the background). Returns each save's URL and the state
    it must hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    state = initial_state()
    saved: list[tuple[str, dict[str, torch.Tensor]]] = []
    pending = None
    for step, options in enumerate(stagers):
        if pending is not None:
            pending.result()  # one save at a time, as torch asks
        stager = DefaultStager(StagingOptions(*options)) if options is not None else None
        target = f"{url}/step-{step}"
        saved.append((target, {k: v.clone() for k, v in state.items()}))
        response = dcp.async_save(
            state,
            storage_writer=make_writer(kind, target, storage_options, **writer_kwargs),
            async_checkpointer_type=AsyncCheckpointerType[mode],
            async_stager=stager,
            no_dist=not torch.distributed.is_initialized(),
        )
        if isinstance(response, AsyncSaveResponse):  # staging runs in the background: wait for the copy only
            response.staging_completion.result()
            pending = response.upload_completion
        else:
            pending = response
        with torch.no_grad():  # the training step, while the save is (usually) still writing
            for t in state.values():
                t.mul_(-3.0).add_(1.0)
        if stager is not None:
            pending.add_done_callback(lambda _f, s=stager: s.close())
    if pending is not None:
        pending.result()
    return saved


def process_mode_all(
    rank: int,
    world: int,
    kinds: list[str],
    targets: dict[str, tuple[str, dict[str, Any]]],
    retry: tuple[str, dict[str, Any]],
) -> dict[str, Any]:
    """Every PROCESS-mode scenario of ``test_async_save.py`` on one gloo rank, so that torch spawns one
    checkpoint process for all of them (the slow part: a fresh interpreter importing torch, seconds each on 2
    cores) and pickles each writer into it: for each backend in ``targets`` (name -> ``(url, options)``)
    :func:`_saves`, then the failed save and its retry (:func:`_retry`) at ``retry``. A scenario that raises
    is reported as its traceback under its name, so the others still run and each test fails on its own."""
    import traceback

    from torch.distributed.checkpoint import _async_process_executor as executor

    os.environ["MASTER_ADDR"] = "127.0.0.1"  # the checkpoint process's group (torch falls back to the FQDN)
    out: dict[str, Any] = {}
    scenarios = {backend: (lambda u=url, o=opts: _saves(kinds, u, o)) for backend, (url, opts) in targets.items()}
    scenarios["retry"] = lambda: _retry(*retry)
    try:
        for name, scenario in scenarios.items():
            try:
                out[name] = scenario()
            except Exception:  # noqa: BLE001 - reported by scenario name
                out[name] = traceback.format_exc()
    finally:
        # Stop the checkpoint process now rather than at interpreter exit (torch keeps it in a global).
        process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
        del process
    return out


def _saves(
    kinds: list[str], url: str, storage_options: dict[str, Any]
) -> dict[str, list[tuple[str, dict[str, torch.Tensor]]]]:
    """PROCESS mode for each writer in ``kinds`` (under ``{url}/{kind}``)."""
    import torch.distributed as dist

    # A ProcessGroup cannot be pickled: SafetensorsWriter leaves it behind (the checkpoint process's default
    # group is the same ranks).
    writer_kwargs: dict[str, dict[str, Any]] = {"safetensors": {"process_group": dist.group.WORLD}}
    return {
        kind: train_and_save(kind, f"{url}/{kind}", storage_options, "PROCESS", STAGERS, **writer_kwargs.get(kind, {}))
        for kind in kinds
    }


def _retry(url: str, storage_options: dict[str, Any]) -> dict[str, str]:
    """PROCESS mode: an ``async_save`` that fails after taking its lock, then the same writer saving again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from ._failing_writer import FailingFsspecWriter

    writer = FailingFsspecWriter(url, storage_options)
    outcomes = {}
    for attempt in ("failed", "retry"):
        writer.fail_writes = attempt == "failed"
        future = dcp.async_save(
            initial_state(), storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS
        )
        try:
            future.result()
            outcomes[attempt] = "ok"
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            outcomes[attempt] = f"{type(exc).__name__}: {exc}"[:2000]
    return outcomes
