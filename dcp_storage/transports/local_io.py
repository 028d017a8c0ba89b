"""Vectored positioned reads on local files.

``os.preadv`` fills the caller's buffers (often destination tensor memory) straight from the page cache:
no intermediate ``bytes`` object, no extra copy. Gaps between coalesced ranges land in a scratch buffer.
"""

from __future__ import annotations

import os
import threading

from ..errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["LocalFiles", "preadv_exact"]

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
    """Read-only descriptors of local files, opened on first use and shared by threads; ``close`` them all."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: str, where: str | None = None) -> int:
        """The descriptor of ``path``; a missing file raises ``CheckpointNotFoundError`` naming ``where``."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError as exc:
                    raise CheckpointNotFoundError(f"{where or path}: no such file") from exc
                self._fds[path] = fd
            return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
