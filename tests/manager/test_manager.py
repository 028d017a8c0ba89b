"""``CheckpointManager``'s rules on a local disk and ``memory://`` (the other stores:
``tests/conformance/test_manager_stores.py``).

Torn folders, live locks, failed async saves, the index as a cache (absent, stale, lying), retention after
durability, and the same answer on every rank.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage.cli import main as cli_main
from dcp_storage.manager.folders import step_name
from dcp_storage.manager.steps import INDEX_FILE
from dcp_storage.planners.key_map import IncompatibleKeysError
from dcp_storage_testing.distributed import run_ranks

from . import _manager_fns

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((8, 8), value), "b": torch.arange(4.0) + value, "step": int(value)}


def _steps(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def _torn(root: Path, step: int, *, lock: dict | None = None) -> Path:
    """A step folder as a killed save leaves it: a data file, a manifest, maybe the lock, no .metadata."""
    folder = root / step_name(step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)
    if lock is not None:
        (folder / ".dcp_storage.lock").write_text(json.dumps(lock))
    return folder


@pytest.mark.parametrize("mode", [None, "thread"])
def test_save_interval_keep_and_restore(tmp_path: Path, mode: str | None) -> None:
    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=2), save_interval_steps=3, async_mode=mode) as mgr:
        started = [mgr.save(step, _state(step)) for step in range(1, 11)]
        assert started == [s % 3 == 0 for s in range(1, 11)]
        assert mgr.save(9, _state(9)) is False  # already stored
        assert mgr.save(10, _state(10), force=True) is True  # preemption: save now
        mgr.wait()
        assert mgr.latest_step() == 10
        assert mgr.all_steps() == [9, 10]
        assert _steps(root) == [step_name(9), step_name(10)]
        target = _state(0)
        assert mgr.restore(target) == 10
        assert torch.equal(target["w"], _state(10)["w"]) and target["step"] == 10
        assert mgr.restore(target, step=9) == 9 and target["step"] == 9


def test_stateful_train_state_roundtrip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    counter = torch.tensor([41])
    with ds.CheckpointManager(tmp_path / "run", async_mode="thread") as mgr:
        mgr.save(1, ds.TrainState(model, opt, sched, tokens=counter))
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    counter2 = torch.tensor([0])
    with ds.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.restore(ds.TrainState(model2, opt2, sched2, tokens=counter2)) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    assert sched2.state_dict()["last_epoch"] == 1 and opt2.param_groups[0]["lr"] == pytest.approx(0.05)
    assert int(counter2) == 41


def test_train_state_refuses_what_it_cannot_restore() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="neither Stateful"):
        ds.TrainState(model, counter=3)
    with pytest.raises(TypeError, match="optimizer must be"):
        ds.TrainState(model, object())


def test_torn_folder_removed_on_start_never_counted(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ds.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _torn(root, 2, lock={"host": socket.gethostname(), "pid": int(dead.stdout), "since": "2026-01-01T00:00:00Z"})
    _torn(root, 3)  # a delete killed after the marker went: no lock either
    with ds.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 1
        assert _steps(root) == [step_name(1)]
        assert mgr.last_cleanup.torn_removed == [2, 3]


def test_folder_held_by_a_live_save_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ds.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"host": socket.gethostname(), "pid": live.pid, "since": "2026-01-01T00:00:00Z"}
        held = _torn(root, 2, lock=lock)
        other_host = _torn(root, 3, lock={"host": "elsewhere", "pid": 1, "since": "2099-01-01T00:00:00Z"})
        with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=1)) as mgr:
            assert mgr.last_cleanup.held == [2, 3]
            assert held.exists() and other_host.exists()
            assert mgr.latest_step() == 1  # held or not, a torn folder is no step
            mgr.save(4, _state(4))
        assert _steps(root) == [step_name(2), step_name(3), step_name(4)]
    finally:
        live.kill()
        live.wait()
    with ds.CheckpointManager(root) as mgr:  # its holder is dead now: the next start removes it
        assert mgr.last_cleanup.torn_removed == [2]


def test_failed_async_save_raises_next_and_never_counts(tmp_path: Path) -> None:
    root = tmp_path / "run"
    mgr = ds.CheckpointManager(root, async_mode="thread")
    mgr.save(1, _state(1))
    assert mgr.save(2, {**_state(2), "bad": lambda: None}) is True  # fails in the background (pickling)
    with pytest.raises(CheckpointException, match="ranks"):
        mgr.save(3, _state(3))
    assert mgr.latest_step() == 1 and mgr.all_steps() == [1]
    assert mgr.save(3, _state(3)) is True  # the error was raised once; saving goes on
    mgr.wait()
    assert mgr.all_steps() == [1, 3]
    assert step_name(2) not in _steps(root)  # the failed save's folder went with the next save
    mgr.save(4, {**_state(4), "bad": lambda: None})
    with pytest.raises(CheckpointException, match="ranks"):
        mgr.close()
    assert ds.CheckpointManager(root).latest_step() == 3


def test_async_staging_reuse_follows_tied_and_untied_tensors() -> None:
    """The thread mode's stager reuses its buffers from save to save; one tensor under two keys (tied weights)
    is staged once, so a later state with the two untied must be staged afresh (it was copied into that one
    buffer in turn: both keys saved with the last one's values)."""
    from dcp_storage.manager.retention import ReusingStager

    stager = ReusingStager()
    tied = torch.ones(4)
    stager.stage({"embed": tied, "head": tied})
    staged = stager.stage({"embed": torch.full((4,), 2.0), "head": torch.full((4,), 3.0)})
    assert staged["embed"].tolist() == [2.0] * 4 and staged["head"].tolist() == [3.0] * 4
    assert stager.reused == 0  # staged afresh
    again = stager.stage({"embed": torch.full((4,), 5.0), "head": torch.full((4,), 6.0)})
    assert again["embed"].tolist() == [5.0] * 4 and again["head"].tolist() == [6.0] * 4 and stager.reused == 1
    flat = torch.arange(8.0)  # views of one buffer, as in a flat parameter: reused, values in place
    stager = ReusingStager()
    stager.stage({"a": flat[:4], "b": flat[4:]})
    other = torch.arange(8.0) + 10
    refilled = stager.stage({"a": other[:4], "b": other[4:]})
    assert (
        stager.reused == 1
        and refilled["a"].tolist() == other[:4].tolist()
        and refilled["b"].tolist() == other[4:].tolist()
    )


def test_thread_mode_save_after_untying_weights(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ds.CheckpointManager(root, async_mode="thread", keep=ds.KeepPolicy(last=5)) as mgr:
        tied = torch.ones(4)
        mgr.save(1, {"embed": tied, "head": tied})
        mgr.save(2, {"embed": torch.full((4,), 2.0), "head": torch.full((4,), 3.0)})
    out = {"embed": torch.zeros(4), "head": torch.zeros(4)}
    with ds.CheckpointManager(root) as mgr:
        assert mgr.restore(out, step=2) == 2
    assert out["embed"].tolist() == [2.0] * 4 and out["head"].tolist() == [3.0] * 4


def test_failed_save_raises_at_wait(tmp_path: Path) -> None:
    mgr = ds.CheckpointManager(tmp_path / "run", async_mode="thread")
    mgr.save(1, {"bad": lambda: None})
    with pytest.raises(CheckpointException, match="ranks"):
        mgr.wait()
    mgr.close()


def test_index_is_only_a_cache(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=3)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    index = root / INDEX_FILE
    with ds.CheckpointManager(root) as mgr:
        assert (mgr.latest_step(), mgr.all_steps()) == (3, [1, 2, 3])
        index.unlink()  # absent
        assert (mgr.latest_step(), mgr.all_steps()) == (3, [1, 2, 3])
        index.write_text("{not json")  # unreadable
        assert (mgr.latest_step(), mgr.all_steps()) == (3, [1, 2, 3])
        body = {"kind": "dcp-storage-steps/1", "steps": {"1": ".metadata", "9": ".metadata"}, "pending": None}
        index.write_text(json.dumps(body))  # names a step that has no marker
        assert (mgr.latest_step(), mgr.all_steps()) == (3, [1, 2, 3])
        stale = {"kind": "dcp-storage-steps/1", "steps": {"1": ".metadata", "2": ".metadata"}, "pending": 3}
        index.write_text(json.dumps(stale))  # killed after step 3's commit, before the index said so
        assert mgr.latest_step() == 3


def test_lost_marker_makes_a_step_torn(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ds.CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    (root / step_name(2) / ".metadata").unlink()  # what a delete killed half way leaves
    (root / INDEX_FILE).unlink()
    with ds.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 1
        target = _state(0)
        assert mgr.restore(target) == 1 and target["step"] == 1


def test_index_naming_a_step_whose_marker_is_gone_never_costs_the_good_steps(tmp_path: Path) -> None:
    """The newest step's marker deleted by hand while the index still names it complete: recovery believes
    the marker, not the index, so retention keeps the last good step and the next save succeeds."""
    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=3)) as mgr:
        for step in (10, 20):
            mgr.save(step, _state(step))
    (root / step_name(20) / ".metadata").unlink()  # the index at the root still lists 20
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=1)) as mgr:
        assert mgr.last_cleanup.torn_removed == [20] and mgr.all_steps() == [10]
        assert mgr.save(11, _state(11)) is True
        assert mgr.all_steps() == [11] and mgr.save(20, _state(20)) is True
        assert mgr.all_steps() == [20]
    assert cli_main(["gc", str(root), "--keep-last", "1"]) == 0
    assert _steps(root) == [step_name(20)]


