"""Where this process stands in a process group: rank, size, transfer device, or no group at all.

The one rule for the device a group's collectives use lives here (:func:`group_view`): every strategy and
writer that sends tensors over a group asks its :class:`GroupView` rather than the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SOLO", "GroupView", "group_view"]


@dataclass(frozen=True)
class GroupView:
    """``rank``/``world`` are ranks *within* ``group``; ``distributed`` is False without a process group.

    ``device`` is where tensors sent over ``group`` must live: ``cpu`` for gloo, the current CUDA device
    for NCCL (the group's own choice, never assumed).
    """

    group: Any
    rank: int
    world: int
    device: torch.device
    distributed: bool

    def check_src(self, src: int, what: str) -> None:
        if not 0 <= src < self.world:
            raise ValueError(f"{what}={src} is not a rank of a process group of size {self.world}")


#: The view of a process that works alone: rank 0 of a group of one, no collectives.
SOLO = GroupView(None, 0, 1, torch.device("cpu"), False)


def group_view(group: Any = None) -> GroupView:
    """Describe ``group`` (``None``: the default group), or a single process when none is initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return SOLO
    from torch.distributed.distributed_c10d import _get_object_coll_device

    kind = _get_object_coll_device(group)
    if kind == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(kind)
    return GroupView(group, dist.get_rank(group), dist.get_world_size(group), device, True)
