"""Real multi-process save/load: FSDP2 at world size 2, resharded loads at world sizes 1, 3 and 4.

Each ``run_ranks`` call pays process start-up, so the checks are bundled: one spawn saves everything
(model to a local dir and to S3, plus an Adam checkpoint), and one spawn per load world size runs every
load of that size (both placements, both backends, and at world size 3 the optimizer round trip).
Rank bodies live in :mod:`._rank_fns`; they check bit-exactness in place and report back.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.s3_server import MotoS3Server

from . import _rank_fns as R

SAVE_WORLD = 2
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def saved(moto_server: MotoS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Run the world-size-2 save once for the whole module."""
    root: Path = tmp_path_factory.mktemp("distributed")
    s3 = moto_server.new_location("fsdp2", skip_instance_cache=True, use_listings_cache=False)
    local = str(root / "fsdp2")
    paths = {
        "local": local,
        "s3": (s3.url, s3.storage_options),
        "optim_dir": str(root / "optim"),
        "optim_full": str(root / "optim_full.pt"),
    }
    results = run_ranks(
        R.save_fsdp2,
        SAVE_WORLD,
        [(local, {}), (s3.url, s3.storage_options)],
        paths["optim_dir"],
        paths["optim_full"],
        timeout=TIMEOUT_S,
    )
    paths["save_results"] = results
    try:
        yield paths
    finally:
        bucket = s3.url.split("/")[2]
        try:
            moto_server.delete_bucket(bucket)  # moto is in-memory: give it back
        except Exception as exc:  # noqa: BLE001 - cleanup must not mask the result
            warnings.warn(f"could not delete test bucket {bucket}: {exc!r}", stacklevel=1)


def _sources(saved: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(saved["local"], {}), saved["s3"]]


def _check_reports(reports_per_rank: list[list[dict[str, Any]]], world: int) -> None:
    assert len(reports_per_rank) == world
    for rank, reports in enumerate(reports_per_rank):
        for rep in reports:
            where = f"rank {rank}/{world} {rep['placement']} {rep['url']}"
            assert rep["mismatched"] == [], f"{where}: tensors differ from the reference: {rep['mismatched']}"
            # Shard(0) loads read contiguous row ranges; Shard(1) without coalescing reads exact runs.
            # Shard(1) with coalescing reads the gap bytes between rows on purpose, so it is not bounded.
            # On S3 the default 256 KiB coalescing gap may add up to a few gaps per file: on this ~18 MB
            # model that is ~13% at world size 4 (on real shard sizes it vanishes), hence a looser bound.
            if rep["placement"] in ("Shard(0)", "Shard(1) gap=0"):
                limit = R.MAX_READ_RATIO if "://" not in rep["url"] else R.MAX_READ_RATIO_REMOTE
                ratio = rep["bytes_read"] / rep["needed"]
                assert ratio <= limit, (
                    f"{where}: read {rep['bytes_read']} bytes for {rep['needed']} bytes of local shards "
                    f"({ratio:.3f}x > {limit}x)"
                )


def test_save_world2(saved: dict[str, Any]) -> None:
    results = saved["save_results"]
    assert len(results) == SAVE_WORLD
    local_ckpt = Path(saved["local"])
    names = sorted(p.name for p in local_ckpt.iterdir())
    assert ".metadata" in names
    assert {n for n in names if n.endswith(".distcp")} >= {"__0_0.distcp", "__1_0.distcp"}
    assert not [n for n in names if n.endswith(".tmp")]
    # Every rank wrote its own shard bytes (about half the model each), nothing else.
    written = [r["counters"][0]["bytes_written"] for r in results]
    assert min(written) > 0.4 * sum(written)
    assert results[0]["state_keys"], "Adam produced no state to round-trip"


def test_load_world1_full_tensors(saved: dict[str, Any]) -> None:
    (reports,) = run_ranks(R.load_full, 1, _sources(saved), timeout=TIMEOUT_S)
    for rep in reports:
        assert rep["mismatched"] == [], f"{rep['url']}: {rep['mismatched']}"
        assert rep["bytes_read"] <= R.MAX_READ_RATIO * rep["needed"], rep


def test_load_world3_resharded_and_optimizer(saved: dict[str, Any]) -> None:
    results = run_ranks(
        R.load_world3,
        3,
        _sources(saved),
        saved["local"],
        saved["optim_dir"],
        saved["optim_full"],
        timeout=TIMEOUT_S,
    )
    _check_reports([r["reshard"] for r in results], 3)
    expected_keys = saved["save_results"][0]["state_keys"]
    for rank, r in enumerate(results):
        optim = r["optim"]
        assert optim["mismatched"] == [], f"rank {rank}: optimizer round trip differs: {optim['mismatched']}"
        assert optim["state_keys"] == expected_keys
        assert optim["compared"] == 3 * len(expected_keys)  # step, exp_avg, exp_avg_sq per parameter
        assert optim["lrs"] == [1e-2], f"rank {rank}: param_groups not restored: lr {optim['lrs']}"


def test_load_world4_resharded(saved: dict[str, Any]) -> None:
    results = run_ranks(R.load_resharded, 4, _sources(saved), timeout=TIMEOUT_S)
    _check_reports(results, 4)
