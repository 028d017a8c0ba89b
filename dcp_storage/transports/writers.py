"""The writers an fsspec transport's :meth:`~.protocol.Transport.open_atomic` yields, and giving one up."""

from __future__ import annotations

import contextlib
from typing import IO, Any

from dcp_storage.transports.counters import TransportCounters

__all__ = ["CountingWriter", "abandon"]


class CountingWriter:
    """File wrapper that counts bytes written (and forwards everything else)."""

    def __init__(self, raw: IO[bytes], counters: TransportCounters) -> None:
        self._raw = raw
        self._counters = counters
        self.written = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes  # fsspec files return len(data): elements, not bytes, for typed views
        self._raw.write(data)
        self.written += n
        self._counters.add(bytes_written=n)
        return n

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True


def abandon(raw: Any) -> None:
    """Give up an object-store upload: abort it, and keep its finalizer from committing it.

    ``discard`` aborts a multipart upload; marking the file closed stops ``__del__`` from flushing the
    buffer (s3fs's would raise on the discarded buffer; other filesystems would commit a partial file).
    """
    discard = getattr(raw, "discard", None)
    if callable(discard):
        with contextlib.suppress(Exception):
            discard()
    with contextlib.suppress(Exception):
        raw.closed = True
