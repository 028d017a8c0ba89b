"""Saves and loads through s3fs survive a store that fails 1 request in 3, in every fault mode.

Each test drives ``dcp.save``/``dcp.load`` (DCP layout and safetensors) through a :class:`FaultProxy` in
front of moto and checks every tensor bit for bit, and that the proxy really injected faults of that mode
in both phases. The permanent-fault tests check that a store that never recovers yields a
:class:`TransportError` naming URL, operation and attempts, before the deadline, and that a failed
multipart upload is aborted.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage.errors import TransportError
from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage.formats.safetensors.reader import SafetensorsReader
from dcp_storage.formats.safetensors.writer import SafetensorsWriter
from dcp_storage.transports import RetryPolicy, TransportConfig
from dcp_storage_testing.fault_proxy import FAULT_MODES, FaultProxy, FaultRule
from dcp_storage_testing.s3_server import S3Location

from .conftest import SLOW_DELAY

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _no_collection_inside_a_deadline() -> None:
    """By the time these tests run, a full run has built a large heap: a full cyclic collection triggered
    inside one of their 1 s deadlines would stall every thread, the event loop's included. In two full runs
    an unfaulted first request got no answer within its deadline, in the same test each time (collections
    follow the allocation pattern, which a full run repeats). Collect before each test instead."""
    gc.collect()


MiB = 1024 * 1024
# Enough attempts that 1-in-3 faults never exhaust them; backoff small so the tests stay fast.
TOLERANT = RetryPolicy(max_attempts=10, initial_backoff=0.01, max_backoff=0.1, deadline=60.0)
CONFIG = TransportConfig(
    max_workers=4,
    part_size=5 * MiB,  # the S3 minimum: the 6 MiB tensor's file is a two-part multipart upload
    max_request_bytes=1 * MiB,  # large reads become several ranged GETs
    retry=TOLERANT,
)


def sample_state() -> dict[str, torch.Tensor]:
    """About 9 MiB in six tensors of five dtypes, arbitrary bit patterns (NaN payloads, -0.0, ...)."""
    g = torch.Generator().manual_seed(7)

    def bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        width = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (*shape, width), generator=g, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)

    return {
        "big": bits((3 * MiB // 2,), torch.float32),  # 6 MiB
        "w1": bits((512, 512), torch.float32),
        "w2": bits((300, 700), torch.bfloat16),
        "b": bits((1000,), torch.float64),
        "idx": bits((256, 256), torch.int64),
        "h": bits((1024, 300), torch.float16),
    }


def assert_bit_exact(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for key, want in expected.items():
        got = loaded[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), key


def unwrap(exc: BaseException) -> BaseException:
    """The reader's/writer's own exception inside DCP's ``CheckpointException``."""
    if isinstance(exc, CheckpointException):
        (inner, _trace), *_ = exc.failures.values()
        return inner
    return exc


# Modes whose every fault reaches our retry layer. On writes, "slow" is not one of them: aiohttp's socket
# read timeout does not cover the wait for the response to a request with a body, so a held-back PUT
# response is merely slow (measured: a 1 s hold with read_timeout=0.5 s completes after 1 s).
ANSWERED_WRITES = ("slowdown_503", "error_500")
ANSWERED_READS = ("slowdown_503", "error_500", "slow")


def one_in_three(mode: str) -> list[FaultRule]:
    return [FaultRule(mode, every=3, delay=SLOW_DELAY)]  # type: ignore[arg-type]


def save_dcp(location: S3Location, state: dict[str, torch.Tensor], config: TransportConfig = CONFIG) -> Any:
    url, options = location
    writer = FsspecWriter(url, options, thread_count=3, overwrite=True, transport_config=config)
    dcp.save(state, storage_writer=writer)
    return writer


def load_dcp(location: S3Location, like: dict[str, torch.Tensor], config: TransportConfig = CONFIG) -> Any:
    url, options = location
    dest = {k: torch.zeros_like(v) for k, v in like.items()}
    reader = FsspecReader(url, options, transport_config=config)
    dcp.load(dest, storage_reader=reader)
    return dest, reader


def run_phase(proxy: FaultProxy, mode: str, phase: Any) -> Any:
    """Run ``phase()`` with 1 request in 3 faulted in ``mode``; return its result and the proxy's counters."""
    proxy.reset_counters()
    proxy.set_rules(one_in_three(mode))
    try:
        result = phase()
    finally:
        proxy.clear_rules()
    return result, proxy.counters()


