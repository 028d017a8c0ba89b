"""Where each step lives: ``root/step-<N>/``, N zero-padded so that a listing sorts by step.

Ten digits cover any step count a job reaches; a larger step gets more digits (still parsed, and still
sorted by the listing code, which sorts by the number, never by the name).
"""

from __future__ import annotations

import re

__all__ = ["INDEX_FILE", "STEP_INFO_FILE", "STEP_DIGITS", "parse_step", "step_name"]

STEP_DIGITS = 10
STEP_RE = re.compile(r"^step-(?P<n>[0-9]{1,20})$")
INDEX_FILE = ".dcp_storage_steps.json"  # at the root: the cache of the complete steps (see .index)
STEP_INFO_FILE = ".dcp_storage_step.json"  # in a step folder, written after its commit: metrics, time saved


def step_name(step: int) -> str:
    """``step-0000000100`` for step 100; ``ValueError`` for a negative or non-integer step."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step must be a non-negative int, got {step!r}")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """The step of a folder name such as ``step-0000000100`` (or ``step-100``), else ``None``."""
    match = STEP_RE.match(name.rstrip("/"))
    return int(match["n"]) if match else None
