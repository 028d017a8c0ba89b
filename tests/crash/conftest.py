"""Fixtures of the crash tests: the session's rank-launching zygote (root ``conftest.py``; its start costs seconds)."""

from __future__ import annotations

import pytest

from ._launcher import Zygote


@pytest.fixture(scope="session")
def zygote(rank_zygote: Zygote) -> Zygote:
    return rank_zygote
