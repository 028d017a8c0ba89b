"""The file object ``open_atomic`` hands out: it copies every buffer into the upload spool.

``open_atomic`` spools a file and sends it with one retried ``obstore.put`` (see the transport); this writer
gathers small writes into private staging buffers on the way, so the spool sees few, large writes and no
caller's buffer is ever referenced after ``write`` returns. Why that matters:

obstore 0.12's ``WritableFile.write`` does not copy: it keeps a reference to the caller's buffer until the
part holding it is uploaded (at the next part boundary or at ``close``). A caller that reuses its buffer
(a staging area, a tensor being overwritten, a ``bytearray`` refilled in a loop) would upload whatever the
buffer holds *later*, silently. So every buffer is copied exactly once here, into a private ``bytearray``
that is then handed on (to the spool) and never touched again. Small writes are gathered into that staging
``bytearray`` (one spool write per ``stage_bytes`` rather than per ``write``); only immutable ``bytes`` of
at least ``stage_bytes`` go through uncopied, since nobody can change them.
"""

from __future__ import annotations

from typing import Any

from dcp_storage.plugin_api import TransportCounters

__all__ = ["CopyingWriter"]


class CopyingWriter:
    """Write-only, binary file object over an obstore ``WritableFile`` (see the module docstring)."""

    def __init__(self, raw: Any, counters: TransportCounters, stage_bytes: int) -> None:
        if stage_bytes < 1:
            raise ValueError(f"stage_bytes must be >= 1, got {stage_bytes}")
        self._raw = raw
        self._counters = counters
        self._stage_bytes = stage_bytes
        self._stage = bytearray()
        self.written = 0
        # The storage error that broke the upload, kept because a caller in between (torch's zip writer)
        # may turn it into an unrelated error ("unexpected pos ..."); the transport reports this one.
        self.failure: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = view.nbytes
        if n == 0:
            return 0
        if len(self._stage) + n > self._stage_bytes:
            self._flush_stage()
        if n >= self._stage_bytes:
            # Large: one private copy (or none for immutable bytes), straight to obstore.
            self._hand_over(data if type(data) is bytes else bytearray(view))
        else:
            self._stage += view
        self.written += n
        self._counters.add(bytes_written=n)
        return n

    def _flush_stage(self) -> None:
        if self._stage:
            handed, self._stage = self._stage, bytearray()
            self._hand_over(handed)  # obstore now owns `handed`; this object never touches it again

    def _hand_over(self, data: Any) -> None:
        try:
            self._raw.write(data)
        except Exception as exc:
            self.failure = exc
            raise

    def finish(self) -> None:
        """Hand over what is still staged (before the upload is committed)."""
        self._flush_stage()

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        """A no-op: bytes are committed only by the transport, when the ``open_atomic`` block ends."""

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False
