"""Vectored positioned reads on local files.

``os.preadv`` fills the caller's buffers (often destination tensor memory) straight from the page cache:
no intermediate ``bytes`` object, no extra copy. Gaps between coalesced ranges land in a scratch buffer.
"""

from __future__ import annotations

import os

from ..errors import CorruptCheckpointError

__all__ = ["preadv_exact"]

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
                f"{path}: file ends at byte {size} but bytes up to {position + want} were expected "
                "(truncated file?)"
            )
        position += got
        pending = _advance(batch, got) + pending[len(batch) :]
    return calls
