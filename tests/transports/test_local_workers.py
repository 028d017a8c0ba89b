"""How many threads a local transport reads with: the host's CPUs shared by its ranks (``LOCAL_WORLD_SIZE``)."""

from __future__ import annotations

import os

import pytest

from dcp_storage.transports import TransportConfig
from dcp_storage.transports.protocol import local_workers, resolve_config


@pytest.mark.parametrize(
    ("cpus", "ranks", "expected"),
    [(2, None, 2), (1, None, 2), (16, None, 16), (2, "2", 1), (16, "8", 2), (4, "8", 1), (8, "not a number", 8)],
)
def test_the_ranks_of_a_host_share_its_cpus(
    monkeypatch: pytest.MonkeyPatch, cpus: int, ranks: str | None, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)), raising=False)
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert local_workers() == expected
    assert resolve_config(TransportConfig(), is_local=True).max_workers == expected
    assert resolve_config(TransportConfig(), is_local=False).max_workers == 16  # object stores: requests wait
    assert resolve_config(TransportConfig(max_workers=3), is_local=True).max_workers == 3  # asked for
