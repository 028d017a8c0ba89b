"""Fixtures of the manager's tests: the crash tests' rank-launching zygote (one per session)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from crash._launcher import Zygote  # tests/ is on sys.path (rootdir-relative packages, as pytest imports them)


@pytest.fixture(scope="session")
def manager_zygote() -> Iterator[Zygote]:
    if not sys.platform.startswith("linux"):
        pytest.skip("the kill tests fork ranks from a zygote and use PR_SET_PDEATHSIG and /proc (Linux only)")
    z = Zygote()
    try:
        yield z
    finally:
        z.close()
