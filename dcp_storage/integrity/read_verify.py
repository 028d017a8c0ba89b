"""Checking records against their recorded checksums while a reader loads them.

A reader with ``verify`` fetches every record it touches whole (the resharding path would read only
slices, which cannot be checked), hashes it, and decodes from those same bytes, so what lands in the
destination is exactly what was checked. Records are fetched in batches of at most ``budget`` bytes (the
loader's staging limit, or one record if larger), so memory stays bounded however much a rank loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.integrity.blocks import FIX
from dcp_storage.integrity.checksums import Hasher, checksum, mismatch, new_hasher
from dcp_storage.integrity.manifest import Manifest

__all__ = ["RecordVerifier", "batches_by_bytes", "key_name"]

_MAX_KEYS_NAMED = 5


def key_name(index: Any) -> str:
    """``'fqn'``, or ``'fqn' (chunk at [o, ...])`` for a shard that does not start at the origin."""
    offsets = [int(o) for o in (index.offset or ())]
    return repr(index.fqn) + (f" (chunk at {offsets})" if any(offsets) else "")


def _keys(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:_MAX_KEYS_NAMED])
    return shown + (f" and {len(keys) - _MAX_KEYS_NAMED} more" if len(keys) > _MAX_KEYS_NAMED else "")


class RecordVerifier:
    """Checks whole records ``(file, offset, length)`` against a manifest's checksums.

    ``keys`` maps a record to the state-dict keys stored there (for the error); ``url_of`` turns a
    checkpoint-relative file name into the URL to report.
    """

    def __init__(self, manifest: Manifest, url_of: Callable[[str], str], keys: dict[tuple[str, int, int], list[str]]):
        if manifest.algorithm is None:
            raise ValueError("RecordVerifier needs a manifest with checksums")
        self.manifest = manifest
        self.algorithm = manifest.algorithm
        self.url_of = url_of
        self.keys = keys
        self.checked = 0
        self.checked_bytes = 0

    @classmethod
    def for_storage(cls, manifest: Manifest, url_of: Callable[[str], str], storage: dict[Any, Any]) -> RecordVerifier:
        keys: dict[tuple[str, int, int], list[str]] = {}
        for index, info in storage.items():
            rec = (info.relative_path, int(info.offset), int(info.length))
            keys.setdefault(rec, []).append(key_name(index))
        return cls(manifest, url_of, keys)

    def check(self, file: str, offset: int, length: int, data: Any) -> None:
        """Raise :class:`CorruptCheckpointError` (URL, file, byte range, keys) unless ``data`` matches."""
        self.check_digest(file, offset, length, checksum(data, self.algorithm))

    def hasher(self) -> Hasher:
        """A fresh incremental hasher of the manifest's algorithm (to hash a record read in pieces)."""
        return new_hasher(self.algorithm)

    def check_digest(self, file: str, offset: int, length: int, got: str) -> None:
        """Like :meth:`check`, for a record the caller hashed (in pieces): ``got`` is its hex digest."""
        where = f"{self.url_of(file)} bytes [{offset}, {offset + length})"
        keys = _keys(self.keys.get((file, offset, length), []))
        expected = self.manifest.item(file, offset, length)
        if expected is None:
            raise CorruptCheckpointError(
                f"{where} (holding {keys or 'unknown keys'}): the manifest records no checksum for this record; the "
                "metadata and the manifest disagree"
            )
        if got != expected.digest:
            raise CorruptCheckpointError(
                f"{where} (holding {keys or 'unknown keys'}): {mismatch(self.algorithm, expected.digest)}: the stored "
                f"bytes changed after they were written, or the storage returned other bytes; {FIX}"
            )
        self.checked += 1
        self.checked_bytes += length


def batches_by_bytes(items: Iterable[Any], size_of: Callable[[Any], int], budget: int) -> Iterator[list[Any]]:
    """Consecutive groups of ``items`` whose sizes add up to at most ``budget`` (or a single larger item)."""
    batch: list[Any] = []
    total = 0
    for item in items:
        n = size_of(item)
        if batch and total + n > budget:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch
