"""Positioned ``O_DIRECT`` writes of a local safetensors save (:class:`~dcp_storage.formats.safetensors.reader.DirectRuns`).

Each rank writes its chunks at their final offsets; the whole 4 KiB blocks inside a long run go direct from
page-aligned stage buffers, the partial blocks at its ends (which may hold another rank's bytes) and short
runs through the page cache. Checked here: the bytes are exactly where they belong for runs of every
alignment and length, also when two writers share a block; the direct path is really taken; a file system
that refuses ``O_DIRECT`` (or its alignment) gets plain writes of the same bytes; a failed write is raised,
and a full save with two gloo ranks loads back bit-exact.
"""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

import dcp_storage.formats.safetensors.reader as st_io
from dcp_storage.formats.safetensors.reader import DirectRuns
from dcp_storage.transports import FsspecTransport
from dcp_storage_testing.distributed import run_ranks

from . import _rank_fns as R

ALIGN = DirectRuns.ALIGN
MiB = 1 << 20


def _runs(rng: random.Random, size: int) -> list[tuple[int, int]]:
    """Back-to-back runs covering ``[0, size)``: short, block-crossing, and longer than a stage buffer."""
    lengths = [1, ALIGN - 1, ALIGN + 3, 3 * MiB + 17, 2 * ALIGN, 9 * MiB + 4093, 700, 1 * MiB, MiB - 1]
    runs, at = [], 5  # the data section rarely starts on a block
    for n in lengths:
        runs.append((at, n))
        at += n
    assert at <= size
    rng.shuffle(runs)
    return runs


@pytest.fixture
def target(tmp_path: Path) -> tuple[Any, str, int]:
    size = 16 * MiB
    path = tmp_path / "f.tmp"
    with open(path, "wb") as f:
        f.truncate(size)
    transport, _root = FsspecTransport.from_url(str(tmp_path))
    return transport, str(path), size


def _write(transport: Any, path: str, payload: bytes, runs: list[tuple[int, int]]) -> None:
    out = DirectRuns(transport, path)
    try:
        for at, n in runs:
            out.write_at(memoryview(payload)[at : at + n], at)
        out.finish()
    finally:
        out.close()


def test_every_run_lands_at_its_offset_and_long_ones_go_direct(
    target: tuple[Any, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    transport, path, size = target
    payload = random.Random(1).randbytes(size)
    runs = _runs(random.Random(2), size)
    direct: list[int] = []
    real = DirectRuns._write_direct

    def noting(self: DirectRuns, view: memoryview, offset: int) -> None:
        assert offset % ALIGN == 0 and view.nbytes % ALIGN == 0
        direct.append(view.nbytes)
        real(self, view, offset)

    monkeypatch.setattr(DirectRuns, "_write_direct", noting)
    _write(transport, path, payload, runs)
    end = max(at + n for at, n in runs)
    with open(path, "rb") as f:
        assert f.read(end)[5:] == payload[5:end]
    assert sum(direct) > 12 * MiB, direct  # the runs of 1 MiB and more, but for their partial blocks


def test_two_writers_sharing_blocks_leave_both_their_bytes(target: tuple[Any, str, int]) -> None:
    """Two ranks whose runs alternate inside shared blocks (every run boundary off the 4 KiB grid)."""
    transport, path, size = target
    payload = random.Random(3).randbytes(size)
    cuts = sorted(random.Random(4).sample(range(1, size), 24)) + [size]
    runs = [(a, b - a) for a, b in zip([0, *cuts[:-1]], cuts)]
    mine = [runs[0::2], runs[1::2]]
    threads = [threading.Thread(target=_write, args=(transport, path, payload, r)) for r in mine]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(path, "rb") as f:
        assert f.read() == payload


def test_a_file_system_without_o_direct_gets_plain_writes(
    target: tuple[Any, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    transport, path, size = target
    payload = random.Random(5).randbytes(size)
    runs = _runs(random.Random(6), size)
    real_open = os.open

    def refusing(p: Any, flags: int, *a: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr(os, "open", refusing)
    _write(transport, path, payload, runs)
    with open(path, "rb") as f:
        data = f.read()
    assert all(data[at : at + n] == payload[at : at + n] for at, n in runs)


def test_a_refused_alignment_writes_that_buffer_plain(
    target: tuple[Any, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    transport, path, size = target
    payload = random.Random(7).randbytes(size)
    runs = _runs(random.Random(8), size)
    real, refused, direct_fds = st_io.pwrite_all, [], set()
    real_init = DirectRuns.__init__

    def init(self: DirectRuns, *a: Any) -> None:
        real_init(self, *a)
        direct_fds.add(self._direct)

    def picky(fd: int, view: memoryview, offset: int) -> int:
        if fd in direct_fds and not refused:  # the first direct write: as a file system refusing its alignment
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, view, offset)

    monkeypatch.setattr(DirectRuns, "__init__", init)
    monkeypatch.setattr(st_io, "pwrite_all", picky)
    _write(transport, path, payload, runs)
    assert refused
    with open(path, "rb") as f:
        data = f.read()
    assert all(data[at : at + n] == payload[at : at + n] for at, n in runs)


def test_a_failed_direct_write_is_raised(target: tuple[Any, str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    transport, path, size = target
    payload = random.Random(9).randbytes(size)

    def full(self: DirectRuns, view: memoryview, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DirectRuns, "_write_direct", full)
    with pytest.raises(OSError) as caught:
        _write(transport, path, payload, [(0, 12 * MiB)])
    assert caught.value.errno == errno.ENOSPC


def test_a_two_rank_save_loads_back_bit_exact(tmp_path: Path) -> None:
    assert run_ranks(R.direct_runs_roundtrip, 2, str(tmp_path / "ckpt")) == [True, True]