def test_a_deletion_killed_half_way_is_finished_on_start(tmp_path: Path) -> None:
    """The index names a step whose deletion began (its marker may still be there): recovery ends it, as this
    manager's own step, whatever files it still holds."""
    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=5)) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    body = {"kind": "dcp-storage-steps/1", "steps": {"2": ".metadata"}, "pending": None, "deleting": [1]}
    (root / INDEX_FILE).write_text(json.dumps(body))
    with ds.CheckpointManager(root) as mgr:
        assert mgr.last_cleanup.torn_removed == [1] and mgr.last_cleanup.foreign == []
        assert mgr.all_steps() == [2]
    assert _steps(root) == [step_name(2)]


def test_a_kill_after_a_commit_never_leaves_a_step_retention_would_delete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed right after the index write that records a new step: that same write names the steps retention
    no longer keeps as being deleted, so the next start deletes them even if the resumed job saves nothing."""
    from dcp_storage.manager import steps

    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=None)) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step))
    real = steps.write_index

    def killed_after_recording_5(transport: Any, where: str, index: Any) -> None:
        real(transport, where, index)
        if 5 in index.steps:
            raise SystemExit("killed")  # nothing after this write runs

    monkeypatch.setattr(steps, "write_index", killed_after_recording_5)
    mgr = ds.CheckpointManager(root, keep=ds.KeepPolicy(last=2))
    with pytest.raises(SystemExit):
        mgr.save(5, _state(5))
    monkeypatch.setattr(steps, "write_index", real)
    written = json.loads((root / INDEX_FILE).read_text())
    assert sorted(written["steps"]) == ["4", "5"] and written["deleting"] == [1, 2, 3]
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=2)) as again:
        assert again.all_steps() == [4, 5] and again.last_cleanup.torn_removed == [1, 2, 3]
    assert _steps(root) == [step_name(4), step_name(5)]


def test_a_kill_between_a_commit_and_the_index_write_is_retained_on_start(tmp_path: Path) -> None:
    """The index still names step 4 pending but step 4 committed (killed before the index recorded it): the
    next start runs the retention that save would have run (the one the index names with it), whatever policy
    the starting manager has (an evaluation job's). Steps the index recorded are never deleted at start (a
    stricter policy, a rollback): only the next save's retention deletes."""
    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=None)) as mgr:
        for step in (1, 2, 3, 4, 5):
            mgr.save(step, _state(step))
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=2)) as mgr:
        assert mgr.all_steps() == [1, 2, 3, 4, 5] and mgr.last_cleanup.deleted == []
        target = _state(0)
        assert mgr.restore(target, step=1) == 1 and target["step"] == 1
    index = root / INDEX_FILE
    body = {"kind": "dcp-storage-steps/1", "steps": {str(s): ".metadata" for s in (1, 2, 3, 4)}, "pending": 5}
    index.write_text(json.dumps(body))  # an index that names no retention with the pending save: none runs
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=1)) as mgr:
        assert mgr.last_cleanup.unrecorded == [5] and mgr.last_cleanup.deleted == []
        assert mgr.all_steps() == [1, 2, 3, 4, 5]
    body["pending_keep"] = {"last": 3}
    index.write_text(json.dumps(body))
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=1)) as mgr:
        assert mgr.last_cleanup.unrecorded == [5] and mgr.last_cleanup.deleted == [1, 2]
        assert mgr.all_steps() == [3, 4, 5] and mgr.latest_step() == 5
    assert _steps(root) == [step_name(s) for s in (3, 4, 5)]


