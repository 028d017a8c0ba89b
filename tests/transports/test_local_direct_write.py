"""Local saves write through page-aligned buffers with ``O_DIRECT`` (``LocalWriter``): the same bytes as a
plain write for every size and split of writes, the flag really on for large files, plain writes where the
file system refuses it, and a failing write raised to the caller with nothing left behind."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import threading
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_storage.transports.local as local
from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.transports.local import LocalTransport, LocalWriter

STAGE = LocalWriter.STAGE_BYTES


def _transport(root: str) -> LocalTransport:
    transport, _ = LocalTransport.from_url(root, {})
    return transport  # type: ignore[return-value]


def _assert_round_trip(tmp_path: Any, data: bytes) -> None:
    """One ``write`` of ``data`` through ``open_atomic``; the file then holds exactly ``data``."""
    transport = _transport(str(tmp_path))
    path = transport.join(str(tmp_path), "f.bin")
    with transport.open_atomic(path) as f:
        f.write(data)
    with open(path, "rb") as got:
        assert got.read() == data


def _pieces(data: bytes, seed: int) -> list[memoryview]:
    """``data`` cut at random points: tiny writes (zip headers) and long ones (a tensor's elements)."""
    rng = random.Random(seed)
    view, out, pos = memoryview(data), [], 0
    while pos < len(data):
        n = rng.choice([1, 7, 4096, 300_000, STAGE - 3, 2 * STAGE + 5])
        out.append(view[pos : pos + n])
        pos += n
    return out


@pytest.mark.parametrize(
    "size", [0, 1, 4095, 4096, STAGE - 1, STAGE, STAGE + 1, 2 * STAGE, 2 * STAGE + 4097, 3 * STAGE + 123]
)
def test_bytes_on_disk_are_the_bytes_written(tmp_path: Any, size: int) -> None:
    data = random.Random(size).randbytes(size)
    transport = _transport(str(tmp_path))
    path = transport.join(str(tmp_path), "f.bin")
    with transport.open_atomic(path) as f:
        for piece in _pieces(data, size):
            assert f.write(piece) == piece.nbytes
        assert f.tell() == size
    with open(path, "rb") as got:
        assert got.read() == data
    assert [n for n in os.listdir(tmp_path) if n != "f.bin"] == []  # no temp file left


def _spy_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int, int]]:
    """Every ``pwrite`` of the writer: (``O_DIRECT`` on, offset, size)."""
    seen: list[tuple[bool, int, int]] = []
    real = local._pwrite_all

    def spy(fd: int, view: memoryview, offset: int) -> None:
        seen.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, view.nbytes))
        real(fd, view, offset)

    monkeypatch.setattr(local, "_pwrite_all", spy)
    return seen


