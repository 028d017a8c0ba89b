"""Block digests checked as the bytes land (``BlockRun``): pieces of any size, in order or not, or none at all, and
a local read hashing 1 MiB blocks in 256 KiB pieces: every block is checked exactly once whichever way the bytes
came, and a flipped byte anywhere is refused naming its block."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.reading import _landing
from dcp_storage.integrity.blocks import BlockCover
from dcp_storage.integrity.checksums import checksum
from dcp_storage.transports import local, open_transport
from tests.integrity._flips import assert_block_flips_refused

START, FIRST, SIZE = 4096, 1000, 64 * 1024
LENGTH = FIRST + 5 * SIZE + 3000  # a header block, five whole blocks and a short last one


def _cover(data: bytes, start: int = START, first: int = FIRST, size: int = SIZE) -> BlockCover:
    bounds = [0, first, *range(first + size, len(data), size), len(data)]
    digests = tuple(checksum(data[a:b], "xxh3_64") for a, b in zip(bounds, bounds[1:]))
    return BlockCover(start, len(data), size, digests, "xxh3_64", "the record", first)


@pytest.fixture(scope="module")
def record() -> bytes:
    return random.Random(1).randbytes(LENGTH)


@pytest.mark.parametrize("piece", [4096, SIZE, 100_000, LENGTH])
def test_pieces_in_order_check_every_block_once(record: bytes, piece: int) -> None:
    cover = _cover(record)
    run = cover.run(START, START + LENGTH)
    view = memoryview(record)
    for pos in range(0, LENGTH, piece):
        run.piece(START + pos, view[pos : pos + piece])
    run.complete(view)  # nothing left to check

    rng = random.Random(piece)
    for _ in range(6):
        bad = bytearray(record)
        at = rng.randrange(LENGTH)
        bad[at] ^= 0x10
        run, view = cover.run(START, START + LENGTH), memoryview(bad)
        block = 0 if at < FIRST else 1 + (at - FIRST) // SIZE
        with pytest.raises(CorruptCheckpointError, match=rf"block {block} of the record"):
            for pos in range(0, LENGTH, piece):
                run.piece(START + pos, view[pos : pos + piece])


def test_complete_checks_what_the_pieces_did_not(record: bytes) -> None:
    cover = _cover(record)
    bad = bytearray(record)
    bad[FIRST + 2 * SIZE + 5] ^= 0x01
    cover.run(START, START + LENGTH).complete(memoryview(record))  # a transport that never calls on_piece
    with pytest.raises(CorruptCheckpointError, match=r"block 3 of the record"):
        cover.run(START, START + LENGTH).complete(memoryview(bad))
    for data in (record, bytes(bad)):  # pieces out of order: all of it is checked at the end
        run, view = cover.run(START, START + LENGTH), memoryview(data)
        run.piece(START + FIRST, view[FIRST : FIRST + SIZE])
        run.piece(START, view[:FIRST])
        if data is record:
            run.complete(view)
        else:
            with pytest.raises(CorruptCheckpointError, match=r"block 3 of the record"):
                run.complete(view)


def test_a_local_read_hashes_large_blocks_in_hot_pieces(tmp_path: Path) -> None:
    """1 MiB blocks read in 256 KiB pieces (each hashed into its block as it lands), a flip anywhere refused."""
    size, first = 1 << 20, 1000
    data = random.Random(2).randbytes(first + 5 * size + 777)
    path = tmp_path / "data.bin"
    path.write_bytes(b"\0" * START + data)
    cover = _cover(data, START, first, size)
    transport, fpath = open_transport(str(tmp_path))
    name = os.path.join(fpath, "data.bin")
    with transport:
        into = bytearray(len(data))
        before = transport.counters.snapshot()["requests"]
        transport.read_ranges(_landing(name, START, START + len(data), memoryview(into), cover))
        assert into == data
        assert transport.counters.snapshot()["requests"] - before >= 5 * size // local.HOT_PIECE_BYTES
        inside = first + 3 * size + random.Random(3).randrange(size)
        at = (0, first - 1, first, first + size - 1, inside, len(data) - 1)
        assert_block_flips_refused(transport, path, name, data, START, first, size, cover, at)
