"""One step folder of a manager root: its name, its listing and what it holds, its info file.

``root/step-<N>/``, N zero-padded to ten digits (a larger step gets more): only such names are the manager's
steps (``step-100`` is another tool's, or one made by hand). A folder is *complete* when its listing holds
the commit marker its format writes last, *torn* when it holds anything else, *empty* when it holds nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.formats.commit_holder import MARKER_SUFFIX
from dcp_storage.formats.location import commit_marker, list_all
from dcp_storage.formats.paths import DATA_SUFFIX, HF_SHARD_RE, LOCK_RE, MANIFEST_RE, TEMP_RE

__all__ = [
    "STEP_DIGITS",
    "STEP_INFO_FILE",
    "StepFolder",
    "list_steps",
    "parse_step",
    "read_step_info",
    "save_leftovers_only",
    "scan_step",
    "step_info",
    "step_name",
    "step_path",
]

STEP_DIGITS = 10
STEP_RE = re.compile(r"^step-(?P<n>[0-9]{1,20})$")
STEP_INFO_FILE = ".dcp_storage_step.json"  # in a step folder, written after its commit: metrics, time saved


def step_name(step: int) -> str:
    """``step-0000000100`` for step 100; ``ValueError`` for a negative or non-integer step."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step must be a non-negative int, got {step!r}")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """The step of a folder name the manager writes (``step-0000000100``), else ``None``: ``step-100`` (another
    tool's name, or one made by hand) is not one of its steps, which it opens as ``step_name(step)``."""
    match = STEP_RE.match(name.rstrip("/"))
    step = int(match["n"]) if match else None
    return step if step is not None and step_name(step) == name.rstrip("/") else None


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
    """``step -> folder name`` for every step folder directly under ``root`` (one listing request), named as
    the manager names them (:func:`parse_step`)."""
    found: dict[int, str] = {}
    for name in transport.listdir(root):
        step = parse_step(name)
        if step is not None:
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


def save_leftovers_only(names: Iterable[str]) -> bool:
    """Whether every entry of a step folder is something a save leaves: data files, temp files, manifests,
    locks and their takeover markers, the step's info file."""
    for name in names:
        lock = name
        while lock.endswith(MARKER_SUFFIX):  # a takeover's marker, or a marker's marker (commit_holder)
            lock = lock[: -len(MARKER_SUFFIX)]
        ours = name.endswith(DATA_SUFFIX) or name == STEP_INFO_FILE or LOCK_RE.match(lock)
        if not (ours or any(pattern.match(name) for pattern in (HF_SHARD_RE, TEMP_RE, MANIFEST_RE))):
            return False
    return True
