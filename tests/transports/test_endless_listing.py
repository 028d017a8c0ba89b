"""A store whose listing never ends is cut off by a bound naming the URL and the limit (issue 20).

A loopback HTTP server speaks just enough S3 (``ListObjectsV2``, ``ListMultipartUploads``), GCS JSON
(``objects.list``) and Azure (List Blobs) to answer every page with one entry and a fresh continuation token, forever (or, in
``same-token`` mode, the same token again). The transport's listings must stop at
``DCP_STORAGE_MAX_LIST_PAGES`` (set low here so the test is quick; the default is measured by
``test_the_default_bound_ends_an_endless_listing``), at a repeated token, and at the retry policy's deadline.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported (see gcs_server)

import pytest

from dcp_storage.errors import DcpStorageError, ListingTooLongError, TransportError
from dcp_storage.transports import FsspecTransport, RetryPolicy, TransportConfig
from dcp_storage.transports.guards import MAX_LIST_ENTRIES_ENV, MAX_LIST_PAGES_ENV, ListingBound

_S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
_AZ_ACCOUNT = "devstoreaccount1"
_AZ_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # azurite's


class _EndlessStore(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, same_token: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.same_token = same_token
        self.pages = 0
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _EndlessStore
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.pages += 1
            n = self.server.pages
        token = "same" if self.server.same_token else f"token-{n}"
        url = urlparse(self.path)
        query = parse_qs(url.query, keep_blank_values=True)
        if "comp" in query and query.get("restype") == ["container"]:  # Azure List Blobs
            body = (
                f'<?xml version="1.0" encoding="utf-8"?><EnumerationResults ServiceEndpoint="{self.server.endpoint}/'
                f'{_AZ_ACCOUNT}/" ContainerName="b"><Prefix>ckpt/</Prefix><Delimiter>/</Delimiter><Blobs><Blob>'
                f"<Name>ckpt/obj-{n}</Name><Properties><Content-Length>1</Content-Length><BlobType>BlockBlob</BlobType>"
                f"</Properties></Blob></Blobs><NextMarker>{token}</NextMarker></EnumerationResults>"
            )
            self._send(body.encode(), "application/xml")
        elif url.path.startswith("/storage/v1/b/"):  # GCS objects.list
            page = {
                "kind": "storage#objects",
                "items": [{"name": f"ckpt/obj-{n}", "size": "1"}],
                "nextPageToken": token,
            }
            self._send(json.dumps(page).encode(), "application/json")
        elif "uploads" in query:  # S3 ListMultipartUploads
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult xmlns="{_S3_NS}">'
                f"<Bucket>b</Bucket><KeyMarker></KeyMarker><UploadIdMarker></UploadIdMarker>"
                f"<NextKeyMarker>ckpt/k-{token}</NextKeyMarker><NextUploadIdMarker>u-{token}</NextUploadIdMarker>"
                f"<MaxUploads>1000</MaxUploads><IsTruncated>true</IsTruncated>"
                f"<Upload><Key>ckpt/k-{n}</Key><UploadId>u-{n}</UploadId>"
                f"<Initiated>2026-01-01T00:00:00.000Z</Initiated></Upload></ListMultipartUploadsResult>"
            )
            self._send(body.encode(), "application/xml")
        else:  # S3 ListObjectsV2
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{_S3_NS}">'
                f"<Name>b</Name><Prefix>ckpt/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
                f"<Delimiter>/</Delimiter><IsTruncated>true</IsTruncated>"
                f"<NextContinuationToken>{token}</NextContinuationToken>"
                f"<Contents><Key>ckpt/obj-{n}</Key><Size>1</Size></Contents></ListBucketResult>"
            )
            self._send(body.encode(), "application/xml")


def _serve(same_token: bool = False) -> Iterator[_EndlessStore]:
    server = _EndlessStore(same_token)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def endless() -> Iterator[_EndlessStore]:
    yield from _serve()


def _config(deadline: float = 60.0) -> TransportConfig:
    return TransportConfig(retry=RetryPolicy(max_attempts=2, initial_backoff=0.01, deadline=deadline))


def _s3(server: _EndlessStore, deadline: float = 60.0) -> tuple[Any, str]:
    pytest.importorskip("s3fs")
    opts = {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": server.endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }
    return FsspecTransport.from_url("s3://b/ckpt", opts, _config(deadline))


def _gcs(server: _EndlessStore) -> tuple[Any, str]:
    pytest.importorskip("gcsfs")
    opts = {"endpoint_url": server.endpoint, "token": "anon", "project": "p", "skip_instance_cache": True}
    return FsspecTransport.from_url("gs://b/ckpt", opts, _config())


def _az(server: _EndlessStore) -> tuple[Any, str]:
    pytest.importorskip("adlfs")
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={_AZ_ACCOUNT};AccountKey={_AZ_KEY};"
        f"BlobEndpoint={server.endpoint}/{_AZ_ACCOUNT};"
    )
    opts = {"connection_string": connection, "account_name": _AZ_ACCOUNT, "skip_instance_cache": True}
    return FsspecTransport.from_url("az://b/ckpt", opts, _config())


@pytest.mark.parametrize("kind", ["s3", "gs", "az"])
def test_an_endless_object_listing_stops_at_the_page_bound(
    endless: _EndlessStore, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MAX_LIST_PAGES_ENV, "20")
    transport, root = {"s3": _s3, "gs": _gcs, "az": _az}[kind](endless)
    with transport, pytest.raises(ListingTooLongError) as info:
        transport.listdir(root)
    message = str(info.value)
    assert f"{kind}://b/ckpt" in message and f"{MAX_LIST_PAGES_ENV}=20" in message
    assert endless.pages == 20  # not one page more, and not retried


def test_an_endless_multipart_listing_stops_at_the_page_bound(
    endless: _EndlessStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MAX_LIST_PAGES_ENV, "20")
    transport, root = _s3(endless)
    with transport, pytest.raises(ListingTooLongError, match="in-progress multipart uploads") as info:
        transport.pending_uploads(root)  # type: ignore[attr-defined]
    assert "s3://b/ckpt" in str(info.value) and endless.pages == 20


def test_a_repeated_token_stops_the_listing_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for server in _serve(same_token=True):
        transport, root = _s3(server)
        with transport, pytest.raises(ListingTooLongError, match="token it gave before"):
            transport.listdir(root)
        assert server.pages == 2


def test_the_multipart_listing_runs_under_the_deadline(endless: _EndlessStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_LIST_PAGES_ENV, "100000000")  # only the deadline can stop it now
    transport, root = _s3(endless, deadline=1.5)
    started = time.monotonic()
    with transport, pytest.raises((TransportError, DcpStorageError)) as info:
        transport.pending_uploads(root)  # type: ignore[attr-defined]
    assert time.monotonic() - started < 10
    assert "s3://b/ckpt" in str(info.value)


def test_the_default_bound_is_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MAX_LIST_PAGES_ENV, raising=False)
    monkeypatch.delenv(MAX_LIST_ENTRIES_ENV, raising=False)
    bound = ListingBound("s3://b/ckpt")
    assert (bound.max_pages, bound.max_entries) == (1000, 1_000_000)
    monkeypatch.setenv(MAX_LIST_ENTRIES_ENV, "3")
    bound = ListingBound("s3://b/ckpt")
    bound.page(2, "t1")
    with pytest.raises(ListingTooLongError, match=f"{MAX_LIST_ENTRIES_ENV}=3"):
        bound.page(2, "t2")


@pytest.mark.skipif(
    not os.environ.get("DCP_STORAGE_FULL_LISTING"), reason="56 s under load; DCP_STORAGE_FULL_LISTING=1"
)
def test_the_default_bound_ends_an_endless_listing(endless: _EndlessStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (1,000 pages) holds without any setting, well before the 300 s default deadline."""
    monkeypatch.delenv(MAX_LIST_PAGES_ENV, raising=False)
    transport, root = _s3(endless, deadline=300.0)
    started = time.monotonic()
    with transport, pytest.raises(ListingTooLongError, match="1000 pages"):
        transport.listdir(root)
    assert endless.pages == 1000 and time.monotonic() - started < 120
