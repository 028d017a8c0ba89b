"""A save's lock against real failures: a holder SIGKILLed or stopped, a pid reused, a lease run out, takers
racing, ``verify --cleanup``, Ctrl-C and SIGTERM, and a store that ignores ``If-None-Match``.

Before: a save killed on this host left ``.dcp_storage.lock`` and every later ``overwrite=False`` save to
that step (what a resumed job does) was refused naming the dead pid; the job crash-looped. Holders that
stopped on another host were never judged stale. Two saves on a store that ignores ``If-None-Match`` both
went on. Each test here failed before (see its docstring).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.cli import main as cli
from dcp_storage.errors import CheckpointExistsError
from dcp_storage.formats.commit_claim import LOCK_FILE, claim_location
from dcp_storage.formats.commit_holder import LEASE_ENV, SETTLE_ENV
from dcp_storage.transports import FsspecTransport
from dcp_storage_testing.fault_proxy import FaultProxy, FaultRule

ROOT = Path(__file__).resolve().parents[2]
TAKERS = int(os.environ.get("DCP_STORAGE_TAKEOVER_ROUNDS", "5"))


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=g), "step": seed}


def load(path: Path | str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    dest: dict[str, Any] = {"w": torch.empty(16, 8), "step": None}
    dcp.load(dest, storage_reader=FsspecReader(str(path), options), no_dist=True)
    return dest


def unwrap(exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointException):
        (inner, _trace), *_ = exc.failures.values()
        return inner
    return exc


def lease_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dcp-storage-lease"]


@pytest.fixture
def stuck_save(tmp_path: Path) -> Iterator[Any]:
    """Start ``tests/storage/_lock_fns.py``: a real save process, in its first data file (prints WRITING)."""
    procs: list[subprocess.Popen[str]] = []

    def start(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        full = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.storage._lock_fns", str(path), *args],
            cwd=ROOT,
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", (line, proc.stderr.read() if proc.poll() is not None else "")
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def temp_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".tmp"))


# ------------------------------------------------------------------------------------ dead holders
def test_a_sigkilled_save_is_taken_over_by_the_resumed_job(tmp_path: Path, stuck_save: Any) -> None:
    """Before: "another save holds this location (... pid N ...)" with N dead, on every retry."""
    ckpt = tmp_path / "ckpt"
    proc = stuck_save(ckpt)
    holder = json.loads((ckpt / LOCK_FILE).read_text())
    assert holder["pid"] == proc.pid and holder["started"] > 0 and holder["lease_s"] == 90
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (ckpt / LOCK_FILE).exists() and temp_files(ckpt), sorted(os.listdir(ckpt))  # what a kill leaves

    resumed = FsspecWriter(ckpt)
    dcp.save(state(1), storage_writer=resumed, no_dist=True)  # overwrite=False, as a resumed job saves
    assert load(ckpt)["step"] == 1 and ds.verify(ckpt, deep=True).ok
    names = sorted(os.listdir(ckpt))
    tag = resumed.save_id[:12]
    assert names[:2] == [".dcp_storage.json", ".metadata"] and names[2:], names  # the dead save's files retired
    assert all(n.startswith(f"__0_{tag}_") and n.endswith(".distcp") for n in names[2:]), names


def _lock_of(pid: int, started: int | None, host: str | None = None, **more: Any) -> dict[str, Any]:
    from dcp_storage.formats.commit_holder import _this_process

    me = _this_process()
    return {
        **me,
        "save_id": "d" * 32,
        "claim": "c" * 32,
        "writer": "x",
        "since": "-",
        "pid": pid,
        "started": started,
        "host": host or me["host"],
        "lease_s": 90,
        "renewed": time.time(),
        **more,
    }


def test_a_reused_pid_and_a_live_one(tmp_path: Path) -> None:
    """The lock's pid is alive but was started at another time: another process has it now (taken over).
    A live process with the recorded start time holds it (refused), however old the lock."""
    from dcp_storage.formats.commit_holder import _process_start

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = _process_start(sleeper.pid)
        assert started is not None
        for live, lock in [(True, _lock_of(sleeper.pid, started[0])), (False, _lock_of(sleeper.pid, started[0] - 7))]:
            ckpt = tmp_path / f"live-{live}"
            ckpt.mkdir()
            (ckpt / LOCK_FILE).write_text(json.dumps(lock))
            if live:
                with pytest.raises(CheckpointException) as info:
                    dcp.save(state(2), storage_writer=FsspecWriter(ckpt), no_dist=True)
                assert isinstance(unwrap(info.value), CheckpointExistsError)
                assert f"pid {sleeper.pid}" in str(unwrap(info.value))
            else:
                dcp.save(state(2), storage_writer=FsspecWriter(ckpt), no_dist=True)
                assert load(ckpt)["step"] == 2
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_without_lease_fields_is_never_judged(tmp_path: Path) -> None:
    """An older version's lock from another host (no start time, no lease) is left to overwrite=True."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LOCK_FILE).write_text(json.dumps({"save_id": "e" * 32, "host": "elsewhere", "pid": 7, "since": "-"}))
    with pytest.raises(CheckpointException) as info:
        dcp.save(state(3), storage_writer=FsspecWriter(ckpt), no_dist=True)
    assert isinstance(unwrap(info.value), CheckpointExistsError)


