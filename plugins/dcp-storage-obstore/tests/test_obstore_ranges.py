"""A ranged read through the obstore transport delivers exactly the bytes asked for, or fails.

A :class:`FaultProxy` in front of moto answers ranged GETs with other bytes than asked for (its range
modes: ``ignore_range``, a ``200`` with the whole object; ``shift_range``, a ``206`` naming as many bytes
one byte off; ``short_range``, a complete ``206`` with half the range). object_store refuses each of these;
before this transport turned its refusal into a retried mismatch, one wrong answer failed the load at once,
and a ``200`` to a range that was the whole object (a small file read whole) failed too. Now: answered
wrongly every time, a read and a ``dcp.load`` fail with a :class:`TransportError` naming the URL, the range,
what came back and the attempts; 1 GET in 3 answered wrongly is retried and the load is bit-exact; a
``200`` to a whole-object range is used.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dcp_storage.plugin_api import DcpLoaderConfig, RetryPolicy, TransportError, open_transport
from dcp_storage_testing.fault_proxy import BODY_FAULT_MODES, RANGE_FAULT_MODES, FaultProxy, FaultRule
from test_obstore_faults import _config, _inner, _load, _options, _save
from torch.distributed.checkpoint.api import CheckpointException

BLOB = bytes((i * 7 + 3) % 251 for i in range(100_000))
FEW_ATTEMPTS = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02, deadline=30.0)
TOLERANT = RetryPolicy(max_attempts=10, initial_backoff=0.01, max_backoff=0.05, deadline=60.0)
_GAVE_UP = re.compile(
    r"read (?P<url>\S+) bytes \[(?P<start>\d+), (?P<end>\d+)\) failed after 3 attempt\(s\) .*"
    r"RangeMismatchError: asked for bytes \[(?P<a>\d+), (?P<b>\d+)\), got (?P<got>.*)",
    re.DOTALL,
)


def assert_names_the_wrong_answer(message: str, mode: str, url: str) -> None:
    """URL, range and attempts, and the answer object_store saw, as the mode shapes it."""
    found = _GAVE_UP.search(message)
    assert found is not None and found["url"].startswith(url), message
    start, end = int(found["a"]), int(found["b"])
    assert (start, end) == (int(found["start"]), int(found["end"])), message
    if mode == "ignore_range":
        expected = "status 200 (Range ignored)" if start == 0 else "Received non-partial response"
        assert expected in found["got"], message
        return
    answer = re.search(rf"Requested {start}\.\.{end}, got (\d+)\.\.(\d+)", found["got"])
    assert answer is not None, message
    first, stop = int(answer[1]), int(answer[2])
    if mode == "shift_range":  # one byte off: up from 0, where the end may be the object's
        step = -1 if start > 0 else 1
        assert first == start + step and stop in (end + step, end), message
    else:
        assert (first, stop) == (start, start + (end - start) // 2), message


@pytest.fixture
def blob(s3_url: Any, faults: FaultProxy) -> Iterator[tuple[Any, str]]:
    """An obstore transport through the proxy (3 attempts) and the path of a 100,000-byte object."""
    url, _ = s3_url
    transport, path = open_transport(f"{url}/blob", _options(s3_url, faults), _config(FEW_ATTEMPTS))
    with transport:
        transport.write_file(path, BLOB)
        faults.reset_counters()
        yield transport, path


@pytest.mark.parametrize("mode", RANGE_FAULT_MODES)
@pytest.mark.parametrize(("start", "end"), [(1000, 5000), (0, 5000)])
def test_a_wrong_answer_is_retried_then_a_transport_error(
    blob: tuple[Any, str], faults: FaultProxy, mode: str, start: int, end: int
) -> None:
    transport, path = blob
    faults.set_rules([FaultRule(mode)])  # type: ignore[arg-type]
    with pytest.raises(TransportError) as info:
        transport.read_range(path, start, end)
    assert_names_the_wrong_answer(str(info.value), mode, transport.url(path))
    assert faults.counters().faults[mode] == 3 and transport.counters.retries == 2


def test_a_200_to_a_range_that_was_the_whole_object_is_used(blob: tuple[Any, str], faults: FaultProxy) -> None:
    transport, path = blob
    faults.set_rules([FaultRule("ignore_range")])
    assert bytes(transport.read_range(path, 0, len(BLOB))) == BLOB
    assert faults.counters().faults["ignore_range"] == 1 and transport.counters.retries == 0


# The proxy keeps the store's 206 head (its Content-Range the range asked for) and changes the body: gzip
# with Content-Encoding (padded to the range's length), or a chunked body longer than the range. Before, the
# stream was cut to the range's length: the gzip bytes were taken as the object's, without an error.
_BODY_ANSWER = {
    "encoded_range": r"got status 206, Content-Encoding 'gzip'",
    "long_range": r"Content-Length Header missing|got a longer body",  # object_store wants a length
}


@pytest.mark.parametrize("mode", BODY_FAULT_MODES)
@pytest.mark.parametrize(("start", "end"), [(1000, 5000), (0, 5000), (7, 8)])
def test_a_ranged_answer_whose_body_is_not_the_stored_bytes_is_refused(
    blob: tuple[Any, str], faults: FaultProxy, mode: str, start: int, end: int
) -> None:
    transport, path = blob
    faults.set_rules([FaultRule(mode)])  # type: ignore[arg-type]
    with pytest.raises(TransportError) as info:
        got = transport.read_range(path, start, end)
        pytest.fail(f"{mode}: read {len(got)} bytes, equal to the stored ones: {bytes(got) == BLOB[start:end]}")
    message = str(info.value)
    assert f"{transport.url(path)} bytes [{start}, {end})" in message, message
    assert re.search(_BODY_ANSWER[mode], message), message
    assert faults.counters().faults[mode] >= 1


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randint(0, 256, (300_000, 4), generator=g, dtype=torch.uint8).view(torch.float32).reshape(-1),
        "b": torch.randint(0, 256, (999, 8), generator=g, dtype=torch.uint8).view(torch.int64).reshape(-1),
    }


@pytest.mark.parametrize("mode", RANGE_FAULT_MODES)
def test_load_fails_when_every_ranged_read_is_answered_wrongly(s3_url: Any, faults: FaultProxy, mode: str) -> None:
    url, _ = s3_url
    options, state = _options(s3_url, faults), _state()
    _save(url, options, state, TOLERANT)
    faults.set_rules([FaultRule(mode, method="GET", path=r"\.distcp$")])  # type: ignore[arg-type]
    with pytest.raises(CheckpointException) as info:
        _load(url, options, state, FEW_ATTEMPTS)
    inner = _inner(info.value)
    assert isinstance(inner, TransportError), repr(inner)
    assert_names_the_wrong_answer(str(inner), mode, f"{url}/__")


@pytest.mark.parametrize("mode", RANGE_FAULT_MODES)
def test_load_is_bit_exact_when_one_ranged_read_in_three_is_answered_wrongly(
    s3_url: Any, faults: FaultProxy, mode: str
) -> None:
    url, _ = s3_url
    options, state = _options(s3_url, faults), _state()
    _save(url, options, state, TOLERANT)
    faults.set_rules([FaultRule(mode, every=3, method="GET")])  # type: ignore[arg-type]
    # Headers probed first, so no request spans a whole object (one record per file here): a 200 that ignores
    # the range would rightly answer one, and need no retry.
    loaded, reader = _load(url, options, state, TOLERANT, DcpLoaderConfig(guess_layouts=False))
    for key, want in state.items():
        assert torch.equal(loaded[key].view(torch.uint8), want.view(torch.uint8)), key
    fired = faults.counters().faults[mode]
    assert fired > 0 and reader.counters["retries"] >= 1, (fired, reader.counters)


def test_load_of_whole_objects_answered_200_is_bit_exact(s3_url: Any, faults: FaultProxy) -> None:
    """One small tensor per file: each file is read whole, so a store that ignores Range still loads."""
    url, _ = s3_url
    options = _options(s3_url, faults)
    state = {f"t{i}": torch.arange(300, dtype=torch.float32) * (i + 1) for i in range(2)}
    _save(url, options, state, TOLERANT)
    faults.set_rules([FaultRule("ignore_range", method="GET")])
    loaded, reader = _load(url, options, state, FEW_ATTEMPTS)
    for key, want in state.items():
        assert torch.equal(loaded[key], want), key
    assert faults.counters().faults["ignore_range"] >= 1 and reader.counters["retries"] == 0
