"""Direct S3 ranged GETs (:func:`dcp_storage.transports.s3.direct_range`), on moto: the bytes land in place
through the worker thread's own connection, every error is the one the aiobotocore path raises, and the path
is left to aiobotocore where its client would not send the request alone (a proxy, the client's own retries)
or the switch is off."""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import dcp_storage.transports.guards as guards
import dcp_storage.transports.s3 as s3_module
from dcp_storage.errors import CheckpointNotFoundError, FileTooLargeError, ObjectChangedError, TransportError
from dcp_storage.transports import FsspecTransport, RangeRequest, RetryPolicy, TransportConfig
from dcp_storage.transports.s3_stream import ScatterSink, client_ready

SIZE = 3 << 20
BLOB = random.Random(7).randbytes(SIZE)
CONFIG = TransportConfig(retry=RetryPolicy(max_attempts=3, initial_backoff=0.01, deadline=30.0))


@pytest.fixture
def blob(s3_url: Any) -> Iterator[tuple[Any, str, str, dict[str, Any]]]:
    """``(transport, path of a 3 MiB object, url, storage options)``."""
    url, options = s3_url
    transport, root = FsspecTransport.from_url(url, options, CONFIG)
    with transport:
        path = transport.join(root, "blob")
        transport.write_file(path, BLOB)
        transport.begin_load()
        yield transport, path, url, options