def test_the_index_names_the_pending_saves_retention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the index says while a save of step 2 runs: that step, and the retention to run after it."""
    from dcp_storage.manager import steps

    seen: list[dict[str, Any]] = []
    real = steps.write_index
    monkeypatch.setattr(steps, "write_index", lambda t, w, i: (seen.append(json.loads(i.to_json())), real(t, w, i)))
    keep = ds.KeepPolicy(last=2, every=10, best=1, metric="loss", mode="max")
    with ds.CheckpointManager(tmp_path / "run", keep=keep) as mgr:
        mgr.save(2, _state(2), metrics={"loss": 1.0})
    begun = [w for w in seen if w["pending"] == 2]
    assert begun and begun[0]["pending_keep"] == {"last": 2, "every": 10, "best": 1, "metric": "loss", "mode": "max"}
    assert seen[-1]["pending"] is None and seen[-1]["pending_keep"] is None and seen[-1]["steps"] == {"2": ".metadata"}


def _killed_after_commit(root: Path, step: int, keep: ds.KeepPolicy, mp: pytest.MonkeyPatch, **kw: Any) -> None:
    """A save of ``step`` whose process dies after its commit marker, before the index records it."""
    from dcp_storage.manager import steps

    def killed(*_args: Any, **_kw: Any) -> None:
        raise SystemExit("killed")

    with mp.context() as patched:
        patched.setattr(steps.StepRoot, "commit", killed)
        with pytest.raises(SystemExit):
            ds.CheckpointManager(root, keep=keep).save(step, _state(step), **kw)


def test_the_killed_saves_retention_survives_starts_during_it_and_its_own_failure(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Another manager (an evaluation job) or ``gc`` starting while a save runs keeps the save's pending mark
    and retention in the index; a start whose deletions fail only logs (the index names them: the next start
    ends them); ``gc`` reports what that retention deleted."""
    from dcp_storage.manager import steps

    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=None)) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step))
    real_begin = steps.StepRoot.begin

    def begin_then_another_start(self: Any, *args: Any) -> None:
        real_begin(self, *args)
        ds.CheckpointManager(root, keep=ds.KeepPolicy(last=None)).close()

    with monkeypatch.context() as patched:
        patched.setattr(steps.StepRoot, "begin", begin_then_another_start)
        _killed_after_commit(root, 5, ds.KeepPolicy(last=2), monkeypatch)
    assert json.loads((root / INDEX_FILE).read_text())["pending"] == 5
    with monkeypatch.context() as patched:
        patched.setattr(steps.StepRoot, "remove_step", lambda *_: (_ for _ in ()).throw(OSError("refused")))
        with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=None)) as mgr:
            assert mgr.last_cleanup.deleted == [1, 2, 3] and mgr.all_steps() == [4, 5]
    assert "refused" in caplog.text and json.loads((root / INDEX_FILE).read_text())["deleting"] == [1, 2, 3]
    assert cli_main(["gc", str(root), "--keep-last", "5"]) == 0
    assert _steps(root) == [step_name(4), step_name(5)]
    _killed_after_commit(root, 6, ds.KeepPolicy(last=1), monkeypatch)
    capsys.readouterr()
    assert cli_main(["gc", str(root), "--keep-last", "5", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["deleted"], said["kept"]) == ([4, 5], [6]) and _steps(root) == [step_name(6)]


def test_the_killed_saves_metrics_count_and_a_subclassed_policy_deletes_nothing_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metrics of a save killed before its index write are in the index from its start, so its step
    counts as best; a ``KeepPolicy`` subclass is not named in the index (its fields alone would rebuild the
    base class's choices), so nothing is deleted for it at start."""
    root = tmp_path / "run"
    keep = ds.KeepPolicy(last=1, best=1, metric="loss", mode="min")
    with ds.CheckpointManager(root, keep=keep) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 5.0})
        mgr.save(2, _state(2), metrics={"loss": 4.0})
    _killed_after_commit(root, 3, keep, monkeypatch, metrics={"loss": 1.0})
    with ds.CheckpointManager(root, keep=keep) as mgr:
        assert mgr.last_cleanup.deleted == [2]
        mgr.save(4, _state(4), metrics={"loss": 3.0})
        assert mgr.all_steps() == [3, 4]  # 3: the best loss; 4: the last

    class KeepOdd(ds.KeepPolicy):
        def keep(self, steps: Any, metrics: Any = None) -> set[int]:
            return super().keep(steps, metrics) | {s for s in steps if s % 2}

    _killed_after_commit(root, 6, KeepOdd(last=1), monkeypatch)
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=None)) as mgr:
        assert mgr.last_cleanup.unrecorded == [6] and mgr.last_cleanup.deleted == []
        assert mgr.all_steps() == [3, 4, 6]


