"""Vectored positioned reads on local files.

``os.preadv`` fills the caller's buffers (often destination tensor memory) straight from the page cache:
no intermediate ``bytes`` object, no extra copy. Gaps between coalesced ranges land in a scratch buffer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable

from dcp_storage.errors import CorruptCheckpointError, FileTooLargeError
from dcp_storage.transports.local_open import Confinement, open_regular

__all__ = ["LocalFiles", "fsync_dir", "preadv_exact", "read_whole"]

_IOV_MAX = min(getattr(os, "IOV_MAX", 1024) if hasattr(os, "IOV_MAX") else 1024, 1024)


def _advance(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """Drop the first ``nbytes`` bytes from a list of buffers."""
    out: list[memoryview] = []
    for buf in buffers:
        if nbytes >= buf.nbytes:
            nbytes -= buf.nbytes
            continue
        out.append(buf[nbytes:] if nbytes else buf)
        nbytes = 0
    return out


def preadv_exact(fd: int, path: str, buffers: list[memoryview], offset: int) -> int:
    """Fill ``buffers`` in order from ``offset``; returns the number of ``preadv`` calls made.

    Raises :class:`CorruptCheckpointError` naming the file if it ends early (a truncated file).
    """
    calls = 0
    pending = [b for b in buffers if b.nbytes]
    position = offset
    while pending:
        batch = pending[:_IOV_MAX]
        want = sum(b.nbytes for b in batch)
        got = os.preadv(fd, batch, position)
        calls += 1
        if got == 0:
            size = os.fstat(fd).st_size
            raise CorruptCheckpointError(
                f"{path}: file ends at byte {size} but bytes up to {position + want} were expected (truncated file?)"
            )
        position += got
        pending = _advance(batch, got) + pending[len(batch) :]
    return calls


class LocalFiles:
    """Read-only descriptors of local files, opened on first use and shared by threads; ``close`` them all.

    Only regular files inside ``confinement`` (when given) are opened (see :mod:`.local_open`).
    """

    def __init__(self, confinement: Confinement | None = None) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._confinement = confinement

    def fd(self, path: str, where: str | None = None) -> int:
        """The descriptor of ``path``; errors (``CheckpointNotFoundError`` for a missing file) name ``where``."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = open_regular(path, self._confinement, where)
            return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


_GROWTH_PIECE = 1024 * 1024  # what a file that grows while read_whole reads it is read on in


def read_whole(path: str, confinement: Confinement | None, max_bytes: int | None) -> bytes:
    """A whole regular file (inside ``confinement``); one larger than ``max_bytes`` is refused before any of
    it is read, from its size, and a file that grows while it is read stops counting at ``max_bytes + 1``."""
    fd = open_regular(path, confinement)
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise FileTooLargeError(path, size, max_bytes)
        with open(fd, "rb", closefd=False) as f:  # noqa: PTH123 - a descriptor, not a path
            if max_bytes is None:
                return f.read()
            # read(n) allocates n bytes up front: ask for the size seen (+1 to notice growth), never the limit,
            # which would reserve the whole limit (1 GiB for a .metadata) for every small file read
            data = f.read(size + 1)
            if len(data) <= size:
                return data
            parts, total = [data], len(data)  # it grew while being read: count on up to max_bytes + 1
            while total <= max_bytes:
                piece = f.read(min(_GROWTH_PIECE, max_bytes + 1 - total))
                if not piece:
                    break
                parts.append(piece)
                total += len(piece)
            return b"".join(parts)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, do not wait


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), which the ``os`` module lacks; ``None`` elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_SYNC_RANGE = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk now, without waiting.

    A save writes gigabytes and then ``fsync``s; left alone, the kernel starts writeback only once dirty
    pages pass ``dirty_background_ratio``, so the disk idles while the writer serialises and the final
    ``fsync`` waits for nearly everything. Started range by range, the disk works while the writer does,
    and the ``fsync`` (still made: durability is unchanged) has little left. A no-op where unsupported.
    """
    if _SYNC_RANGE is not None:
        _SYNC_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(directory: str) -> None:
    """Persist a rename: fsync the directory entry (POSIX only; a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
