"""Rank bodies of the manager's kill tests: a 2-rank FSDP2 training job that saves through a
``CheckpointManager`` and resumes from its latest complete step (run in the crash tests' zygote ranks).

The job is deterministic: the weights start from a seed, each step's batch comes from a generator seeded
by the step, and gloo's collectives on a fixed world size are deterministic, so a job resumed from step k
must reach exactly the parameters of a job that never stopped. Each rank returns digests (sha256 of the
bytes of every full tensor of model and optimizer, in key order), so the test compares bit for bit.

Rank 0 appends events to ``{log_dir}/events.log`` (fsynced each line): ``durable N`` once the save of
step N is known durable (the next ``save`` or ``wait`` returned), ``resumed N`` on start.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

SEED = 7
SHAPE = {"vocab": 96, "dim": 32, "hidden": 64, "layers": 2}


def _build(world: int) -> tuple[Any, Any]:
    from dcp_storage_testing.models import build_model, fsdp2_shard

    model = fsdp2_shard(build_model(SEED, **SHAPE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, SHAPE["vocab"], (4, 8), generator=gen)


def _train_step(model: Any, optimizer: Any, step: int) -> None:
    tokens = _batch(step)
    loss = model(tokens).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def digest(state: Any) -> str:
    """sha256 over every full tensor (DTensors gathered: a collective) and value of ``state``, in key order."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)
        elif isinstance(value, torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            h.update(prefix.encode())
            h.update(full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={value!r}".encode())

    walk("", state)
    return h.hexdigest()


def _log(log_dir: str, line: str) -> None:
    with open(os.path.join(log_dir, "events.log"), "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def train(
    rank: int,
    world: int,
    root: str,
    storage_options: dict[str, Any],
    total: int,
    interval: int,
    keep_last: int,
    log_dir: str,
    record: bool,
) -> dict[str, Any]:
    """Train to step ``total``, saving every ``interval`` steps async and resuming from the latest step.

    ``record``: also return the digest of the state at every saved step (the reference run)."""
    import dcp_storage as ds

    model, optimizer = _build(world)
    state = ds.TrainState(model, optimizer)
    mgr = ds.CheckpointManager(
        root, storage_options, keep=ds.KeepPolicy(last=keep_last), save_interval_steps=interval, async_mode="thread"
    )
    out: dict[str, Any] = {"resumed": None, "restored_digest": None, "steps": {}}
    latest = mgr.latest_step()
    start = 1
    if latest is not None:
        out["resumed"] = mgr.restore(state)
        out["restored_digest"] = digest(state.state_dict())
        start = out["resumed"] + 1
        if rank == 0:
            _log(log_dir, f"resumed {out['resumed']}")
    previous = None
    for step in range(start, total + 1):
        _train_step(model, optimizer, step)
        if record and step % interval == 0:
            out["steps"][str(step)] = digest(state.state_dict())
        if mgr.save(step, state):
            if previous is not None and rank == 0:
                _log(log_dir, f"durable {previous}")  # save() returned: the one before is durable
            previous = step
    mgr.close()
    if previous is not None and rank == 0:
        _log(log_dir, f"durable {previous}")
    out["final"] = digest(state.state_dict())
    return out


def restore_only(rank: int, world: int, root: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """Restore the latest step at this world size (resharded) and return its digest."""
    import dcp_storage as ds

    model, optimizer = _build(world)
    state = ds.TrainState(model, optimizer)
    with ds.CheckpointManager(root, storage_options, keep=ds.KeepPolicy(last=2)) as mgr:
        step = mgr.restore(state)
    return {"step": step, "digest": digest(state.state_dict())}
