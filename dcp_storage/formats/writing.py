"""How a rank's save is laid out in data files, and how its write errors are reported.

Write errors as a save reports them: the storage's own error, naming the path, not what torch made of it.

``torch.save`` into a Python stream swallows the stream's ``OSError`` and fails later with ``RuntimeError:
[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598``, which names neither the cause nor
the file. :class:`RecordingWriter` sits between the serializer and the file and keeps the first ``OSError``
the file raised; :func:`write_error` turns a failed write into the error to raise: a full disk or quota
(``ENOSPC``, ``EDQUOT``) as :class:`~dcp_storage.errors.StorageFullError` naming the path and the bytes the
file needed, any other storage error as itself (with the path), anything else unchanged.

How a rank's save is laid out in data files, and how many are written at once.

Local disks: ``thread_count`` files per rank, one thread each (torch's ``FileSystemWriter`` layout and
split, so either side reads the other's output the same way). Object stores: a request costs a round
trip and a multipart upload costs three requests more than a PUT, while a store spreads concurrent
requests over its servers, so a rank's items are split into at least ``thread_count`` objects of about
one upload part (``part_size``) each: such an object is built in memory and sent by one PUT, and several
are in flight at once, within the transport's in-flight byte budget. An item larger than a part gets an
object of its own, sent as a multipart upload whose parts go up concurrently.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_storage._torch import item_size, split_by_size_and_type
from dcp_storage.errors import StorageFullError

__all__ = [
    "FULL_ERRNOS",
    "MemoryFile",
    "RECORD_OVERHEAD",
    "RecordingWriter",
    "estimated_bytes",
    "group_items",
    "write_error",
]


FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)


class RecordingWriter:
    """A pass-through writer that remembers the first ``OSError`` its file raised (``error``)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._raw.write(data)  # type: ignore[no-any-return]
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:  # tell, writable, ... of the file
        return getattr(self._raw, name)


def _os_error(exc: BaseException, recorded: OSError | None) -> OSError | None:
    """The storage's error behind ``exc``: the recorded one, else the first ``OSError`` in its chain."""
    if recorded is not None:
        return recorded
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def write_error(
    exc: BaseException, url: str, needed: int | None = None, recorded: OSError | None = None
) -> BaseException:
    """The error to raise for ``exc``, raised while writing ``url`` (a file of about ``needed`` bytes)."""
    if isinstance(exc, StorageFullError):
        return exc
    cause = _os_error(exc, recorded)
    if cause is None:
        return exc
    if cause.errno in FULL_ERRNOS:
        return StorageFullError(url, needed, cause.errno, cause.strerror or str(cause))
    if cause is not exc and not isinstance(exc, OSError):  # torch's RuntimeError hid it: the real one
        return type(cause)(cause.errno, f"{url}: {cause.strerror or cause}")
    return exc


RECORD_OVERHEAD = 4096  # a torch.save record's zip headers and data.pkl, rounded up


def estimated_bytes(items: Sequence[WriteItem]) -> int:
    """About the stored size of ``items`` (exact for tensors up to the small per-record overhead)."""
    return sum((item_size(i) if i.type != WriteItemType.BYTE_IO else 0) + RECORD_OVERHEAD for i in items)


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
    return [b for b in split_by_size_and_type(files, list(items)) if b]


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
