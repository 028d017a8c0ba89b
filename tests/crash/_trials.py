"""SIGKILL trials: kill one rank of a 2-rank ``FsspecWriter`` save at a random moment, then check the wreck.

One trial:

1. For half of the trials the target path first gets a complete *old* checkpoint (state ``OLD_SEED``) and
   the killed save uses ``overwrite=True``; otherwise the target is a fresh path.
2. A 2-rank gloo save of state ``NEW_SEED`` starts (real processes, see ``_launcher``); after a random
   delay drawn from the save's measured duration (85 % of draws before its measured commit, the rest
   after it, up to 1.15 x its duration; the measure is the fastest of the recent uninterrupted saves,
   trials included) one rank (drawn too) gets SIGKILL. The other is SIGKILLed too if
   it has not failed on its own within a short grace, as a launcher would.
3. The target must then be exactly one of: the complete old checkpoint, bit-exact (the kill came before
   the save retired it); the complete new one, bit-exact (the kill came after the commit); or refused by
   ``open_reader``, ``FsspecReader`` + ``dcp.load`` and ``verify`` with "incomplete checkpoint" (nothing
   at all there, only for a fresh path killed before its first byte: "not found"). Never a mix.
4. The previous checkpoint at another path loads bit-exact; on S3, in-progress multipart uploads under
   the target are listed by ``verify`` and aborted by ``abort_stale_uploads``.
5. A save with ``overwrite=True`` to the target succeeds, loads bit-exact, verifies, and its metadata
   references only files that save wrote (no temp files are left on a local disk).

Where each kill landed is read from the target afterwards (which files are new compared with before
the trial), not from the clock, and summed up in :class:`Tally`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.transports import TransportConfig

from . import _rank_fns as R
from ._launcher import Zygote

OLD_SEED, NEW_SEED, OTHER_SEED = 11, 22, 33
MiB = 1024 * 1024
PART_SIZE = 5 * MiB  # S3's minimum: ~5 MiB data files become multipart uploads a kill can leave behind
# Kill delays: with probability PRE_COMMIT_SHARE uniform over [0, commit) of the measured save, else
# uniform over [commit, DELAY_SPAN x its duration), so most kills land before the commit but every
# phase, the tail included, gets some.
PRE_COMMIT_SHARE = 0.85
DELAY_SPAN = 1.15
KILL_GRACE_S = 2.0
S3_LOAD_EVERY = 5
# The kill aim follows the machine: the commit estimate is the fastest of the last RECENT_SAVES saves
# observed (the set-up saves, then every trial save that reached its commit). A CI machine's speed drifts
# within a run; one cold or slow set-up save used to push most kills past the commit.
RECENT_SAVES = 4

BEFORE_DATA = "before any data"
MID_DATA = "mid data"
DATA_NO_METADATA = "data written, no .metadata"
OLD_INTACT = "before retiring the old checkpoint"
AFTER_COMMIT = "after the commit"
MISSED = "after the save ended"
PHASES = (BEFORE_DATA, MID_DATA, DATA_NO_METADATA, OLD_INTACT, AFTER_COMMIT, MISSED)
PRE_COMMIT = (BEFORE_DATA, MID_DATA, DATA_NO_METADATA, OLD_INTACT)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Single-process ``dcp.save/load`` warn that no process group is set up; that is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled.*")
        yield


@dataclass
class Location:
    """Where trials write: a local directory or an ``s3://`` prefix, plus what the checks need of it."""

    base: str
    storage_options: dict[str, Any]

    @property
    def is_s3(self) -> bool:
        return self.base.startswith("s3://")

    def url(self, name: str) -> str:
        return f"{self.base.rstrip('/')}/{name}"

    def _fs(self) -> Any:
        import fsspec

        return fsspec.core.url_to_fs(self.base, **self.storage_options)[0]

    def snapshot(self, url: str) -> dict[str, Any]:
        """Every name under ``url`` (hidden temp files included) with a signature that changes on rewrite."""
        if not self.is_s3:
            try:
                names = os.listdir(url)
            except FileNotFoundError:
                return {}
            out = {}
            for name in names:
                with_stat = os.stat(os.path.join(url, name))
                out[name] = (with_stat.st_ino, with_stat.st_size, with_stat.st_mtime_ns)
            return out
        fs = self._fs()
        fs.invalidate_cache()
        try:
            entries = fs.ls(url, detail=True)
        except FileNotFoundError:
            return {}
        return {
            e["name"].rsplit("/", 1)[-1]: (e.get("ETag"), e.get("size"), str(e.get("LastModified"))) for e in entries
        }

    def remove(self, url: str) -> None:
        if not self.is_s3:
            shutil.rmtree(url, ignore_errors=True)
            return
        fs = self._fs()
        if fs.exists(url):
            fs.rm(url, recursive=True)