# ------------------------------------------------------------------------------------ 1 in 3 faulted
@pytest.mark.parametrize("mode", FAULT_MODES)
def test_dcp_save_and_load_survive_one_in_three(
    mode: str, proxied_s3: S3Location, fault_proxy: FaultProxy, moto_server: Any
) -> None:
    state = sample_state()
    writer, saved = run_phase(fault_proxy, mode, lambda: save_dcp(proxied_s3, state))
    assert saved.faults[mode] > 0 and saved.total_faults == saved.faults[mode], saved.faults
    # aiohttp itself resends an idempotent request once when a reused connection dies before any response
    # (a reset, a truncated bodiless response), so not every such fault reaches our retry layer; every
    # error status and timeout does.
    if mode in ANSWERED_WRITES:
        assert writer.counters["retries"] >= saved.faults[mode], (writer.counters, saved.faults)

    (loaded, reader), read = run_phase(fault_proxy, mode, lambda: load_dcp(proxied_s3, state))
    assert read.faults[mode] > 0, read.faults
    if mode in ANSWERED_READS:
        assert reader.counters["retries"] >= read.faults[mode], (reader.counters, read.faults)
    elif mode == "truncate":  # a GET cut mid-body always surfaces (and resumes)
        assert reader.counters["retries"] > 0, reader.counters
    assert_bit_exact(loaded, state)

    bucket = proxied_s3.url.split("/")[2]
    pending = moto_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    if mode in ("slowdown_503", "error_500", "reset"):  # faulted requests never reached moto
        assert pending == [], pending


@pytest.mark.parametrize("mode", FAULT_MODES)
def test_safetensors_save_and_load_survive_one_in_three(
    mode: str, proxied_s3: S3Location, fault_proxy: FaultProxy
) -> None:
    state = sample_state()
    del state["big"]  # multipart uploads are covered above; 3 MiB in 5 tensors keeps this test fast
    url, options = proxied_s3

    def save() -> None:
        writer = SafetensorsWriter(url, options, max_shard_size=1 * MiB, overwrite=True, transport_config=CONFIG)
        dcp.save(state, storage_writer=writer)

    def load() -> dict[str, torch.Tensor]:
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(dest, storage_reader=SafetensorsReader(url, options, transport_config=CONFIG))
        return dest

    _, saved = run_phase(fault_proxy, mode, save)
    assert saved.faults[mode] > 0, saved.faults
    loaded, read = run_phase(fault_proxy, mode, load)
    assert read.faults[mode] > 0, read.faults
    assert_bit_exact(loaded, state)


# ------------------------------------------------------------------------------------ permanent faults
DEADLINE = 1.0
# The retry loop gives up before the deadline (the message's own "in X.Xs" is checked against it); the
# wall time around dcp.save/load also holds client start-up and planning, hence the slack.
SLACK = 3.0
IMPATIENT = RetryPolicy(max_attempts=1000, initial_backoff=0.02, max_backoff=0.2, deadline=DEADLINE)
FEW_ATTEMPTS = RetryPolicy(max_attempts=3, initial_backoff=0.02, max_backoff=0.05, deadline=30.0)
_GAVE_UP = re.compile(r"failed after (\d+) attempt\(s\) in (\d+\.\d)s")


def _config(policy: RetryPolicy) -> TransportConfig:
    return TransportConfig(max_workers=4, part_size=5 * MiB, max_request_bytes=1 * MiB, retry=policy)


def transport_error_text(exc: BaseException) -> str:
    """The TransportError message inside what DCP raised (read_metadata failures arrive as text)."""
    inner = unwrap(exc)
    text = str(inner)
    assert isinstance(inner, TransportError) or "failed after" in text, repr(inner)
    return text


def failing(proxy: FaultProxy, rules: list[FaultRule], action: Callable[[], Any]) -> tuple[str, float]:
    """Run ``action`` with ``rules`` installed (counters reset first); it must fail as DCP reports failures.

    Returns the transport error's text and the seconds until it surfaced. The rules are removed afterwards.
    """
    proxy.reset_counters()
    proxy.set_rules(rules)
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointException) as info:
            action()
    finally:
        proxy.clear_rules()
    return transport_error_text(info.value), time.monotonic() - started


def assert_data_read_gave_up(message: str, elapsed: float, url: str, proxy: FaultProxy, mode: str) -> None:
    """A permanently failing data read: the error names the operation, URL and range, and gave up at the
    deadline, in time, after as many attempts as the proxy faulted."""
    assert message.startswith(f"read {url}/__0_"), message  # operation and URL
    assert re.search(r"\.distcp bytes \[\d+, \d+\) failed after", message), message  # the range
    assert "gave up: deadline, 1s" in message, message
    attempts = assert_gave_up_in_time(message, elapsed)
    assert attempts >= 1 and proxy.counters().faults[mode] >= attempts


def assert_metadata_read_gave_up(message: str, url: str, proxy: FaultProxy) -> None:
    """A ``.metadata`` read under a permanent SlowDown with ``FEW_ATTEMPTS``: the error names the URL and
    the attempts, and one layer of retries sent exactly 3 requests into the fault."""
    assert f"read {url}/.metadata failed after 3 attempt(s)" in message, message
    assert "gave up: attempts, max_attempts=3" in message and "reduce your request rate" in message, message
    assert proxy.counters().faults["slowdown_503"] == 3


