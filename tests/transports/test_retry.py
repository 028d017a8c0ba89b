"""Classification of storage errors and the retry loop around every storage call."""

from __future__ import annotations

import errno
import http.client
import time

import pytest

from dcp_storage.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DcpStorageError,
    TransportError,
)
from dcp_storage.transports.retry import RetryPolicy, TruncatedReadError, call_with_retry, is_transient

FAST = RetryPolicy(max_attempts=5, initial_backoff=0.001, max_backoff=0.005, jitter=0.0, deadline=None)


class _ClientError(Exception):
    """Shaped like botocore's ClientError: a ``response`` dict."""

    def __init__(self, status: int | None = None, code: str | None = None) -> None:
        self.response: dict = {}
        if status is not None:
            self.response["ResponseMetadata"] = {"HTTPStatusCode": status}
        if code is not None:
            self.response["Error"] = {"Code": code, "Message": "..."}
        super().__init__(f"status={status} code={code}")


class _WithStatus(Exception):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"HTTP {status}")


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as c:
            raise outer from c
    except BaseException as e:  # noqa: BLE001
        return e


# ------------------------------------------------------------------------------------ is_transient


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError("reset by peer"),
        ConnectionAbortedError(),
        BrokenPipeError(),
        TimeoutError("read timed out"),
        OSError(errno.ECONNRESET, "connection reset"),
        OSError(errno.ETIMEDOUT, "timed out"),
        OSError(errno.EPIPE, "broken pipe"),
        http.client.IncompleteRead(b"partial", 10),
        TruncatedReadError("got 5 of 10 bytes"),
        _ClientError(status=503),
        _ClientError(status=500),
        _ClientError(code="SlowDown"),
        _ClientError(status=400, code="RequestTimeout"),
        _WithStatus(503),
        _WithStatus(429),
        OSError("Please reduce your request rate. (SlowDown)"),
    ],
    ids=lambda e: f"{type(e).__name__}:{e}"[:60],
)
def test_transient_errors(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError("nope"),
        PermissionError("denied"),
        IsADirectoryError("dir"),
        CheckpointNotFoundError("s3://b/k: no such file"),
        OSError(errno.ENOSPC, "no space left"),
        OSError(errno.EINVAL, "bad"),
        ValueError("bad argument"),
        KeyError("x"),
        _ClientError(status=403, code="AccessDenied"),
        _ClientError(status=404, code="NoSuchKey"),
        _ClientError(status=400),
        _WithStatus(404),
        RuntimeError("SlowDown"),  # text markers only count on OSErrors
    ],
    ids=lambda e: f"{type(e).__name__}:{e}"[:60],
)
def test_permanent_errors(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_error_code_wins_over_nothing_and_is_checked_against_the_list() -> None:
    # a 4xx status with a throttling code is transient; a 5xx status is transient whatever the code
    assert is_transient(_ClientError(status=400, code="Throttling"))
    assert is_transient(_ClientError(status=503, code="Whatever"))
    assert not is_transient(_ClientError(status=409, code="OperationAborted"))


def test_cause_chain_is_followed() -> None:
    wrapped = _chained(RuntimeError("wrapper"), ConnectionResetError("reset"))
    assert wrapped.__cause__ is not None
    assert is_transient(wrapped)
    # two levels deep
    deeper = _chained(ValueError("outer"), wrapped)
    assert is_transient(deeper)


def test_permanent_error_in_chain_stops_the_walk() -> None:
    assert not is_transient(_chained(FileNotFoundError("gone"), ConnectionResetError("reset")))


def test_implicit_context_is_followed() -> None:
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError:
            raise RuntimeError("while handling")  # noqa: B904 - implicit __context__ on purpose
    except RuntimeError as e:
        assert is_transient(e)


def test_context_suppressed_by_from_none_is_not_followed() -> None:
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError:
            raise ValueError("bad value") from None
    except ValueError as e:
        assert not is_transient(e)


def test_project_errors_are_final_even_when_raised_from_a_transient_one() -> None:
    # A TransportError means "retries exhausted": retrying it again would multiply the attempts.
    gave_up = _chained(TransportError("read s3://b/k failed after 6 attempt(s)"), ConnectionResetError())
    assert not is_transient(gave_up)
    assert not is_transient(_chained(CorruptCheckpointError("truncated"), TimeoutError()))


def test_self_referencing_chain_terminates() -> None:
    a = ValueError("a")
    b = ValueError("b")
    a.__cause__ = b
    b.__cause__ = a
    assert not is_transient(a)


def test_aiohttp_payload_error_is_transient() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    assert is_transient(aiohttp.ClientPayloadError("Response payload is not completed"))
    assert is_transient(aiohttp.ServerDisconnectedError())


def test_botocore_errors_classified() -> None:
    botocore_exc = pytest.importorskip("botocore.exceptions")
    assert is_transient(botocore_exc.ResponseStreamingError(error=ConnectionResetError()))
    assert is_transient(botocore_exc.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    err = botocore_exc.ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "Get")
    assert is_transient(err)
    denied = botocore_exc.ClientError(
        {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject"
    )
    assert not is_transient(denied)


# ------------------------------------------------------------------------------------ call_with_retry


class Flaky:
    """Fails with ``exc`` for the first ``failures`` calls, then returns ``value``."""

    def __init__(self, failures: int, exc: type[BaseException] | BaseException = ConnectionResetError, value="ok"):
        self.failures = failures
        self.exc = exc
        self.value = value
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc("flaky") if isinstance(self.exc, type) else self.exc
        return self.value


@pytest.mark.parametrize("failures", [0, 1, 4])
def test_succeeds_after_transient_failures(failures: int) -> None:
    fn = Flaky(failures)
    retried: list[BaseException] = []
    assert call_with_retry(fn, FAST, lambda: "op", on_retry=retried.append) == "ok"
    assert fn.calls == failures + 1
    assert len(retried) == failures
    assert all(isinstance(e, ConnectionResetError) for e in retried)


def test_gives_up_after_max_attempts() -> None:
    fn = Flaky(100)
    retried: list[BaseException] = []
    with pytest.raises(TransportError) as info:
        call_with_retry(fn, FAST, lambda: "read s3://bucket/key bytes [0, 4096)", on_retry=retried.append)
    msg = str(info.value)
    assert "read s3://bucket/key bytes [0, 4096)" in msg
    assert "5 attempt(s)" in msg
    assert "ConnectionResetError" in msg
    assert "gave up: attempts" in msg
    assert fn.calls == 5
    assert len(retried) == 4  # no retry after the last attempt
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert isinstance(info.value, OSError) and isinstance(info.value, DcpStorageError)


def test_single_attempt_policy_never_retries() -> None:
    fn = Flaky(1)
    with pytest.raises(TransportError, match="1 attempt"):
        call_with_retry(fn, RetryPolicy(max_attempts=1), lambda: "op")
    assert fn.calls == 1


def test_deadline_bounds_total_time() -> None:
    policy = RetryPolicy(max_attempts=1000, initial_backoff=0.02, max_backoff=0.05, jitter=0.0, deadline=0.3)
    fn = Flaky(10**6)
    started = time.monotonic()
    with pytest.raises(TransportError) as info:
        call_with_retry(fn, policy, lambda: "stat s3://b/k")
    elapsed = time.monotonic() - started
    assert elapsed < 0.3 + 0.2, f"took {elapsed:.3f}s, deadline was 0.3s"
    assert elapsed > 0.1, "should have retried until close to the deadline"
    assert "gave up: deadline" in str(info.value)
    assert "stat s3://b/k" in str(info.value)
    assert 3 <= fn.calls < 1000


def test_deadline_not_exceeded_by_a_long_backoff() -> None:
    # the next sleep would overshoot the deadline: give up now instead of sleeping past it
    policy = RetryPolicy(max_attempts=10, initial_backoff=5.0, max_backoff=5.0, jitter=0.0, deadline=1.0)
    started = time.monotonic()
    with pytest.raises(TransportError, match="deadline"):
        call_with_retry(Flaky(10), policy, lambda: "op")
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize(
    "exc",
    [FileNotFoundError("missing"), PermissionError("denied"), ValueError("bad"), CheckpointNotFoundError("x")],
)
def test_permanent_error_propagates_unchanged_on_first_try(exc: BaseException) -> None:
    fn = Flaky(100, exc=exc)
    retried: list[BaseException] = []
    with pytest.raises(type(exc)) as info:
        call_with_retry(fn, FAST, lambda: "op", on_retry=retried.append)
    assert info.value is exc
    assert fn.calls == 1
    assert retried == []


def test_transport_error_from_inner_retry_is_not_retried_again() -> None:
    inner_calls = 0

    def inner() -> None:
        nonlocal inner_calls
        inner_calls += 1
        raise ConnectionResetError("reset")

    def outer() -> None:
        call_with_retry(inner, FAST, lambda: "inner op")

    with pytest.raises(TransportError, match="inner op"):
        call_with_retry(outer, FAST, lambda: "outer op")
    assert inner_calls == FAST.max_attempts  # not max_attempts ** 2


def test_custom_classifier() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff=0, jitter=0, classify=lambda e: isinstance(e, KeyError))
    fn = Flaky(2, exc=KeyError)
    assert call_with_retry(fn, policy, lambda: "op") == "ok"
    with pytest.raises(ConnectionResetError):
        call_with_retry(Flaky(1), policy, lambda: "op")


def test_describe_only_called_on_failure() -> None:
    calls = 0

    def describe() -> str:
        nonlocal calls
        calls += 1
        return "op"

    call_with_retry(Flaky(2), FAST, describe)
    assert calls == 0


# ------------------------------------------------------------------------------------ RetryPolicy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"initial_backoff": -0.1}, "backoff"),
        ({"max_backoff": -1}, "backoff"),
        ({"jitter": 1.5}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
        ({"deadline": 0}, "deadline"),
        ({"deadline": -3}, "deadline"),
    ],
)
def test_retry_policy_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetryPolicy(**kwargs)


def test_retry_policy_accepts_no_deadline() -> None:
    assert RetryPolicy(deadline=None).deadline is None


def test_backoff_doubles_caps_and_jitters() -> None:
    p = RetryPolicy(initial_backoff=0.1, max_backoff=0.5, jitter=0.0)
    assert [round(p.backoff(a), 6) for a in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    j = RetryPolicy(initial_backoff=1.0, max_backoff=1.0, jitter=0.5)
    samples = [j.backoff(1) for _ in range(200)]
    assert all(0.5 <= s <= 1.0 for s in samples)
    assert max(samples) - min(samples) > 0.1  # actually random
