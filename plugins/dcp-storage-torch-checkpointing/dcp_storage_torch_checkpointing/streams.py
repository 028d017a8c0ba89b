"""The file objects a torch_checkpointing ``Storage`` returns: ranged readers and atomic writers.

Readers are ``io.RawIOBase`` with ``readinto`` (torch_checkpointing fills its buffers through it):

* :class:`RangeReader` reads ``[pos, pos + len(buffer))`` straight into the caller's buffer through the
  transport (concurrent, split, retried ranged reads); small reads are served from a read-ahead block, so
  a ``torch.load`` walking a zip's headers costs a few requests, not one per header;
* :class:`MemoryReader` serves a file already read whole (``pre_read_full_file``).

:class:`AtomicWriteStream` is the transport's ``open_atomic`` as a file object: nothing is visible until
it closes (local: temp file, ``fsync``, rename; object stores: one PUT or a completed multipart upload),
and an exception inside its ``with`` block discards everything. It buffers nothing of its own and has no
alignment rule, so any tail length is fine (torch_checkpointing's ``O_DIRECT`` stream fails on close for
a tail that is not a multiple of the block size).
"""

from __future__ import annotations

import io
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from dcp_storage.plugin_api import RangeRequest, Transport
from typing_extensions import Self

__all__ = ["AtomicWriteStream", "MemoryReader", "RangeReader"]

READ_AHEAD = 1 << 20  # a read smaller than this fetches this much and serves the next reads from it


class _SeekableReader(io.RawIOBase):
    """Position bookkeeping shared by both readers."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence!r}")
        position = base + offset
        if position < 0:
            raise OSError(22, f"negative seek position {position}")
        self._pos = position
        return position

    def readall(self) -> bytes:
        out = bytearray(max(0, self._size - self._pos))
        n = self.readinto(out) or 0
        return bytes(out[:n])


class MemoryReader(_SeekableReader):
    """A file read whole, served from memory without another copy."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._data = memoryview(data).cast("B")
        super().__init__(self._data.nbytes)

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(out.nbytes, self._size - self._pos))
        out[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._data.release()
        super().close()


class RangeReader(_SeekableReader):
    """Ranged reads of one stored file of known ``size``, each landing in the caller's buffer."""

    def __init__(self, transport: Transport, path: str, size: int) -> None:
        super().__init__(size)
        self._transport = transport
        self._path = path
        self._block = b""
        self._block_start = 0

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(out.nbytes, self._size - self._pos))
        if n == 0:
            return 0
        start, end = self._pos, self._pos + n
        lo = start - self._block_start
        if 0 <= lo and end - self._block_start <= len(self._block):
            out[:n] = memoryview(self._block)[lo : lo + n]
        elif n >= READ_AHEAD:
            self._transport.read_ranges([RangeRequest(self._path, start, end, into=out[:n])])
        else:
            block_end = min(self._size, start + READ_AHEAD)
            self._block = bytes(self._transport.read_range(self._path, start, block_end))
            self._block_start = start
            out[:n] = memoryview(self._block)[:n]
        self._pos = end
        return n


class AtomicWriteStream(io.RawIOBase):
    """A writer whose bytes appear at ``path`` whole when it closes, and never after an exception."""

    def __init__(self, transport: Transport, path: str) -> None:
        self._transport = transport
        self._path = path
        self._context: AbstractContextManager[Any] | None = None
        self._writer: Any = None

    def writable(self) -> bool:
        return True

    def _open(self) -> Any:
        if self._writer is None:
            if self.closed:
                raise ValueError(f"write to closed stream for {self._transport.url(self._path)}")
            self._context = self._transport.open_atomic(self._path)
            self._writer = self._context.__enter__()
        return self._writer

    def __enter__(self) -> Self:
        self._open()
        return self

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._open().write(view)
        return view.nbytes

    def tell(self) -> int:
        return int(self._open().tell())

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort(exc_type, exc, tb)

    def abort(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        """Discard what was written: nothing appears at the path."""
        context, self._context, self._writer = self._context, None, None
        try:
            if context is not None:
                error = exc if exc is not None else RuntimeError("write aborted")
                try:
                    context.__exit__(type(error), error, tb)
                except BaseException as raised:  # the writer re-raises what it was given: that is the abort
                    if raised is not error:
                        raise
        finally:
            super().close()

    def __del__(self) -> None:
        # io.IOBase.__del__ would close(), which commits: a stream dropped unclosed is discarded instead.
        if not self.closed:
            self.abort()

    def close(self) -> None:
        """Commit: the bytes written so far appear at the path (an empty file if nothing was written)."""
        if self.closed:
            return
        try:
            self._open()
            context, self._context, self._writer = self._context, None, None
            if context is not None:
                context.__exit__(None, None, None)
        finally:
            super().close()
