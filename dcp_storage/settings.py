"""Whole-number settings read from the environment: the one parser for every limit a user may tune.

Byte limits of files read whole (:mod:`dcp_storage.formats.limits`), the lazy-metadata threshold and the
listing bounds (:mod:`dcp_storage.transports.listing`) are read at each use through :func:`count_setting`,
so a process can change one before a load, and a bad value fails naming the variable.
"""

from __future__ import annotations

import os

__all__ = ["count_setting"]


def count_setting(env: str, default: int, unit: str) -> int:
    """The whole, non-negative number in environment variable ``env`` (``default`` when unset or blank);
    ``ValueError`` naming the variable and ``unit`` for anything else."""
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not a whole number of {unit}") from None
    if value < 0:
        raise ValueError(f"{env}={raw!r} must not be negative")
    return value
