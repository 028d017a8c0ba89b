"""Hypothesis settings for the fuzz tests: a bounded CI run by default, a long run on request.

``HYPOTHESIS_PROFILE=long`` (or ``DCP_STORAGE_FUZZ_EXAMPLES=N``) selects the long run; see tests/README.md.
The profiles are applied per test (``@FUZZ``) rather than loaded globally, so they never change the
settings of other hypothesis tests in the same session.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["FUZZ", "PROFILE", "examples"]

_CI_EXAMPLES = 120  # per test: the whole tests/fuzz directory stays under ~30 s on a 2-core box
_LONG_EXAMPLES = 6_000

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def examples(weight: float = 1.0) -> int:
    """Examples for one test: the profile's count scaled by ``weight`` (slow targets get fewer)."""
    override = os.environ.get("DCP_STORAGE_FUZZ_EXAMPLES")
    base = int(override) if override else (_LONG_EXAMPLES if PROFILE == "long" else _CI_EXAMPLES)
    return max(10, int(base * weight))


def FUZZ(weight: float = 1.0) -> settings:
    long_run = PROFILE == "long" or bool(os.environ.get("DCP_STORAGE_FUZZ_EXAMPLES"))
    return settings(
        max_examples=examples(weight),
        deadline=None,
        derandomize=not long_run,  # CI: the same examples every run; the long run explores
        suppress_health_check=_SUPPRESS,
        print_blob=True,
    )