def test_retention_never_keeps_an_old_step_whose_marker_is_gone(tmp_path: Path) -> None:
    """Recovery checks the markers of the newest steps only; retention checks those it keeps, so a best step
    whose marker went (older than those) is not kept in place of the best good one."""
    root = tmp_path / "run"
    keep = ds.KeepPolicy(last=1, best=1, metric="loss", mode="min")
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=None)) as mgr:
        for step in range(1, 21):
            mgr.save(step, _state(step), metrics={"loss": 0.5 if step == 1 else 2.0 - step / 100})
    (root / step_name(1) / ".metadata").unlink()
    with ds.CheckpointManager(root, keep=keep) as mgr:
        mgr.save(21, _state(21), metrics={"loss": 9.0})
        assert mgr.all_steps() == [20, 21]  # 20: the best good loss; 21: the last


def test_step_folders_of_another_tool_are_left_alone(tmp_path: Path) -> None:
    """A ``step-N`` folder holding anything a save does not leave (another tool's checkpoint, a note) is not
    this manager's torn step: recovery and ``gc`` leave it, and say so."""
    root = tmp_path / "run"
    foreign = {100: "pytorch_model.bin", 200: "notes.txt", 300: "model.pt"}
    for step, name in foreign.items():
        (root / step_name(step)).mkdir(parents=True)
        (root / step_name(step) / name).write_bytes(b"not ours")
        (root / step_name(step) / "__0_0.distcp").write_bytes(b"\0" * 8)
    _torn(root, 400)  # a save's leftovers only: removed
    (root / step_name(400) / ".dcp_storage.lock.takeover.takeover").write_text("{}")  # a marker's marker: ours
    with ds.CheckpointManager(root) as mgr:
        assert mgr.last_cleanup.torn_removed == [400] and mgr.last_cleanup.foreign == [100, 200, 300]
        assert mgr.latest_step() is None
        with pytest.raises(ds.errors.CheckpointExistsError, match="holds files no save"):
            mgr.save(200, _state(200))  # its files would be mixed in, and deleted by retention with the step
    assert cli_main(["gc", str(root), "--keep-last", "1"]) == 0
    assert _steps(root) == [step_name(s) for s in foreign]
    assert all((root / step_name(s) / n).read_bytes() == b"not ours" for s, n in foreign.items())


