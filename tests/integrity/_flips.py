"""Byte-flip trials shared by the integrity tests: flip one byte, load or verify, restore the file."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.dcp_native.native import load_metadata
from dcp_storage.formats.reading import _landing


@contextlib.contextmanager
def flipped(path: Path, pos: int, rng: random.Random) -> Iterator[None]:
    """Byte ``pos`` of ``path`` XOR-ed with a random non-zero value inside the block; the file is restored after."""
    original = path.read_bytes()
    data = bytearray(original)
    data[pos] ^= rng.randrange(1, 256)
    path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(original)


def load_error(load: Callable[[], object]) -> str:
    """The message of what ``load()`` raises (each rank's failure for DCP's ``CheckpointException``); '' if it loads."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load()
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the message is what is checked
        failures = getattr(exc, "failures", None)
        return " ".join(str(f) for f in failures.values()) if failures else str(exc)
    return ""


def dcp_records(path: Path) -> list[tuple[str, int, int, str]]:
    """``(file, offset, length, key)`` of every record in the DCP checkpoint at ``path``."""
    md = load_metadata((path / ".metadata").read_bytes(), str(path))
    return [(i.relative_path, int(i.offset), int(i.length), idx.fqn) for idx, i in md.storage_data.items()]


def assert_block_flips_refused(
    transport: Any, file: Path, name: str, data: bytes, start: int, first: int, size: int, cover: Any, at: Iterable[int]
) -> None:
    """A local read of the whole record ``data`` (at byte ``start`` of ``file``, ``name`` to the transport, checked
    by the block ``cover``: a first block of ``first`` bytes, then ``size``) with byte ``i`` of it flipped, for each
    ``i`` in ``at``: refused, naming the block that holds it."""
    for i in at:
        bad = bytearray(data)
        bad[i] ^= 0x80
        file.write_bytes(b"\0" * start + bytes(bad))
        block = 0 if i < first else 1 + (i - first) // size
        with pytest.raises(CorruptCheckpointError, match=rf"block {block} of the record"):
            transport.read_ranges(_landing(name, start, start + len(data), memoryview(bytearray(len(data))), cover))