def assert_gave_up_in_time(message: str, elapsed: float) -> int:
    match = _GAVE_UP.search(message)
    assert match, message
    assert float(match.group(2)) <= DEADLINE, message
    assert elapsed < DEADLINE + SLACK, f"gave up after {elapsed:.1f}s, deadline {DEADLINE}s"
    return int(match.group(1))


@pytest.fixture(scope="module")
def saved_checkpoint(proxied_s3_module: S3Location) -> tuple[S3Location, dict[str, torch.Tensor]]:
    state = sample_state()
    save_dcp(proxied_s3_module, state)
    return proxied_s3_module, state


@pytest.mark.parametrize("mode", FAULT_MODES)
def test_permanent_fault_on_data_reads_fails_before_the_deadline(
    mode: str, saved_checkpoint: tuple[S3Location, dict[str, torch.Tensor]], fault_proxy: FaultProxy
) -> None:
    location, state = saved_checkpoint
    rules = [FaultRule(mode, method="GET", path=r"\.distcp$", delay=SLOW_DELAY)]  # type: ignore[arg-type]
    message, elapsed = failing(fault_proxy, rules, lambda: load_dcp(location, state, _config(IMPATIENT)))
    assert_data_read_gave_up(message, elapsed, location.url, fault_proxy, mode)


def test_permanent_fault_on_metadata_read_names_attempts(
    saved_checkpoint: tuple[S3Location, dict[str, torch.Tensor]], fault_proxy: FaultProxy
) -> None:
    location, state = saved_checkpoint
    rules = [FaultRule("slowdown_503", method="GET", path=r"/ckpt/\.metadata$")]
    message, _ = failing(fault_proxy, rules, lambda: load_dcp(location, state, _config(FEW_ATTEMPTS)))
    assert_metadata_read_gave_up(message, location.url, fault_proxy)  # not 3 x botocore's x s3fs's tries


@pytest.mark.parametrize(
    ("mode", "method", "query", "operation"),
    [
        ("slowdown_503", "PUT", r"partNumber=", r"upload part 1 \(5242880 bytes\) of"),
        ("reset", "PUT", r"partNumber=2", r"upload part 2 \(\d+ bytes\) of"),
        ("error_500", "POST", r"uploadId=", r"complete multipart upload \(2 parts, \d+ bytes\) of"),
    ],
)
def test_permanent_fault_on_save_fails_and_aborts_the_upload(
    mode: str,
    method: str,
    query: str,
    operation: str,
    proxied_s3: S3Location,
    fault_proxy: FaultProxy,
    moto_server: Any,
) -> None:
    state = {"big": sample_state()["big"]}  # one file of 6 MiB and a few hundred bytes: two parts
    fault_proxy.set_rules([FaultRule(mode, method=method, query=query)])  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        save_dcp(proxied_s3, state, _config(IMPATIENT))
    message = transport_error_text(info.value)
    assert re.match(operation, message) and f"{proxied_s3.url}/__0_0.distcp failed" in message, message
    assert_gave_up_in_time(message, time.monotonic() - started)

    bucket = proxied_s3.url.split("/")[2]
    client = moto_server.client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # aborted
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert "ckpt/__0_0.distcp" not in keys and "ckpt/.metadata" not in keys, keys


def test_completion_that_timed_out_but_happened_is_recognised(proxied_s3: S3Location, fault_proxy: FaultProxy) -> None:
    """Every CompleteMultipartUpload response comes too late, yet the store completed the upload."""
    state = {"big": sample_state()["big"]}
    fault_proxy.set_rules([FaultRule("slow", method="POST", query=r"uploadId=", delay=SLOW_DELAY)])
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.02, max_backoff=0.05, deadline=30.0)
    writer = save_dcp(proxied_s3, state, _config(policy))
    assert fault_proxy.counters().faults["slow"] >= 1
    fault_proxy.clear_rules()
    loaded, _ = load_dcp(proxied_s3, state)
    assert_bit_exact(loaded, state)
    assert writer.counters["retries"] >= 1


def test_permanent_fault_on_small_put_names_url_and_size(proxied_s3: S3Location, fault_proxy: FaultProxy) -> None:
    state = {"b": sample_state()["b"]}
    fault_proxy.set_rules([FaultRule("error_500", method="PUT", path=r"\.distcp$")])  # the data file, not the lock
    with pytest.raises(CheckpointException) as info:
        save_dcp(proxied_s3, state, _config(FEW_ATTEMPTS))
    message = transport_error_text(info.value)
    assert re.match(rf"write \(\d+ bytes\) {re.escape(proxied_s3.url)}/__0_0.distcp failed after 3 attempt", message)
    assert "internal error" in message, message
    assert fault_proxy.counters().faults["error_500"] == 3
