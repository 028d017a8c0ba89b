"""A local byte range read and CRC-32'd per block in one native loop (``_pread_crc32``), as a default-checked
warm load reads: the same CRC-32s as ISA-L's Python function for every block layout, the truncated file named,
every flipped byte refused naming its block, and the same checks where the loop is not available."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.reading import _landing
from dcp_storage.integrity.blocks import BlockCover
from dcp_storage.integrity.checksums import checksum
from dcp_storage.transports import local_io, open_transport
from tests.integrity._flips import assert_block_flips_refused

needs_native = pytest.mark.skipif(not local_io.native_crc32_reads(), reason="_pread_crc32 not built")
START = 4096


def test_native_loop_built_in_ci() -> None:
    """CI builds the extension and finds ISA-L's CRC-32: without them a default-checked load costs twice as much."""
    if not local_io.native_crc32_reads() and os.environ.get("CI", "").lower() == "true":
        pytest.fail("dcp_storage.transports._pread_crc32 is not built, or ISA-L's crc32_gzip_refl was not found")


def _blocks(data: bytes, first: int, block: int) -> list[int]:
    bounds = [0, *range(min(first, len(data)), len(data), block), len(data)]
    return [zlib.crc32(data[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


@needs_native
@pytest.mark.parametrize(
    ("n", "first", "block", "piece"),
    [
        (5 << 20, 1 << 20, 1 << 20, 128 << 10),  # whole blocks
        ((5 << 20) + 777, 1000, 1 << 20, 128 << 10),  # a short first block (elements aligned) and a short last
        (300_000, 1 << 20, 1 << 20, 128 << 10),  # less than one block
        (1_000_003, 4096, 65_536, 100_000),  # pieces that do not divide blocks, blocks inside one piece
        (10_000, 1, 1, 3),  # one-byte blocks
        (2_000_000, 2_000_000, 4096, 1 << 20),  # the first block is all of it
    ],
)
def test_the_crc32s_are_isa_l_s_for_every_layout(tmp_path: Path, n: int, first: int, block: int, piece: int) -> None:
    data = random.Random(n).randbytes(n)
    path = tmp_path / "f.bin"
    path.write_bytes(b"\x5a" * START + data + b"tail")
    into = bytearray(n)
    fd = os.open(path, os.O_RDONLY)
    try:
        got, calls, crcs = local_io._native_crc32.pread_crc32(fd, memoryview(into), START, piece, first, block)
    finally:
        os.close(fd)
    assert (got, bytes(into)) == (n, data)
    assert calls == -(-n // piece)
    assert crcs == _blocks(data, first, block)


@needs_native
def test_a_file_that_ends_early_is_named(tmp_path: Path) -> None:
    path = tmp_path / "short.distcp"
    path.write_bytes(b"x" * 10_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpointError, match=r"short\.distcp: file ends at byte 10000"):
            local_io.pread_crc32(fd, str(path), memoryview(bytearray(20_000)), 0, 4096, 4096)
        with pytest.raises(OSError):
            local_io._native_crc32.pread_crc32(-1, memoryview(bytearray(10)), 0, 4, 4, 4)
        with pytest.raises(ValueError):
            local_io._native_crc32.pread_crc32(fd, memoryview(bytearray(10)), 0, 0, 4, 4)
        for args in ((0, 4, 4, 2**62), (0, 4, 2**62, 4), (2**62, 4, 4, 4), (0, 2**62, 4, 4)):  # no sum overflows
            with pytest.raises(ValueError):
                local_io._native_crc32.pread_crc32(fd, memoryview(bytearray(10)), *args)
        with pytest.raises(TypeError):
            local_io._native_crc32.pread_crc32(fd, b"read-only", 0, 4, 4, 4)
    finally:
        os.close(fd)


@needs_native
def test_a_short_read_then_the_rest_still_gives_every_crc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end of the file met, then the bytes there after all (it grew): the rest read, every block hashed."""
    data = random.Random(5).randbytes(300_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    real = local_io._native_crc32

    class HalfRead:
        crc32 = staticmethod(real.crc32)

        @staticmethod
        def pread_crc32(fd, view, offset, piece, first, block):  # type: ignore[no-untyped-def]
            got, calls, crcs = real.pread_crc32(fd, view[:150_000], offset, piece, first, block)
            return got, calls, crcs[:1]

    monkeypatch.setattr(local_io, "_native_crc32", HalfRead)
    fd = os.open(path, os.O_RDONLY)
    try:
        into = bytearray(len(data))
        calls, crcs = local_io.pread_crc32(fd, str(path), memoryview(into), 0, 1000, 65_536)
    finally:
        os.close(fd)
    assert bytes(into) == data and crcs == _blocks(data, 1000, 65_536) and calls >= 2


def _crc_cover(data: bytes, first: int, size: int) -> BlockCover:
    bounds = [0, first, *range(first + size, len(data), size), len(data)]
    digests = tuple(checksum(data[a:b], "crc32") for a, b in zip(bounds, bounds[1:]))
    return BlockCover(START, len(data), size, digests, "crc32", "the record", first)


@pytest.mark.parametrize("native", [True, False])
def test_a_checked_local_read_refuses_a_flip_in_any_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """CRC-32 blocks of 1 MiB: the native loop where it runs (one call per request), the Python pieces where it
    does not; either way a flipped byte anywhere is refused naming its block, and good bytes load."""
    if native and not local_io.native_crc32_reads():
        pytest.skip("_pread_crc32 not built")
    calls: list[int] = []
    if native:
        real = local_io.pread_crc32

        def spy(fd, path, view, offset, first, block):  # type: ignore[no-untyped-def]
            calls.append(view.nbytes)
            return real(fd, path, view, offset, first, block)

        monkeypatch.setattr("dcp_storage.transports.local.pread_crc32", spy)
    else:
        monkeypatch.setattr("dcp_storage.transports.local.native_crc32_reads", lambda: False)
    size, first = 1 << 20, 1000
    data = random.Random(2).randbytes(first + 9 * size + 777)
    path = tmp_path / "data.bin"
    path.write_bytes(b"\0" * START + data)
    cover = _crc_cover(data, first, size)
    transport, fpath = open_transport(str(tmp_path))
    name = os.path.join(fpath, "data.bin")
    with transport:
        into = bytearray(len(data))
        transport.read_ranges(_landing(name, START, START + len(data), memoryview(into), cover))
        assert into == data
        assert (sum(calls) == len(data) and len(calls) == 1) if native else not calls  # one run of <= 16 MiB
        at = (0, first - 1, first, first + size - 1, first + 5 * size + 12345, len(data) - 1)
        assert_block_flips_refused(transport, path, name, data, START, first, size, cover, at)


def test_crc32s_that_do_not_fit_leave_every_block_to_complete() -> None:
    """A transport handing over the wrong number of CRC-32s checks nothing by them: complete() checks all."""
    data = random.Random(4).randbytes(1000 + 3 * 4096)
    cover = _crc_cover(data, 1000, 4096)
    run = cover.run(START, START + len(data))
    assert run.crc32_blocks(START, len(data)) == (1000, 4096)
    assert run.crc32_blocks(START + 1000, len(data) - 1000) is None  # not the run's bytes
    run.crc32_digested(START, len(data), [0, 0])  # two CRC-32s for four blocks
    bad = bytearray(data)
    bad[1000 + 4096 + 7] ^= 1
    with pytest.raises(CorruptCheckpointError, match=r"block 2 of the record"):
        run.complete(memoryview(bad))
    run = cover.run(START, START + len(data))
    with pytest.raises(CorruptCheckpointError, match=r"block 0 of the record"):
        run.crc32_digested(START, len(data), [0, 0, 0, 0])  # four CRC-32s, all wrong: the first is named
    xxh = BlockCover(START, len(data), 4096, cover.digests, "xxh3_64", "the record", 1000)
    assert xxh.run(START, START + len(data)).crc32_blocks(START, len(data)) is None
