"""``check_range_answer``: which answers to ``Range: bytes=start-(end-1)`` hold exactly those bytes.

The end-to-end attacks (a proxy in front of real emulators) are in ``tests/faults/test_range_faults.py``;
this is the decision table itself, including answers no emulator gives.
"""

from __future__ import annotations

import pytest

from dcp_storage.errors import TransportError
from dcp_storage.transports import RetryPolicy, is_transient
from dcp_storage.transports.guards import RangeMismatchError, check_range_answer
from dcp_storage.transports.retry import call_with_retry

ACCEPTED = [
    # (start, end, status, Content-Range, length)
    (100, 200, 206, "bytes 100-199/1000", 100),
    (100, 200, 206, "bytes 100-199/1000", None),  # length unknown (chunked): the caller counts the bytes
    (100, 200, 206, "bytes 100-199/*", 100),  # size unknown to the server
    (0, 1000, 206, "bytes 0-999/1000", 1000),
    (990, 1000, 206, " bytes 990-999/1000 ", 10),
    (0, 1000, 200, None, 1000),  # Range ignored, but the range was the whole object
]

REFUSED = [
    (100, 200, 200, None, 1000),  # the whole object, not the range
    (0, 500, 200, None, 1000),  # a 200 for a prefix: the object is longer than the caller expects
    (0, 1000, 200, None, None),  # a 200 of unknown length
    (0, 1000, 200, None, 999),
    (100, 200, 206, None, 100),  # no Content-Range
    (100, 200, 206, "bytes 99-198/1000", 100),  # shifted
    (100, 200, 206, "bytes 101-200/1000", 100),
    (100, 200, 206, "bytes 100-149/1000", 50),  # short
    (100, 200, 206, "bytes 100-249/1000", 150),  # long
    (100, 200, 206, "bytes 100-199/1000", 99),  # right header, wrong length
    (100, 200, 206, "bytes 100-199/150", 100),  # a size that ends inside the range
    (100, 200, 206, "bytes=100-199/1000", 100),  # not a Content-Range
    (100, 200, 206, "bytes 100-199/1000, 300-399/1000", 100),
    (100, 200, 206, "items 100-199/1000", 100),
    (100, 200, 204, None, 0),
    (100, 200, 304, None, None),
    (100, 200, None, None, 100),
]


@pytest.mark.parametrize(("start", "end", "status", "content_range", "length"), ACCEPTED)
def test_accepted(start: int, end: int, status: int, content_range: str | None, length: int | None) -> None:
    check_range_answer(start, end, status, content_range, length)


@pytest.mark.parametrize(("start", "end", "status", "content_range", "length"), REFUSED)
def test_refused_naming_what_came_back(
    start: int, end: int, status: int | None, content_range: str | None, length: int | None
) -> None:
    with pytest.raises(RangeMismatchError) as info:
        check_range_answer(start, end, status, content_range, length)
    message = str(info.value)
    assert message.startswith(f"asked for bytes [{start}, {end}), got ")
    assert (f"status {status}" if status is not None else "no status") in message
    if content_range is not None:
        assert repr(content_range) in message


def test_server_text_is_quoted_escaped_and_cut() -> None:
    hostile = "bytes 0-9/10\x1b]0;OK: checkpoint verified\x07" + "x" * 500
    with pytest.raises(RangeMismatchError) as info:
        check_range_answer(0, 10, 206, hostile, 10)
    message = str(info.value)
    assert "\x1b" not in message and "\x07" not in message and "\\x1b" in message
    assert len(message) < 200


def test_a_mismatch_is_retried_and_then_a_transport_error() -> None:
    assert is_transient(RangeMismatchError("asked for bytes [0, 1), got status 200"))
    calls = []

    def answer_wrongly() -> None:
        calls.append(1)
        check_range_answer(100, 200, 206, "bytes 99-198/1000", 100)

    policy = RetryPolicy(max_attempts=3, initial_backoff=0, max_backoff=0)
    with pytest.raises(TransportError, match=r"read x bytes \[100, 200\) failed after 3 attempt.*bytes 99-198/1000"):
        call_with_retry(answer_wrongly, policy, lambda: "read x bytes [100, 200)")
    assert len(calls) == 3
