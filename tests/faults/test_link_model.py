"""The proxy's link model: a bandwidth cap per connection and a first-byte latency, paced on a fake clock.

The benchmarks rely on it to make an emulator behave like a store whose throughput grows with the requests
in flight, so what is tested is the arithmetic (how long each body is held) and that bodies pass intact;
no wall-clock time is measured.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
from collections.abc import Iterator

import pytest

from dcp_storage_testing.fault_proxy import FaultProxy, LinkModel, Pacer

from .test_fault_proxy import _Echo, _serve


class FakeTime:
    """A clock that moves only when something sleeps on it; every sleep is recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_pacer_holds_a_body_to_its_rate() -> None:
    t = FakeTime()
    pace = Pacer(10_000.0, t.clock, t.sleep)

    async def body() -> None:
        for _ in range(10):
            await pace(1_000)

    asyncio.run(body())
    assert sum(t.sleeps) == pytest.approx(1.0)  # 10,000 bytes at 10,000 B/s
    assert len(t.sleeps) == 10


def test_pacer_never_delays_a_body_the_peer_sends_slower_than_the_cap() -> None:
    t = FakeTime()
    pace = Pacer(10_000.0, t.clock, t.sleep)

    async def body() -> None:
        for _ in range(5):
            await pace(1_000)  # due 0.1 s after the previous piece ...
            t.now += 0.5  # ... and the next arrives 0.5 s later

    asyncio.run(body())
    assert t.sleeps == [pytest.approx(0.1)]  # only the first piece waited


def test_link_parse_and_validation() -> None:
    link = LinkModel.parse("25,30")
    assert link.bytes_per_s == 25e6 and link.first_byte_s == pytest.approx(0.03)
    assert LinkModel.parse("0").bytes_per_s is None and LinkModel.parse("0").pacer() is None
    assert "25 MB/s per connection, 30 ms" in link.describe()
    with pytest.raises(ValueError, match="MBPS,LATENCY_MS"):
        LinkModel.parse("fast")
    with pytest.raises(ValueError, match="bytes_per_s"):
        LinkModel(bytes_per_s=-1)
    with pytest.raises(ValueError, match="first_byte_s"):
        LinkModel(first_byte_s=-0.5)


@pytest.fixture
def echo() -> Iterator[str]:
    yield from _serve(_Echo)


def test_proxy_paces_both_bodies_and_delays_the_response(echo: str) -> None:
    t = FakeTime()
    link = LinkModel(bytes_per_s=1e6, first_byte_s=0.025, clock=t.clock, sleep=t.sleep)
    body = bytes(range(256)) * 800  # 204,800 bytes: several relay pieces
    with FaultProxy(echo, link=link) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        conn.request("PUT", "/bucket/key", body=body, headers={"Content-Length": str(len(body))})
        response = conn.getresponse()
        answer = response.read()
        conn.close()
        counters = proxy.counters()
    assert response.status == 200
    assert json.loads(answer)["sha"] == hashlib.sha256(body).hexdigest()
    assert 0.025 in t.sleeps  # the first-byte latency, once
    # Each body is held to 1 MB/s on its own clock: the request's 204,800 bytes and the response's body.
    paced = sum(t.sleeps) - 0.025
    assert paced == pytest.approx((len(body) + len(answer)) / 1e6, rel=1e-6)
    assert counters.requests == 1
