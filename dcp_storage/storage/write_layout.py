"""How a rank's save is laid out in data files, and how many are written at once.

Local disks: ``thread_count`` files per rank, one thread each (torch's ``FileSystemWriter`` layout and
split, so either side reads the other's output the same way). Object stores: a request costs a round
trip and a multipart upload costs three requests more than a PUT, while a store spreads concurrent
requests over its servers, so a rank's items are split into at least ``thread_count`` objects of about
one upload part (``part_size``) each: such an object is built in memory and sent by one PUT, and several
are in flight at once, within the transport's in-flight byte budget. An item larger than a part gets an
object of its own, sent as a multipart upload whose parts go up concurrently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.filesystem import _item_size, _split_by_size_and_type
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

__all__ = ["RECORD_OVERHEAD", "MemoryFile", "estimated_bytes", "group_items"]

RECORD_OVERHEAD = 4096  # a torch.save record's zip headers and data.pkl, rounded up


def estimated_bytes(items: Sequence[WriteItem]) -> int:
    """About the stored size of ``items`` (exact for tensors up to the small per-record overhead)."""
    return sum((_item_size(i) if i.type != WriteItemType.BYTE_IO else 0) + RECORD_OVERHEAD for i in items)


def group_items(
    items: Sequence[WriteItem], *, local: bool, thread_count: int, single_file_per_rank: bool, object_bytes: int
) -> list[list[WriteItem]]:
    """The items of each data file (see the module docstring); no empty files.

    Both cases use torch's split (largest items first, each into the smallest file so far): ``thread_count``
    files locally; on object stores as many more as it takes for the files to be about ``object_bytes``.
    """
    if not single_file_per_rank:
        return [[item] for item in items]
    files = thread_count
    if not local:
        files = max(thread_count, -(-estimated_bytes(items) // object_bytes))
    return [b for b in _split_by_size_and_type(files, list(items)) if b]


class MemoryFile:
    """A write-only file in one ``bytearray``, allocated once at ``capacity`` (no regrowth copies for a
    good estimate) and trimmed to what was written: ``data`` after :meth:`close_buffer`."""

    def __init__(self, capacity: int) -> None:
        self.data = bytearray(capacity)
        self._view = memoryview(self.data)
        self._pos = 0

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        n = src.nbytes
        end = self._pos + n
        if end > len(self.data):  # the estimate was short: grow (one copy of what is there)
            self._view.release()
            self.data.extend(bytes(end - len(self.data)))
            self._view = memoryview(self.data)
        self._view[self._pos : end] = src
        self._pos = end
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """Nothing to flush: the bytes are sent whole by the caller."""

    def writable(self) -> bool:
        return True

    def close_buffer(self) -> bytearray:
        """The bytes written (the spare capacity is dropped in place)."""
        self._view.release()
        del self.data[self._pos :]
        return self.data
