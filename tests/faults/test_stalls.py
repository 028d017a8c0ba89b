"""A server that stalls (before its headers, or in the middle of a body) fails a load at its deadline.

A stalled connection raises no socket error: before :mod:`dcp_storage.transports.retry`, one attempt
lasted as long as the client's socket timeout (botocore's ``read_timeout``, gcsfs's ``sock_read``: 60 s
by default), whatever ``RetryPolicy(deadline=...)`` said, and fsspec's HTTP client (aiohttp, no read
timeout) waited 300 s per attempt: a ``dcp.load`` with ``deadline=4`` from an HTTP server that sent half a
body hung for 15 minutes. Here the clients keep long socket timeouts, the proxy stalls for far longer than
the deadline, and every load must fail with a :class:`TransportError` naming the URL within the deadline
plus a little.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import aiohttp
import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage.errors import TransportError
from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage.formats.safetensors.writer import SafetensorsWriter
from dcp_storage.transports import RetryPolicy, TransportConfig
from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.fault_proxy import FaultProxy, FaultRule

from . import _stall_ranks
from .test_gcs_faults import gcs_proxy, gcs_server  # noqa: F401 - fixtures used by name below
from .test_s3_faults import assert_bit_exact, sample_state, save_dcp, unwrap

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(120)]

DEADLINE = 2.0
SLACK = 2.5  # a load is a few operations in a row: the one that stalls ends at its deadline, the rest are quick
STALL = 60.0  # far past the deadline, and as long as the clients' own socket timeouts
CONFIG = TransportConfig(
    max_workers=4, retry=RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05, deadline=DEADLINE)
)


class Stalled(NamedTuple):
    url: str
    options: dict[str, Any]
    proxy: FaultProxy
    like: dict[str, Any]


@pytest.fixture(scope="module")
def saved(moto_server: Any) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """One checkpoint in a moto bucket, and the bucket's name."""
    bucket = moto_server.create_bucket(moto_server.unique_bucket_name("stall"))
    url = f"s3://{bucket}/ckpt"
    state = sample_state()
    save_dcp((url, moto_server.storage_options(skip_instance_cache=True)), state)
    client = moto_server.client()
    for item in client.list_objects_v2(Bucket=bucket)["Contents"]:  # readable by plain http(s):// GETs
        client.put_object_acl(Bucket=bucket, Key=item["Key"], ACL="public-read")
    yield bucket, url, state
    moto_server.delete_bucket(bucket)


@pytest.fixture(params=["s3", "http", "gs"])
def stalled(request: pytest.FixtureRequest, moto_server: Any, saved: Any) -> Iterator[Stalled]:
    bucket, url, state = saved
    like = {k: v.clone().zero_() for k, v in state.items()}
    if request.param == "gs":
        server, proxy = request.getfixturevalue("gcs_server"), request.getfixturevalue("gcs_proxy")
        gs_bucket = server.create_bucket(server.unique_bucket_name("stall"))
        options = server.storage_options(
            endpoint_url=proxy.url,
            requests_timeout=aiohttp.ClientTimeout(sock_connect=STALL, sock_read=STALL),
            skip_instance_cache=True,
        )
        save_dcp((f"gs://{gs_bucket}/ckpt", options), state)
        yield Stalled(f"gs://{gs_bucket}/ckpt", options, proxy, like)
        proxy.clear_rules()
        server.delete_bucket(gs_bucket)
        return
    with FaultProxy(moto_server.endpoint_url) as proxy:
        if request.param == "s3":  # botocore's socket timeouts as long as the stall: only the deadline ends it
            timeouts = {"connect_timeout": STALL, "read_timeout": STALL}
            options = moto_server.storage_options(
                client_kwargs={"endpoint_url": proxy.url}, config_kwargs=timeouts, skip_instance_cache=True
            )
            yield Stalled(url, options, proxy, like)
        else:  # moto serves public objects to plain GETs: http(s):// through fsspec's aiohttp client
            yield Stalled(f"{proxy.url}/{bucket}/ckpt", {}, proxy, like)


