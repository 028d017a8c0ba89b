"""Fixtures of the manager's tests: the crash tests' rank-launching zygote (one per session, root ``conftest.py``)."""

from __future__ import annotations

import pytest
from crash._launcher import Zygote  # tests/ is on sys.path (rootdir-relative packages, as pytest imports them)


@pytest.fixture(scope="session")
def manager_zygote(rank_zygote: Zygote) -> Zygote:
    return rank_zygote
