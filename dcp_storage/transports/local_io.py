"""Vectored positioned reads on local files.

``os.preadv`` fills the caller's buffers (often destination tensor memory) straight from the page cache:
no intermediate ``bytes`` object, no extra copy. Gaps between coalesced ranges land in a scratch buffer.
"""

from __future__ import annotations

import os
import threading

from ..errors import CorruptCheckpointError, FileTooLargeError
from .local_open import Confinement, open_regular

__all__ = ["LocalFiles", "preadv_exact", "read_whole"]

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


def read_whole(path: str, confinement: Confinement | None, max_bytes: int | None) -> bytes:
    """A whole regular file (inside ``confinement``); one larger than ``max_bytes`` is refused before any of
    it is read, from its size, and a file that grows while it is read stops counting at ``max_bytes + 1``."""
    fd = open_regular(path, confinement)
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise FileTooLargeError(path, size, max_bytes)
        with open(fd, "rb", closefd=False) as f:  # noqa: PTH123 - a descriptor, not a path
            return f.read(-1 if max_bytes is None else max_bytes + 1)
    finally:
        os.close(fd)
