"""Coordinator-reads strategies on real gloo ranks: ``BroadcastingTorchSaveReader`` and ``Broadcasting``.

Three ``run_ranks`` spawns in all (each pays process start-up):

* world size 2: save a 2-rank FSDP2 DCP checkpoint; load the ``torch.save`` file (local and ``s3://``) into
  ``Shard(0)``/``Shard(1)`` DTensors and full tensors;
* world size 3: the same loads, ``Broadcasting(FsspecReader(...))`` over the 2-rank DCP checkpoint, and
  ``share_object``;
* world size 3: bad and malicious files, which must fail on every rank, fast.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.s3_server import MotoS3Server

from . import _rank_fns as R

TIMEOUT_S = 120.0
BAD_FILES_BUDGET_S = 30.0


class _Marker:
    """Unpickling this opens (creates) ``path``: the payload that must never run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def files(moto_server: MotoS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root: Path = tmp_path_factory.mktemp("broadcast")
    local = str(root / "model.pt")
    torch.save(R.build_torch_save_state(), local)
    s3 = moto_server.new_location("bcast", skip_instance_cache=True, use_listings_cache=False)
    s3_file = s3.url + "/model.pt"
    fs = fsspec.filesystem("s3", **s3.storage_options)
    fs.put(local, s3_file)
    try:
        yield {
            "local": local,
            "size": os.path.getsize(local),
            "sources": [(local, {}), (s3_file, s3.storage_options)],
            "dcp_dir": str(root / "fsdp2_dcp"),
            "root": root,
        }
    finally:
        with contextlib.suppress(Exception):  # cleanup must not mask the result
            moto_server.delete_bucket(s3.url.split("/")[2])


@pytest.fixture(scope="module")
def world2(files: dict[str, Any]) -> list[dict[str, Any]]:
    return run_ranks(R.world2, 2, files["local"], files["sources"], files["dcp_dir"], timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def world3(files: dict[str, Any], world2: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return run_ranks(R.world3, 3, files["local"], files["sources"], files["dcp_dir"], timeout=TIMEOUT_S)


def _check_loads(results: list[dict[str, Any]], files: dict[str, Any]) -> None:
    world = len(results)
    by_case: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rank, res in enumerate(results):
        for rep in res["loads"]:
            where = f"rank {rank}/{world} {rep['case']} {rep['url']}"
            assert rep["mismatched"] == [], f"{where}: tensors differ from torch.load: {rep['mismatched']}"
            if rep["case"] == "full+values":
                assert rep["values"] == (1234, "tiny-transformer"), where
            if rank != 0:
                assert rep["storage"]["requests"] == 0, f"{where}: a non-coordinator touched storage"
                ratio = rep["bytes_received"] / rep["needed"]
                assert 0.99 <= ratio <= R.MAX_RECEIVE_RATIO, f"{where}: received {ratio:.3f}x its shards"
            else:
                assert rep["bytes_received"] == 0
            by_case.setdefault((rep["url"], rep["case"]), []).append(rep)
    for (url, case), reps in by_case.items():
        coord = reps[0]
        read = coord["storage"]["bytes_read"]
        assert 0.95 * files["size"] <= read <= 1.10 * files["size"], (
            f"{url} {case}: the coordinator read {read} bytes of a {files['size']}-byte file"
        )
        shipped = sum(coord["sent_per_rank"].values())
        assert shipped == sum(r["bytes_received"] for r in reps[1:]), f"{url} {case}: sent != received"


def test_torch_save_world2(world2: list[dict[str, Any]], files: dict[str, Any]) -> None:
    _check_loads(world2, files)


def test_torch_save_world3(world3: list[dict[str, Any]], files: dict[str, Any]) -> None:
    _check_loads(world3, files)


def test_broadcasting_fsspec_reader_world3(world3: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world3):
        rep = res["broadcasting"]
        assert rep["mismatched"] == [], f"rank {rank}: {rep['mismatched']}"
        if rank == 0:
            assert rep["inner"]["requests"] > 0 and rep["inner"]["bytes_read"] > 0
        else:
            assert rep["inner"]["requests"] == 0 and rep["inner"]["bytes_read"] == 0, f"rank {rank} read storage"
            ratio = rep["bytes_received"] / rep["needed"]
            assert 0.99 <= ratio <= R.MAX_RECEIVE_RATIO, f"rank {rank}: received {ratio:.3f}x its shards"


def test_small_budgets_world3(world3: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world3):
        rep = res["small_budgets"]
        assert rep["mismatched"] == [], f"rank {rank}: {rep['mismatched']}"
        if rank != 0:
            assert rep["bytes_received"] <= R.MAX_RECEIVE_RATIO * rep["needed"]


def test_failure_mid_transfer_reaches_every_rank(world3: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world3):
        rep = res["mid_transfer"]
        assert rep["raised"] == "CorruptCheckpointError", f"rank {rank}: {rep}"
        assert "injected failure mid-transfer" in rep["text"], f"rank {rank}: {rep['text']}"
        assert rep["seconds"] < 10, f"rank {rank} took {rep['seconds']:.1f}s to fail"
    assert any(res["mid_transfer"]["received"] > 0 for res in world3[1:]), "the failure should come after some data"


def test_a_commit_failing_on_the_coordinator_reaches_every_rank(world3: list[dict[str, Any]]) -> None:
    """The coordinator commits a slice it sent from its own destination only after the sends: a failure there
    still reaches every rank, promptly (and what it committed before had all its bytes)."""
    for rank, res in enumerate(world3):
        rep = res["in_commit"]
        # the coordinator's own error; another rank got it sent mid-transfer, or had all its slices and gets it
        # from DCP's gather of every rank's result (raised=None: no failure of its own, the exception names rank 0's)
        assert rep["raised"] == "CorruptCheckpointError" or (rank and rep["raised"] is None), f"rank {rank}: {rep}"
        assert "injected failure in commit_tensor" in rep["text"], f"rank {rank}: {rep['text']}"
        assert rep["seconds"] < 10, f"rank {rank} took {rep['seconds']:.1f}s to fail"


def test_share_object_world3(world3: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world3):
        share = res["share"]
        assert share["value"] == {"rank": 2, "t": [0, 1, 2]}
        assert share["unsafe"]["type"] == "UnsafeCheckpointError"
        assert "os.system" in share["unsafe"]["text"] and "s3://b/evil.pt" in share["unsafe"]["text"]
        if rank != 0:
            assert share["unsafe"]["attrs"]["forbidden"] == "os.system"
            assert share["foreign"]["type"] == "DcpStorageError"
            assert "ValueError on rank 0: plain value error on rank 0" in share["foreign"]["text"]
        else:
            assert share["foreign"]["type"] == "ValueError"


# ---------------------------------------------------------------------------------------------- errors
def _bad_files(root: Path, good: str) -> tuple[dict[str, str], list[Path]]:
    data = Path(good).read_bytes()
    out = {
        "empty": root / "empty.pt",
        "random": root / "random.pt",
        "truncated": root / "truncated.pt",
        "legacy": root / "legacy.pt",
        "evil_zip": root / "evil_zip.pt",
        "evil_legacy": root / "evil_legacy.pt",
    }
    out["empty"].write_bytes(b"")
    out["random"].write_bytes(
        torch.randint(0, 256, (100_000,), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
        .numpy()
        .tobytes()
    )
    out["truncated"].write_bytes(data[: len(data) * 2 // 3])
    torch.save({"w": torch.ones(4)}, out["legacy"], _use_new_zipfile_serialization=False)
    markers = [root / "pwned_zip", root / "pwned_legacy"]
    torch.save({"w": torch.ones(4), "evil": _Marker(str(markers[0]))}, out["evil_zip"])
    torch.save(
        {"w": torch.ones(4), "evil": _Marker(str(markers[1]))}, out["evil_legacy"], _use_new_zipfile_serialization=False
    )
    return {k: str(v) for k, v in out.items()}, markers


def test_bad_files_fail_fast_on_every_rank(files: dict[str, Any]) -> None:
    bad, markers = _bad_files(files["root"], files["local"])
    start = time.monotonic()
    results = run_ranks(R.load_bad_files, 3, bad, timeout=2 * BAD_FILES_BUDGET_S)
    elapsed = time.monotonic() - start
    assert elapsed < BAD_FILES_BUDGET_S, f"bad files took {elapsed:.1f}s on 3 ranks"
    assert not any(m.exists() for m in markers), "a malicious payload ran"
    expected = {
        "empty": ("CorruptCheckpointError", "empty"),
        "random": ("CorruptCheckpointError", "not a torch.save archive"),
        "truncated": ("CorruptCheckpointError", "truncated"),
        "legacy": ("UnsupportedFormatError", "legacy torch.save format"),
        "evil_zip": ("UnsafeCheckpointError", "forbidden global"),
        "evil_legacy": ("UnsafeCheckpointError", "forbidden global"),
    }
    for rank, res in enumerate(results):
        for name, (cls, text) in expected.items():
            rep = res[name]
            where = f"rank {rank} {name}"
            direct = rep["direct"]
            assert direct is not None, f"{where}: read_metadata succeeded"
            assert direct["type"] == cls, f"{where}: {direct}"
            assert text in direct["text"] and bad[name] in direct["text"], f"{where}: {direct['text']}"
            if name.startswith("evil"):
                assert "open" in direct["text"], f"{where}: the message should name the global: {direct['text']}"
            assert rep["dcp"] is not None and text in rep["dcp"]["text"], f"{where}: dcp.load said {rep['dcp']}"
            assert rep["seconds"] < 10, f"{where}: took {rep['seconds']:.1f}s"
