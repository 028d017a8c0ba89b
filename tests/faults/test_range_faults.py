"""A ranged read delivers exactly the bytes asked for, or fails: s3fs, gcsfs, adlfs and HTTP behind a proxy
that answers ranged GETs with other bytes than asked for.

The :class:`FaultProxy`'s range modes stand for a server or cache that mishandles ``Range``:
``ignore_range`` (``200`` and the whole object), ``shift_range`` (a ``206`` naming as many bytes, one byte
off) and ``short_range`` (a complete ``206`` with half the range). Without the checks of
:mod:`dcp_storage.transports.guards`, s3fs and gcsfs loads returned wrong tensor bytes without an error.
Here, for each backend: with every ranged data GET answered wrongly, a read and a ``dcp.load`` fail with a
:class:`TransportError` naming the URL, the range, what came back and the attempts; with 1 GET in 3
answered wrongly, the retries make the load bit-exact; a ``200`` to a range that was the whole object is
that object, and is used as it is (except on Azure, whose SDK cannot read one: refused, retried, failed).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage.errors import TransportError
from dcp_storage.formats.dcp_native.item_loader import DcpLoaderConfig
from dcp_storage.formats.dcp_native.reader import FsspecReader
from dcp_storage.formats.dcp_native.writer import FsspecWriter
from dcp_storage.transports import RangeRequest, RetryPolicy, TransportConfig, open_transport
from dcp_storage_testing.fault_proxy import BODY_FAULT_MODES, RANGE_FAULT_MODES, FaultProxy, FaultRule

from .test_gcs_faults import _proxied_bucket as proxied_gs_bucket
from .test_gcs_faults import gcs_proxy, gcs_server  # noqa: F401 - fixtures used by name below
from .test_s3_faults import assert_bit_exact, sample_state, unwrap

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KiB, MiB = 1024, 1024 * 1024
BLOB = bytes((i * 7 + 3) % 251 for i in range(100_000))
FEW_ATTEMPTS = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02, deadline=30.0)
TOLERANT = RetryPolicy(max_attempts=10, initial_backoff=0.01, max_backoff=0.05, deadline=60.0)


def _config(policy: RetryPolicy, coalesce_gap: int | None = None) -> TransportConfig:
    # 256 KiB requests: every data file is read in several parts, none of them the whole object
    return TransportConfig(
        max_workers=4, part_size=5 * MiB, max_request_bytes=256 * KiB, coalesce_gap=coalesce_gap, retry=policy
    )


class Store(NamedTuple):
    """A fresh location reached through ``proxy``; ``backend`` names it."""

    backend: str
    url: str
    options: dict[str, Any]
    proxy: FaultProxy


# ------------------------------------------------------------------------------------ fixtures
def _store(request: pytest.FixtureRequest, backend: str) -> Iterator[Store]:
    if backend == "s3":
        location = request.getfixturevalue("proxied_s3_module")
        yield Store(backend, location.url, location.storage_options, request.getfixturevalue("fault_proxy"))
    elif backend == "gs":
        proxy = request.getfixturevalue("gcs_proxy")
        with proxied_gs_bucket(request.getfixturevalue("gcs_server"), proxy) as location:
            yield Store(backend, location.url, location.storage_options, proxy)
    else:
        server, proxy = request.getfixturevalue("azurite"), request.getfixturevalue("az_proxy")
        container = server.create_container(server.unique_container_name("ranges"))
        options = server.sas_storage_options(via=proxy.url, skip_instance_cache=True, use_listings_cache=False)
        try:
            yield Store(backend, f"az://{container}/ckpt", options, proxy)
        finally:
            server.delete_container(container)


@pytest.fixture(scope="module", params=["s3", "gs", "az"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """One location per backend for the module: a DCP checkpoint (``/ckpt``) and small files beside it."""
    yield from _store(request, request.param)


@pytest.fixture
def proxy(store: Store) -> Iterator[FaultProxy]:
    store.proxy.clear_rules()
    store.proxy.reset_counters()
    yield store.proxy
    store.proxy.clear_rules()


def _state() -> dict[str, torch.Tensor]:
    state = sample_state()
    return {k: state[k] for k in ("w1", "w2", "b")}  # 1.4 MiB: 1 MiB float32, bf16, float64


@pytest.fixture(scope="module")
def saved(store: Store) -> tuple[Store, dict[str, torch.Tensor]]:
    store.proxy.clear_rules()
    state = _state()
    writer = FsspecWriter(store.url, store.options, thread_count=3, overwrite=True, transport_config=_config(TOLERANT))
    dcp.save(state, storage_writer=writer)
    return store, state


def _load(
    url: str, options: dict[str, Any], like: dict[str, torch.Tensor], policy: RetryPolicy, **reader_kw: Any
) -> Any:
    dest = {k: torch.zeros_like(v) for k, v in like.items()}
    reader = FsspecReader(url, options, transport_config=_config(policy), **reader_kw)
    dcp.load(dest, storage_reader=reader)
    return dest, reader


# ------------------------------------------------------------------------------------ what came back
_MESSAGE = re.compile(
    r"read (?P<url>\S+) bytes \[(?P<start>\d+), (?P<end>\d+)\) failed after (?P<attempts>\d+) attempt\(s\) .*"
    r"RangeMismatchError: asked for bytes \[(?P<a>\d+), (?P<b>\d+)\), got (?P<got>.*)",
    re.DOTALL,
)
_CONTENT_RANGE = re.compile(r"status 206, Content-Range 'bytes (\d+)-(\d+)/(\d+)', (\d+) bytes")


def assert_names_the_wrong_answer(message: str, mode: str, url: str, attempts: int) -> None:
    """The final error names the URL, the range, the attempts, and the answer as the mode shapes it."""
    found = _MESSAGE.search(message)
    assert found is not None, message
    assert found["url"].startswith(url) and int(found["attempts"]) == attempts, message
    start, end = int(found["a"]), int(found["b"])
    assert (start, end) == (int(found["start"]), int(found["end"])), message  # nothing of it was taken
    if mode == "ignore_range":
        assert found["got"].startswith("status 200, no Content-Range"), message
        return
    answer = _CONTENT_RANGE.match(found["got"])
    assert answer is not None, message
    first, last, length = int(answer[1]), int(answer[2]), int(answer[4])
    if mode == "shift_range":
        step = -1 if start > 0 else 1
        assert first == start + step and length == last - first + 1 <= end - start, message
    else:
        assert (first, last + 1, length) == (start, start + (end - start) // 2, (end - start) // 2), message


# ------------------------------------------------------------------------------------ transport level
@pytest.fixture
def blob(store: Store, proxy: FaultProxy) -> Iterator[tuple[Any, str]]:
    """A transport on ``store`` (few attempts) and the path of a 100,000-byte object written through it."""
    transport, path = open_transport(f"{store.url}-blob/blob", store.options, _config(FEW_ATTEMPTS))
    with transport:
        transport.write_file(path, BLOB)
        proxy.reset_counters()
        yield transport, path


@pytest.mark.parametrize("mode", RANGE_FAULT_MODES)
@pytest.mark.parametrize(("start", "end"), [(1000, 5000), (0, 5000)])
def test_a_wrong_answer_is_retried_then_a_transport_error(
    blob: tuple[Any, str], proxy: FaultProxy, store: Store, mode: str, start: int, end: int
) -> None:
    transport, path = blob
    proxy.set_rules([FaultRule(mode)])  # type: ignore[arg-type]
    with pytest.raises(TransportError) as info:
        transport.read_range(path, start, end)
    assert f"bytes [{start}, {end})" in str(info.value)
    assert_names_the_wrong_answer(str(info.value), mode, transport.url(path), attempts=3)
    assert proxy.counters().faults[mode] == 3 and transport.counters.retries == 2


def test_a_200_to_a_range_that_was_the_whole_object_is_used(
    blob: tuple[Any, str], proxy: FaultProxy, store: Store
) -> None:
    transport, path = blob
    proxy.set_rules([FaultRule("ignore_range")])
    if store.backend == "az":  # the Azure SDK needs Content-Range to learn the size: a 200 is refused
        with pytest.raises(TransportError, match="reads only 206 answers"):
            transport.read_range(path, 0, len(BLOB))
        return
    assert bytes(transport.read_range(path, 0, len(BLOB))) == BLOB
    assert proxy.counters().faults["ignore_range"] == 1 and transport.counters.retries == 0


# A 206 whose head names exactly the range asked for, with a body that is not those stored bytes: encoded
# (gzip; its Content-Length padded to the range's length) or longer than the range (chunked, no length).
# Before: the s3fs stream took the first bytes of either, aiohttp (HTTP, GCS) decoded the gzip into as many
# wrong bytes, and the obstore plugin's stream cut the encoded body to the range's length: wrong bytes, no
# error. A ranged answer must be the stored bytes themselves (no Content-Encoding) and end with the range.
_BODY_ANSWER = {
    "encoded_range": r"RangeMismatchError: asked for bytes \[{a}, {b}\), got status 206, .*Content-Encoding 'gzip'",
    # adlfs: the Azure SDK reads the body itself, and the transport's length check names what it got
    "long_range": r"RangeMismatchError: (asked for bytes \[{a}, {b}\), got a longer body|.*: got \d+ of {n} bytes)",
}


def assert_names_the_body_fault(message: str, mode: str, start: int, end: int, attempts: int) -> None:
    head = re.search(rf"bytes \[{start}, {end}\) failed after {attempts} attempt\(s\)", message)
    assert head is not None, message
    assert re.search(_BODY_ANSWER[mode].format(a=start, b=end, n=end - start), message), message


@pytest.mark.parametrize("mode", BODY_FAULT_MODES)
@pytest.mark.parametrize(("start", "end"), [(1000, 5000), (0, 5000), (7, 8)])
def test_a_ranged_answer_whose_body_is_not_the_stored_bytes_is_refused(
    blob: tuple[Any, str], proxy: FaultProxy, store: Store, mode: str, start: int, end: int
) -> None:
    transport, path = blob
    proxy.set_rules([FaultRule(mode)])  # type: ignore[arg-type]
    with pytest.raises(TransportError) as info:
        got = transport.read_range(path, start, end)
        pytest.fail(f"{mode}: read {len(got)} bytes, equal to the stored ones: {bytes(got) == BLOB[start:end]}")
    assert_names_the_body_fault(str(info.value), mode, start, end, attempts=3)
    assert proxy.counters().faults[mode] == 3


# ------------------------------------------------------------------------------------ dcp.load
@pytest.mark.parametrize("mode", RANGE_FAULT_MODES)
def test_load_fails_when_every_ranged_read_is_answered_wrongly(
    saved: tuple[Store, dict[str, torch.Tensor]], proxy: FaultProxy, mode: str
) -> None:
    store, state = saved
    proxy.set_rules([FaultRule(mode, method="GET", path=r"\.distcp$")])  # type: ignore[arg-type]
    with pytest.raises(CheckpointException) as info:
        _load(store.url, store.options, state, FEW_ATTEMPTS)
    inner = unwrap(info.value)
    assert isinstance(inner, TransportError), repr(inner)
    assert_names_the_wrong_answer(str(inner), mode, f"{store.url}/__", attempts=3)
    assert proxy.counters().faults[mode] >= 3


@pytest.mark.parametrize("mode", RANGE_FAULT_MODES)
def test_load_is_bit_exact_when_one_ranged_read_in_three_is_answered_wrongly(
    saved: tuple[Store, dict[str, torch.Tensor]], proxy: FaultProxy, mode: str
) -> None:
    store, state = saved
    # Every record probed, none fetched whole: a request for a whole object (one record per file here) is
    # rightly answered by a 200 that ignores its range, which would need no retry. So no layout is guessed
    # either: the header and data of a file's one record would be one request for the whole object. The
    # smallest file (one 9,577-byte record) is still read whole once probed; its requests are not faulted
    # (which of the concurrent requests came third decided whether its read was, and then needed no retry).
    proxy.set_rules([FaultRule(mode, every=3, method="GET", path=r"__0_[01]\.distcp$")])  # type: ignore[arg-type]
    config = DcpLoaderConfig(small_item_bytes=0, guess_layouts=False)
    loaded, reader = _load(store.url, store.options, state, TOLERANT, loader_config=config)
    assert_bit_exact(loaded, state)
    faults = proxy.counters().faults[mode]
    assert faults > 0 and reader.counters["retries"] >= faults, (faults, reader.counters)


def test_load_of_whole_objects_answered_200_is_bit_exact(store: Store, proxy: FaultProxy) -> None:
    """One small tensor per file: each file is read whole, so a store that ignores Range still loads."""
    state = {f"t{i}": torch.arange(300, dtype=torch.float32) * (i + 1) for i in range(3)}
    url = f"{store.url}-small"
    writer = FsspecWriter(url, store.options, thread_count=3, overwrite=True, transport_config=_config(TOLERANT))
    dcp.save(state, storage_writer=writer)
    proxy.reset_counters()
    proxy.set_rules([FaultRule("ignore_range", method="GET")])
    if store.backend == "az":  # see test_a_200_to_a_range_that_was_the_whole_object_is_used
        with pytest.raises(CheckpointException, match="reads only 206 answers"):
            _load(url, store.options, state, FEW_ATTEMPTS)
        return
    loaded, reader = _load(url, store.options, state, FEW_ATTEMPTS)
    assert_bit_exact(loaded, state)
    assert proxy.counters().faults["ignore_range"] >= 1 and reader.counters["retries"] == 0


# ------------------------------------------------------------------------------------ http(s)://
@pytest.fixture
def http_url(proxied_s3: Any, fault_proxy: FaultProxy, moto_server: Any) -> str:
    """The 100,000-byte object on moto, public, as a plain HTTP URL through the proxy."""
    s3, path = open_transport(f"{proxied_s3.url}/blob", proxied_s3.storage_options)
    with s3:
        s3.write_file(path, BLOB)
    bucket, key = path.split("/", 1)
    moto_server.client().put_object_acl(Bucket=bucket, Key=key, ACL="public-read")
    fault_proxy.reset_counters()
    return f"{fault_proxy.url}/{path}"


def _http(url: str, policy: RetryPolicy) -> Any:
    """fsspec's HTTP filesystem under our transport, one GET per range."""
    transport, path = open_transport(url, {"skip_instance_cache": True}, _config(policy, coalesce_gap=0))
    assert path == url
    return transport


