"""DCP save/load through the obstore transport survive a store that fails 1 request in 3, in every mode.

A :class:`FaultProxy` in front of moto: ``dcp.save``/``dcp.load`` with ``{"transport": "obstore"}`` bit for
bit (a 6 MiB file is a two-part multipart upload; large reads become several ranged GETs), with faults of
that mode injected in both phases. A store that never recovers yields a :class:`TransportError` naming the
URL and operation before the policy's deadline, and a failed multipart upload is aborted.

Reads are retried by the core's policy (obstore's own retries off). A write is spooled and sent by one
``obstore.put`` that the core's policy retries as a whole; inside it obstore resends a failed part itself.
obstore 0.12 does not retry a request whose response body was cut off (a truncated answer to
CreateMultipartUpload or CompleteMultipartUpload): the whole put is then retried by our layer and the save
still finishes. The upload whose id never reached the client is left pending (nobody can abort it; an S3
lifecycle rule for incomplete uploads removes it), which the last test shows.
"""

from __future__ import annotations

import re
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.plugin_api import RetryPolicy, TransportConfig, TransportError
from dcp_storage_testing.fault_proxy import FAULT_MODES, FaultProxy, FaultRule
from torch.distributed.checkpoint.api import CheckpointException

MiB = 1024 * 1024
SLOW_DELAY = 1.0
# object_store's whole-request timeout: a held-back response (SLOW_DELAY) times out; a 5 MiB part through
# the proxy on a busy 2-core machine finishes well within it.
REQUEST_TIMEOUT = "0.6s"
TOLERANT = RetryPolicy(max_attempts=10, initial_backoff=0.01, max_backoff=0.1, deadline=60.0)
DEADLINE = 2.0
IMPATIENT = RetryPolicy(max_attempts=1000, initial_backoff=0.02, max_backoff=0.2, deadline=DEADLINE)
SLACK = 3.0


