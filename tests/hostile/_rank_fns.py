"""Rank bodies for ``test_ranks.py`` (module-level, importable: ``run_ranks`` unpickles them by name)."""

from __future__ import annotations

import dataclasses
from typing import Any


def load_cases(rank: int, world: int, cases: list[Any], entries: list[str]) -> list[dict[str, Any]]:
    """Run every case through every entry point on this rank; plain outcome dicts for the parent to judge."""
    import logging
    import warnings

    from .harness import run_entry

    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)  # expected fallback warnings
    warnings.simplefilter("ignore")
    return [dataclasses.asdict(run_entry(case, entry)) for case in cases for entry in entries]