@pytest.mark.parametrize("mode", ["slow", "stall_body"])
@pytest.mark.parametrize("target", [r"\.distcp$", r"/\.metadata$"])
def test_a_stalled_read_fails_at_the_deadline_naming_the_url(stalled: Stalled, mode: str, target: str) -> None:
    stalled.proxy.set_rules([FaultRule(mode, method="GET", path=target, delay=STALL)])
    began = time.monotonic()
    with pytest.raises((CheckpointException, TransportError)) as info:
        dcp.load(stalled.like, storage_reader=FsspecReader(stalled.url, stalled.options, transport_config=CONFIG))
    took = time.monotonic() - began
    stalled.proxy.clear_rules()
    error = unwrap(info.value)
    text = str(error)  # torch wraps a failed metadata read in an AssertionError that keeps our message
    assert isinstance(error, TransportError) or "metadata read failed" in text, text
    assert f"deadline, {DEADLINE:g}s" in text, text
    host_path = stalled.url.split("://", 1)[1]
    assert host_path in text, text  # the URL of what stalled
    # torch's load reads a rank-local metadata file after a failed .metadata: two operations in a row
    limit = (2 if "metadata" in target else 1) * DEADLINE + SLACK
    assert took < limit, f"{mode} on {target}: failed after {took:.1f}s, deadline {DEADLINE}s"


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_trickling_s3_body_fails_at_the_deadline(
    moto_server: Any, saved: Any, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """Half the body, then a byte every 0.3 s: every wait is well within the socket timeouts, the whole is not.
    Both S3 read paths end at the deadline (the direct one bounded the first wait only, and took minutes)."""
    monkeypatch.setenv("DCP_STORAGE_S3_DIRECT", direct)
    _, url, state = saved
    like = {k: v.clone().zero_() for k, v in state.items()}
    with FaultProxy(moto_server.endpoint_url) as proxy:
        timeouts = {"connect_timeout": STALL, "read_timeout": STALL}
        options = moto_server.storage_options(
            client_kwargs={"endpoint_url": proxy.url}, config_kwargs=timeouts, skip_instance_cache=True
        )
        proxy.set_rules([FaultRule("trickle_body", method="GET", path=r"\.distcp$", delay=0.3)])
        began = time.monotonic()
        with pytest.raises(CheckpointException) as info:
            dcp.load(like, storage_reader=FsspecReader(url, options, transport_config=CONFIG))
        took = time.monotonic() - began
    text = str(unwrap(info.value))
    assert f"deadline, {DEADLINE:g}s" in text and url.split("://", 1)[1] in text, text
    assert took < DEADLINE + SLACK, f"failed after {took:.1f}s, deadline {DEADLINE}s"


@pytest.mark.parametrize("kind", ["dcp", "safetensors"])
def test_a_stall_on_one_rank_fails_every_rank_at_the_deadline(kind: str, moto_server: Any, saved: Any) -> None:
    """Two gloo ranks; only rank 1's requests go through the stalling proxy. Both raise, naming the URL."""
    bucket, _url, state = saved
    direct = moto_server.storage_options(skip_instance_cache=True, config_kwargs={"read_timeout": STALL})
    url = f"s3://{bucket}/{kind}"
    if kind == "safetensors":
        dcp.save(state, storage_writer=SafetensorsWriter(url, direct, overwrite=True), no_dist=True)
    else:
        url = _url
    with FaultProxy(moto_server.endpoint_url) as proxy:
        stalling = dict(direct, client_kwargs={"endpoint_url": proxy.url})
        proxy.set_rules([FaultRule("stall_body", method="GET", path=r"\.(distcp|safetensors)$", delay=STALL)])
        began = time.monotonic()
        results = run_ranks(_stall_ranks.load_and_time, 2, kind, url, [direct, stalling], state, CONFIG, timeout=60)
        took = time.monotonic() - began
    for rank, (text, seconds) in enumerate(results):
        assert f"deadline, {DEADLINE:g}s" in text and f"{bucket}/" in text, f"rank {rank}: {text}"
        assert seconds < DEADLINE + SLACK, f"rank {rank} failed after {seconds:.1f}s"
    assert took < 30, took  # start-up of two processes included


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("PUT", r"/\.dcp_storage\.lock$"),  # the save's claim: a create-if-absent upload
        ("HEAD", r"/\.metadata$"),  # the save's look for a committed checkpoint
        ("DELETE", r"/\.dcp_storage\.lock$"),  # the claim's removal after the commit: a warning, not a failure
    ],
)
def test_a_stalled_azure_query_or_small_write_fails_at_the_deadline(
    method: str, target: str, azurite: Any, az_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """adlfs's own calls (exists, size, small uploads, deletes) ran through fsspec's ``sync`` with no bound:
    a stalled answer held a save for the Azure SDK's read timeout (each of these took the test's 120 s). They
    go through the deadline too."""
    container = azurite.create_container(azurite.unique_container_name("stall"))
    options = azurite.sas_storage_options(via=az_proxy.url, skip_instance_cache=True, use_listings_cache=False)
    url = f"az://{container}/ckpt"
    state = sample_state()
    az_proxy.set_rules([FaultRule("slow", method=method, path=target, delay=STALL)])
    began = time.monotonic()
    try:
        try:
            dcp.save(state, storage_writer=FsspecWriter(url, options, transport_config=CONFIG), no_dist=True)
            error: BaseException | None = None
        except (CheckpointException, TransportError) as exc:
            error = unwrap(exc)
        took = time.monotonic() - began
        az_proxy.clear_rules()
        if method == "DELETE":  # committed; the lock left behind is reported
            assert error is None, repr(error)
            text = caplog.text
            like = {k: v.clone().zero_() for k, v in state.items()}
            dcp.load(like, storage_reader=FsspecReader(url, options, transport_config=CONFIG), no_dist=True)
            assert_bit_exact(like, state)
        else:
            assert isinstance(error, TransportError), repr(error)
            text = str(error)
    finally:
        az_proxy.clear_rules()
        azurite.delete_container(container)
    assert f"deadline, {DEADLINE:g}s" in text and f"{container}/ckpt/" in text, text
    assert took < DEADLINE + SLACK, f"a stalled {method} held the save for {took:.1f}s"