def _config(policy: RetryPolicy) -> TransportConfig:
    return TransportConfig(max_workers=4, part_size=5 * MiB, max_request_bytes=1 * MiB, retry=policy)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)

    def bits(n: int, dtype: torch.dtype) -> torch.Tensor:
        width = torch.empty((), dtype=dtype).element_size()
        return torch.randint(0, 256, (n, width), generator=g, dtype=torch.uint8).view(dtype).reshape(n)

    return {"big": bits(3 * MiB // 2, torch.float32), "w": bits(200_000, torch.bfloat16), "b": bits(999, torch.int64)}


def _options(s3_url: Any, proxy: FaultProxy) -> dict[str, Any]:
    _url, options = s3_url
    return {
        **options,
        "client_kwargs": {"endpoint_url": proxy.url},
        "transport": "obstore",
        "obstore": {"client_options": {"timeout": REQUEST_TIMEOUT, "connect_timeout": "2s"}},
    }


def _save(url: str, options: dict[str, Any], state: dict[str, torch.Tensor], policy: RetryPolicy) -> Any:
    writer = FsspecWriter(url, options, thread_count=2, overwrite=True, transport_config=_config(policy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def _load(
    url: str, options: dict[str, Any], like: dict[str, torch.Tensor], policy: RetryPolicy, loader_config: Any = None
) -> Any:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    reader = FsspecReader(url, options, transport_config=_config(policy), loader_config=loader_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out, reader


def _inner(exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointException):
        (inner, _trace), *_ = exc.failures.values()
        return inner
    return exc


def _pending_uploads(moto_server: Any, url: str) -> list[Any]:
    return moto_server.client().list_multipart_uploads(Bucket=url.split("/")[2]).get("Uploads", [])


@pytest.mark.parametrize("mode", FAULT_MODES)
def test_save_and_load_survive_one_in_three(mode: str, s3_url: Any, faults: FaultProxy, moto_server: Any) -> None:
    url, _ = s3_url
    options = _options(s3_url, faults)
    state = _state()
    faults.set_rules([FaultRule(mode, every=3, delay=SLOW_DELAY)])  # type: ignore[arg-type]
    _save(url, options, state, TOLERANT)
    saved = faults.counters()
    faults.reset_counters()
    faults.set_rules([FaultRule(mode, every=3, delay=SLOW_DELAY)])  # type: ignore[arg-type]
    loaded, reader = _load(url, options, state, TOLERANT)
    read = faults.counters()
    faults.clear_rules()
    assert saved.faults[mode] > 0 and saved.total_faults == saved.faults[mode], saved.faults
    assert read.faults[mode] > 0, read.faults
    if mode != "reset":  # every answered fault and every cut body reaches the core's retry layer
        assert reader.counters["retries"] >= 1, reader.counters
    for key, want in state.items():
        assert torch.equal(loaded[key].view(torch.uint8), want.view(torch.uint8)), key
    if mode in ("slowdown_503", "error_500", "reset"):  # faulted requests never reached moto
        assert _pending_uploads(moto_server, url) == []


@pytest.mark.parametrize("mode", FAULT_MODES)
def test_permanent_fault_on_reads_fails_before_the_deadline(mode: str, s3_url: Any, faults: FaultProxy) -> None:
    url, _ = s3_url
    options = _options(s3_url, faults)
    state = _state()
    _save(url, options, state, TOLERANT)
    faults.set_rules([FaultRule(mode, method="GET", path=r"\.distcp$", delay=SLOW_DELAY)])  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        _load(url, options, state, IMPATIENT)
    elapsed = time.monotonic() - started
    message = str(_inner(info.value))
    assert isinstance(_inner(info.value), TransportError), repr(_inner(info.value))
    assert re.match(rf"read {re.escape(url)}/__\d_\d\.distcp bytes \[\d+, \d+\) failed after (\d+) attempt", message)
    assert "gave up: deadline" in message, message
    assert elapsed < DEADLINE + SLACK, f"gave up after {elapsed:.1f}s, deadline {DEADLINE}s"


@pytest.mark.parametrize(
    ("mode", "method", "query"),
    [
        ("slowdown_503", "PUT", r"partNumber=2"),
        ("reset", "PUT", r"partNumber="),
        ("error_500", "POST", r"uploadId="),
    ],
)
def test_permanent_fault_on_multipart_save_fails_in_time_and_aborts(
    mode: str, method: str, query: str, s3_url: Any, faults: FaultProxy, moto_server: Any
) -> None:
    url, _ = s3_url
    options = _options(s3_url, faults)
    faults.set_rules([FaultRule(mode, method=method, query=query)])  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        _save(url, options, {"big": _state()["big"]}, IMPATIENT)
    elapsed = time.monotonic() - started
    faults.clear_rules()
    inner = _inner(info.value)
    message = str(inner)
    assert isinstance(inner, TransportError), repr(inner)
    assert message.startswith("write (") and f"{url}/__0_0.distcp failed" in message, message
    assert elapsed < DEADLINE + SLACK, f"gave up after {elapsed:.1f}s, deadline {DEADLINE}s"
    assert faults.counters().faults[mode] >= 1
    assert _pending_uploads(moto_server, url) == []  # aborted
    keys = [o["Key"] for o in moto_server.client().list_objects_v2(Bucket=url.split("/")[2]).get("Contents", [])]
    assert "ckpt/__0_0.distcp" not in keys and "ckpt/.metadata" not in keys, keys


def test_truncated_create_multipart_answer_is_retried_and_the_save_finishes(
    s3_url: Any, faults: FaultProxy, moto_server: Any
) -> None:
    """obstore does not retry a cut-off CreateMultipartUpload answer; our retry of the whole put does."""
    url, _ = s3_url
    options = _options(s3_url, faults)
    state = {"big": _state()["big"]}
    faults.set_rules([FaultRule("truncate", method="POST", query=r"^uploads=?$", limit=1)])
    _save(url, options, state, TOLERANT)
    assert faults.counters().faults["truncate"] == 1
    faults.clear_rules()
    loaded, _reader = _load(url, options, state, TOLERANT)
    assert torch.equal(loaded["big"].view(torch.uint8), state["big"].view(torch.uint8))
    # The first upload's id was cut off with the answer: it stays pending until a lifecycle rule removes it.
    assert len(_pending_uploads(moto_server, url)) <= 1


def test_truncated_complete_multipart_answer_still_counts_as_written(
    s3_url: Any, faults: FaultProxy, moto_server: Any
) -> None:
    """The store completed the upload but its answer was cut off: obstore retries the completion, the store
    no longer knows the upload (NoSuchUpload, a not-found), yet the object is there, whole. The save must
    see that, not fail with "no such file"."""
    url, _ = s3_url
    options = _options(s3_url, faults)
    state = {"big": _state()["big"]}
    faults.set_rules([FaultRule("truncate", method="POST", query=r"uploadId=", limit=1)])
    _save(url, options, state, TOLERANT)
    assert faults.counters().faults["truncate"] == 1
    faults.clear_rules()
    loaded, _reader = _load(url, options, state, TOLERANT)
    assert torch.equal(loaded["big"].view(torch.uint8), state["big"].view(torch.uint8))
    assert _pending_uploads(moto_server, url) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["slow", "stall_body"])
def test_a_stalled_read_fails_at_the_deadline_with_the_default_client_timeout(
    mode: str, s3_url: Any, faults: FaultProxy
) -> None:
    """A server that holds back its headers, or stops in mid-body, raises no error: the request lasts as long
    as object_store's whole-request timeout, 300 s by default here. The policy's deadline bounds it when the
    user set no timeout of their own."""
    url, _ = s3_url
    options = {k: v for k, v in _options(s3_url, faults).items() if k != "obstore"}  # default client options
    state = _state()
    _save(url, options, state, TOLERANT)
    faults.set_rules([FaultRule(mode, method="GET", path=r"\.distcp$", delay=120.0)])  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        _load(url, options, state, IMPATIENT)
    elapsed = time.monotonic() - started
    faults.clear_rules()
    inner = _inner(info.value)
    assert isinstance(inner, TransportError), repr(inner)
    assert re.search(rf"{re.escape(url)}/__\d_\d\.distcp .*gave up: deadline", str(inner)), str(inner)
    assert elapsed < DEADLINE + SLACK, f"gave up after {elapsed:.1f}s, deadline {DEADLINE}s"
