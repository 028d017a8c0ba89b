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

from dcp_storage.formats.completeness import commit_marker, list_all
from dcp_storage.formats.paths import LOCK_RE
from dcp_storage.manager.layout import STEP_INFO_FILE, parse_step, step_name

__all__ = ["StepFolder", "list_steps", "read_step_info", "scan_step", "step_info", "step_path"]

METRICS_LIMIT = 64 * 1024  # a metrics file holds a few numbers; never read more than this


@dataclass(frozen=True)
class StepFolder:
    """One ``step-<N>`` folder: its step, name, listing, and the commit marker found in it (``None``: torn)."""

    step: int
    name: str
    names: tuple[str, ...] = ()
    marker: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    saved_at: float | None = None  # when its save committed (unix time), if the manager recorded it

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
    saved_at = None
    if metrics and marker is not None and STEP_INFO_FILE in names:
        found, saved_at = read_step_info(transport, transport.join(root, name, STEP_INFO_FILE))
    return StepFolder(step, name, names, marker, found, saved_at)


def step_info(metrics: dict[str, Any] | None, saved_at: float) -> bytes:
    """The bytes of a step's info file."""
    return json.dumps({"metrics": dict(metrics or {}), "saved_at": saved_at}, sort_keys=True).encode()


def read_step_info(transport: Any, path: str) -> tuple[dict[str, Any], float | None]:
    """A step's info file: its metrics (numbers only) and when it was saved; empty if absent or bad."""
    try:
        data = json.loads(transport.read_file(path, max_bytes=METRICS_LIMIT))
    except Exception:  # noqa: BLE001 - the info is a convenience: a bad file only loses it
        return {}, None
    if not isinstance(data, dict):
        return {}, None
    raw = data.get("metrics")
    metrics = {str(k): v for k, v in raw.items() if _number(v)} if isinstance(raw, dict) else {}
    saved_at = data.get("saved_at")
    return metrics, float(saved_at) if _number(saved_at) else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
