"""Saves and loads through gcsfs (``gs://``) survive a store that fails 1 request in 3, in every fault mode.

The same matrix as :mod:`.test_s3_faults`, with a :class:`FaultProxy` (``dialect="gcs"``: JSON error
bodies) in front of fake-gcs-server: ``dcp.save``/``dcp.load`` bit for bit (large reads split into ranged
GETs), faults of that mode really injected in both phases; a store that never recovers yields a
:class:`TransportError` naming URL, operation and attempts before the deadline, with one retry layer only
(gcsfs's own six tries with 1-16 s sleeps are bypassed, see :mod:`dcp_storage.transports.gcs`).
"""

from __future__ import annotations

import os

# Before anything imports gcsfs (see dcp_storage_testing.gcs_server): plain GCSFileSystem for gs://.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import contextlib
import re
import time
import warnings
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage_testing.fault_proxy import FAULT_MODES, FaultProxy, FaultRule
from dcp_storage_testing.gcs_server import FakeGcsServer, FakeGcsServerError, GcsLocation
from dcp_storage_testing.serving import serving

from .conftest import READ_TIMEOUT, SLOW_DELAY
from .test_s3_faults import (
    FEW_ATTEMPTS,
    IMPATIENT,
    _config,
    assert_bit_exact,
    assert_data_read_gave_up,
    assert_gave_up_in_time,
    assert_metadata_read_gave_up,
    failing,
    load_dcp,
    run_phase,
    sample_state,
    save_dcp,
    transport_error_text,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def gcs_server() -> Iterator[FakeGcsServer]:
    with serving("fake-gcs-server", FakeGcsServer, (FakeGcsServerError, OSError)) as server:
        yield server


@pytest.fixture(scope="module")
def gcs_proxy(gcs_server: FakeGcsServer) -> Iterator[FaultProxy]:
    with FaultProxy(gcs_server.endpoint_url, dialect="gcs", rewrite_location=True) as proxy:
        yield proxy


@contextlib.contextmanager
def _proxied_bucket(server: FakeGcsServer, proxy: FaultProxy) -> Iterator[GcsLocation]:
    """A fresh bucket (created and deleted on the server directly), reached through the proxy."""
    proxy.clear_rules()
    proxy.reset_counters()
    bucket = server.create_bucket(server.unique_bucket_name("fault"))
    options = server.storage_options(
        endpoint_url=proxy.url,
        # a held-back response ("slow") makes the client time out and retry; a healthy one comes well within
        requests_timeout=aiohttp.ClientTimeout(sock_connect=2, sock_read=READ_TIMEOUT),
        skip_instance_cache=True,
        use_listings_cache=False,
    )
    try:
        yield GcsLocation(f"gs://{bucket}/ckpt", options)
    finally:
        proxy.clear_rules()
        try:
            server.delete_bucket(bucket)
        except Exception as exc:  # noqa: BLE001 - cleanup must not mask the test result
            warnings.warn(f"could not delete test bucket {bucket}: {exc!r}", stacklevel=1)


@pytest.fixture
def proxied_gs(gcs_server: FakeGcsServer, gcs_proxy: FaultProxy) -> Iterator[GcsLocation]:
    with _proxied_bucket(gcs_server, gcs_proxy) as location:
        yield location


@pytest.fixture(scope="module")
def saved_gs_checkpoint(gcs_server: FakeGcsServer, gcs_proxy: FaultProxy) -> Iterator[tuple[GcsLocation, Any]]:
    with _proxied_bucket(gcs_server, gcs_proxy) as location:
        state = sample_state()
        save_dcp(location, state)
        yield location, state


def _object_names(server: FakeGcsServer, location: GcsLocation) -> list[str]:
    bucket = location.url.split("/")[2]
    page = server._call("GET", f"/storage/v1/b/{bucket}/o") or {}
    return [item["name"] for item in page.get("items", [])]


# ------------------------------------------------------------------------------------ 1 in 3 faulted
# Modes whose every fault reaches our retry layer: an error status always does; on reads a held-back
# response times out (sock_read). A reset before any byte of a reused connection's response can be resent
# by aiohttp itself, and a held-back upload response is merely slow (aiohttp's sock_read does not cover the
# wait for the answer to a request with a body), so those are checked only for having been injected.
ANSWERED_WRITES = ("slowdown_503", "error_500")
ANSWERED_READS = ("slowdown_503", "error_500", "slow")


@pytest.mark.parametrize("mode", FAULT_MODES)
def test_dcp_save_and_load_survive_one_in_three(mode: str, proxied_gs: GcsLocation, gcs_proxy: FaultProxy) -> None:
    state = sample_state()
    writer, saved = run_phase(gcs_proxy, mode, lambda: save_dcp(proxied_gs, state))
    assert saved.faults[mode] > 0 and saved.total_faults == saved.faults[mode], saved.faults
    assert any(path.startswith("/upload/") for _m, path, _f in saved.faulted), saved.faulted  # uploads too
    if mode in ANSWERED_WRITES:
        assert writer.counters["retries"] >= saved.faults[mode], (writer.counters, saved.faults)

    (loaded, reader), read = run_phase(gcs_proxy, mode, lambda: load_dcp(proxied_gs, state))
    assert read.faults[mode] > 0, read.faults
    assert any(path.endswith(".distcp") for _m, path, _f in read.faulted), read.faulted  # ranged data GETs too
    if mode in ANSWERED_READS:
        assert reader.counters["retries"] >= read.faults[mode], (reader.counters, read.faults)
    elif mode == "truncate":  # a GET cut mid-body always surfaces (length check or aiohttp payload error)
        assert reader.counters["retries"] > 0, reader.counters
    assert_bit_exact(loaded, state)


# ------------------------------------------------------------------------------------ permanent faults
@pytest.mark.parametrize("mode", FAULT_MODES)
def test_permanent_fault_on_data_reads_fails_before_the_deadline(
    mode: str, saved_gs_checkpoint: tuple[GcsLocation, Any], gcs_proxy: FaultProxy
) -> None:
    location, state = saved_gs_checkpoint
    # object downloads, not the metadata GETs of the same names
    data_gets = FaultRule(mode, method="GET", path=r"\.distcp$", query="alt=media", delay=SLOW_DELAY)  # type: ignore[arg-type]
    message, elapsed = failing(gcs_proxy, [data_gets], lambda: load_dcp(location, state, _config(IMPATIENT)))
    assert_data_read_gave_up(message, elapsed, location.url, gcs_proxy, mode)


def test_permanent_fault_on_metadata_read_costs_exactly_max_attempts(
    saved_gs_checkpoint: tuple[GcsLocation, Any], gcs_proxy: FaultProxy
) -> None:
    location, state = saved_gs_checkpoint
    rules = [FaultRule("slowdown_503", method="GET", path=r"/ckpt/\.metadata$")]
    message, elapsed = failing(gcs_proxy, rules, lambda: load_dcp(location, state, _config(FEW_ATTEMPTS)))
    assert_metadata_read_gave_up(message, location.url, gcs_proxy)  # not 3 x gcsfs's 6 tries
    assert elapsed < 5.0  # and none of gcsfs's 1-16 s sleeps


@pytest.mark.parametrize("mode", ["slowdown_503", "error_500", "reset", "truncate"])
def test_permanent_fault_on_save_fails_and_leaves_nothing(
    mode: str, proxied_gs: GcsLocation, gcs_proxy: FaultProxy, gcs_server: FakeGcsServer
) -> None:
    state = {"big": sample_state()["big"]}  # one 6 MiB file: spilled to a temp file, one media upload
    gcs_proxy.set_rules(
        [FaultRule(mode, method="POST", path=r"/upload/", query=r"uploadType=media&name=ckpt(%2F|/)__0_0\.distcp")]
    )  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        save_dcp(proxied_gs, state, _config(IMPATIENT))
    message = transport_error_text(info.value)
    assert re.match(rf"write \(\d+ bytes\) {re.escape(proxied_gs.url)}/__0_0\.distcp failed after", message), message
    assert_gave_up_in_time(message, time.monotonic() - started)
    names = _object_names(gcs_server, proxied_gs)
    assert "ckpt/.metadata" not in names, names
    if mode != "truncate":  # a cut-off answer comes after the store took the object (as a real store may)
        assert "ckpt/__0_0.distcp" not in names, names