@dataclass
class Tally:
    """Where kills landed, and what the checks saw."""

    where: str
    phases: collections.Counter[str] = field(default_factory=collections.Counter)
    refused_incomplete: int = 0
    nothing_written: int = 0
    loaded_complete: int = 0
    uploads_left: int = 0
    uploads_aborted: int = 0
    seconds: float = 0.0
    save_duration: float = 0.0
    commit: float = 0.0

    def summary(self) -> str:
        n = sum(self.phases.values())
        landed = ", ".join(f"{p}: {self.phases[p]}" for p in PHASES if self.phases[p])
        text = (
            f"crash trials on {self.where}: {n} trials in {self.seconds:.1f}s (save ~{self.save_duration * 1000:.0f} ms, "
            f"commit at ~{self.commit * 1000:.0f} ms); "
            f"kills landed {landed}; refused as incomplete {self.refused_incomplete}, nothing written "
            f"{self.nothing_written}, complete and bit-exact {self.loaded_complete}"
        )
        if self.uploads_left:
            text += f"; {self.uploads_left} trials left multipart uploads ({self.uploads_aborted} aborted)"
        return text


class CrashTrials:
    """Runs trials against one :class:`Location`; state dicts are built once."""

    def __init__(self, zygote: Zygote, location: Location, scratch: Path, seed: int) -> None:
        self.zygote = zygote
        self.loc = location
        self.scratch = scratch
        self.rng = random.Random(seed)
        self.states = {s: R.make_state(s) for s in (OLD_SEED, NEW_SEED, OTHER_SEED)}
        self.tally = Tally(location.base)
        self.other = location.url("other")
        self.duration = 0.0
        self.commit = 0.0  # seconds from a save's start to its commit (finish returned on the coordinator)
        self._observed: collections.deque[tuple[float, float]] = collections.deque(maxlen=RECENT_SAVES)
        self.data_files = 0
        self._other_snapshot: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------ helpers
    def _signal_dir(self, name: str) -> str:
        path = self.scratch / name
        path.mkdir(parents=True, exist_ok=False)
        return str(path)

    def _launch(self, url: str, seed: int, overwrite: bool, name: str) -> tuple[Any, str]:
        signals = self._signal_dir(name)
        args = [url, self.loc.storage_options, seed, signals, overwrite, PART_SIZE]
        return self.zygote.launch("save", args, signals), signals

    def _writer(self, url: str) -> FsspecWriter:
        return FsspecWriter(
            url, self.loc.storage_options, overwrite=True, transport_config=TransportConfig(part_size=PART_SIZE)
        )

    def save_in_process(self, url: str, seed: int) -> None:
        with _quiet_dcp():
            dcp.save(self.states[seed], storage_writer=self._writer(url), no_dist=True)

    def load(self, url: str) -> dict[str, Any]:
        dest = R.zeros_like_state(self.states[NEW_SEED])
        with _quiet_dcp():
            dcp.load(dest, storage_reader=FsspecReader(url, self.loc.storage_options), no_dist=True)
        return dest

    def assert_loads(self, url: str, seed: int, what: str) -> None:
        got = self.load(url)
        assert R.same_bits(got, self.states[seed]), f"{what}: {url} does not load bit-exact (state {seed})"

    # ------------------------------------------------------------------------------------ set-up
    def measure(self) -> float:
        """Three uninterrupted 2-rank saves: the first (the *other* checkpoint) warms up, and two more, each to a
        fresh path, give the first aim. Fresh paths are the fastest saves a trial makes (an overwrite also
        retires the old files), so kills drawn within the span land before a save ends. Trials refine the
        aim (:meth:`_observe`)."""
        for attempt in range(3):
            url = self.other if attempt == 0 else self.loc.url(f"measure{attempt}")
            job, signals = self._launch(url, OTHER_SEED, True, f"measure{attempt}")
            status = job.wait()
            assert status == [0, 0], f"uninterrupted save failed: {status}"
            timing = _save_timing(signals)
            assert timing is not None, f"uninterrupted save left no timing in {signals}"
            if attempt:
                self._observe(timing)
                self.loc.remove(url)
        self.data_files = sum(n.endswith(".distcp") for n in self.loc.snapshot(self.other))
        assert self.data_files >= 4, self.loc.snapshot(self.other)
        self.assert_loads(self.other, OTHER_SEED, "the previous checkpoint")
        self._other_snapshot = self.loc.snapshot(self.other)
        return self.duration

    def _observe(self, timing: tuple[float, float]) -> None:
        """Take one save's (duration, commit) into the aim: the fastest of the recent ones."""
        self._observed.append(timing)
        self.duration, self.commit = min(self._observed)
        self.tally.save_duration = self.duration
        self.tally.commit = self.commit

    # ------------------------------------------------------------------------------------ one trial
    def _kill_at_random(self, job: Any, signals: str) -> bool:
        victim = self.rng.randrange(2)
        if self.rng.random() < PRE_COMMIT_SHARE:
            delay = self.rng.uniform(0.0, self.commit)
        else:
            delay = self.rng.uniform(self.commit, DELAY_SPAN * self.duration)
        start_file = Path(signals, "rank0.start")  # the commit was measured from rank 0's start
        deadline = time.monotonic() + 60
        while not start_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never started its save")
            time.sleep(0.0005)
        started = float(start_file.read_text().split()[1])
        pause = started + delay - time.time()
        if pause > 0:
            time.sleep(pause)
        if Path(signals, f"rank{victim}.done").exists():
            return False
        return job.kill(victim)

    def _phase(self, before: dict[str, Any], after: dict[str, Any], same_path: bool, killed: bool) -> str:
        new = {n for n, sig in after.items() if before.get(n) != sig}
        if ".metadata" in after:
            if ".metadata" not in new:
                assert same_path, "a fresh path cannot hold an old .metadata"
                return OLD_INTACT
            return AFTER_COMMIT if killed else MISSED
        partial = any(n.endswith(".tmp") for n in after) or (
            self.loc.is_s3 and ds.inspection.list_pending_uploads(self._target, self.loc.storage_options)
        )
        written = {n for n in new if n.endswith(".distcp")}
        if not written and not partial:
            return BEFORE_DATA
        if len(written) >= self.data_files and not partial:
            return DATA_NO_METADATA
        return MID_DATA

    def run(self, k: int, same_path: bool) -> str:
        target = self._target = self.loc.url(f"trial{k}")
        if same_path:
            self.save_in_process(target, OLD_SEED)
        before = self.loc.snapshot(target)
        job, signals = self._launch(target, NEW_SEED, same_path, f"trial{k}")
        killed = self._kill_at_random(job, signals)
        status = job.wait(grace=KILL_GRACE_S)
        after = self.loc.snapshot(target)
        phase = self._phase(before, after, same_path, killed)
        self.tally.phases[phase] += 1
        if phase in (AFTER_COMMIT, MISSED):
            timing = _save_timing(signals)
            if timing is not None:  # both ranks reached the end: this save is one more observation
                self._observe(timing)
        if phase in (AFTER_COMMIT, MISSED, OLD_INTACT):
            expected = OLD_SEED if phase == OLD_INTACT else NEW_SEED
            self._check_complete(target, expected, phase)
        else:
            assert killed and status != [0, 0], f"trial {k}: no .metadata although the save was not killed: {status}"
            self._check_refused(target, after)
        self._check_other(k)
        self._check_uploads(target)
        self._check_recovery(target)
        self.loc.remove(target)
        return phase

    # ------------------------------------------------------------------------------------ checks
    def _check_other(self, k: int) -> None:
        """The previous checkpoint at another path: untouched (same objects) and loading bit-exact.

        Loaded after every trial on a local disk; on S3 (a load costs ~0.3 s of moto time) every
        ``S3_LOAD_EVERY`` trials and at the end, and in between its objects' ETags (MD5 of the content)
        and modification times must be those of the last bit-exact load.
        """
        snapshot = self.loc.snapshot(self.other)
        if self._other_snapshot is not None:
            assert snapshot == self._other_snapshot, f"trial {k}: the previous checkpoint at another path changed"
        if not self.loc.is_s3 or k % S3_LOAD_EVERY == S3_LOAD_EVERY - 1:
            self.assert_loads(self.other, OTHER_SEED, f"trial {k}: the previous checkpoint at another path")
            self._other_snapshot = snapshot

    def _check_complete(self, target: str, seed: int, phase: str) -> None:
        self.assert_loads(target, seed, f"kill {phase}")
        assert ds.opening.detect_format(target, self.loc.storage_options).name == "dcp"
        report = ds.verify(target, self.loc.storage_options)
        assert report.ok, report.problems
        self.tally.loaded_complete += 1

    def _check_refused(self, target: str, after: dict[str, Any]) -> None:
        so = self.loc.storage_options
        expected: type[Exception] = ds.errors.IncompleteCheckpointError if after else ds.CheckpointNotFoundError
        with pytest.raises(expected) as opened:
            ds.open_reader(target, storage_options=so)
        with pytest.raises(expected):
            FsspecReader(target, so).read_metadata()
        with pytest.raises(CheckpointException) as loaded:  # dcp.load wraps the reader's error in its own
            self.load(target)
        report = ds.verify(target, so)
        assert not report.ok
        if after:
            for text in (str(opened.value), str(loaded.value), report.problems[0]):
                assert "incomplete checkpoint" in text and "no .metadata" in text, text
            self.tally.refused_incomplete += 1
        else:
            self.tally.nothing_written += 1

    def _check_uploads(self, target: str) -> None:
        if not self.loc.is_s3:
            return
        so = self.loc.storage_options
        pending = ds.inspection.list_pending_uploads(target, so)
        if not pending:
            return
        self.tally.uploads_left += 1
        notes = " ".join(ds.verify(target, so).notes)
        assert f"{len(pending)} multipart upload(s) in progress" in notes and pending[0].url in notes, notes
        aborted = ds.inspection.abort_stale_uploads(target, so, older_than=0)
        assert sorted(u.upload_id for u in aborted) == sorted(u.upload_id for u in pending)
        assert ds.inspection.list_pending_uploads(target, so) == []
        self.tally.uploads_aborted += len(aborted)

    def _check_recovery(self, target: str) -> None:
        before = self.loc.snapshot(target)
        self.save_in_process(target, NEW_SEED)
        after = self.loc.snapshot(target)
        self.assert_loads(target, NEW_SEED, "the overwrite=True save after the kill")
        report = ds.verify(target, self.loc.storage_options)
        assert report.ok, report.problems
        metadata = FsspecReader(target, self.loc.storage_options).read_metadata()
        referenced = {info.relative_path for info in metadata.storage_data.values()}
        assert referenced and referenced <= set(after), (sorted(referenced), sorted(after))
        rewritten = {n for n, sig in after.items() if before.get(n) != sig}
        stale = {n for n in referenced if n in after and n not in rewritten}
        assert not stale, f"the new .metadata references files the save did not write: {sorted(stale)}"
        assert not [n for n in after if n.endswith(".tmp")], f"temp files left after overwrite: {sorted(after)}"


def _save_timing(signals: str) -> tuple[float, float] | None:
    """(seconds the save took on its slower rank, seconds from rank 0's start to the commit) of a save
    whose ranks both marked their end, else ``None``."""
    done = [Path(signals, f"rank{r}.done") for r in (0, 1)]
    committed = Path(signals, "committed")
    if not committed.exists() or not all(p.exists() for p in done):
        return None
    duration = max(float(p.read_text()) for p in done)
    started = float(Path(signals, "rank0.start").read_text().split()[1])
    return duration, float(committed.read_text()) - started
