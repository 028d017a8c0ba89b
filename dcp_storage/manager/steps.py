"""A manager root's steps: their layout, the index cache and listing them.

Where each step lives: ``root/step-<N>/``, N zero-padded to ten digits (a larger step gets more); only
such names are steps. The index: a small JSON object at the root that caches which steps are complete.

Why: the truth (a commit marker in each step folder, :mod:`.listing`) costs one listing per step, so a
root with 1,000 steps would cost 1,001 requests to answer "which step is the latest complete one". The
index makes that three: read the index (1), check the commit marker of the step it names as *pending*
(1), else that of the newest complete step it names (1).

The coordinator writes it (one atomic PUT) at three moments of a save of step M:

1. before the save starts: ``pending = M`` (so a save killed after its commit but before step 3 is still
   found: its marker is checked first);
2. nothing during the save;
3. after the commit: ``M`` joins ``steps``, ``pending`` is cleared; steps about to be deleted move to
   ``deleting`` first and leave it once gone.

It is only a cache. Any answer from it is checked against a commit marker; an index that is absent,
unreadable, from another tool, or whose newest step has no marker, is ignored and rebuilt from a
listing, which gives the same answer.

Which steps a root holds and which of them are complete: the commit marker of each step is the truth.

A step folder is *complete* when its listing holds the commit marker its format writes last
(:func:`~dcp_storage.formats.location.commit_marker`: ``.metadata``, a safetensors index, a single
safetensors file), *torn* when it holds anything else (the leftovers of a killed save, or of a delete
killed half way: deletion removes the marker first), and *empty* when it holds nothing.

Listing every folder is the slow path (O(steps) requests), taken only where the index is missing or wrong.

The coordinator's view of a root of step folders: latest step, recovery, commit, retention, deletion.

Only the coordinator (rank 0) calls these; :mod:`.agreement` hands every other rank the same answer.
``dcp-storage ls`` and ``gc`` use the same object, so the command line obeys the manager's rules:

* only complete steps count (:mod:`.listing`); the index (:mod:`.index`) is a cache checked against them;
* deletion happens only after the new step is durable, and removes the commit marker first, so a delete
  killed half way leaves a torn folder (cleaned up later), never a step that looks complete but is not;
* the newest complete step is never deleted;
* a step the index names counts only with its commit marker (checked at recovery for the newest steps, and
  by retention for those it keeps): a marker deleted by hand makes the step torn, never one kept in place
  of the last good steps;
* a torn folder is removed unless a live save holds it (:mod:`.liveness`), and only if everything in it is
  what a save leaves (:func:`save_leftovers_only`): a ``step-N`` folder holding anything else is another
  tool's (torchtitan names its folders so too) and is left alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.formats.commit_holder import MARKER_SUFFIX
from dcp_storage.formats.location import commit_marker, list_all
from dcp_storage.formats.paths import DATA_SUFFIX, HF_SHARD_RE, LOCK_RE, MANIFEST_RE, TEMP_RE
from dcp_storage.manager.retention import DEFAULT_STALE_AFTER, KeepPolicy, held_by_live_save

__all__ = [
    "Cleanup",
    "INDEX_FILE",
    "INDEX_LIMIT",
    "STEP_DIGITS",
    "STEP_INFO_FILE",
    "StepFolder",
    "StepIndex",
    "StepRoot",
    "list_steps",
    "parse_step",
    "read_index",
    "read_step_info",
    "save_leftovers_only",
    "scan_step",
    "step_info",
    "step_name",
    "step_path",
    "write_index",
]


STEP_DIGITS = 10
VERIFIED_AT_START = 16  # the newest steps whose commit markers recovery checks (the index is a cache)
STEP_RE = re.compile(r"^step-(?P<n>[0-9]{1,20})$")
INDEX_FILE = ".dcp_storage_steps.json"  # at the root: the cache of the complete steps (see .index)
STEP_INFO_FILE = ".dcp_storage_step.json"  # in a step folder, written after its commit: metrics, time saved


def step_name(step: int) -> str:
    """``step-0000000100`` for step 100; ``ValueError`` for a negative or non-integer step."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step must be a non-negative int, got {step!r}")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """The step of a folder name the manager writes (``step-0000000100``), else ``None``: ``step-100`` (another
    tool's name, or one made by hand) is not one of its steps, which it opens as ``step_name(step)``."""
    match = STEP_RE.match(name.rstrip("/"))
    step = int(match["n"]) if match else None
    return step if step is not None and step_name(step) == name.rstrip("/") else None


KIND = "dcp-storage-steps/1"
INDEX_LIMIT = 8 * 1024 * 1024  # ~40 bytes a step: far more steps than any job keeps