def test_a_large_file_is_written_with_o_direct_a_small_one_plainly(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _spy_writes(monkeypatch)
    transport = _transport(str(tmp_path))
    with transport.open_atomic(transport.join(str(tmp_path), "big")) as f:
        f.write(bytes(3 * STAGE + 100))
    big, seen[:] = list(seen), []
    with transport.open_atomic(transport.join(str(tmp_path), "small")) as f:
        f.write(b"x" * 5000)
    if not any(direct for direct, _, _ in big):
        pytest.skip("this file system refuses O_DIRECT; the plain path is what ran")
    assert [direct for direct, _, _ in big] == [True] * (len(big) - 1) + [False], big  # the 100-byte tail plain
    assert big[-1][2] == 100 and all(n % 4096 == 0 and n <= STAGE for _, _, n in big[:-1])
    assert [o for _, o, _ in big] == [sum(n for _, _, n in big[:i]) for i in range(len(big))]  # contiguous
    assert seen == [(False, 0, 5000)]


def test_an_idle_disk_gets_the_first_mib_at_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in flight: the first ``EARLY_BYTES`` go to the disk while the caller is still writing."""
    seen = _spy_writes(monkeypatch)
    transport = _transport(str(tmp_path))
    piece = bytes(64 * 1024)
    with transport.open_atomic(transport.join(str(tmp_path), "f")) as f:
        for _ in range(LocalWriter.EARLY_BYTES // len(piece)):
            f.write(piece)
        f._wait()  # type: ignore[attr-defined]
        assert seen and seen[0][1:] == (0, LocalWriter.EARLY_BYTES), seen  # out before finish
        f.write(piece)


@pytest.mark.parametrize("seed", range(6))
def test_hand_overs_at_any_fill_level_keep_the_bytes_and_the_alignment(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """The disk seen idle at random moments: buffers go out part-filled, their tails under 4 KiB carried
    into the next one. Every direct write stays 4 KiB aligned and the file holds exactly what was written."""
    rng = random.Random(seed)
    monkeypatch.setattr(local._DISK_WRITES, "idle", lambda: rng.random() < 0.3)
    seen = _spy_writes(monkeypatch)
    data = random.Random(100 + seed).randbytes(2 * STAGE + rng.randrange(3 * 4096))
    transport = _transport(str(tmp_path))
    path = transport.join(str(tmp_path), "f.bin")
    view, pos = memoryview(data), 0
    with transport.open_atomic(path) as f:
        while pos < len(data):
            n = rng.choice([1, 7, 4096, 5000, 300_000, 1_500_000])
            f.write(view[pos : pos + n])
            pos += n
    with open(path, "rb") as got:
        assert got.read() == data
    assert all(o % 4096 == 0 and n % 4096 == 0 for direct, o, n in seen if direct), seen
    assert sum(1 for _, _, n in seen if n < STAGE) > 3  # part-filled buffers went out


def test_where_o_direct_is_refused_plain_writes_give_the_same_bytes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LocalWriter, "_set_direct", lambda self, on: False)
    _assert_round_trip(tmp_path, random.Random(3).randbytes(2 * STAGE + 777))


def test_an_alignment_the_disk_refuses_falls_back_to_plain_writes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device whose direct-I/O alignment is larger than 4 KiB answers ``EINVAL``: the same buffer is
    written plainly and the rest of the file too."""
    real = local._pwrite_all

    def picky(fd: int, view: memoryview, offset: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, view, offset)

    monkeypatch.setattr(local, "_pwrite_all", picky)
    _assert_round_trip(tmp_path, random.Random(4).randbytes(3 * STAGE + 4097))


def test_a_failing_disk_write_reaches_the_caller_and_leaves_nothing(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk thread's ``ENOSPC`` is raised by a later ``write`` (or the commit) in the caller's thread;
    the temp file is removed and no file appears."""
    calls = {"n": 0}
    real = local._pwrite_all

    def full(fd: int, view: memoryview, offset: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, view, offset)

    monkeypatch.setattr(local, "_pwrite_all", full)
    transport = _transport(str(tmp_path))
    path = transport.join(str(tmp_path), "f.bin")
    with pytest.raises(OSError) as caught, transport.open_atomic(path) as f:
        for _ in range(6):
            f.write(bytes(STAGE))
    assert caught.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_a_write_when_the_disk_thread_takes_no_more_work_is_made_in_the_caller(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At interpreter shutdown thread pools refuse new work: the buffer is written by the caller instead (the
    same bytes, no error), and no write is left counted as in flight."""
    from concurrent.futures import ThreadPoolExecutor

    closed = ThreadPoolExecutor(1)
    closed.shutdown()
    monkeypatch.setattr(local, "_disk_thread", lambda: closed)
    _assert_round_trip(tmp_path, random.Random(5).randbytes(2 * STAGE + 4097))
    assert local._DISK_WRITES.idle()


def test_a_child_forked_during_a_write_starts_with_no_write_in_flight(tmp_path: Any) -> None:
    local._DISK_WRITES.started()  # as if the parent's disk thread were writing at the fork
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's outcome is its exit status
            os._exit(0 if local._DISK_WRITES.idle() else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        local._DISK_WRITES.ended()
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_disk_thread_is_the_process_s_own_after_fork(tmp_path: Any) -> None:
    """A child forked after a save has no copy of the parent's disk thread: it gets one of its own, and its
    save completes (a stale executor would queue the write forever)."""
    transport = _transport(str(tmp_path))
    with transport.open_atomic(transport.join(str(tmp_path), "parent")) as f:
        f.write(bytes(2 * STAGE))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's outcome is its exit status
        code = 1
        try:
            timer = threading.Timer(60, lambda: os._exit(3))
            timer.start()
            with transport.open_atomic(transport.join(str(tmp_path), "child")) as f:
                f.write(bytes(2 * STAGE + 1))
            code = 0 if os.path.getsize(transport.join(str(tmp_path), "child")) == 2 * STAGE + 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_dcp_save_through_o_direct_loads_bit_exact_with_torch_s_reader(tmp_path: Any) -> None:
    torch.manual_seed(0)
    state = {
        "big": torch.randn(3 * STAGE // 4 + 1001),  # several buffers and an unaligned tail
        "small": torch.arange(7, dtype=torch.int16),
        "bf16": torch.randn(123_457).to(torch.bfloat16),
    }
    dcp.save(state, storage_writer=FsspecWriter(str(tmp_path), thread_count=2), no_dist=True)
    for reader in (FsspecReader(str(tmp_path)), dcp.FileSystemReader(str(tmp_path))):
        got = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(got, storage_reader=reader, no_dist=True)
        for key, value in state.items():
            assert torch.equal(got[key].view(torch.uint8), value.view(torch.uint8)), key