def test_temp_files_of_killed_index_writes_are_removed_on_start(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ds.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
    old, fresh = root / f".{INDEX_FILE}.{'a' * 32}.tmp", root / f".{INDEX_FILE}.{'b' * 32}.tmp"
    for path in (old, fresh):
        path.write_text("{}")
    os.utime(old, (1, 1))  # a job killed long ago; the fresh one may still be renamed by its writer
    with ds.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 1
    assert not old.exists() and fresh.exists()


def test_a_rollback_refuses_to_mix_runs_until_the_newer_steps_are_discarded(tmp_path: Path) -> None:
    """restore(step=10) with 15 and 20 stored: saving 15 again was skipped as stored, new steps below 20 were
    deleted by retention, and a restart resumed from the old run's 20. Now such a save raises until the newer
    steps are discarded; restore(..., discard_newer=True) does it at once."""
    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=3)) as mgr:
        for step in (10, 15, 20):
            mgr.save(step, _state(step))
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=3)) as mgr:
        assert mgr.restore(_state(0), step=10) == 10
        assert mgr.save(10, _state(10)) is False  # the restored step itself: stored, as before
        with pytest.raises(ds.errors.CheckpointExistsError, match=r"discard_newer_than\(10\)"):
            mgr.save(11, _state(11))
        assert mgr.all_steps() == [10, 15, 20]  # nothing lost by refusing
        assert mgr.discard_newer_than(10) == [15, 20]
        assert mgr.save(15, _state(15.5)) is True and mgr.all_steps() == [10, 15]
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=3)) as mgr:
        target = _state(0)
        assert mgr.restore(target) == 15 and torch.equal(target["b"], _state(15.5)["b"])
        assert mgr.restore(_state(0), step=10, discard_newer=True) == 10 and mgr.all_steps() == [10]
        assert mgr.save(11, _state(11)) is True and mgr.all_steps() == [10, 11]
    assert _steps(root) == [step_name(10), step_name(11)]


