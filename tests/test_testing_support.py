"""Fast checks that the test-support helpers themselves work.

Everything else in the suite leans on these fixtures and on ``run_ranks``; if
they are broken, failures elsewhere are noise. Keep this file quick.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from dcp_storage_testing.distributed import RankFailedError, RankTimeoutError, run_ranks
from dcp_storage_testing.s3_server import MotoS3Server, S3Location

# --- rank bodies: module level so that spawned processes can unpickle them ---


def _all_reduce_rank(rank: int, world_size: int, scale: int, *, offset: int = 0) -> dict:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"hello from rank {rank}", flush=True)
    return {
        "rank": rank,
        "dist_rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": value.item() * scale + offset,
        "tensor": value * scale,  # tensors come back by value
        "threads": torch.get_num_threads(),
        "env_rank": os.environ["RANK"],
        "env_marker": os.environ.get("DCP_TEST_MARKER"),
    }


def _raise_on_rank_one(rank: int, world_size: int, pid_dir: str) -> int:
    import torch
    import torch.distributed as dist

    _record_pid(pid_dir, rank)
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.all_reduce(torch.zeros(1))  # would hang forever without rank 1
    return rank


def _noop_rank(rank: int, world_size: int) -> int:
    return rank


def _die_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # no traceback, no report: like a segfault or OOM kill
    return rank


def _hang_on_rank_one(rank: int, world_size: int, pid_dir: str) -> int:
    _record_pid(pid_dir, rank)
    if rank == 1:
        time.sleep(600)
    return rank


def _record_pid(pid_dir: str, rank: int) -> None:
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def _assert_ranks_gone(pid_dir: Path, world_size: int) -> None:
    """Every rank that started must be dead (and reaped) once run_ranks returns."""
    for rank in range(world_size):
        pid_file = pid_dir / f"rank{rank}.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            assert not alive, f"rank {rank} (pid {pid}) still running"


# --- S3 ---


def test_moto_server_round_trip(moto_server: MotoS3Server, s3_url: S3Location) -> None:
    import s3fs

    url, storage_options = s3_url
    assert url.startswith("s3://") and url.endswith("/ckpt")
    assert moto_server.endpoint_url == f"http://127.0.0.1:{moto_server.port}"
    assert moto_server.port > 0
    assert storage_options["client_kwargs"] == {"endpoint_url": moto_server.endpoint_url}
    assert os.environ["AWS_DEFAULT_REGION"] == "us-east-1"

    fs = s3fs.S3FileSystem(**storage_options)
    fs.pipe(f"{url}/shard-0", b"payload")
    assert fs.cat(f"{url}/shard-0") == b"payload"
    assert [p.rsplit("/", 1)[1] for p in fs.ls(url)] == ["shard-0"]
    # Another filesystem object (as in another rank) writes; with s3fs's
    # defaults `fs` would share it / serve its cached listing and miss shard-1.
    other = s3fs.S3FileSystem(**storage_options)
    assert other is not fs
    other.pipe(f"{url}/shard-1", b"more")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(url)) == ["shard-0", "shard-1"]
    assert fs.exists(f"{url}/shard-1")


def test_s3_url_buckets_are_fresh(s3_url: S3Location) -> None:
    import s3fs

    url, storage_options = s3_url
    fs = s3fs.S3FileSystem(**storage_options)
    assert not fs.exists(url)
    assert fs.ls(url.rsplit("/", 1)[0]) == []


# --- distributed ---


def test_run_ranks_returns_per_rank_values(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setenv("DCP_TEST_MARKER", "set-after-forkserver-start")
    results = run_ranks(_all_reduce_rank, 2, 10, offset=1, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["dist_rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["sum"] == 31.0 for r in results)  # (1 + 2) * 10 + 1
    assert all(r["threads"] == 1 for r in results)
    assert [r["env_rank"] for r in results] == ["0", "1"]
    assert all(torch.equal(r["tensor"], torch.tensor([30.0])) for r in results)
    # Ranks see the caller's environment and write to the caller's stdout.
    assert all(r["env_marker"] == "set-after-forkserver-start" for r in results)
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


def test_run_ranks_reports_failing_rank(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_raise_on_rank_one, 2, str(tmp_path), timeout=60)
    assert info.value.rank == 1
    assert "ValueError: boom from rank one" in info.value.failures[1]
    assert "rank 1" in str(info.value) and "boom from rank one" in str(info.value)
    assert not isinstance(info.value, RankTimeoutError)
    _assert_ranks_gone(tmp_path, 2)


def test_run_ranks_reports_rank_that_died() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_die_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "exited with code 3" in info.value.failures[1]


def test_run_ranks_times_out_hung_rank(tmp_path: Path) -> None:
    # Size the timeout from a warm call: the first call in a process pays the
    # forkserver's torch import, and plain spawn pays it every call. The hang
    # must be detected in a *running* rank, not in one still starting up.
    start = time.monotonic()
    assert run_ranks(_noop_rank, 2, timeout=60) == [0, 1]
    hang_timeout = 1.5 + 2 * (time.monotonic() - start)
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_ranks(_hang_on_rank_one, 2, str(tmp_path), timeout=hang_timeout)
    assert time.monotonic() - start < hang_timeout + 10
    assert info.value.unfinished == [1]
    assert "did not finish" in str(info.value)
    assert "_hang_on_rank_one" in info.value.failures[1]  # faulthandler stack dump
    assert (tmp_path / "rank1.pid").exists()  # it really was hanging, not starting
    _assert_ranks_gone(tmp_path, 2)
