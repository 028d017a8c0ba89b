"""The index: a small JSON object at the root that caches which steps are complete.

Why: the truth (a commit marker in each step folder, :mod:`.listing`) costs one listing per step, so a
root with 1,000 steps would cost 1,001 requests to answer "which step is the latest complete one". The
index makes that three: read the index (1), check the commit marker of the step it names as *pending*
(1), else that of the newest complete step it names (1).

The coordinator writes it (one atomic PUT) at three moments of a save of step M:

1. before the save starts: ``pending = M`` (so a save killed after its commit but before step 3 is still
   found: its marker is checked first);
2. nothing during the save;
3. after the commit: ``M`` joins ``steps``, ``pending`` is cleared; steps about to be deleted move to
   ``deleting`` first and leave it once gone.

It is only a cache. Any answer from it is checked against a commit marker; an index that is absent,
unreadable, from another tool, or whose newest step has no marker, is ignored and rebuilt from a
listing, which gives the same answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.manager.layout import INDEX_FILE

__all__ = ["INDEX_LIMIT", "StepIndex", "read_index", "write_index"]

KIND = "dcp-storage-steps/1"
INDEX_LIMIT = 8 * 1024 * 1024  # ~40 bytes a step: far more steps than any job keeps


@dataclass
class StepIndex:
    """``steps``: complete step -> its commit marker's name; ``pending``: the step a save is writing;
    ``deleting``: steps whose deletion started; ``metrics``: step -> its metrics."""

    steps: dict[int, str] = field(default_factory=dict)
    pending: int | None = None
    pending_marker: str | None = None
    deleting: list[int] = field(default_factory=list)
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body = {
            "kind": KIND,
            "steps": {str(s): m for s, m in sorted(self.steps.items())},
            "pending": self.pending,
            "pending_marker": self.pending_marker,
            "deleting": sorted(self.deleting),
            "metrics": {str(s): m for s, m in sorted(self.metrics.items()) if s in self.steps},
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StepIndex | None:
        """The index in ``raw``, or ``None`` if it is not one (the caller falls back to a listing)."""
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or body.get("kind") != KIND:
                return None
            steps = {_step(s): _name(m) for s, m in body["steps"].items()}
            pending = body.get("pending")
            marker = body.get("pending_marker")
            return cls(
                steps=steps,
                pending=None if pending is None else _step(pending),
                pending_marker=None if marker is None else _name(marker),
                deleting=[_step(s) for s in body.get("deleting", [])],
                metrics={
                    _step(s): {str(k): v for k, v in m.items() if isinstance(v, (int, float))}
                    for s, m in body.get("metrics", {}).items()
                    if isinstance(m, dict)
                },
            )
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None

    @property
    def latest(self) -> int | None:
        return max(self.steps) if self.steps else None


def _step(value: Any) -> int:
    step = int(value)
    if step < 0 or isinstance(value, (bool, float)):
        raise ValueError(value)
    return step


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError(value)  # a marker name is a plain name inside the step folder, never a path
    return value


def read_index(transport: Any, root: str) -> StepIndex | None:
    """The index at ``root`` (one request), or ``None``: absent, too large, or not an index."""
    try:
        raw = transport.read_file(transport.join(root, INDEX_FILE), max_bytes=INDEX_LIMIT)
    except Exception:  # noqa: BLE001 - absent or unreadable: the listing is the truth anyway
        return None
    return StepIndex.from_json(bytes(raw))


def write_index(transport: Any, root: str, index: StepIndex) -> None:
    """Replace the index atomically (one PUT, or temp file and rename)."""
    transport.write_file(transport.join(root, INDEX_FILE), index.to_json())