def test_unpadded_step_folders_are_not_steps(tmp_path: Path) -> None:
    """``step-7`` (another tool's name, or a copy renamed by hand) was listed as step 7, but restore opened
    ``step-0000000007`` and failed, and gc reported it deleted while it stayed: it is no step of the manager."""
    root = tmp_path / "run"
    ds.save(_state(7), str(root / "step-7"))
    with ds.CheckpointManager(root) as mgr:
        assert mgr.latest_step() is None and mgr.all_steps() == []
        mgr.save(8, _state(8))
        assert mgr.all_steps() == [8]
    assert cli_main(["gc", str(root), "--keep-last", "1"]) == 0
    assert sorted(os.listdir(root)) == sorted([INDEX_FILE, "step-7", step_name(8)])


def test_restore_without_steps_and_of_a_torn_step(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with ds.CheckpointManager(root) as mgr:
        assert mgr.latest_step() is None and mgr.all_steps() == []
        with pytest.raises(ds.CheckpointNotFoundError, match="no complete step"):
            mgr.restore(_state(0))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _torn(root, 5, lock={"host": socket.gethostname(), "pid": live.pid, "since": "2026-01-01T00:00:00Z"})
        with ds.CheckpointManager(root) as mgr:
            with pytest.raises(ds.errors.IncompleteCheckpointError):
                mgr.restore(_state(0), step=5)
            with pytest.raises(ds.CheckpointNotFoundError, match="no complete step 6"):
                mgr.restore(_state(0), step=6)
    finally:
        live.kill()
        live.wait()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="async_mode"):
        ds.CheckpointManager(tmp_path, async_mode="fork")
    with pytest.raises(ValueError, match="save_interval_steps"):
        ds.CheckpointManager(tmp_path, save_interval_steps=0)
    with pytest.raises(TypeError, match="KeepPolicy"):
        ds.CheckpointManager(tmp_path, keep=3)  # type: ignore[arg-type]
    with pytest.raises(ds.DcpStorageError, match="nope"):  # at construction, not at the first save
        ds.CheckpointManager(tmp_path / "never", writer="nope")
    assert not (tmp_path / "never").exists()
    with ds.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(ValueError, match="non-negative int"):
            mgr.save(-1, _state(1))
        with pytest.raises(TypeError, match="metrics"):
            mgr.save(1, _state(1), metrics={"loss": "low"})
        with pytest.raises(TypeError, match="TrainState"):
            mgr.save(1, [torch.zeros(1)])


