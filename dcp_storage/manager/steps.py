"""A manager root's steps: the index cache, recovery, commit, retention and deletion.

The index: a small JSON object at the root that caches which steps are complete.

Why: the truth (a commit marker in each step folder, :mod:`.folders`) costs one listing per step, so a
root with 1,000 steps would cost 1,001 requests to answer "which step is the latest complete one". The
index makes that three: read the index (1), check the commit marker of the step it names as *pending*
(1), else that of the newest complete step it names (1).

The coordinator writes it (one atomic PUT) at two moments of a save of step M:

1. before the save starts: ``pending = M`` and the retention it runs once committed (so a save killed after
   its commit but before step 2 is still found: its marker is checked first, and the next start runs that
   save's retention, never the policy of whoever starts next);
2. after the commit: ``M`` joins ``steps``, ``pending`` is cleared, and the steps retention no longer keeps
   move to ``deleting``, all in one write; they leave it once gone (a second write).

It is only a cache. Any answer from it is checked against a commit marker; an index that is absent,
unreadable, from another tool, or whose newest step has no marker, is ignored and rebuilt from a
listing, which gives the same answer.

What a step folder is (complete, torn, empty) and how one is listed: :mod:`.folders`. Listing every folder is
the slow path (O(steps) requests), taken only where the index is missing or wrong.

The coordinator's view of a root (latest step, recovery, commit, retention, deletion): only the coordinator
(rank 0) calls these; :mod:`.agreement` hands every other rank the same answer.
``dcp-storage ls`` and ``gc`` use the same object, so the command line obeys the manager's rules:

* only complete steps count (:mod:`.folders`); the index is a cache checked against them;
* deletion happens only after the new step is durable, and removes the commit marker first, so a delete
  killed half way leaves a torn folder (cleaned up later), never a step that looks complete but is not;
* the newest complete step is never deleted;
* a step the index names counts only with its commit marker (checked at recovery for the newest steps, and
  by retention for those it keeps): a marker deleted by hand makes the step torn, never one kept in place
  of the last good steps;
* a torn folder is removed unless a live save holds it (:func:`~.retention.held_by_live_save`), and only if
  everything in it is what a save leaves (:func:`~.folders.save_leftovers_only`): a ``step-N`` folder holding
  anything else is another tool's (torchtitan names its folders so too) and is left alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.formats.location import commit_marker, list_all
from dcp_storage.formats.paths import TEMP_RE
from dcp_storage.manager.folders import (
    STEP_INFO_FILE,
    StepFolder,
    list_steps,
    save_leftovers_only,
    scan_step,
    step_info,
    step_name,
)
from dcp_storage.manager.retention import DEFAULT_STALE_AFTER, KeepPolicy, held_by_live_save

__all__ = ["Cleanup", "INDEX_FILE", "INDEX_LIMIT", "StepIndex", "StepRoot", "read_index", "write_index"]


VERIFIED_AT_START = 16  # the newest steps whose commit markers recovery checks (the index is a cache)
INDEX_FILE = ".dcp_storage_steps.json"  # at the root: the cache of the complete steps (see above)


KIND = "dcp-storage-steps/1"
INDEX_LIMIT = 8 * 1024 * 1024  # ~40 bytes a step: far more steps than any job keeps


@dataclass
class StepIndex:
    """``steps``: complete step -> its commit marker's name; ``pending``: the step a save is writing, and
    ``pending_keep`` the retention that save runs once committed; ``deleting``: steps whose deletion started;
    ``metrics``: step -> its metrics."""

    steps: dict[int, str] = field(default_factory=dict)
    pending: int | None = None
    pending_marker: str | None = None
    pending_keep: KeepPolicy | None = None
    pending_metrics: dict[str, Any] = field(default_factory=dict)
    deleting: list[int] = field(default_factory=list)
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = {
            "kind": KIND,
            "steps": {str(s): m for s, m in sorted(self.steps.items())},
            "pending": self.pending,
            "pending_marker": self.pending_marker,
            "pending_keep": None if self.pending_keep is None else dataclasses.asdict(self.pending_keep),
            "pending_metrics": self.pending_metrics,
            "deleting": sorted(self.deleting),
            "metrics": {str(s): m for s, m in sorted(self.metrics.items()) if s in self.steps},
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StepIndex | None:
        """The index in ``raw``, or ``None`` if it is not one (the caller falls back to a listing)."""
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or body.get("kind") != KIND:
                return None
            steps = {_step(s): _name(m) for s, m in body["steps"].items()}
            pending = body.get("pending")
            marker = body.get("pending_marker")
            return cls(
                steps=steps,
                pending=None if pending is None else _step(pending),
                pending_marker=None if marker is None else _name(marker),
                pending_keep=_policy(body.get("pending_keep")),
                pending_metrics=_metrics(body.get("pending_metrics")),
                deleting=[_step(s) for s in body.get("deleting", [])],
                metrics={_step(s): _metrics(m) for s, m in body.get("metrics", {}).items() if isinstance(m, dict)},
            )
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None

    @property
    def latest(self) -> int | None:
        return max(self.steps) if self.steps else None


def _step(value: Any) -> int:
    step = int(value)
    if step < 0 or isinstance(value, (bool, float)):
        raise ValueError(value)
    return step


def _metrics(value: Any) -> dict[str, Any]:
    """A step's metrics: numbers by name (anything else is dropped)."""
    return {str(k): v for k, v in value.items() if isinstance(v, (int, float))} if isinstance(value, dict) else {}


