"""Writing DCP items through stream-transform extensions (compression, ...), exactly as torch does.

torch's ``FileSystemWriter(_extensions=[...])`` wraps each item's output stream in every extension's
``transform_to`` (the last extension outermost), writes the item, closes the chain, and records
``[ext.get_descriptor() for ext in reversed(extensions)]`` as the item's ``transform_descriptors`` (or
``None`` when there are no extensions). :class:`ItemEncoder` does the same, so torch's
``FileSystemReader`` with an ``ExtensionRegistry`` holding the extensions reads our output and ours
reads torch's.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

from torch.distributed.checkpoint._extension import StreamTransformExtension

__all__ = ["ItemEncoder"]


class _NoCloseWriter(io.RawIOBase):
    """The file stream as the innermost transform sees it: closing the chain must not close the file
    (the next item is appended to it), only flush it."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        if not self.closed:
            self.raw.flush()
        super().close()


class ItemEncoder:
    """Encodes items through ``extensions`` (an empty sequence writes them unchanged).

    Raises ``TypeError`` for an extension that is not a ``StreamTransformExtension``.
    """

    def __init__(self, extensions: Sequence[StreamTransformExtension] | None = None) -> None:
        self.extensions: tuple[StreamTransformExtension, ...] = tuple(extensions or ())
        for ext in self.extensions:
            if not isinstance(ext, StreamTransformExtension):
                raise TypeError(
                    f"extensions must be torch StreamTransformExtension instances, got {type(ext).__name__}"
                )
        descriptors = [ext.get_descriptor() for ext in reversed(self.extensions)]
        self.descriptors: list[str] | None = descriptors or None  # what torch records in _StorageInfo

    @contextmanager
    def open(self, stream: Any) -> Iterator[IO[bytes]]:
        """A stream whose writes land, transformed, in ``stream``; the chain is closed (flushing the
        extensions' trailers) on exit, ``stream`` itself stays open."""
        if not self.extensions:
            yield stream
            return
        out: Any = _NoCloseWriter(stream)
        for ext in self.extensions:
            out = ext.transform_to(out)
        yield out
        out.close()