def test_keep_best_by_metric_survives_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "run"
    keep = ds.KeepPolicy(last=1, best=1, metric="loss")
    with ds.CheckpointManager(root, keep=keep) as mgr:
        for step, loss in ((1, 0.9), (2, 0.2), (3, 0.5)):
            mgr.save(step, _state(step), metrics={"loss": loss})
        assert mgr.all_steps() == [2, 3]
    (root / INDEX_FILE).unlink()  # the metrics come back from the steps' own info files
    with ds.CheckpointManager(root, keep=keep) as mgr:
        mgr.save(4, _state(4), metrics={"loss": 0.7})
        assert mgr.all_steps() == [2, 4]


def test_safetensors_writer(tmp_path: Path) -> None:
    """Tensor-only state (its reader does not load the writer's extra-state file back)."""
    tensors = lambda v: {k: t for k, t in _state(v).items() if isinstance(t, torch.Tensor)}  # noqa: E731
    with ds.CheckpointManager(tmp_path / "run", writer="safetensors", keep=ds.KeepPolicy(last=1)) as mgr:
        mgr.save(1, tensors(1))
        mgr.save(2, tensors(2))
        assert mgr.all_steps() == [2]
        target = tensors(0)
        assert mgr.restore(target) == 2 and torch.equal(target["w"], _state(2)["w"])


def test_safetensors_writer_refuses_what_it_could_not_restore(tmp_path: Path) -> None:
    """Optimizer state has non-tensor entries (param_groups): a safetensors step of it was saved and could never
    be restored (IncompatibleKeysError). It is refused at save time, with our error naming the fix, and the step
    does not count."""
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    with ds.CheckpointManager(tmp_path / "run", writer="safetensors") as mgr:
        with pytest.raises(ds.errors.NonTensorStateError, match="writer='dcp'") as raised:
            mgr.save(1, ds.TrainState(model, optim))
        assert "param_groups" in str(raised.value)
        assert raised.value.__notes__ == ["dcp_storage.CheckpointManager.save failed on rank 0"]
        assert mgr.all_steps() == [] and mgr.save(2, ds.TrainState(model)) is True
        assert mgr.all_steps() == [2]


def test_save_and_restore_raise_our_errors_not_torchs(tmp_path: Path) -> None:
    """``except Exception`` catches them (torch's CheckpointException is a BaseException), named by rank."""
    root = tmp_path / "run"
    with ds.CheckpointManager(root) as mgr:
        mgr.save(1, _state(1))
        with pytest.raises(IncompatibleKeysError) as raised:
            mgr.restore({**_state(0), "not_saved": torch.zeros(2)})
        assert "CheckpointManager.restore failed on" in " ".join(getattr(raised.value, "__notes__", []))
        (root / step_name(2)).write_text("a file where the step's folder goes")
        with pytest.raises(ds.DcpStorageError):
            mgr.save(2, _state(2))