def _policy(value: Any) -> KeepPolicy | None:
    """The retention a pending save runs, or ``None`` if absent or not one (nothing is deleted for it)."""
    if not isinstance(value, dict):
        return None
    try:
        return KeepPolicy(**{str(k): v for k, v in value.items()})
    except (TypeError, ValueError):
        return None


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError(value)  # a marker name is a plain name inside the step folder, never a path
    return value


def read_index(transport: Any, root: str) -> StepIndex | None:
    """The index at ``root`` (one request), or ``None``: absent, too large, or not an index."""
    try:
        raw = transport.read_file(transport.join(root, INDEX_FILE), max_bytes=INDEX_LIMIT)
    except Exception:  # noqa: BLE001 - absent or unreadable: the listing is the truth anyway
        return None
    return StepIndex.from_json(bytes(raw))


def write_index(transport: Any, root: str, index: StepIndex) -> None:
    """Replace the index atomically (one PUT, or temp file and rename)."""
    transport.write_file(transport.join(root, INDEX_FILE), index.to_json())


_log = logging.getLogger(__name__)


@dataclass
class Cleanup:
    """What one pass removed (or, dry run, would remove), and the torn folders it left because a live save
    holds them."""

    deleted: list[int] = field(default_factory=list)
    torn_removed: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    foreign: list[int] = field(default_factory=list)  # torn folders holding more than a save leaves: kept
    # complete steps the index named as pending: a save killed after its commit and before the index recorded
    # it, so the retention that follows a commit never ran for it (recovery runs that save's own retention)
    unrecorded: list[int] = field(default_factory=list)


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
        """The newest complete step, in at most 3 requests when the index is right (see above)."""
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
        that no live save holds and that hold only a save's leftovers, and write the index. One listing of the
        root, one existence check of the commit marker of each of the 16 newest steps the index names as
        complete (concurrent), and one listing per other folder (every folder when there is no index)."""
        cached = read_index(self.transport, self.root)
        names = list_steps(self.transport, self.root)
        marked = self._markers_present(cached, names)
        index = StepIndex()
        report = Cleanup()
        for step, name in names.items():
            known = None if cached is None else cached.steps.get(step)
            interrupted = cached is not None and step in cached.deleting
            if known is not None and not interrupted and marked.get(step, True):
                index.steps[step] = known
                if step in cached.metrics:  # type: ignore[union-attr]
                    index.metrics[step] = cached.metrics[step]  # type: ignore[union-attr]
                continue
            folder = scan_step(self.transport, self.root, step, name)
            if folder.complete and not interrupted:
                if cached is not None and cached.pending == step and known is None:
                    report.unrecorded.append(step)  # its info file was never written: the index has its metrics
                    folder = dataclasses.replace(folder, metrics=folder.metrics or cached.pending_metrics)
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
            if not interrupted and not save_leftovers_only(folder.names):  # a deletion we began is ours to end
                _log.warning(
                    "%s holds files no save of dcp-storage leaves (%s): not a step of this manager, left in place",
                    self.transport.url(self.transport.join(self.root, name)),
                    ", ".join(sorted(folder.names)[:5]),
                )
                report.foreign.append(step)
                continue
            report.torn_removed.append(step)
            if not dry_run:
                self._remove(self.transport.join(self.root, name), folder.names)
        self.index = index
        self._finish_killed_save(cached, names, report, dry_run)
        return report

    def _finish_killed_save(self, cached: StepIndex | None, names: dict[int, str], report: Cleanup, dry: bool) -> None:
        """Write the reconciled index: with the retention of a save killed between its commit and its index
        write (the one the cached index names with it, never the caller's: an evaluation job's start deletes
        nothing of its own accord) named as being deleted in that same write, then delete; and with the
        pending mark of a save still running (its folder held by a live save, or not made yet), kept for the
        start that follows if that save is killed after its commit. A failing retention is only logged: the
        next start finishes what the index names as being deleted."""
        index = self.index
        pending = None if cached is None else cached.pending
        if pending is not None and pending not in index.steps and (pending in report.held or pending not in names):
            index.pending, index.pending_keep = pending, cached.pending_keep  # type: ignore[union-attr]
            index.pending_metrics = dict(cached.pending_metrics)  # type: ignore[union-attr]
        keep = None if cached is None else cached.pending_keep
        doomed: list[int] = []
        if report.unrecorded and keep is not None:
            try:
                doomed = self._doomed(keep)
            except Exception as exc:  # noqa: BLE001 - retention is a clean-up: a start never fails on it
                _log.warning("%s: could not run the retention of the save killed after its commit: %s", self.root, exc)
        report.deleted = doomed
        if dry:
            return
        self._mark_deleting(doomed)  # one write: the reconciled index and the steps retention no longer keeps
        self._remove_stale_index_temps()
        try:
            self._remove_marked(doomed)
        except Exception as exc:  # noqa: BLE001 - named as being deleted: the next start finishes it
            _log.warning("%s: deleting steps %s the killed save's retention drops failed: %s", self.root, doomed, exc)

    def _remove_stale_index_temps(self, older_than: float = 60.0) -> None:
        """Local disks: the temp files of index writes killed before their rename (one per killed job, never
        renamed since); a write takes milliseconds, so one older than a minute has no writer left."""
        if not self.transport.is_local:
            return
        for name in list_all(self.transport, self.root):
            found = TEMP_RE.match(name)
            if found is None or found["name"] != INDEX_FILE:
                continue
            path = self.transport.join(self.root, name)
            with contextlib.suppress(OSError):
                if time.time() - os.lstat(path).st_mtime > older_than:
                    os.remove(path)

    def _markers_present(self, cached: StepIndex | None, names: dict[int, str]) -> dict[int, bool]:
        """Whether the commit marker the index names is there, for the newest steps it names as complete (the
        index is a cache: a marker deleted by hand makes the step torn, not the newest complete one); older
        ones are checked when retention would keep them (:meth:`apply`). Asked concurrently."""
        newest = sorted((s for s in names if cached is not None and s in cached.steps), reverse=True)
        asked = {s: self.transport.join(self.root, names[s], cached.steps[s]) for s in newest[:VERIFIED_AT_START]}  # type: ignore[union-attr]
        if not asked:
            return {}
        with ThreadPoolExecutor(len(asked), thread_name_prefix="dcp-storage-steps") as pool:
            return dict(zip(asked, pool.map(self.transport.exists, asked.values())))

    # ---------------------------------------------------------------------------------------- a save
    def begin(self, step: int, keep: KeepPolicy | None = None, metrics: dict[str, Any] | None = None) -> None:
        """Before a save of ``step`` starts: the index names it pending, with its metrics and the retention
        ``keep`` that follows its commit (see above: a start after a kill runs it). A subclass of
        :class:`KeepPolicy` is not named: its fields alone would rebuild the base class's choices."""
        self.index.pending = step
        self.index.pending_keep = keep if type(keep) is KeepPolicy else None
        self.index.pending_metrics = dict(metrics or {})
        write_index(self.transport, self.root, self.index)

    def commit(self, step: int, metrics: dict[str, Any] | None, keep: KeepPolicy | None = None) -> bool:
        """After a save of ``step`` returned: record it if its commit marker is there (one listing);
        ``False`` (nothing recorded) if it is not. With ``keep``: the steps it no longer keeps are named as being
        deleted in the same index write that records ``step``, then deleted, so a kill anywhere after the
        commit leaves the next start a deletion to finish, never an extra step nobody removes."""
        folder = scan_step(self.transport, self.root, step, metrics=False)
        self.index.pending, self.index.pending_keep, self.index.pending_metrics = None, None, {}
        if not folder.complete:
            write_index(self.transport, self.root, self.index)
            return False
        info = step_info(metrics, time.time())
        self.transport.write_file(self.transport.join(self.folder(step), STEP_INFO_FILE), info)
        if metrics:
            self.index.metrics[step] = dict(metrics)
        self.index.steps[step] = folder.marker  # type: ignore[assignment]
        try:
            doomed = [] if keep is None else self._doomed(keep)
        except Exception:
            write_index(self.transport, self.root, self.index)  # the step is durable: recorded all the same
            raise
        self.delete(doomed)
        return True

    def apply(self, policy: KeepPolicy, *, dry_run: bool = False) -> list[int]:
        """Delete the complete steps ``policy`` does not keep (never the newest); returns them."""
        doomed = self._doomed(policy)
        return doomed if dry_run or not doomed else self.delete(doomed)

    def _doomed(self, policy: KeepPolicy) -> list[int]:
        """The steps ``policy`` does not keep, once every step it keeps in their place still has its commit
        marker (one existence check each; a step without it leaves the index and is never kept)."""
        while True:
            doomed = policy.delete(list(self.index.steps), self.index.metrics)
            if not doomed:  # nothing deleted: no step is kept in place of another, nothing to check
                return doomed
            kept = [s for s in self.index.steps if s not in doomed]
            gone = [
                s for s in kept if not self.transport.exists(self.transport.join(self.folder(s), self.index.steps[s]))
            ]
            if not gone:  # a kept step without its marker would be kept instead of a good one
                return doomed
            for step in gone:
                self.index.steps.pop(step)
                self.index.metrics.pop(step, None)

    def delete(self, doomed: list[int]) -> list[int]:
        """Delete these complete steps: named in the index as being deleted first (in the one write that also
        records any change made to the index before), so a delete killed half way is finished by the next
        recovery; returns them."""
        self._mark_deleting(doomed)
        self._remove_marked(doomed)
        return doomed

    def _mark_deleting(self, doomed: list[int]) -> None:
        """Write the index with ``doomed`` out of its steps and named as being deleted: before the first byte goes."""
        self.index.deleting = list(doomed)
        for step in doomed:
            self.index.steps.pop(step, None)
            self.index.metrics.pop(step, None)
        write_index(self.transport, self.root, self.index)

    def _remove_marked(self, doomed: list[int]) -> None:
        """Remove the steps :meth:`_mark_deleting` named, then the mark."""
        if not doomed:
            return
        for step in doomed:
            self.remove_step(step)
        self.index.deleting = []
        write_index(self.transport, self.root, self.index)

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
