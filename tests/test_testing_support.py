"""Fast checks that the test-support helpers themselves work.

Everything else in the suite leans on these fixtures and on ``run_ranks``; if
they are broken, failures elsewhere are noise. Keep this file quick.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

from dcp_storage.testing.distributed import RankFailedError, RankTimeoutError, run_ranks
from dcp_storage.testing.s3_server import MotoS3Server, S3Location

# --- rank bodies: module level so that spawned processes can unpickle them ---


def _all_reduce_rank(rank: int, world_size: int, scale: int, *, offset: int = 0) -> dict:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {
        "rank": rank,
        "dist_rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": value.item() * scale + offset,
        "threads": torch.get_num_threads(),
        "env_rank": os.environ["RANK"],
    }


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom from rank one")
    dist.all_reduce(torch.zeros(1))  # would hang forever without rank 1
    return rank


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def _child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


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
    # A listing right after a second write must not be served from a cache.
    fs.pipe(f"{url}/shard-1", b"more")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(url)) == ["shard-0", "shard-1"]


def test_s3_url_buckets_are_fresh(s3_url: S3Location) -> None:
    import s3fs

    url, storage_options = s3_url
    fs = s3fs.S3FileSystem(**storage_options)
    assert not fs.exists(url)
    assert fs.ls(url.rsplit("/", 1)[0]) == []


# --- distributed ---


def test_run_ranks_returns_per_rank_values() -> None:
    results = run_ranks(_all_reduce_rank, 2, 10, offset=1, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["dist_rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["sum"] == 31.0 for r in results)  # (1 + 2) * 10 + 1
    assert all(r["threads"] == 1 for r in results)
    assert [r["env_rank"] for r in results] == ["0", "1"]


def test_run_ranks_reports_failing_rank() -> None:
    before = _child_pids()
    with pytest.raises(RankFailedError) as info:
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "ValueError: boom from rank one" in info.value.failures[1]
    assert "rank 1" in str(info.value) and "boom from rank one" in str(info.value)
    assert not isinstance(info.value, RankTimeoutError)
    assert _child_pids() <= before


def test_run_ranks_times_out_hung_rank() -> None:
    before = _child_pids()
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_ranks(_hang_on_rank_one, 2, timeout=8)
    assert time.monotonic() - start < 20
    assert info.value.unfinished == [1]
    assert "did not finish" in str(info.value)
    assert "_hang_on_rank_one" in info.value.failures[1]  # faulthandler stack dump
    assert _child_pids() <= before
