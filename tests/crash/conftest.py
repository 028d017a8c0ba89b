"""Fixtures of the crash tests: one rank-launching zygote for the whole session (its start costs seconds)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from ._launcher import Zygote


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    if not sys.platform.startswith("linux"):
        pytest.skip("the crash tests fork ranks from a zygote and use PR_SET_PDEATHSIG and /proc (Linux only)")
    z = Zygote()
    try:
        yield z
    finally:
        z.close()
