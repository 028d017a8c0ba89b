"""The coordinator decides, every rank gets its answer: one broadcast of a value or of the error.

Without a process group (one process) the function just runs. With one, rank 0 of ``group`` runs it and
broadcasts ``("ok", value)`` or ``("error", exception)``; every rank returns the value or raises the
coordinator's exception, so no rank goes on alone after a failure and no collective hangs waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["agreed", "coordinator_rank", "is_coordinator"]

T = TypeVar("T")


def _distributed(group: Any) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized()


def coordinator_rank(group: Any) -> int:
    """The global rank of ``group``'s rank 0."""
    return dist.get_global_rank(group, 0) if _distributed(group) else 0


def is_coordinator(group: Any) -> bool:
    return not _distributed(group) or dist.get_rank(group) == 0


def agreed(group: Any, fn: Callable[[], T]) -> T:
    """``fn()`` run on the coordinator of ``group``; its result (or its exception) on every rank."""
    if not _distributed(group):
        return fn()
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there and here
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=coordinator_rank(group), group=group)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
