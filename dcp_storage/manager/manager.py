"""``CheckpointManager``: saves over time, with the coordinator deciding and every rank getting its answer.

The coordinator decides, every rank gets its answer: the library's one coordinator broadcast.

Without a process group (one process) the function just runs. With one, rank 0 of ``group`` runs it and
every rank gets its value, or raises its error
(:func:`~dcp_storage.strategies.collectives.share_object`), so no rank goes on alone after a failure
and no collective hangs waiting for it. ``location`` (the manager's root) makes a rank given another root
raise instead of acting on the coordinator's answer about a different root.

``CheckpointManager``: the save/restore loop of a training job, over ``root/step-<N>/`` folders.

Call order (every rank calls every method, in the same order, as with ``dcp.save``/``dcp.load``):

1. ``CheckpointManager(root, ...)``: the coordinator (rank 0 of ``process_group``) recovers the root:
   reconciles the index with a listing, finishes deletions a killed job left, removes torn step folders
   no live save holds. With ``async_mode="thread"`` every rank also creates a gloo group for the saves,
   so the background save's collectives never meet the training loop's or the manager's own.
2. ``restore(state)``: the latest complete step (the coordinator decides, every rank gets its answer),
   loaded in place by ``dcp.load``: at any world size, resharded.
3. ``save(step, state)`` every step: saves when ``step % save_interval_steps == 0`` or ``force=True``.
   It first waits for the save before (at most one in flight) and raises that save's error if it failed.
   Async, the call blocks only while the state is copied to host memory
   (:class:`~.retention.ReusingStager`); the write, the commit, the index and the retention run in the
   background. Deletion starts only once the new step is durable.
4. ``wait()`` / ``close()`` at the end: until the last save is durable, raising its error.

Who touches storage: each rank writes its own data (the writer's job); the coordinator alone lists,
reads and writes the index, and deletes. Cleanup problems after a durable save (an index that could not
be written, a step that could not be deleted) are warnings, not errors: the step is saved, the index is a
cache, and the next save retries the deletion.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_storage.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    NonTensorStateError,
    RankMismatchError,
    StorageAccessError,
)
from dcp_storage.formats.location import find_leftovers
from dcp_storage.manager.folders import scan_step, step_name
from dcp_storage.manager.retention import InFlight, KeepPolicy, ReusingStager, _is_stateful
from dcp_storage.manager.steps import StepRoot
from dcp_storage.opening import open_reader, open_writer, raising_ours, writable_format
from dcp_storage.strategies.collectives import RANK_FAILURES, group_view, share_object
from dcp_storage.strategies.rank_agreement import agree
from dcp_storage.transports import open_transport
from dcp_storage.transports.access import prepare_output

__all__ = ["CheckpointManager", "InFlight", "agreed", "is_coordinator"]


T = TypeVar("T")


def _distributed(group: Any) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized()


def is_coordinator(group: Any) -> bool:
    return not _distributed(group) or dist.get_rank(group) == 0


def agreed(group: Any, fn: Callable[[], T], location: str | None = None) -> T:
    """``fn()`` run on the coordinator of ``group``; its result (or its exception) on every rank."""
    if not _distributed(group):
        return fn()
    return share_object(fn, group=group, src_rank=0, location=location)


_log = logging.getLogger(__name__)
_MODES = (None, "thread", "process")
STATE_KEY = "state"  # a Stateful passed as the whole state is stored under this key


class CheckpointManager:
    """Save every N steps, keep the last K complete steps, resume from the latest complete one.

    Args:
        root: a local directory or URL (``s3://``, ``gs://``, ``az://``, ``memory://``, any fsspec URL);
            each step is saved under ``root/step-<N zero-padded>/``.
        storage_options: the filesystem's options (credentials, endpoint), as for the readers and writers.
        keep: which complete steps survive a save (:class:`KeepPolicy`); the newest always does.
        save_interval_steps: ``save(step)`` saves when ``step`` is a multiple of it (or ``force=True``).
        async_mode: ``None`` saves before ``save()`` returns; ``"thread"`` copies the state to host memory
            and writes in a background thread; ``"process"`` hands it to torch's checkpoint process
            (``dcp.async_save(..., AsyncCheckpointerType.PROCESS)``; the script needs the
            ``if __name__ == "__main__"`` guard).
        writer: the format of each step: ``"dcp"`` (:class:`~dcp_storage.FsspecWriter`), ``"safetensors"``
            (:class:`~dcp_storage.SafetensorsWriter`; tensor-only state: non-tensor entries such as an
            optimizer's ``param_groups`` raise ``NonTensorStateError`` at save, since its reader could not restore
            them) or any registered format with a writer.
        process_group: the ranks that save together (default: the whole job). Every rank of the default
            group must construct the manager (it may create a process group).
        create_bucket: create the URL's bucket if it does not exist (else ``BucketNotFoundError``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        keep: KeepPolicy = KeepPolicy(last=3, every=None),  # noqa: B008 - frozen, so sharing it is safe
        save_interval_steps: int = 1,
        async_mode: str | None = None,
        writer: str = "dcp",
        process_group: Any = None,
        create_bucket: bool = False,
    ) -> None:
        if async_mode not in _MODES:
            raise ValueError(f"async_mode must be None, 'thread' or 'process', got {async_mode!r}")
        if isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be a positive int, got {save_interval_steps!r}")
        if not isinstance(keep, KeepPolicy):
            raise TypeError(f"keep must be a KeepPolicy, got {type(keep).__name__}")
        if not isinstance(writer, str):
            raise TypeError(f"writer must be a format name such as 'dcp' or 'safetensors', got {type(writer).__name__}")
        writable_format(writer, "CheckpointManager")  # a wrong name fails here; discovery is not paid in a save
        self.root = os.fspath(root).rstrip("/") or os.fspath(root)
        self.storage_options = dict(storage_options or {})
        self.keep = keep
        self.save_interval_steps = save_interval_steps
        self.async_mode = async_mode
        self.writer = writer
        self.create_bucket = create_bucket
        self._distributed = dist.is_available() and dist.is_initialized()
        if async_mode == "process" and not self._distributed:
            raise ValueError(
                "async_mode='process' needs an initialized process group (torch's checkpoint process joins it): "
                "call torch.distributed.init_process_group('gloo') first (torchrun sets the environment), or use "
                "async_mode='thread'"
            )
        self._group = (process_group or dist.group.WORLD) if self._distributed else None
        if self._group is not None:
            self._check_same_settings()
        self._own_group = None
        if self._distributed and async_mode == "thread":
            self._own_group = dist.new_group(ranks=dist.get_process_group_ranks(self._group), backend="gloo")
        self._save_group = self._own_group or self._group
        self._coordinator = is_coordinator(self._group)
        self._root: StepRoot | None = None
        self._inflight = InFlight()
        self._stager = ReusingStager()
        self._closed = False
        self.last_cleanup = None
        complete, foreign = agreed(self._group, self._recover, self.root)
        self._complete: set[int] = set(complete)
        self._foreign = set(foreign)  # step folders holding others' files: never saved into (see save)
        self._rolled_back_to: int | None = None  # restore() of a step older than others stored (see save)

    def _check_same_settings(self) -> None:
        """Every rank of the group manages alike, or every rank raises :class:`RankMismatchError` here: ranks
        with other async modes, intervals, writers or policies would save other steps at other moments and wait
        in collectives the others never enter (the thread mode's own group is made collectively, next)."""
        mine = {
            "async_mode": self.async_mode,
            "save_interval_steps": self.save_interval_steps,
            "writer": self.writer,
            "keep": repr(self.keep),
        }
        every: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(every, mine, group=self._group)
        differ = {rank: s for rank, s in enumerate(every) if s != every[0]}
        if differ:
            raise RankMismatchError(
                f"CheckpointManager({self.root!r}) was made with other settings on other ranks: rank 0 {every[0]}, "
                + ", ".join(f"rank {rank} {s}" for rank, s in differ.items())
                + "; every rank must pass the same async_mode, save_interval_steps, writer and keep"
            )

    # ------------------------------------------------------------------------------------ coordinator
    def _store(self) -> StepRoot:
        if self._root is None:
            transport, path = open_transport(self.root, self.storage_options)
            self._root = StepRoot(transport, path)
        return self._root

    def _recover(self) -> tuple[list[int], list[int]]:
        store = self._store()
        prepare_output(store.transport, store.root, coordinator=True, create_bucket=self.create_bucket)
        try:
            self.last_cleanup = store.recover()
        except StorageAccessError as exc:  # read-only credentials (an evaluation job): restore still works
            self.last_cleanup = store.recover(dry_run=True)  # raises if reading is refused too
            warnings.warn(
                f"{self.root}: this manager may read but not write there ({exc}); it can restore steps, but its "
                "saves and clean-up will fail with these credentials",
                stacklevel=3,
            )
        if self.last_cleanup.held:
            _log.info("step folders held by a live save, left in place: %s", self.last_cleanup.held)
        return sorted(store.index.steps), sorted(self.last_cleanup.foreign)

    def _before_save(self, step: int, metrics: dict[str, float] | None) -> None:
        """Coordinator, before a save's first byte: remove this manager's failed steps, mark ``step`` pending
        with its metrics and the retention that follows its commit (a start after a kill runs it)."""
        store = self._store()
        try:
            for failed in list(self._inflight.failed):
                store.remove_step(failed)
                self._inflight.failed.remove(failed)
            store.begin(step, self.keep, metrics)
        except Exception as exc:  # noqa: BLE001 - the index is a cache: the save goes on (see module docstring)
            warnings.warn(f"{self.root}: could not prepare the index for step {step}: {exc}", stacklevel=2)

    def _after_save(self, step: int, metrics: dict[str, float] | None) -> None:
        """Coordinator, once ``step`` is durable: record it, then delete what the policy does not keep."""
        store = self._store()
        try:
            if not store.commit(step, metrics, self.keep):
                warnings.warn(f"{self.root}: step {step} was saved but its commit marker is not there", stacklevel=2)
        except Exception as exc:  # noqa: BLE001 - the step is durable; the next save retries (module docstring)
            warnings.warn(f"{self.root}: step {step} is saved, but cleaning up after it failed: {exc}", stacklevel=2)

    # ------------------------------------------------------------------------------------ saving
    def save(self, step: int, state: Any, *, metrics: Mapping[str, float] | None = None, force: bool = False) -> bool:
        """Save ``state`` (a state dict, or a Stateful such as :class:`TrainState`) as ``step``.

        Returns ``True`` when a save started (async: it runs on in the background), ``False`` when the
        interval says no, or the step is already stored complete.
        """
        self._check_open()
        step_name(step)  # refuses a step that is not a non-negative int
        checked = _checked_metrics(metrics)
        if not force and step % self.save_interval_steps != 0:
            return False
        self._settle()  # at most one save in flight; the previous one's error is raised here
        self._refuse_abandoned(step)
        if step in self._complete:
            return False
        if step in self._foreign:
            raise CheckpointExistsError(
                f"{self._step_url(step)} holds files no save of dcp-storage leaves (another tool's?): saving step "
                f"{step} into it would mix them with the checkpoint, and retention would later delete them with it; "
                "move that folder away (then make the manager again) or save under another step"
            )
        staged, failure = None, None
        try:  # one rank unable to start this save (its state, out of host memory): no rank starts it
            app = _app_state(state)
            writer = self._make_writer(self._step_url(step))
            if self.async_mode == "thread":  # the only part the training loop waits for
                staged = self._stager.stage({k: v.state_dict() if _is_stateful(v) else v for k, v in app.items()})
        except RANK_FAILURES as exc:
            failure = exc
        agree(group_view(self._group), failure)  # else the others would wait in the save's collectives
        if self.async_mode is None:
            try:
                self._run_save(step, app, writer, checked)
            except BaseException:  # torch's CheckpointException is a BaseException
                self._inflight.failed.append(step)
                raise
            self._complete.add(step)
            return True
        if self.async_mode == "thread":
            self._inflight.submit(step, lambda: self._run_save(step, staged, writer, checked))
            return True
        return self._submit_process_save(step, app, writer, checked)

    def _refuse_abandoned(self, step: int) -> None:
        """After a restore of an older step, the newer steps are another run's: a save of one of them would be
        skipped as already stored, and any new step below them deleted by retention (which keeps the newest
        by number), and a restart would resume from them. Refused until they are discarded."""
        back = self._rolled_back_to
        newer = sorted(s for s in self._complete if back is not None and s > back)
        if not newer or step <= back:  # type: ignore[operator]
            return
        raise CheckpointExistsError(
            f"{self.root}: steps {newer} were saved after step {back}, which was restored; saving step {step} "
            f"on top of them would mix two runs (a stored step is not saved again, retention keeps the newest "
            f"steps by number, a restart resumes from step {newer[-1]}): call discard_newer_than({back}) (or "
            "restore(..., discard_newer=True)) to delete them first, or restore the latest step instead"
        )

    def discard_newer_than(self, step: int) -> list[int]:
        """Delete every complete step newer than ``step`` (a rollback: training goes on from ``step``); returns
        them. Every rank calls it; the coordinator deletes, marker first (a delete killed half way is finished
        by the next start)."""
        self._check_open()
        self._settle()
        step_name(step)

        def discard() -> list[int]:
            store = self._store()
            newer = sorted(s for s in store.index.steps if s > step)
            return store.delete(newer) if newer else []

        gone = agreed(self._group, discard, self.root)
        self._complete -= set(gone)
        self._rolled_back_to = None
        return gone

    def _run_save(self, step: int, state: dict[str, Any], writer: Any, metrics: dict[str, float] | None) -> int:
        if self._coordinator:
            self._before_save(step, metrics)
        try:
            raising_ours(
                lambda: dcp.save(
                    state, storage_writer=writer, process_group=self._save_group, no_dist=not self._distributed
                ),
                lambda: writer,
                "CheckpointManager.save",
            )
        except NonTensorStateError as exc:
            if self.writer != "safetensors":
                raise
            ours = NonTensorStateError(
                exc.keys,
                fix="CheckpointManager(writer='safetensors') saves tensors only, so this step could not be restored: "
                "save optimizer and scheduler state with writer='dcp', or save TrainState(model) alone",
            )
            ours.__notes__ = list(getattr(exc, "__notes__", []))  # which ranks failed
            raise ours from None
        if self._coordinator:
            self._after_save(step, metrics)
        return step

    def _submit_process_save(
        self, step: int, app: dict[str, Any], writer: Any, metrics: dict[str, float] | None
    ) -> bool:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

        if self._coordinator:
            self._before_save(step, metrics)
        response = dcp.async_save(
            app,
            storage_writer=writer,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            no_dist=not self._distributed,
        )
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response

        def job() -> int:
            upload.result()
            if self._coordinator:
                self._after_save(step, metrics)
            return step

        self._inflight.submit(step, job)
        return True

    def _make_writer(self, url: str) -> Any:
        options: dict[str, Any] = {}
        if self.writer in ("dcp", "safetensors") or self.create_bucket:
            options["create_bucket"] = self.create_bucket
        if self.writer == "safetensors":  # tensors only: its reader restores no extra_state.pt (non-tensor values)
            if self._save_group is not None and self.async_mode != "process":
                options["process_group"] = self._save_group
        return open_writer(url, self.writer, self.storage_options, **options)

    def _step_url(self, step: int) -> str:
        if "://" in self.root:
            return posixpath.join(self.root, step_name(step))
        return os.path.join(self.root, step_name(step))

    def _settle(self) -> None:
        step = self._inflight.step
        self._inflight.settle()
        if step is not None:
            self._complete.add(step)

    def wait(self) -> None:
        """Until the save in flight is durable (and cleaned up after); raises its error if it failed."""
        self._settle()

    # ------------------------------------------------------------------------------------ questions
    def latest_step(self) -> int | None:
        """The newest complete step (``None``: none yet), the same on every rank; O(1) requests."""
        self._check_open()
        return agreed(self._group, lambda: self._store().latest(), self.root)

    def all_steps(self) -> list[int]:
        """Every complete step, ascending, the same on every rank."""
        self._check_open()
        return agreed(self._group, lambda: self._store().steps(), self.root)

    def restore(self, state: Any, step: int | None = None, *, planner: Any = None, discard_newer: bool = False) -> int:
        """Load ``step`` (default: the latest complete one) into ``state`` in place; returns the step.

        Raises :class:`~dcp_storage.errors.CheckpointNotFoundError` when the root holds no complete step,
        :class:`~dcp_storage.errors.IncompleteCheckpointError` for a ``step`` that is not complete.

        A rollback (``step`` older than other complete steps): with ``discard_newer=True`` the newer steps are
        deleted once the load succeeded; without, they stay and a save of a step after ``step`` raises
        :class:`~dcp_storage.errors.CheckpointExistsError` until :meth:`discard_newer_than` deletes them.
        """
        self._check_open()
        self._settle()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"{self.root}: no complete step to restore from; start from scratch (check latest_step() "
                    "for None first) or point the manager at the root that holds the checkpoints"
                )
        else:
            step_name(step)
            agreed(self._group, lambda: self._require_complete(step), self.root)
        app = _app_state(state)
        flat = {k: v.state_dict() if _is_stateful(v) else v for k, v in app.items()}
        reader = open_reader(self._step_url(step), self.writer, self.storage_options)
        raising_ours(
            lambda: dcp.load(
                flat, storage_reader=reader, planner=planner, process_group=self._group, no_dist=not self._distributed
            ),
            lambda: reader,
            "CheckpointManager.restore",
        )
        for key, value in app.items():  # dcp.load fills tensors in place; the rest is handed back here
            if _is_stateful(value):
                value.load_state_dict(flat[key])
            elif isinstance(state, MutableMapping) and flat[key] is not value:
                state[key] = flat[key]  # a non-tensor value (an int, a list): replaced in the caller's dict
        newer = any(s > step for s in self._complete)
        if newer and discard_newer:
            self.discard_newer_than(step)
        self._rolled_back_to = step if newer and not discard_newer else None
        return step

    def _require_complete(self, step: int) -> None:
        store = self._store()
        folder = scan_step(store.transport, store.root, step, metrics=False)
        if not folder.complete:
            url = store.transport.url(store.folder(step))
            leftovers = find_leftovers(store.transport, store.folder(step), list(folder.names))
            if leftovers is not None:
                raise leftovers.error()
            raise CheckpointNotFoundError(f"{url}: no complete step {step} here; complete steps: {store.steps()}")

    # ------------------------------------------------------------------------------------ the end
    def close(self) -> None:
        """Wait for the save in flight (raising its error), then release threads, buffers and groups."""
        if self._closed:
            return
        try:
            self._settle()
        finally:
            self._closed = True
            self._inflight.close()
            self._stager.close()
            if self._own_group is not None:
                dist.destroy_process_group(self._own_group)
                self._own_group = None
            if self._root is not None:
                self._root.transport.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager({self.root!r}) is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.root!r}, keep={self.keep}, save_interval_steps={self.save_interval_steps}, "
            f"async_mode={self.async_mode!r}, writer={self.writer!r})"
        )


def _app_state(state: Any) -> dict[str, Any]:
    if isinstance(state, Mapping):
        return dict(state)
    if _is_stateful(state):
        return {STATE_KEY: state}
    raise TypeError(
        f"state must be a state dict (a Mapping) or a Stateful (state_dict and load_state_dict), got "
        f"{type(state).__name__}; wrap a model and optimizer in dcp_storage.TrainState(model, optimizer)"
    )


def _checked_metrics(metrics: Mapping[str, float] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of names to numbers, got {type(metrics).__name__}")
    out = {}
    for key, value in metrics.items():
        number = value.item() if hasattr(value, "item") else value
        if not isinstance(key, str) or isinstance(number, bool) or not isinstance(number, (int, float)):
            raise TypeError(f"metrics: {key!r} must map a name to a number, got {type(value).__name__}")
        out[key] = number
    json.dumps(out)  # numbers only: always serialisable
    return out
