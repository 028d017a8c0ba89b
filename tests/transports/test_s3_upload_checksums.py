"""Upload bodies carry the CRC-32 botocore would have sent, computed by ISA-L instead of zlib, and none where
the client is configured not to send checksums (a store that refuses them) or the caller names its own.

Checked on moto: the ``x-amz-checksum-crc32`` header of every ``PutObject`` and ``UploadPart`` as sent,
against the CRC-32 of the body, and that botocore's own CRC-32 never ran.
"""

from __future__ import annotations

import base64
import random
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from botocore import httpchecksum
from s3fs import S3FileSystem

from dcp_storage.transports.s3_stream import s3_call
from dcp_storage.transports.s3_upload import S3AtomicUpload, put_object
from dcp_storage_testing.s3_server import S3Location

MiB = 1024 * 1024
RUN: Callable[[Callable[[], Any], str], Any] = lambda fn, what: fn()  # noqa: E731 - a runner without retries


def _sent(fs: S3FileSystem) -> list[tuple[str, str | None, bytes]]:
    """Every upload request the client sends: (operation, its x-amz-checksum-crc32 header, its body)."""
    s3_call(fs, "list_buckets")  # the client exists, so its events can be watched
    seen: list[tuple[str, str | None, bytes]] = []

    def before_send(request: Any, **_kw: Any) -> None:
        op = request.url.split("?")[1] if "?" in request.url else "PutObject"
        if request.method == "PUT":
            crc = request.headers.get("x-amz-checksum-crc32")
            body = request.body
            data = body.getvalue() if hasattr(body, "getvalue") else bytes(body or b"")  # botocore wraps bytes
            seen.append((op, crc.decode() if isinstance(crc, bytes) else crc, data))

    fs._s3.meta.events.register("before-send.s3", before_send)
    return seen


def _crc(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode("ascii")


def _botocore_crc_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    for cls in (httpchecksum.Crc32Checksum, getattr(httpchecksum, "CrtCrc32Checksum", None)):
        if cls is not None:
            original = cls.update
            monkeypatch.setattr(cls, "update", lambda self, chunk, _o=original: calls.append(1) or _o(self, chunk))
    return calls


def test_puts_and_parts_carry_the_bodys_crc32_computed_by_us(
    s3_url: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = S3FileSystem(**s3_url.storage_options)
    sent = _sent(fs)
    botocore_crc = _botocore_crc_calls(monkeypatch)
    base = s3_url.url.removeprefix("s3://")
    small = random.Random(1).randbytes(1000)
    put_object(fs, f"{base}/small", small, RUN)
    big = random.Random(2).randbytes(11 * MiB)
    upload = S3AtomicUpload(fs, f"{base}/big", 5 * MiB, RUN)
    upload.write(big)
    upload.commit()
    assert fs.cat_file(f"{base}/small") == small and fs.cat_file(f"{base}/big") == big
    bodies = [(crc, body) for _op, crc, body in sent if body]
    assert len(bodies) == 4  # the small PUT, three parts of 5, 5 and 1 MiB
    assert all(crc == _crc(body) for crc, body in bodies), [c for c, _ in bodies]
    assert botocore_crc == []  # botocore computed none of them


@pytest.mark.parametrize("how", ["when_required", "caller_checksum"])
def test_no_checksum_of_ours_where_the_client_or_the_caller_says_otherwise(
    s3_url: S3Location, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    options = dict(s3_url.storage_options)
    if how == "when_required":  # a store that refuses checksum headers: the user turned them off
        options["config_kwargs"] = {**options.get("config_kwargs", {}), "request_checksum_calculation": "when_required"}
    else:  # the caller asks for another algorithm through s3fs's per-request options
        options["s3_additional_kwargs"] = {"ChecksumAlgorithm": "SHA256"}
    fs = S3FileSystem(**options)
    sent = _sent(fs)
    base = s3_url.url.removeprefix("s3://")
    data = random.Random(3).randbytes(6 * MiB)
    upload = S3AtomicUpload(fs, f"{base}/obj", 5 * MiB, RUN)
    upload.write(data)
    upload.commit()
    assert fs.cat_file(f"{base}/obj") == data
    crcs = [crc for _op, crc, body in sent if body]
    assert crcs and all(crc is None for crc in crcs), crcs
