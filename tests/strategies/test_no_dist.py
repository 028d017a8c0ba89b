"""``dcp.load(..., no_dist=True)`` on 2 real gloo ranks, with every reader: no collective, no hang.

``if rank == 0: dcp.load(..., no_dist=True)`` (export and eval code) and every rank loading its own full
copy with ``no_dist=True`` must work with every reader, including the strategies around them and the
readers ``open_reader`` picks; a distributed load over the same readers must still work, also over a
subgroup passed as ``dcp.load(process_group=...)``. A reader that starts a collective another rank is not in
hangs: ``run_ranks``' deadline (a process-join timeout, far below the process group's) turns that into a
failure that names the stuck rank and its stack.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.every_format import every_reader, write_every_format

from . import _no_dist_fns as F

WORLD = 2
DEADLINE_S = 60.0  # a healthy run takes a few seconds


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root: Path = tmp_path_factory.mktemp("no_dist")
    return write_every_format(str(root), F.reference())


@pytest.mark.parametrize("pattern", ["rank0", "every", "dist"])
def test_every_reader_loads_without_a_hang(paths: dict[str, str], pattern: str) -> None:
    results = run_ranks(F.load_every_reader, WORLD, paths, pattern, timeout=DEADLINE_S)
    loaders = [0] if pattern == "rank0" else list(range(WORLD))
    names = list(every_reader(paths))
    for rank in range(WORLD):
        if rank not in loaders:
            assert results[rank] == {}
            continue
        assert list(results[rank]) == names
        failed = {name: outcome for name, outcome in results[rank].items() if outcome != "ok"}
        assert not failed, f"rank {rank}, pattern {pattern}: {failed}"


def test_every_reader_serves_the_load_s_process_group(paths: dict[str, str]) -> None:
    """``dcp.load(process_group=sub)`` with readers built without a group: their collectives run on ``sub``,
    so the rank outside it is never waited for."""
    results = run_ranks(F.load_on_a_subgroup, 3, paths, timeout=DEADLINE_S)
    names = list(every_reader(paths))
    assert results[2] == {}
    for rank in (0, 1):
        assert results[rank] == dict.fromkeys(names, "ok"), f"rank {rank}"


def test_broadcast_metadata_false_still_works(paths: dict[str, str]) -> None:
    """The old workaround stays a working option, in a distributed load and alone."""
    results = run_ranks(_load_without_metadata_broadcast, WORLD, paths, timeout=DEADLINE_S)
    assert results == [{"dist": "ok", "alone": "ok"}] * WORLD


def _load_without_metadata_broadcast(rank: int, world: int, paths: dict[str, str]) -> dict[str, str]:
    from dcp_storage import SafetensorsReader

    make = lambda: SafetensorsReader(paths["hf_index"], broadcast_metadata=False)  # noqa: E731
    return {"dist": F._load(make, no_dist=False), "alone": F._load(make, no_dist=True)}
