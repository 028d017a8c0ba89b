"""``unwrap``: the library's own error from inside torch's ``CheckpointException``.

``dcp.load`` / ``dcp.save`` run each rank's planning and I/O steps inside torch's collectives, which catch
whatever a reader, writer or planner raised on any rank and raise a ``CheckpointException`` on every rank
instead. That class derives from ``BaseException`` (``except Exception`` misses it), and keeps each rank's
exception and traceback in ``failures``. :func:`unwrap` digs ours out: the lowest rank whose failure is (or
was caused by) a :class:`~dcp_storage.errors.DcpStorageError`, else the lowest rank's failure; anything else
is returned as is. It never imports torch (``failures`` is read by duck typing), so it sits with the errors.
"""

from __future__ import annotations

from dcp_storage.errors import DcpStorageError

__all__ = ["failing_ranks", "unwrap"]


def _failures(exc: BaseException) -> dict[int, BaseException]:
    raw = getattr(exc, "failures", None)
    if type(exc).__name__ != "CheckpointException" or not isinstance(raw, dict):
        return {}
    out = {}
    for rank, failure in raw.items():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            out[int(rank)] = inner
    return out


def _ours(exc: BaseException) -> DcpStorageError | None:
    """``exc`` or the first of its causes/contexts that is one of ours (a chain at most 32 deep)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 32:
        if isinstance(current, DcpStorageError):
            return current
        current = current.__cause__ or current.__context__
        seen += 1
    return None


def failing_ranks(exc: BaseException) -> list[int]:
    """The ranks a ``CheckpointException`` reports as failed, ascending (``[]`` for any other exception)."""
    return sorted(_failures(exc))


def unwrap(exc: BaseException) -> BaseException:
    """The library's error inside ``exc`` (a torch ``CheckpointException``, whichever rank raised it).

    The lowest failing rank whose error is ours (or was caused by ours), else the lowest failing rank's
    error; ``exc`` itself when it is not a ``CheckpointException``, or is one with no failures::

        try:
            dcp.load(state, storage_reader=ds.FsspecReader(url, opts))
        except BaseException as exc:  # CheckpointException is a BaseException
            raise ds.unwrap(exc) from exc
    """
    failures = _failures(exc)
    if not failures:
        return exc
    for rank in sorted(failures):
        ours = _ours(failures[rank])
        if ours is not None:
            return ours
    return failures[min(failures)]
