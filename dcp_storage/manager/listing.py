"""Which steps a root holds and which of them are complete: the commit marker of each step is the truth.

A step folder is *complete* when its listing holds the commit marker its format writes last
(:func:`~dcp_storage.formats.completeness.commit_marker`: ``.metadata``, a safetensors index, a single
safetensors file), *torn* when it holds anything else (the leftovers of a killed save, or of a delete
killed half way: deletion removes the marker first), and *empty* when it holds nothing.

This is the slow path, O(steps) requests: one listing of the root, one of each step folder. The manager
takes it only when its index (:mod:`.index`) is missing or wrong, and for folders the index does not name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..formats.completeness import commit_marker, list_all
from ..formats.paths import LOCK_RE
from .layout import METRICS_FILE, parse_step, step_name

__all__ = ["StepFolder", "list_steps", "read_metrics", "scan_step", "step_path"]

METRICS_LIMIT = 64 * 1024  # a metrics file holds a few numbers; never read more than this


@dataclass(frozen=True)
class StepFolder:
    """One ``step-<N>`` folder: its step, name, listing, and the commit marker found in it (``None``: torn)."""

    step: int
    name: str
    names: tuple[str, ...] = ()
    marker: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def empty(self) -> bool:
        return not self.names

    @property
    def locks(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if LOCK_RE.match(n))


def step_path(transport: Any, root: str, step: int) -> str:
    return transport.join(root, step_name(step))


def list_steps(transport: Any, root: str) -> dict[int, str]:
    """``step -> folder name`` for every ``step-<N>`` entry directly under ``root`` (one listing request).

    Two names for one step (``step-100`` beside ``step-0000000100``) keep the zero-padded one, the
    manager's own name.
    """
    found: dict[int, str] = {}
    for name in transport.listdir(root):
        step = parse_step(name)
        if step is not None and (step not in found or name == step_name(step)):
            found[step] = name
    return dict(sorted(found.items()))


def scan_step(transport: Any, root: str, step: int, name: str | None = None, *, metrics: bool = True) -> StepFolder:
    """List one step folder (one request; hidden temp files included on a local disk) and classify it."""
    name = name or step_name(step)
    names = tuple(list_all(transport, transport.join(root, name)))
    marker = commit_marker(names)
    found: dict[str, Any] = {}
    if metrics and marker is not None and METRICS_FILE in names:
        found = read_metrics(transport, transport.join(root, name, METRICS_FILE))
    return StepFolder(step, name, names, marker, found)


def read_metrics(transport: Any, path: str) -> dict[str, Any]:
    """A step's metrics file (a JSON object of numbers); ``{}`` if absent, too large or not such an object."""
    try:
        raw = transport.read_file(path, max_bytes=METRICS_LIMIT)
        data = json.loads(raw)
    except Exception:  # noqa: BLE001 - metrics are a convenience: a bad file only loses them
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