def test_a_read_only_user_can_restore(moto_server: Any, s3_url: Any) -> None:
    """Recovery writes the index; credentials that may only read (an evaluation job) could not even construct a
    manager (StorageAccessError). They restore now, with a warning; credentials that may not read still fail."""
    url, options = s3_url
    with ds.CheckpointManager(url + "/run", options) as mgr:
        mgr.save(1, _state(1))
    actions = ["s3:GetObject", "s3:ListBucket", "s3:HeadBucket"]
    allow = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
    key, secret = moto_server.create_access_key(f"ro-{uuid.uuid4().hex[:8]}", allow)
    with moto_server.iam_auth():
        with pytest.warns(UserWarning, match="may read but not write"):
            mgr = ds.CheckpointManager(url + "/run", {**options, "key": key, "secret": secret})
        target = _state(0)
        assert mgr.restore(target) == 1 and torch.equal(target["w"], _state(1)["w"])
        with pytest.raises(ds.errors.StorageAccessError):
            mgr.save(2, _state(2))
        mgr.close()
        with pytest.raises(ds.errors.StorageAccessError, match="rejected the credentials"):
            ds.CheckpointManager(url + "/run", {**options, "key": key, "secret": "wrong"})


def test_memory_store() -> None:
    root = f"memory://manager-{uuid.uuid4().hex}/run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=2), async_mode="thread") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.all_steps() == [2, 3]
    with ds.CheckpointManager(root) as mgr:
        target = _state(0)
        assert mgr.restore(target) == 3 and target["step"] == 3


def test_same_answer_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_manager_fns.same_answer, 2, str(tmp_path / "run"), timeout=180)
    assert results[0] == results[1] == {"latest": 3, "all": [2, 3], "restored": 3, "value": 3.0}


def test_ranks_with_other_settings_fail_at_construction(tmp_path: Path) -> None:
    """Other async modes or intervals on other ranks: RankMismatchError on every rank at once (a rank in
    thread mode made its own gloo group, a collective the others never entered: a hang for the group's
    timeout; different intervals saved other steps)."""
    for report in run_ranks(_manager_fns.mixed_settings, 2, str(tmp_path / "run"), timeout=120):
        assert "'async_mode': 'thread'" in report["async_mode"]["text"], report
        assert "'save_interval_steps': 5" in report["interval"]["text"], report
        assert max(r["seconds"] for r in report.values()) < 10, report


def test_staging_failing_on_one_rank_fails_every_rank_at_once(tmp_path: Path) -> None:
    for report in run_ranks(_manager_fns.staging_fails_on_one_rank, 2, str(tmp_path / "run"), timeout=120):
        thread, sync = report["thread"], report["None"]
        assert "simulated out of memory while staging" in thread["text"] and thread["seconds"] < 10, report
        assert "state must be a state dict" in sync["text"] and sync["seconds"] < 10, report


def test_process_mode(tmp_path: Path) -> None:
    results = run_ranks(_manager_fns.process_mode, 2, str(tmp_path / "run"), timeout=300)
    assert results[0] == results[1] == {"all": [2], "restored": 2, "value": 2.0}
    with pytest.raises(ValueError, match="initialized process group"):
        ds.CheckpointManager(tmp_path / "alone", async_mode="process")


def test_cli_ls_and_gc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dcp_storage.cli import main

    root = tmp_path / "run"
    with ds.CheckpointManager(root, keep=ds.KeepPolicy(last=None)) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
    _torn(root, 6)

    def cli(*argv: str) -> Any:
        capsys.readouterr()
        assert main(list(argv)) == 0
        return json.loads(capsys.readouterr().out)

    listed = cli("ls", str(root), "--json")
    assert [(s["step"], s["state"]) for s in listed["steps"]] == [(s, "complete") for s in range(1, 6)] + [(6, "torn")]
    assert listed["latest"] == 5 and listed["steps"][0]["metrics"] == {"loss": 1.0} and listed["steps"][0]["bytes"] > 0
    dry = cli("gc", str(root), "--keep-last", "2", "--keep-every", "2", "--dry-run", "--json")
    assert dry["deleted"] == [1, 3] and dry["torn_removed"] == [6] and len(_steps(root)) == 6
    done = cli("gc", str(root), "--keep-last", "2", "--keep-every", "2", "--json")
    assert done["deleted"] == [1, 3] and done["kept"] == [2, 4, 5]
    assert _steps(root) == [step_name(s) for s in (2, 4, 5)]
    assert main(["ls", str(root)]) == 0
    assert "complete" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["gc", str(root), "--keep-last", "0"])  # argparse refuses it
