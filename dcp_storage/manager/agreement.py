"""The coordinator decides, every rank gets its answer: the library's one coordinator broadcast.

Without a process group (one process) the function just runs. With one, rank 0 of ``group`` runs it and
every rank gets its value, or raises its error
(:func:`~dcp_storage.strategies.metadata_sharing.share_object`), so no rank goes on alone after a failure
and no collective hangs waiting for it. ``location`` (the manager's root) makes a rank given another root
raise instead of acting on the coordinator's answer about a different root.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from dcp_storage.strategies.metadata_sharing import share_object

__all__ = ["agreed", "is_coordinator"]

T = TypeVar("T")


def _distributed(group: Any) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized()


def is_coordinator(group: Any) -> bool:
    return not _distributed(group) or dist.get_rank(group) == 0


def agreed(group: Any, fn: Callable[[], T], location: str | None = None) -> T:
    """``fn()`` run on the coordinator of ``group``; its result (or its exception) on every rank."""
    if not _distributed(group):
        return fn()
    return share_object(fn, group=group, src_rank=0, location=location)
