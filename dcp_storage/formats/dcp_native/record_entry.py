"""One saved record of a DCP checkpoint, as the item loader and its in-place path address it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RecordEntry"]


@dataclass(frozen=True)
class RecordEntry:
    """One saved record: ``(relative_path, offset, length)`` from the metadata's ``_StorageInfo``."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()
