"""Rank bodies for ``test_stream_failures.py``: a streamed save whose chunk fails on one rank only."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ._rank_fns import _expect_failure, _shard1_state

KEY = "blocks.1.mlp_up.weight"


class NthResolveFails(DefaultSavePlanner):
    """Raises on ``fail_rank`` at the ``nth`` resolve of ``KEY``'s data: the hash (with checksums) is the
    first, the bytes sent or uploaded the next, so ``nth=2`` fails in the middle of the chunk exchange."""

    def __init__(self, fail_rank: int, nth: int) -> None:
        super().__init__()
        self.fail_rank, self.nth, self.calls = fail_rank, nth, 0

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == self.fail_rank and write_item.index.fqn == KEY:
            self.calls += 1
            if self.calls == self.nth:
                raise RuntimeError(f"simulated crash on rank {self.fail_rank} at resolve {self.nth} of {KEY}")
        return super().resolve_data(write_item)


def fail_each(rank: int, world: int, cases: dict[str, tuple[str, dict[str, Any], int, int, str | None]]) -> dict:
    """Each case: ``(url, options, fail_rank, nth, checksum_algorithm)``; one streamed save per case."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, (url, options, fail_rank, nth, algorithm) in cases.items():
        planner = NthResolveFails(fail_rank, nth)
        out[name] = _expect_failure(_shard1_state(mesh), url, options, planner, checksum_algorithm=algorithm)
    return out
