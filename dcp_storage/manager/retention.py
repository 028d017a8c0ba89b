"""What to keep: :class:`KeepPolicy` decides which complete steps survive a save.

Only complete steps are ever passed in (torn folders are cleanup's business, never counted), and the
newest complete step always survives, whatever the policy says: a policy can never leave a root without
its last good checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["KeepPolicy"]


@dataclass(frozen=True)
class KeepPolicy:
    """Keep the last ``last`` complete steps, every step divisible by ``every``, and the ``best`` steps by
    ``metric`` (``mode="min"`` keeps the lowest values, ``"max"`` the highest).

    ``last=None`` keeps every step (nothing is ever deleted). Steps saved without the metric never count as
    best. Examples: ``KeepPolicy(last=3)``; ``KeepPolicy(last=2, every=1000)``;
    ``KeepPolicy(last=1, best=2, metric="loss", mode="min")``.
    """

    last: int | None = 3
    every: int | None = None
    best: int | None = None
    metric: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("last", "every", "best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"KeepPolicy({name}=...) must be a positive int or None, got {value!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepPolicy(mode=...) must be 'min' or 'max', got {self.mode!r}")
        if (self.best is None) != (self.metric is None):
            raise ValueError("KeepPolicy: best=K and metric='name' go together (keep the K best steps by metric)")

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, Any]] | None = None) -> set[int]:
        """The steps of ``steps`` (complete ones) to keep; the newest is always among them."""
        ordered = sorted(set(steps))
        if not ordered:
            return set()
        if self.last is None:
            return set(ordered)
        kept = set(ordered[-self.last :])
        kept.add(ordered[-1])
        if self.every is not None:
            kept.update(s for s in ordered if s % self.every == 0)
        if self.best is not None and self.metric is not None:
            kept.update(self._best(ordered, metrics or {}))
        return kept

    def delete(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, Any]] | None = None) -> list[int]:
        """The steps of ``steps`` to delete, oldest first."""
        kept = self.keep(steps, metrics)
        return sorted(s for s in set(steps) if s not in kept)

    def _best(self, ordered: list[int], metrics: Mapping[int, Mapping[str, Any]]) -> list[int]:
        scored = []
        for step in ordered:
            value = (metrics.get(step) or {}).get(str(self.metric))
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                scored.append((value if self.mode == "min" else -value, -step, step))
        return [step for *_, step in sorted(scored)[: self.best]]