@pytest.mark.parametrize(
    "changes",
    [
        {"pid": 0},
        {"pid": -1},
        {"pid": True},
        {"pid": "4242"},
        {"started": "1"},
        {"lease_s": 0, "renewed": 0},
        {"lease_s": -5, "renewed": 0},
        {"lease_s": 1e12, "renewed": 0},
        {"lease_s": "90", "renewed": 0},
        {"lease_s": True, "renewed": 0},
        {"renewed": float("-inf")},
        {"renewed": float("nan")},
        {"renewed": "0"},
    ],
    ids=repr,
)
def test_malformed_holder_fields_never_make_a_lock_stale(changes: dict[str, Any]) -> None:
    """Only a holder that is provably gone is taken over: a pid of 0 or -1 (``kill(0, ...)`` would name a
    process group), types other than numbers, a non-finite or absurd lease are "unknown"."""
    from dcp_storage.formats.commit_holder import stale_reason

    live_elsewhere = {**_lock_of(os.getpid(), 1, host="elsewhere"), **changes}
    assert stale_reason(json.loads(json.dumps(live_elsewhere)), lambda _c: True) is None
    same_host_pid = {**_lock_of(os.getpid(), 1), **changes}  # our pid, another start time: unless malformed, stale
    if "pid" in changes or "started" in changes:
        assert stale_reason(json.loads(json.dumps(same_host_pid)), lambda _c: True) is None