@pytest.mark.parametrize("mode", RANGE_FAULT_MODES)
def test_http_wrong_answer_is_retried_then_a_transport_error(http_url: str, fault_proxy: FaultProxy, mode: str) -> None:
    fault_proxy.set_rules([FaultRule(mode)])  # type: ignore[arg-type]
    with _http(http_url, FEW_ATTEMPTS) as transport, pytest.raises(TransportError) as info:
        transport.read_range(http_url, 1000, 5000)
    assert_names_the_wrong_answer(str(info.value), mode, http_url, attempts=3)
    assert fault_proxy.counters().faults[mode] == 3


@pytest.mark.parametrize("mode", BODY_FAULT_MODES)
@pytest.mark.parametrize(("start", "end"), [(1000, 5000), (7, 8)])
def test_http_ranged_answer_whose_body_is_not_the_stored_bytes_is_refused(
    http_url: str, fault_proxy: FaultProxy, mode: str, start: int, end: int
) -> None:
    fault_proxy.set_rules([FaultRule(mode)])  # type: ignore[arg-type]
    with _http(http_url, FEW_ATTEMPTS) as transport, pytest.raises(TransportError) as info:
        got = transport.read_range(http_url, start, end)
        pytest.fail(f"{mode}: read {len(got)} bytes, equal to the stored ones: {bytes(got) == BLOB[start:end]}")
    assert_names_the_body_fault(str(info.value), mode, start, end, attempts=3)
    assert fault_proxy.counters().faults[mode] == 3


def test_http_200_to_a_whole_object_range_is_used_and_one_wrong_answer_in_three_retried(
    http_url: str, fault_proxy: FaultProxy
) -> None:
    fault_proxy.set_rules([FaultRule("ignore_range")])
    with _http(http_url, TOLERANT) as transport:
        assert bytes(transport.read_range(http_url, 0, len(BLOB))) == BLOB
        assert transport.counters.retries == 0
        spans = [(s, s + 3000) for s in range(0, 90_000, 9000)]
        for mode in RANGE_FAULT_MODES:
            fault_proxy.set_rules([FaultRule(mode, every=3)])  # type: ignore[arg-type]
            got = transport.read_ranges([RangeRequest(http_url, s, e) for s, e in spans])
            assert [bytes(g) for g in got] == [BLOB[s:e] for s, e in spans], mode  # type: ignore[arg-type]
        assert transport.counters.retries >= len(RANGE_FAULT_MODES) * (len(spans) // 3)