@dataclass
class StepIndex:
    """``steps``: complete step -> its commit marker's name; ``pending``: the step a save is writing;
    ``deleting``: steps whose deletion started; ``metrics``: step -> its metrics."""

    steps: dict[int, str] = field(default_factory=dict)
    pending: int | None = None
    pending_marker: str | None = None
    deleting: list[int] = field(default_factory=list)
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = {
            "kind": KIND,
            "steps": {str(s): m for s, m in sorted(self.steps.items())},
            "pending": self.pending,
            "pending_marker": self.pending_marker,
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
                deleting=[_step(s) for s in body.get("deleting", [])],
                metrics={
                    _step(s): {str(k): v for k, v in m.items() if isinstance(v, (int, float))}
                    for s, m in body.get("metrics", {}).items()
                    if isinstance(m, dict)
                },
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


METRICS_LIMIT = 64 * 1024  # a metrics file holds a few numbers; never read more than this


@dataclass(frozen=True)
class StepFolder:
    """One ``step-<N>`` folder: its step, name, listing, and the commit marker found in it (``None``: torn)."""

    step: int
    name: str
    names: tuple[str, ...] = ()
    marker: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    saved_at: float | None = None  # when its save committed (unix time), if the manager recorded it

    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def empty(self) -> bool:
        return not self.names

    @property
    def locks(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if LOCK_RE.match(n))


def step_path(transport: Any, root: str, step: int) -> str:
    return transport.join(root, step_name(step))


def list_steps(transport: Any, root: str) -> dict[int, str]:
    """``step -> folder name`` for every step folder directly under ``root`` (one listing request), named as
    the manager names them (:func:`parse_step`)."""
    found: dict[int, str] = {}
    for name in transport.listdir(root):
        step = parse_step(name)
        if step is not None:
            found[step] = name
    return dict(sorted(found.items()))


def scan_step(transport: Any, root: str, step: int, name: str | None = None, *, metrics: bool = True) -> StepFolder:
    """List one step folder (one request; hidden temp files included on a local disk) and classify it."""
    name = name or step_name(step)
    names = tuple(list_all(transport, transport.join(root, name)))
    marker = commit_marker(names)
    found: dict[str, Any] = {}
    saved_at = None
    if metrics and marker is not None and STEP_INFO_FILE in names:
        found, saved_at = read_step_info(transport, transport.join(root, name, STEP_INFO_FILE))
    return StepFolder(step, name, names, marker, found, saved_at)


def step_info(metrics: dict[str, Any] | None, saved_at: float) -> bytes:
    """The bytes of a step's info file."""
    return json.dumps({"metrics": dict(metrics or {}), "saved_at": saved_at}, sort_keys=True).encode()


def read_step_info(transport: Any, path: str) -> tuple[dict[str, Any], float | None]:
    """A step's info file: its metrics (numbers only) and when it was saved; empty if absent or bad."""
    try:
        data = json.loads(transport.read_file(path, max_bytes=METRICS_LIMIT))
    except Exception:  # noqa: BLE001 - the info is a convenience: a bad file only loses it
        return {}, None
    if not isinstance(data, dict):
        return {}, None
    raw = data.get("metrics")
    metrics = {str(k): v for k, v in raw.items() if _number(v)} if isinstance(raw, dict) else {}
    saved_at = data.get("saved_at")
    return metrics, float(saved_at) if _number(saved_at) else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_log = logging.getLogger(__name__)


@dataclass
class Cleanup:
    """What one pass removed (or, dry run, would remove), and the torn folders it left because a live save
    holds them."""

    deleted: list[int] = field(default_factory=list)
    torn_removed: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    foreign: list[int] = field(default_factory=list)  # torn folders holding more than a save leaves: kept


def save_leftovers_only(names: Iterable[str]) -> bool:
    """Whether every entry of a step folder is something a save leaves: data files, temp files, manifests,
    locks and their takeover markers, the step's info file."""
    for name in names:
        lock = name
        while lock.endswith(MARKER_SUFFIX):  # a takeover's marker, or a marker's marker (commit_holder)
            lock = lock[: -len(MARKER_SUFFIX)]
        ours = name.endswith(DATA_SUFFIX) or name == STEP_INFO_FILE or LOCK_RE.match(lock)
        if not (ours or any(pattern.match(name) for pattern in (HF_SHARD_RE, TEMP_RE, MANIFEST_RE))):
            return False
    return True


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
        if not dry_run:
            write_index(self.transport, self.root, index)
            self._remove_stale_index_temps()
        return report

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
        while True:
            doomed = policy.delete(list(self.index.steps), self.index.metrics)
            if not doomed:  # nothing deleted: no step is kept in place of another, nothing to check
                return doomed
            kept = [s for s in self.index.steps if s not in doomed]
            gone = [
                s for s in kept if not self.transport.exists(self.transport.join(self.folder(s), self.index.steps[s]))
            ]
            if not gone:  # a kept step without its marker would be kept instead of a good one
                return doomed if dry_run else self.delete(doomed)
            for step in gone:
                self.index.steps.pop(step)
                self.index.metrics.pop(step, None)

    def delete(self, doomed: list[int]) -> list[int]:
        """Delete these complete steps: named in the index as being deleted first, so a delete killed half way
        is finished by the next recovery; returns them."""
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
