"""Carrying each record's checksum from the rank that wrote it to the coordinator's ``finish``.

``WriteResult.storage_data`` travels to the coordinator by pickle; :class:`ChecksummedStorage` wraps
torch's ``_StorageInfo`` with the record's checksum on the way and is unwrapped in ``finish``, so
``.metadata`` holds plain ``_StorageInfo`` objects that torch's readers (and its allow-list) accept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ChecksummedStorage", "unwrap_results"]


@dataclass(frozen=True)
class ChecksummedStorage:
    """A record's ``_StorageInfo`` plus ``(algorithm, digest)`` of its stored bytes, and its block digests."""

    info: Any
    algorithm: str
    digest: str
    blocks: tuple[str, ...] = ()
    first_block: int = 0  # the length of a short first block (the record's header), 0 for none
    block_size: int = 0  # of its blocks (0: the manifest's)


def unwrap_results(
    results: Iterable[Iterable[Any]],
) -> tuple[dict[Any, Any], list[tuple[Any, ...]], set[str]]:
    """``{index: _StorageInfo}``, the ``(file, offset, length, digest, blocks, first_block)`` records and the algorithms seen."""
    storage: dict[Any, Any] = {}
    records: list[tuple[Any, ...]] = []
    algorithms: set[str] = set()
    for rank_results in results:
        for wr in rank_results:
            data = wr.storage_data
            if isinstance(data, ChecksummedStorage):
                info = data.info
                blocks = getattr(data, "blocks", ())  # pickled by an older dcp-storage: none
                first, size = getattr(data, "first_block", 0), getattr(data, "block_size", 0)
                records.append(
                    (info.relative_path, int(info.offset), int(info.length), data.digest, blocks, first, size)
                )
                algorithms.add(data.algorithm)
                data = info
            storage[wr.index] = data
    return storage, records, algorithms
