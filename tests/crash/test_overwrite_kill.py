"""``overwrite=True`` killed at random moments never loses the previous checkpoint, locally and on ``s3://``.

Every trial saves state ``NEW_SEED`` with ``overwrite=True`` over a complete checkpoint of ``OLD_SEED`` (2
real gloo ranks, one SIGKILLed at a random moment; ``_trials.py`` says how the moment is drawn and what is
checked). Bar: every trial leaves the target loading completely, bit-exact, as the old state (killed before
the commit) or the new one (after it), and verifying OK; never "incomplete". Then an ``overwrite=True`` save
retires the killed save's leftovers (only files the new ``.metadata`` names stay).

The suite runs a few trials (``DCP_STORAGE_KILL_TRIALS``, default 3 locally and 2 on ``s3://``); the bar's
full count is ``DCP_STORAGE_KILL_TRIALS=10`` (10 local, 5 on ``s3://``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dcp_storage_testing.s3_server import S3Location

from ._launcher import Zygote
from ._trials import AFTER_COMMIT, MISSED, OLD_INTACT, CrashTrials, Location

SEED = 20261203


def _trial_count(s3: bool) -> int:
    raw = os.environ.get("DCP_STORAGE_KILL_TRIALS", "3")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"DCP_STORAGE_KILL_TRIALS must be a whole number, got {raw!r}") from None
    return max(1, -(-n // 2)) if s3 else max(1, n)


def _run(trials: CrashTrials, n: int, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks do: on 2 busy cores, intra-op threads only add contention
    try:
        start = time.perf_counter()
        trials.measure()
        phases = [trials.run(k, same_path=True) for k in range(n)]
        trials.tally.seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    with capsys.disabled():
        print("\noverwrite=True " + trials.tally.summary())
    # run() checked each: OLD_INTACT loads the old state bit-exact, AFTER_COMMIT/MISSED the new one.
    assert all(p in (OLD_INTACT, AFTER_COMMIT, MISSED) for p in phases), phases
    assert trials.tally.refused_incomplete == 0 and trials.tally.loaded_complete == n


def test_overwrite_kill_local(zygote: Zygote, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trials = CrashTrials(zygote, Location(str(tmp_path / "ckpt"), {}), tmp_path / "signals", SEED)
    _run(trials, _trial_count(s3=False), capsys)


def test_overwrite_kill_s3(
    zygote: Zygote, s3_url: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, storage_options = s3_url
    storage_options = {k: v for k, v in storage_options.items() if k != "skip_instance_cache"}  # see test_sigkill
    trials = CrashTrials(zygote, Location(url, storage_options), tmp_path / "signals", SEED + 1)
    _run(trials, _trial_count(s3=True), capsys)
