"""What ``latest_step()`` costs on ``s3://`` with many stored steps: at most 3 requests, counted by a proxy
in front of moto (every HTTP request the client sends, whatever the client's own counters say).

The steps beyond the few saved for real are bare ``step-N/.metadata`` objects: the manager judges a step by
its commit marker only, so they count as complete steps, and they cost a PUT each to make, not a save.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dcp_storage as ds
from dcp_storage.manager.folders import step_name
from dcp_storage.manager.steps import INDEX_FILE
from dcp_storage_testing.fault_proxy import FaultProxy

STEPS = 60  # the benchmark (benchmarks/bench_manager.py) measures 1,000


@pytest.fixture
def proxied(moto_server: Any) -> Iterator[tuple[str, dict[str, Any], FaultProxy, str]]:
    with FaultProxy(moto_server.endpoint_url) as proxy:
        bucket = moto_server.create_bucket(moto_server.unique_bucket_name("manager"))
        options = moto_server.storage_options(
            client_kwargs={"endpoint_url": proxy.url}, skip_instance_cache=True, use_listings_cache=False
        )
        try:
            yield f"s3://{bucket}/run", options, proxy, bucket
        finally:
            moto_server.delete_bucket(bucket)


def test_latest_step_costs_three_requests(moto_server: Any, proxied: tuple) -> None:
    url, options, proxy, bucket = proxied
    client = moto_server.client()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # straight to moto, not through the proxy
        list(
            pool.map(
                lambda s: client.put_object(Bucket=bucket, Key=f"run/{step_name(s)}/.metadata", Body=b""), range(STEPS)
            )
        )
    state = {"w": torch.arange(16.0)}
    with ds.CheckpointManager(url, options, keep=ds.KeepPolicy(last=None)) as mgr:  # indexes the bare steps
        mgr.save(STEPS, state)
        mgr.save(STEPS + 1, state)
    with ds.CheckpointManager(url, options, keep=ds.KeepPolicy(last=None)) as mgr:
        proxy.reset_counters()
        assert mgr.latest_step() == STEPS + 1
        latest_requests = proxy.counters().requests
        proxy.reset_counters()
        assert mgr.all_steps() == [*range(STEPS + 2)]
        all_requests = proxy.counters().requests
        client.delete_object(Bucket=bucket, Key=f"run/{INDEX_FILE}")  # without the index: the same answer
        proxy.reset_counters()
        assert mgr.latest_step() == STEPS + 1
        listing_requests = proxy.counters().requests
    assert latest_requests <= 3, proxy.counters().log
    assert all_requests <= 3
    assert listing_requests > STEPS  # the fallback lists every step: what the index saves
