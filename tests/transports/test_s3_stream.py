"""ScatterSink: chunks of a coalesced range land in their segments' buffers, gaps dropped."""

from __future__ import annotations

import random

import pytest

from dcp_storage.transports.s3_stream import ScatterSink


@pytest.mark.parametrize("seed", range(20))
def test_scatter_sink_random_chunking(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.randint(1, 5000)
    source = bytes(rng.getrandbits(8) for _ in range(total))
    # random non-overlapping segments with gaps
    cuts = sorted(rng.sample(range(total + 1), k=min(total + 1, 2 * rng.randint(1, 8))))
    segments = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2) if cuts[i] < cuts[i + 1]]
    buffers = [bytearray(hi - lo) for lo, hi in segments]
    sink = ScatterSink([(lo, hi, memoryview(buf)) for (lo, hi), buf in zip(segments, buffers)])
    pos = 0
    while pos < total:
        n = rng.randint(1, 700)
        sink.write(pos, memoryview(source)[pos : pos + n])
        pos += n
    for (lo, hi), buf in zip(segments, buffers):
        assert bytes(buf) == source[lo:hi]


def test_scatter_sink_resume_after_reset() -> None:
    source = bytes(range(256)) * 4
    buf = bytearray(len(source))
    sink = ScatterSink([(0, len(source), memoryview(buf))])
    sink.write(0, memoryview(source)[:300])
    sink.reset()  # a retry resumes from byte 300
    sink.write(300, memoryview(source)[300:])
    assert bytes(buf) == source