# ------------------------------------------------------------------------------------ leases
def test_a_stopped_holder_on_another_host_is_taken_over_after_its_lease(
    tmp_path: Path, stuck_save: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live save on "another host" (its lock names another host name) renews its 3 s lease: refused while
    it runs, even past the lease. SIGSTOPped, it stops renewing: taken over after 3 s; resumed, it finds its
    lock taken and never writes it back. Before: refused for ever."""
    ckpt = tmp_path / "ckpt"
    proc = stuck_save(ckpt, "--host", "elsewhere-host", env={LEASE_ENV: "3"})
    first = json.loads((ckpt / LOCK_FILE).read_text())
    assert first["host"] == "elsewhere-host" and first["lease_s"] == 3
    time.sleep(3.5)  # past one lease: renewed meanwhile
    renewed = json.loads((ckpt / LOCK_FILE).read_text())
    assert renewed["claim"] == first["claim"] and renewed["renewed"] > first["renewed"]
    with pytest.raises(CheckpointException) as info:
        dcp.save(state(4), storage_writer=FsspecWriter(ckpt), no_dist=True)
    assert "elsewhere-host" in str(unwrap(info.value))

    proc.send_signal(signal.SIGSTOP)
    time.sleep(3.5)
    taker = FsspecWriter(ckpt)
    dcp.save(state(4), storage_writer=taker, no_dist=True)
    assert load(ckpt)["step"] == 4
    proc.send_signal(signal.SIGCONT)
    time.sleep(1.5)  # its renewal thread runs again: it must see the lock is gone/another's
    assert not (ckpt / LOCK_FILE).exists(), "the stopped holder wrote its lock back"
    assert ds.verify(ckpt, deep=True).ok


def test_renewal_keeps_a_long_save_and_stops_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renewal runs while the save does and ends with it, committed or failed: no thread is left."""
    monkeypatch.setenv(LEASE_ENV, "1")
    slow = dict(FsspecWriter.__dict__)["_write_records"]
    seen: list[dict[str, Any]] = []

    def write_slowly(self: Any, *args: Any) -> Any:
        seen.append(json.loads((tmp_path / "ok" / LOCK_FILE).read_text()))
        time.sleep(1.5)
        seen.append(json.loads((tmp_path / "ok" / LOCK_FILE).read_text()))
        return slow(self, *args)

    monkeypatch.setattr(FsspecWriter, "_write_records", write_slowly)
    dcp.save(state(5), storage_writer=FsspecWriter(tmp_path / "ok", thread_count=1), no_dist=True)
    assert seen[-1]["renewed"] > seen[0]["renewed"] and seen[-1]["claim"] == seen[0]["claim"], seen
    assert not lease_threads()
    monkeypatch.undo()
    with pytest.raises(CheckpointException):
        dcp.save({**state(5), "bad": lambda: None}, storage_writer=FsspecWriter(tmp_path / "failed"), no_dist=True)
    deadline = time.monotonic() + 5
    while lease_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not lease_threads(), "a failed save left its renewal thread running"


# ------------------------------------------------------------------------------------ one taker wins
def _stale_lock() -> bytes:
    return json.dumps(_lock_of(4242, 1, host="gone-host", renewed=time.time() - 1000)).encode()


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_of_many_takers_of_a_stale_lock_exactly_one_wins(backend: str, tmp_path: Path, request: Any) -> None:
    rounds = TAKERS
    for k in range(rounds):
        if backend == "local":
            url, options = str(tmp_path / f"round{k}"), {}
        else:
            base, options = request.getfixturevalue("s3_url")
            url = f"{base}/round{k}"
        transports = [FsspecTransport.from_url(url, options) for _ in range(4)]
        t0, root0 = transports[0]
        t0.write_file(t0.join(root0, LOCK_FILE), _stale_lock())
        barrier = threading.Barrier(len(transports))
        outcomes: list[Any] = [None] * len(transports)

        def take(i: int) -> None:
            t, root = transports[i]
            barrier.wait()
            try:
                outcomes[i] = claim_location(
                    t, t.join(root, LOCK_FILE), save_id=f"{i}" * 32, overwrite=False, markers=[]
                )
            except CheckpointExistsError as exc:
                outcomes[i] = exc

        threads = [threading.Thread(target=take, args=(i,)) for i in range(len(transports))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [o for o in outcomes if not isinstance(o, CheckpointExistsError)]
        assert len(winners) == 1, f"round {k}: {outcomes}"
        assert winners[0].holds() and winners[0].took_over
        assert not t0.exists(t0.join(root0, LOCK_FILE + ".takeover"))
        winners[0].release()
        assert not t0.exists(t0.join(root0, LOCK_FILE))


# ------------------------------------------------------------------------------------ verify --cleanup
def test_verify_cleanup_removes_a_killed_saves_lock_and_temp_files(
    tmp_path: Path, stuck_save: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: --cleanup removed neither the lock nor the temp files. A live save's are never touched."""
    live, dead = tmp_path / "live", tmp_path / "dead"
    running = stuck_save(live)
    killed = stuck_save(dead)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    assert cli(["verify", str(dead), "--cleanup"]) == 1  # still no checkpoint there: its data file is gone
    out = capsys.readouterr().out
    assert f"removed: {LOCK_FILE} (stale: its process (pid {killed.pid}) is gone)" in out, out
    assert not (dead / LOCK_FILE).exists() and not temp_files(dead), sorted(os.listdir(dead))

    before = sorted(os.listdir(live))
    assert LOCK_FILE in before and temp_files(live)
    cli(["verify", str(live), "--cleanup"])
    out = capsys.readouterr().out
    assert "not cleaned:" in out and f"pid {running.pid}" in out, out
    assert sorted(os.listdir(live)) == before


# ------------------------------------------------------------------------------------ signals
def test_ctrl_c_releases_the_lock_and_the_temp_file(tmp_path: Path, stuck_save: Any) -> None:
    """Before: the lock stayed, refusing saves from other hosts until its lease ran out."""
    ckpt = tmp_path / "ckpt"
    proc = stuck_save(ckpt)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, proc.stderr.read() if proc.stderr else ""
    assert sorted(os.listdir(ckpt)) == [], sorted(os.listdir(ckpt))


def test_sigterm_releases_the_lock_and_ends_the_process_by_the_signal(tmp_path: Path, stuck_save: Any) -> None:
    """Before: the lock stayed. The temp file of the interrupted write stays (no unwinding on SIGTERM's
    default action); verify --cleanup removes it, and no live save is refused meanwhile."""
    ckpt = tmp_path / "ckpt"
    proc = stuck_save(ckpt)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert not (ckpt / LOCK_FILE).exists(), sorted(os.listdir(ckpt))
    assert cli(["verify", str(ckpt), "--cleanup"]) == 1 and os.listdir(ckpt) == []
    dcp.save(state(6), storage_writer=FsspecWriter(ckpt), no_dist=True)
    assert load(ckpt)["step"] == 6


# ------------------------------------------------------------------------------------ If-None-Match ignored
def test_a_store_that_ignores_if_none_match_still_has_one_winner(
    moto_server: Any, s3_url: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a proxy that drops conditional headers, two racing saves both "created" the lock and both
    went on, their files mixed, without a word. Now: a warning, and exactly one winner whose checkpoint
    loads verified."""
    monkeypatch.setenv(SETTLE_ENV, "500")
    url, options = s3_url
    with FaultProxy(moto_server.endpoint_url) as proxy:
        proxied = dict(options, client_kwargs={"endpoint_url": proxy.url})
        proxy.set_rules([FaultRule("ignore_conditions", method="PUT")])
        for k in range(3):
            here = f"{url}/round{k}"
            writers = [FsspecWriter(here, proxied, thread_count=2, single_file_per_rank=False) for _ in range(2)]
            barrier = threading.Barrier(2)
            outcomes: list[Any] = [None, None]

            def run(i: int) -> None:
                barrier.wait()
                try:
                    dcp.save(state(10 * k + i), storage_writer=writers[i], no_dist=True)
                    outcomes[i] = ("ok", None)
                except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
                    outcomes[i] = ("raised", unwrap(exc))

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            with warnings.catch_warnings(record=True) as caught:  # here: catch_warnings is not thread-safe
                warnings.simplefilter("always")
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
            winners = [i for i, o in enumerate(outcomes) if o[0] == "ok"]
            assert len(winners) == 1, f"round {k}: {outcomes}"
            (loser,) = [o[1] for o in outcomes if o[0] == "raised"]
            assert isinstance(loser, CheckpointExistsError), loser
            assert any("ignores If-None-Match" in str(w.message) for w in caught), [str(w.message) for w in caught]
            got = {"w": torch.empty(16, 8), "step": None}
            dcp.load(got, storage_reader=FsspecReader(here, options, verify=True), no_dist=True)
            assert got["step"] == 10 * k + winners[0] and torch.equal(got["w"], state(10 * k + winners[0])["w"])


def test_an_honest_store_costs_one_refused_probe(s3_url: Any) -> None:
    url, options = s3_url
    transport, root = FsspecTransport.from_url(url, options)
    before = transport.counters.snapshot()["requests"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ignores If-None-Match" warning on moto, which honours it
        claim = claim_location(
            transport, transport.join(root, LOCK_FILE), save_id="a" * 32, overwrite=False, markers=[]
        )
    claim.release()
    assert claim.renewal is not None and not claim.renewal.running()
    print(f"\nclaim + release on S3: {transport.counters.snapshot()['requests'] - before} requests")


def test_hostname_is_what_the_lock_records() -> None:
    from dcp_storage.formats.commit_holder import _this_process

    assert _this_process()["host"] == socket.gethostname()