def _no_aiobotocore_reads(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Make aiobotocore's reads (ranges, whole objects, sizes) fail the test; list what the direct ones got."""
    answered: list[object] = []

    def counted(direct: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            got = direct(*args, **kwargs)
            if got is not None:
                answered.append(got)
            return got

        return call

    def refused(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a read went through aiobotocore")

    for name in ("direct_range", "direct_object", "direct_head"):
        monkeypatch.setattr(s3_module, name, counted(getattr(s3_module, name)))
    for name in ("stream_range", "read_object_version", "s3_size_version"):
        monkeypatch.setattr(s3_module, name, refused)
    return answered


def test_ranges_land_in_place_through_the_direct_path(blob: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    transport, path, _, _ = blob
    answered = _no_aiobotocore_reads(monkeypatch)
    rng = random.Random(3)
    spans = sorted({(a, a + rng.randint(1, 200_000)) for a in (rng.randrange(SIZE - 200_000) for _ in range(40))})
    got = transport.read_ranges([RangeRequest(path, a, b) for a, b in spans])  # coalesced, gaps dropped
    assert [bytes(g) for g in got] == [BLOB[a:b] for a, b in spans]  # type: ignore[arg-type]
    assert bytes(transport.read_range(path, 0, SIZE)) == BLOB
    assert answered and transport.counters.retries == 0


def test_whole_objects_and_sizes_are_read_directly(blob: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    transport, path, _, _ = blob
    answered = _no_aiobotocore_reads(monkeypatch)
    small = transport.join(path.rsplit("/", 1)[0], "small")
    transport.write_file(small, BLOB[:1000])
    assert bytes(transport.read_file(small)) == BLOB[:1000]
    assert transport.size(path) == SIZE
    with pytest.raises(FileTooLargeError) as info:  # refused from the answer's length, the body unread
        transport.read_file(path, max_bytes=SIZE - 1)
    assert "blob" in str(info.value)
    assert len(answered) == 2 and transport.counters.bytes_read < 2000


@pytest.mark.parametrize("direct", ["1", "0"])
def test_errors_are_the_ones_the_aiobotocore_path_raises(
    s3_url: Any, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """The same error, message and request count either way: a missing object (permanent, one request), an
    object replaced after its version was pinned (a refused ``If-Match``, never retried)."""
    monkeypatch.setenv(s3_module.DIRECT_ENV, direct)
    url, options = s3_url
    transport, root = FsspecTransport.from_url(url, options, CONFIG)
    with transport:
        missing = transport.join(root, "missing")
        with pytest.raises(CheckpointNotFoundError, match="missing"):
            transport.read_range(missing, 0, 10)
        with pytest.raises(CheckpointNotFoundError, match="missing"):
            transport.read_file(missing)
        with pytest.raises(CheckpointNotFoundError, match="missing"):
            transport.size(missing)
        assert transport.counters.retries == 0, transport.counters  # permanent: one attempt each
        path = transport.join(root, "blob")
        transport.write_file(path, BLOB)
        transport.begin_load()
        assert bytes(transport.read_range(path, 0, 100)) == BLOB[:100]  # pins the version
        writer, _ = FsspecTransport.from_url(url, options, CONFIG)
        with writer:
            writer.write_file(path, BLOB[::-1])  # another process replaces it
        with pytest.raises(ObjectChangedError, match="changed during the load"):
            transport.read_range(path, 100, 200)
        assert transport.counters.retries == 0


@pytest.mark.parametrize(
    "extra",
    [
        {"config_kwargs": {"proxies": {"http": "http://127.0.0.1:9", "https": "http://127.0.0.1:9"}}},
        {"config_kwargs": {"retries": {"max_attempts": 4}}},
    ],
    ids=["proxy", "client_retries"],
)
def test_a_client_that_would_not_send_alone_keeps_the_aiobotocore_path(s3_url: Any, extra: dict[str, Any]) -> None:
    url, options = s3_url
    config_kwargs = {**options.get("config_kwargs", {}), **extra["config_kwargs"]}
    transport, _ = FsspecTransport.from_url(url, {**options, "config_kwargs": config_kwargs}, CONFIG)
    with transport:
        client_ready(transport.fs)
        assert s3_module._state(transport.fs).usable is False


def test_per_request_options_are_in_the_direct_request(s3_url: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request is the client's own: s3fs's per-request options (``requester_pays`` here) are serialised
    and signed into it by botocore, as on the other path."""
    url, options = s3_url
    sent: list[dict[str, Any]] = []
    send = s3_module._send

    def recorded(*args: Any) -> Any:
        sent.append(args[4])  # the headers
        return send(*args)

    monkeypatch.setattr(s3_module, "_send", recorded)
    transport, root = FsspecTransport.from_url(url, {**options, "requester_pays": True}, CONFIG)
    with transport:
        path = transport.join(root, "blob")
        transport.write_file(path, BLOB[:5000])
        assert bytes(transport.read_range(path, 10, 20)) == BLOB[10:20]
    assert sent and all(h.get("x-amz-request-payer") == b"requester" for h in sent), sent
    assert all(h.get("Authorization", b"").startswith(b"AWS4-HMAC-SHA256") for h in sent)  # the client's SigV4


def test_a_forked_child_gets_a_connection_of_its_own(blob: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's kept-alive socket is not a forked child's to use (each would read the other's answers):
    a connection is this process's only."""
    transport, path, _, _ = blob
    assert bytes(transport.read_range(path, 0, 1000)) == BLOB[:1000]
    parts = s3_module.urllib.parse.urlsplit(transport.fs._s3._endpoint.host)
    state = s3_module._state(transport.fs)
    parent, _ = s3_module._connection(state, parts)
    assert s3_module._connection(state, parts) == (parent, True)  # kept for this thread's next request
    monkeypatch.setattr(s3_module.os, "getpid", lambda: -1)  # as in a child after fork
    child, reused = s3_module._connection(state, parts)
    assert child is not parent and not reused
    monkeypatch.undo()
    assert bytes(transport.read_range(path, 1000, 2000)) == BLOB[1000:2000]


@pytest.mark.parametrize("seed", range(20))
def test_scatter_sink_fill_reads_into_the_segments(seed: int) -> None:
    """``fill`` puts each byte of a body read in random short reads where ``write`` would, from any start,
    reports every position reached, and stops where a short body ends."""
    rng = random.Random(seed)
    total = rng.randint(1, 300_000)
    source = rng.randbytes(total)
    cuts = sorted(rng.sample(range(total + 1), k=min(total + 1, 2 * rng.randint(1, 8))))
    segments = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2) if cuts[i] < cuts[i + 1]]
    buffers = [bytearray(hi - lo) for lo, hi in segments]
    sink = ScatterSink([(lo, hi, memoryview(buf)) for (lo, hi), buf in zip(segments, buffers)])
    start = rng.randrange(total)
    body_end = total if rng.random() < 0.7 else rng.randint(start, total)
    pos = start
    reached: list[int] = []

    def readinto(view: memoryview) -> int:
        nonlocal pos
        n = min(view.nbytes, rng.randint(1, 90_000), body_end - pos)
        view[:n] = source[pos : pos + n]
        pos += n
        return n

    assert sink.fill(start, total, readinto, reached.append) == body_end
    assert reached == sorted(reached) and (not reached or reached[-1] == body_end)
    for (lo, hi), buf in zip(segments, buffers):
        a, b = max(lo, start), min(hi, body_end)
        if a < b:
            assert bytes(buf[a - lo : b - lo]) == source[a:b]


class _Answer:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers

    def getheader(self, name: str) -> str | None:
        return self.headers.get(name)


def test_a_whole_object_is_checked_against_the_checksum_its_answer_names() -> None:
    """As botocore checks the bodies of the GETs it sends with ``x-amz-checksum-mode``."""
    import base64
    import zlib

    from botocore.exceptions import FlexibleChecksumError

    body = BLOB[:5000]
    right = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
    guards.check_object_checksum(_Answer({"x-amz-checksum-crc32": right}), body)  # type: ignore[arg-type]
    guards.check_object_checksum(_Answer({"x-amz-checksum-crc32": "AAAAAA==-3"}), body)  # type: ignore[arg-type]
    guards.check_object_checksum(_Answer({}), body)  # type: ignore[arg-type]
    with pytest.raises(FlexibleChecksumError):
        guards.check_object_checksum(_Answer({"x-amz-checksum-crc32": right}), body[:-1] + b"?")  # type: ignore[arg-type]


def test_a_connection_serves_only_filesystems_judged_alike(blob: Any) -> None:
    """A connection made under one TLS context (``verify=False``, say) is never another filesystem's."""
    transport, _, _, _ = blob
    parts = s3_module.urllib.parse.urlsplit(transport.fs._s3._endpoint.host)
    state = s3_module._state(transport.fs)
    other = s3_module._Direct(True, state.ssl_context, state.connect_timeout, state.read_timeout)
    mine, _ = s3_module._connection(state, parts)
    theirs, reused = s3_module._connection(other, parts)
    assert theirs is not mine and not reused
    assert s3_module._connection(state, parts) == (mine, True)


# ------------------------------------------------------------------------------ listings
ODD_NAMES = ["plain", "with space", "per%cent", "plus+sign", "ünï", "q?uery&amp", "dir/inner"]


@pytest.mark.parametrize("direct", ["1", "0"])
def test_listings_read_directly_name_what_the_aiobotocore_path_names(
    s3_url: Any, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """Keys botocore asks the store to URL-encode (spaces, ``%``, ``+``, non-ASCII, ``&``) come back decoded,
    directories as names, a missing bucket as an empty listing, on both paths; the direct one is the only one
    sending a page."""
    monkeypatch.setenv(s3_module.DIRECT_ENV, direct)
    pages: list[dict[str, Any]] = []
    direct_page = s3_module.direct_list_page
    monkeypatch.setattr(s3_module, "direct_list_page", lambda fs, kw: _kept(pages, direct_page(fs, kw)))
    url, options = s3_url
    transport, root = FsspecTransport.from_url(url, options, CONFIG)
    with transport:
        for name in ODD_NAMES:
            transport.write_file(transport.join(root, "ckpt", name), b"x")
        assert transport.listdir(transport.join(root, "ckpt")) == sorted({n.split("/")[0] for n in ODD_NAMES})
        assert transport.listdir(transport.join(root, "nothing-here")) == []
        bucket = root.split("/")[0]
        assert transport.listdir(f"{bucket}-missing/x") == []
    assert len(pages) == (2 if direct == "1" else 0)  # the missing bucket: an error answer, no page


def _kept(pages: list[Any], page: Any) -> Any:
    if page is not None:
        pages.append(page)
    return page


def test_a_listing_in_pages_is_read_whole_directly(blob: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Page by page (``MaxKeys=2``, continuation tokens): the names are all there, once each."""
    transport, path, _, _ = blob
    root = path.rsplit("/", 1)[0]
    names = [f"k {i:02d}+" for i in range(7)]
    for name in names:
        transport.write_file(transport.join(root, "paged", name), b"x")
    bucket, key, _ = transport.fs.split_path(transport.join(root, "paged"))
    seen, token = [], None
    while True:
        kwargs = {"Bucket": bucket, "Prefix": key + "/", "Delimiter": "/", "MaxKeys": 2}
        page = s3_module.direct_list_page(transport.fs, {**kwargs, **({"ContinuationToken": token} if token else {})})
        assert page is not None
        seen += [entry["Key"].rsplit("/", 1)[1] for entry in page.get("Contents", ())]
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated"):
            break
    assert seen == names


class _ScriptedStore(ThreadingHTTPServer):
    """A loopback S3 endpoint answering every ``GET`` with the next of ``answers`` (``status, body``), the last
    one again once they run out."""

    daemon_threads = True

    def __init__(self, answers: list[tuple[int, bytes]]) -> None:
        super().__init__(("127.0.0.1", 0), _Scripted)
        self.answers, self.served = answers, 0


class _Scripted(BaseHTTPRequestHandler):
    server: _ScriptedStore
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def do_GET(self) -> None:
        status, body = self.server.answers[min(self.server.served, len(self.server.answers) - 1)]
        self.server.served += 1
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _page(keys: list[str], token: str | None = None) -> bytes:
    more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    return (
        '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>bkt</Name><Prefix>ckpt/</Prefix><Delimiter>/</Delimiter><EncodingType>url</EncodingType>{more}"
        + "".join(f"<Contents><Key>ckpt/{k}</Key><Size>1</Size></Contents>" for k in keys)
        + "</ListBucketResult>"
    ).encode()


_ERROR_200 = b"<Error><Code>InternalError</Code><Message>We encountered an internal error</Message></Error>"


@pytest.mark.parametrize(
    "answers",
    [
        [(200, _ERROR_200)],
        [(200, _page(["a", "b"])[:-40])],  # a body cut short
        [(200, b"not xml at all")],
        [(200, _page(["shard-1", "shard-2"], token="t2")), (200, _ERROR_200)],  # the second page fails
    ],
    ids=["error-in-200", "cut-short", "not-xml", "second-page"],
)
def test_a_listing_answered_200_with_an_error_fails_as_on_the_aiobotocore_path(
    monkeypatch: pytest.MonkeyPatch, answers: list[tuple[int, bytes]]
) -> None:
    """S3 may answer 200 with an error in the body (or a body cut short): botocore reads it as a 500, retried,
    never as an empty or a complete listing. Both paths raise the same error after the same attempts."""
    import s3fs

    outcomes = []
    for direct in ("1", "0"):
        monkeypatch.setenv(s3_module.DIRECT_ENV, direct)
        store = _ScriptedStore(answers)
        threading.Thread(target=store.serve_forever, daemon=True).start()
        try:
            s3fs.S3FileSystem.clear_instance_cache()
            endpoint = f"http://127.0.0.1:{store.server_address[1]}"
            options = {
                "key": "k",
                "secret": "s",
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            }
            config = TransportConfig(retry=RetryPolicy(max_attempts=2, initial_backoff=0.01, deadline=20.0))
            transport, root = FsspecTransport.from_url("s3://bkt/ckpt", options, config)
            with transport, pytest.raises(TransportError) as caught:
                transport.listdir(root)
            message = re.sub(r" in [0-9.]+s ", " ", str(caught.value).replace(endpoint, "<store>"))
            outcomes.append((message, store.served))
        finally:
            store.shutdown()
            store.server_close()
    assert outcomes[0] == outcomes[1]
    assert "failed after 2 attempt(s)" in outcomes[0][0]
