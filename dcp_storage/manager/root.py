"""The coordinator's view of a root of step folders: latest step, recovery, commit, retention, deletion.

Only the coordinator (rank 0) calls these; :mod:`.agreement` hands every other rank the same answer.
``dcp-storage ls`` and ``gc`` use the same object, so the command line obeys the manager's rules:

* only complete steps count (:mod:`.listing`); the index (:mod:`.index`) is a cache checked against them;
* deletion happens only after the new step is durable, and removes the commit marker first, so a delete
  killed half way leaves a torn folder (cleaned up later), never a step that looks complete but is not;
* the newest complete step is never deleted;
* a torn folder is removed unless a live save holds it (:mod:`.liveness`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.formats.completeness import commit_marker
from dcp_storage.manager.index import StepIndex, read_index, write_index
from dcp_storage.manager.layout import STEP_INFO_FILE, step_name
from dcp_storage.manager.listing import StepFolder, list_steps, scan_step, step_info
from dcp_storage.manager.liveness import DEFAULT_STALE_AFTER, held_by_live_save
from dcp_storage.manager.retention import KeepPolicy

__all__ = ["Cleanup", "StepRoot"]

_log = logging.getLogger(__name__)


@dataclass
class Cleanup:
    """What one pass removed (or, dry run, would remove), and the torn folders it left because a live save
    holds them."""

    deleted: list[int] = field(default_factory=list)
    torn_removed: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)


class StepRoot:
    """``root`` on ``transport``: the step folders under it and their index."""

    def __init__(self, transport: Any, root: str, *, stale_after: float = DEFAULT_STALE_AFTER) -> None:
        self.transport = transport
        self.root = root
        self.stale_after = stale_after
        self.index = StepIndex()

    def folder(self, step: int) -> str:
        return self.transport.join(self.root, step_name(step))

    # ---------------------------------------------------------------------------------------- questions
    def latest(self) -> int | None:
        """The newest complete step, in at most 3 requests when the index is right (module :mod:`.index`)."""
        index = read_index(self.transport, self.root)
        if index is not None:
            answer = self._latest_from(index)
            if answer is not _WRONG:
                return answer  # type: ignore[return-value]
        return self.rebuild().latest

    def _latest_from(self, index: StepIndex) -> object:
        newest = index.latest
        if index.pending is not None and (newest is None or index.pending > newest):
            if scan_step(self.transport, self.root, index.pending, metrics=False).complete:
                return index.pending  # committed, killed before the index said so
        if newest is None:
            return None if index.pending is not None or not index.steps else _WRONG
        marker = index.steps[newest]
        if self.transport.exists(self.transport.join(self.folder(newest), marker)):
            return newest
        return _WRONG  # the index names a step without its marker: not ours to trust

    def steps(self) -> list[int]:
        """Complete steps, ascending (from the index, checked as :meth:`latest` checks it; else a listing)."""
        index = read_index(self.transport, self.root)
        if index is not None:
            answer = self._latest_from(index)
            if answer is not _WRONG:
                steps = set(index.steps)
                if answer is not None:
                    steps.add(answer)  # type: ignore[arg-type]
                return sorted(steps)
        return sorted(self.rebuild().steps)

    def scan(self) -> list[StepFolder]:
        """Every step folder, listed (the truth, O(steps) requests): for ``ls`` and the rebuild."""
        return [scan_step(self.transport, self.root, s, n) for s, n in list_steps(self.transport, self.root).items()]

    def rebuild(self) -> StepIndex:
        """An index from a listing of every folder (not written: :meth:`recover` writes it)."""
        index = StepIndex()
        for folder in self.scan():
            if folder.complete:
                index.steps[folder.step] = folder.marker  # type: ignore[assignment]
                if folder.metrics:
                    index.metrics[folder.step] = folder.metrics
        return index

    # ---------------------------------------------------------------------------------------- recovery
    def recover(self, *, finished_pids: Iterable[int] = (), dry_run: bool = False) -> Cleanup:
        """On start: reconcile the index with the listing, finish interrupted deletions, remove torn folders
        that no live save holds, and write the index. One listing of the root, plus one per folder the index
        does not name as complete (the index itself when absent: every folder)."""
        cached = read_index(self.transport, self.root)
        names = list_steps(self.transport, self.root)
        index = StepIndex()
        report = Cleanup()
        for step, name in names.items():
            known = None if cached is None else cached.steps.get(step)
            interrupted = cached is not None and step in cached.deleting
            if known is not None and not interrupted:
                index.steps[step] = known
                if step in cached.metrics:  # type: ignore[union-attr]
                    index.metrics[step] = cached.metrics[step]  # type: ignore[union-attr]
                continue
            folder = scan_step(self.transport, self.root, step, name)
            if folder.complete and not interrupted:
                index.steps[step] = folder.marker  # type: ignore[assignment]
                if folder.metrics:
                    index.metrics[step] = folder.metrics
                continue
            if folder.empty and not self.transport.is_local:
                continue  # an object store has no empty folders: the listing raced a delete
            if held_by_live_save(
                self.transport,
                self.folder(step) if name == step_name(step) else self.transport.join(self.root, name),
                folder.names,
                finished_pids=finished_pids,
                stale_after=self.stale_after,
            ):
                report.held.append(step)
                continue
            report.torn_removed.append(step)
            if not dry_run:
                self._remove(self.transport.join(self.root, name), folder.names)
        self.index = index
        if not dry_run:
            write_index(self.transport, self.root, index)
        return report

    # ---------------------------------------------------------------------------------------- a save
    def begin(self, step: int) -> None:
        """Before a save of ``step`` starts: the index names it pending (see :mod:`.index`)."""
        self.index.pending = step
        write_index(self.transport, self.root, self.index)

    def commit(self, step: int, metrics: dict[str, Any] | None) -> bool:
        """After a save of ``step`` returned: record it if its commit marker is there (one listing);
        ``False`` (nothing recorded) if it is not."""
        folder = scan_step(self.transport, self.root, step, metrics=False)
        self.index.pending = None
        if not folder.complete:
            write_index(self.transport, self.root, self.index)
            return False
        info = step_info(metrics, time.time())
        self.transport.write_file(self.transport.join(self.folder(step), STEP_INFO_FILE), info)
        if metrics:
            self.index.metrics[step] = dict(metrics)
        self.index.steps[step] = folder.marker  # type: ignore[assignment]
        write_index(self.transport, self.root, self.index)
        return True

    def apply(self, policy: KeepPolicy, *, dry_run: bool = False) -> list[int]:
        """Delete the complete steps ``policy`` does not keep (never the newest); returns them."""
        doomed = policy.delete(list(self.index.steps), self.index.metrics)
        if not doomed or dry_run:
            return doomed
        self.index.deleting = list(doomed)
        for step in doomed:
            self.index.steps.pop(step, None)
            self.index.metrics.pop(step, None)
        write_index(self.transport, self.root, self.index)  # before the first byte goes
        for step in doomed:
            self.remove_step(step)
        self.index.deleting = []
        write_index(self.transport, self.root, self.index)
        return doomed

    def remove_step(self, step: int) -> None:
        """Delete one step folder, its commit marker first."""
        path = self.folder(step)
        self._remove(path, scan_step(self.transport, self.root, step, metrics=False).names)

    def _remove(self, path: str, names: tuple[str, ...]) -> None:
        remaining = list(names)
        while (marker := commit_marker(remaining)) is not None:  # a half-deleted step must look torn
            self.transport.remove(self.transport.join(path, marker))
            remaining.remove(marker)
        self.transport.remove_tree(path)


_WRONG = object()  # the index cannot answer: fall back to the listing
