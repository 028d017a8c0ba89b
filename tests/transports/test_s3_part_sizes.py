"""Multipart part sizes: small parts by default, doubled every 1,000 parts so S3's 10,000-part cap does not
also cap the object's size; an upload that would need more parts fails before sending them.

The real thresholds (1,000 parts, 10,000 parts) need gigabytes; the tests shrink them to 2 and 5 parts
and upload 5 MiB parts (the S3 minimum) to moto.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from s3fs import S3FileSystem

from dcp_storage.errors import TransportError
from dcp_storage.transports import TransportConfig, s3_upload
from dcp_storage.transports.s3_upload import S3AtomicUpload, part_size_at
from dcp_storage_testing.s3_server import S3Location

MiB = 1024 * 1024


def test_part_size_doubles_every_thousand_parts_up_to_five_gib() -> None:
    base = 16 * MiB
    assert [part_size_at(n, base) for n in (1, 1000, 1001, 2000, 2001)] == [base, base, 2 * base, 2 * base, 4 * base]
    assert part_size_at(10_000, base) == 5 * 1024**3  # 16 MiB << 9 = 8 GiB, capped at S3's largest part
    reach = sum(part_size_at(n, base) for n in range(1, s3_upload.MAX_PARTS + 1))
    assert reach >= 5 * 1024**4  # S3's 5 TiB object limit fits in 10,000 parts
    assert sum(part_size_at(n, base) for n in range(1, 1001)) == 1000 * base  # the first 15.6 GiB: 16 MiB parts


def test_default_part_size_keeps_several_parts_in_flight_within_the_budget() -> None:
    config = TransportConfig()
    assert config.part_size == 16 * MiB
    assert config.max_inflight_bytes // (3 * config.part_size) >= 8  # the writer counts each part 3 times


def _upload(s3_url: S3Location, name: str) -> tuple[S3AtomicUpload, S3FileSystem, str]:
    fs = S3FileSystem(**s3_url.storage_options)
    path = s3_url.url.removeprefix("s3://") + "/" + name
    run: Callable[[Callable[[], Any], str], Any] = lambda fn, what: fn()  # noqa: E731 - a runner without retries
    return S3AtomicUpload(fs, path, 5 * MiB, run), fs, path


def test_parts_grow_and_the_object_reads_back(s3_url: S3Location, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_upload, "_PARTS_PER_SIZE", 2)
    data = random.Random(3).randbytes(30 * MiB + 1)
    upload, fs, path = _upload(s3_url, "grown")
    upload.write(data)
    upload.commit()
    # Parts of 5, 5, 10 and 10 MiB, then the 1-byte tail: create + 5 parts + complete. With a fixed 5 MiB
    # size it would have taken 7 parts.
    assert upload.requests == 7
    assert fs.cat_file(path) == data


def test_more_parts_than_s3_allows_fails_and_leaves_nothing(
    s3_url: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_upload, "_PARTS_PER_SIZE", 2)
    monkeypatch.setattr(s3_upload, "MAX_PARTS", 3)
    upload, fs, path = _upload(s3_url, "too-big")
    with pytest.raises(TransportError, match="more than S3's 3 parts"):
        upload.write(bytes(20 * MiB + 1))  # parts of 5, 5, 10 MiB, and a fourth would be needed
        upload.commit()
    upload.abort()
    assert not fs.exists(path)


def test_parts_in_flight_hold_no_more_bytes_once_parts_grow(
    s3_url: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_pending`` bounds the bytes of parts in flight (``max_pending * part_size``), not their count: parts
    that doubled must not double the upload's memory (the writer's budget counts ``part_size`` per part)."""
    monkeypatch.setattr(s3_upload, "_PARTS_PER_SIZE", 2)
    fs = S3FileSystem(**s3_url.storage_options)
    path = s3_url.url.removeprefix("s3://") + "/bounded"
    lock = threading.Lock()
    flying, peak = 0, 0

    def run(fn: Callable[[], Any], what: str) -> Any:
        nonlocal flying, peak
        size = int(what.split("(", 1)[1].split(" ", 1)[0]) if what.startswith("upload part") else 0
        with lock:
            flying += size
            peak = max(peak, flying)
        try:
            time.sleep(0.05 if size else 0)  # a slow link: parts pile up to the limit
            return fn()
        finally:
            with lock:
                flying -= size

    data = random.Random(4).randbytes(60 * MiB)  # parts of 5, 5, 10, 10, 20 and 10 MiB
    with ThreadPoolExecutor(8) as pool:
        upload = S3AtomicUpload(fs, path, 5 * MiB, run, pool, max_pending=2)
        for pos in range(0, len(data), MiB):
            upload.write(data[pos : pos + MiB])
        upload.commit()
    assert fs.cat_file(path) == data
    assert peak <= 20 * MiB, peak  # max_pending * part_size (10 MiB), or one part larger than that alone


def test_upload_memory_counts_the_larger_part_being_filled() -> None:
    """What the writer's budget counts per object in flight: past 1,000 parts the part being filled is
    larger than ``part_size`` (a 100 GiB object at 16 MiB fills 64 MiB parts), and is counted as such."""
    base, pending = 16 * MiB, 8
    for size in (0, 1, base, 9 * base, 1000 * base, 1000 * base + 1, 100 * 1024**3, 6 * 1024**4):
        done, number, largest = 0, 0, 0
        while done < size and number < s3_upload.MAX_PARTS:  # the parts of the object, one by one
            number += 1
            largest = part_size_at(number, base)
            done += largest
        expected = min(size, pending * base + max(largest, base))
        assert s3_upload.upload_memory(size, base, pending) == expected, size
    assert s3_upload.upload_memory(100 * 1024**3, base, pending) == pending * base + 64 * MiB
