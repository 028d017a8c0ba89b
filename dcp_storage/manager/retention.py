"""What to keep and what to clean up: ``KeepPolicy``, liveness of saves, staging, ``TrainState``, the save in flight.

What to keep: :class:`KeepPolicy` decides which complete steps survive a save.

Only complete steps are ever passed in (torn folders are cleanup's business, never counted), and the
newest complete step always survives, whatever the policy says: a policy can never leave a root without
its last good checkpoint.

Whether a live save holds a step folder, so that cleanup never deletes under a running save.

A save holds its folder through the lock of :mod:`dcp_storage.formats.commit_claim` (``.dcp_storage.lock``,
from before its first byte until its commit). The lock names its holder (host, pid, start time). Here:

* no lock: nothing holds the folder;
* a lock the claim protocol wrote (it carries a lease): the protocol's own judgement
  (:func:`dcp_storage.formats.commit_holder.stale_reason`): stale when its process on this host is gone or
  was reused, when its save in this process has ended, or when it was not renewed within its lease;
* an older lock without a lease, of this host: held while its process lives (``os.kill(pid, 0)``), except
  by the processes the caller names as its own finished saves (a save of this process that failed keeps
  its lock);
* such a lock of another host, or one whose holder cannot be read: held (it cannot be told from a running
  save), unless older than ``stale_after`` seconds.

This is the one function the manager and ``dcp-storage gc`` ask.

The one save in flight: a background job, its error kept until the next ``save``/``wait``/``close``.

A job is a callable that runs the whole save of one step (staged state in, durable step out) on the
manager's single worker thread, so at most one save runs at a time and a new one first waits for the
one before. Its exception is never swallowed: :meth:`InFlight.settle` raises it once, and records the
step as failed (its folder is torn: the next save removes it, and it never counts as a step).

Copying the state off the training loop's tensors: what an async save blocks the loop for.

torch's ``dcp.async_save`` stages every save into freshly allocated host memory (its ``DefaultStager``), so
each save pays for the allocation and the page faults of a state-sized buffer on top of the copy. The
manager has at most one save in flight, so once a save is durable its buffers are free again: the
:class:`ReusingStager` keeps them and copies the next state into them in place, which costs a ``memcpy``.

The first save (or one whose state changed shape, dtype, layout or sharding) is staged by torch's own
``DefaultStager``; later ones are copied into its result. Non-tensor values are deep-copied each time.

``TrainState``: a model, its optimizer, its scheduler and any other Stateful objects, as one torch
``Stateful`` for FSDP2, DDP and plain modules.

It goes through torch's ``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``),
which give FSDP2 models and their optimizers sharded (DTensor) state dicts keyed by parameter names, so a
checkpoint restores at another world size, and strip DDP's ``module.`` prefixes.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from dcp_storage.formats.commit_holder import stale_reason
from dcp_storage.formats.commit_lease import is_active
from dcp_storage.formats.paths import LOCK_RE

__all__ = [
    "DEFAULT_STALE_AFTER",
    "InFlight",
    "KeepPolicy",
    "ReusingStager",
    "TrainState",
    "held_by_live_save",
    "state_bytes",
]


@dataclass(frozen=True)
class KeepPolicy:
    """Keep the last ``last`` complete steps, every step divisible by ``every``, and the ``best`` steps by
    ``metric`` (``mode="min"`` keeps the lowest values, ``"max"`` the highest).

    ``last=None`` keeps every step (nothing is ever deleted). Steps saved without the metric never count as
    best. Examples: ``KeepPolicy(last=3)``; ``KeepPolicy(last=2, every=1000)``;
    ``KeepPolicy(last=1, best=2, metric="loss", mode="min")``.
    """

    last: int | None = 3
    every: int | None = None
    best: int | None = None
    metric: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("last", "every", "best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"KeepPolicy({name}=...) must be a positive int or None, got {value!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepPolicy(mode=...) must be 'min' or 'max', got {self.mode!r}")
        if (self.best is None) != (self.metric is None):
            raise ValueError("KeepPolicy: best=K and metric='name' go together (keep the K best steps by metric)")

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, Any]] | None = None) -> set[int]:
        """The steps of ``steps`` (complete ones) to keep; the newest is always among them."""
        ordered = sorted(set(steps))
        if not ordered:
            return set()
        if self.last is None:
            return set(ordered)
        kept = set(ordered[-self.last :])
        kept.add(ordered[-1])
        if self.every is not None:
            kept.update(s for s in ordered if s % self.every == 0)
        if self.best is not None and self.metric is not None:
            kept.update(self._best(ordered, metrics or {}))
        return kept

    def delete(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, Any]] | None = None) -> list[int]:
        """The steps of ``steps`` to delete, oldest first."""
        kept = self.keep(steps, metrics)
        return sorted(s for s in set(steps) if s not in kept)

    def _best(self, ordered: list[int], metrics: Mapping[int, Mapping[str, Any]]) -> list[int]:
        scored = []
        for step in ordered:
            value = (metrics.get(step) or {}).get(str(self.metric))
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                scored.append((value if self.mode == "min" else -value, -step, step))
        return [step for *_, step in sorted(scored)[: self.best]]


DEFAULT_STALE_AFTER = 24 * 3600.0
_LOCK_LIMIT = 4096


def held_by_live_save(
    transport: Any,
    folder: str,
    names: Iterable[str],
    *,
    finished_pids: Iterable[int] = (),
    stale_after: float = DEFAULT_STALE_AFTER,
) -> bool:
    """Whether any lock among ``names`` (the listing of ``folder``) belongs to a save that may be running."""
    return any(
        _live(transport, transport.join(folder, n), set(finished_pids), stale_after) for n in names if LOCK_RE.match(n)
    )


def _live(transport: Any, path: str, finished: set[int], stale_after: float) -> bool:
    try:
        holder = json.loads(bytes(transport.read_file(path, max_bytes=_LOCK_LIMIT)))
    except Exception:  # noqa: BLE001 - gone meanwhile (the save committed), or unreadable
        return transport.exists(path) and not _older(None, stale_after)
    if not isinstance(holder, dict):
        return True
    if "lease_s" in holder and "renewed" in holder:  # the claim protocol's lock: its own rules decide
        return stale_reason(holder, is_active) is None
    since = holder.get("since")
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        pid = holder["pid"]
        if pid in finished:
            return False
        return _alive(pid)
    return not _older(since, stale_after)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # a zombie (ended, not reaped by its parent) holds nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _older(since: Any, stale_after: float) -> bool:
    if not isinstance(since, str):
        return False
    try:
        start = datetime.datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return False
    age = (datetime.datetime.now(datetime.timezone.utc) - start).total_seconds()
    return age > stale_after


class _Mismatch(Exception):
    """The new state does not fit the kept buffers: stage afresh."""


class ReusingStager:
    """Stages a state dict into host memory, reusing the previous staging's buffers when they fit.

    Call :meth:`stage` only when the previous staged copy is no longer read (its save is durable).
    """

    def __init__(self) -> None:
        self._staged: Any = None
        self.reused = 0

    def stage(self, state: Mapping[str, Any]) -> Any:
        if self._staged is not None:
            try:
                with torch.no_grad():
                    staged = _refill(state, self._staged, {})
                self.reused += 1
                return staged
            except _Mismatch:
                self._staged = None
        stager = DefaultStager(StagingOptions(False, False, False, False))  # async_save's own default
        try:
            self._staged = stager.stage(dict(state))
        finally:
            stager.close()
        return self._staged

    def close(self) -> None:
        self._staged = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _refill(src: Any, dst: Any, ties: dict[int, tuple[int, bool]]) -> Any:
    """``dst`` (a staged copy) updated to hold ``src``'s values, tensors copied in place; ``ties``: what each
    staged storage was filled from so far (:func:`_check_ties`)."""
    if isinstance(src, torch.Tensor):
        if not isinstance(dst, torch.Tensor) or isinstance(src, DTensor) != isinstance(dst, DTensor):
            raise _Mismatch
        if isinstance(src, DTensor) and (src.placements != dst.placements or src.device_mesh != dst.device_mesh):
            raise _Mismatch
        s, d = _local(src), _local(dst)
        if s.shape != d.shape or s.dtype != d.dtype or s.stride() != d.stride() or d.device.type != "cpu":
            raise _Mismatch
        if isinstance(src, DTensor) and (src.shape != dst.shape or src.stride() != dst.stride()):
            raise _Mismatch
        _check_ties(ties, s, d)
        d.copy_(s)
        return dst
    if isinstance(src, Mapping):
        if not isinstance(dst, dict) or set(src) != set(dst):
            raise _Mismatch
        for key, value in src.items():
            dst[key] = _refill(value, dst[key], ties)
        return dst
    if isinstance(src, list):
        if not isinstance(dst, list) or len(src) != len(dst):
            raise _Mismatch
        for i, value in enumerate(src):
            dst[i] = _refill(value, dst[i], ties)
        return dst
    if isinstance(src, tuple):
        if not isinstance(dst, tuple) or len(src) != len(dst) or type(src) is not type(dst):
            raise _Mismatch
        return (
            type(src)(*(_refill(s, d, ties) for s, d in zip(src, dst)))
            if hasattr(src, "_fields")
            else tuple(_refill(s, d, ties) for s, d in zip(src, dst))
        )
    return copy.deepcopy(src)


def _check_ties(ties: dict[int, tuple[int, bool]], s: torch.Tensor, d: torch.Tensor) -> None:
    """Staged tensors that share a storage must be filled from one source storage, at the same offsets.

    The stager keeps one copy of a tensor saved under several keys (tied weights); a later state whose
    tensors are no longer tied would otherwise be copied into that one buffer in turn, and every key saved
    with the last one's values.
    """
    if not d.numel():
        return
    here = (s.untyped_storage().data_ptr(), d.storage_offset() == s.storage_offset())
    first = ties.setdefault(d.untyped_storage().data_ptr(), here)
    if first is not here and (first[0] != here[0] or not (first[1] and here[1])):
        raise _Mismatch  # a second tensor in this staged storage, from another source or at another place


def state_bytes(state: Any) -> int:
    """Bytes of the (local) tensors in ``state``: what a ``memcpy`` of the rank's state moves."""
    if isinstance(state, torch.Tensor):
        t = _local(state)
        return t.numel() * t.element_size()
    if isinstance(state, Mapping):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class TrainState:
    """``TrainState(model, optimizer=None, scheduler=None, **extra)``: save it with
    ``CheckpointManager.save(step, TrainState(...))`` and restore it in place with ``restore``.

    ``extra`` values are Stateful objects (a ``StatefulDataLoader``, a step counter with
    ``state_dict``/``load_state_dict``) or tensors (restored in place).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None, **extra: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainState: model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TrainState: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scheduler is not None and not _is_stateful(scheduler):
            raise TypeError(f"TrainState: scheduler {type(scheduler).__name__} has no state_dict/load_state_dict")
        for name, value in extra.items():
            if not (_is_stateful(value) or isinstance(value, torch.Tensor)):
                raise TypeError(
                    f"TrainState: extra state {name!r} ({type(value).__name__}) is neither Stateful (state_dict and "
                    "load_state_dict) nor a tensor, so it could not be restored in place; wrap it in an object with "
                    "both methods"
                )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra = dict(extra)

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        for name, value in self.extra.items():
            state[name] = value if isinstance(value, torch.Tensor) else value.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is not None:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optimizer"],
            )
        else:
            set_model_state_dict(self.model, state_dict["model"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        for name, value in self.extra.items():
            if isinstance(value, torch.Tensor):
                if state_dict[name] is not value:
                    with torch.no_grad():
                        value.copy_(state_dict[name])
            else:
                value.load_state_dict(state_dict[name])


class InFlight:
    """The save running in the background, if any."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[Any] | None = None
        self._step: int | None = None
        self.failed: list[int] = []  # steps whose save failed, not yet cleaned up

    @property
    def step(self) -> int | None:
        return self._step

    def submit(self, step: int, job: Callable[[], Any]) -> None:
        """Run ``job`` in the background; the caller has :meth:`settle`-d the previous one."""
        if self._future is not None:
            raise RuntimeError("a save is already in flight: settle() it first")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcp-storage-manager")
        self._step = step
        self._future = self._pool.submit(job)

    def settle(self) -> Any:
        """Wait for the save in flight; raise its exception (once). Returns its result, or ``None``."""
        future, step = self._future, self._step
        if future is None:
            return None
        try:
            return future.result()
        except BaseException:  # torch's CheckpointException is a BaseException
            if future.done() and not future.cancelled() and future.exception() is not None and step is not None:
                self.failed.append(step)  # the save failed (not an interrupt of this wait)
            raise
        finally:
            if future.done():  # an interrupt while waiting leaves the save in flight
                self._future = None
                self._step = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
