"""torch's rank-local metadata fallback, made to fail once.

``dcp.load`` first calls ``reader.read_metadata()``; if that raises, it logs a traceback ("Global metadata is
not found. Falling back to rank local metadata."), calls ``reader.read_metadata(rank=r)`` (for checkpoints
saved without collectives, which write ``__r.metadata``), and when that fails too raises one
``AssertionError("metadata is None; global metadata read failed: X; rank local metadata read failed: Y")``
where X and Y are, for a bad password or a missing bucket, the same message twice (with a second logged
traceback).

A reader records its global failure (:class:`MetadataFailure`), and the fallback tries the rank-local file
only when the global one was simply missing; when it is missing too, or the global read failed otherwise,
the fallback returns ``None``, which torch takes as "no metadata" and reports with the global error alone.
``dcp_storage.load`` (:mod:`dcp_storage.load_save`) then raises the recorded error itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from dcp_storage.errors import BucketNotFoundError, CheckpointNotFoundError, IncompleteCheckpointError

__all__ = ["MetadataFailure"]

T = TypeVar("T")


class MetadataFailure:
    """What the last global ``read_metadata()`` of one reader raised (``error``), for the fallback to see."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def global_read(self, read: Callable[[], T]) -> T:
        """``read()``, remembering its error (``None`` after a success)."""
        try:
            value = read()
        except Exception as exc:
            self.error = exc
            raise
        self.error = None
        return value

    def rank_read(self, read: Callable[[], T]) -> T | None:
        """torch's fallback: ``read()`` if the global metadata was only missing, else ``None`` (reported once)."""
        first = self.error
        if first is not None and not _only_missing(first):
            return None
        try:
            return read()
        except CheckpointNotFoundError:
            if first is None:
                raise  # a direct call (not torch's fallback): the caller asked for this rank's file
            return None


def _only_missing(exc: Any) -> bool:
    """A missing ``.metadata`` (a rank-local one may exist): not an interrupted save, a missing bucket, or else."""
    return isinstance(exc, CheckpointNotFoundError) and not isinstance(
        exc, (IncompleteCheckpointError, BucketNotFoundError)
    )
