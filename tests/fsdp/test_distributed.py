"""``dcp_storage.fsdp`` on real gloo ranks: two ``run_ranks`` spawns (2 and 4 ranks), checks in :mod:`._rank_fns`.

* 2 ranks: introspection of FSDP2 / FSDP1 / DDP / compiled models; error cases (in memory and from files),
  each raised on every rank, then a good load into the same model; in-memory loads into meta FSDP2 models
  (bit-exact, bytes per rank, forward pass, bf16 -> fp32 cast); a torch.save file; FSDP1 from both.
* 4 ranks: uneven shards, HSDP (2x2 mesh), a torch.save file, FSDP1, and a missing key on all 4 ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_storage_testing.distributed import run_ranks

from . import _rank_fns as R

TIMEOUT_S = 90.0
ERROR_BUDGET_S = 10.0  # an error must not wait for a collective timeout


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root: Path = tmp_path_factory.mktemp("fsdp")
    ref = R.reference()
    paths = {name: str(root / f"{name}.pt") for name in ("full", "bad_shape", "missing_key")}
    torch.save(ref, paths["full"])
    torch.save(dict(ref, **{"head.weight": ref["head.weight"][:, :-1].clone()}), paths["bad_shape"])
    torch.save({k: v for k, v in ref.items() if k != "blocks.1.norm.bias"}, paths["missing_key"])
    paths["missing"] = str(root / "no_such_file.pt")
    return paths


@pytest.fixture(scope="module")
def world2(files: dict[str, str]) -> list[dict[str, Any]]:
    return run_ranks(R.world2, 2, files, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def world4(files: dict[str, str], world2: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return run_ranks(R.world4, 4, files, timeout=TIMEOUT_S)


# ----------------------------------------------------------------------------------------- introspection
def test_is_fsdp_model(world2: list[dict[str, Any]]) -> None:
    for res in world2:
        assert res["introspection"]["is_fsdp"] == {
            "fsdp2": True,
            "fsdp2_blocks_only": True,
            "fsdp1": True,
            "plain": False,
            "ddp": False,
        }


def test_get_fsdp_parent(world2: list[dict[str, Any]]) -> None:
    for res in world2:
        wrong = [name for name, ok in res["introspection"]["parent"].items() if not ok]
        assert wrong == []
        text = res["introspection"]["unknown"]
        assert text is not None and "'blocks.7.attn_qkv'" in text and "'7'" in text and "blocks" in text


def test_maybe_get_wrapped(world2: list[dict[str, Any]]) -> None:
    for res in world2:
        assert all(res["introspection"]["unwrap"].values()), res["introspection"]["unwrap"]


def test_torch_compile_wrappers(world2: list[dict[str, Any]]) -> None:
    compiled = world2[-1]["introspection"]["compiled"]
    assert compiled is not None and all(compiled.values()), compiled


# ----------------------------------------------------------------------------------------- FSDP2 loads
def _check_bytes(results: list[dict[str, Any]], case: str) -> None:
    """Each rank received exactly its blocks; rank 0 sent each rank exactly that; no full broadcast."""
    world = len(results)
    for rank, res in enumerate(results):
        rep = res[case]
        stats = rep["stats"]
        if rank == 0:
            assert stats["bytes_received"] == 0 and rep["p2p"] == 0
            assert stats["bytes_local"] == rep["expected"]
            others = {r: n for r, n in enumerate(rep["expected_per_rank"]) if r}
            assert stats["sent_per_rank"] == others
            assert stats["bytes_sent"] == sum(others.values())
        else:
            assert stats["bytes_received"] == rep["expected"], (rank, stats)
            assert rep["p2p"] == rep["expected"] + R.HEADER_BYTES * stats["messages_received"]
        # Only small control messages (the source, the verdict) travel by broadcast.
        assert rep["broadcast"] < 4096, (rank, rep["broadcast"])
    total = sum(R.shard_bytes(R.reference(), r, world) for r in range(world))
    assert sum(res[case]["expected"] for res in results) == total


@pytest.mark.parametrize("case", ["memory", "after_errors", "cast", "url"])
def test_fsdp2_loads_bit_exact(world2: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(world2):
        assert res[case]["mismatched"] == [], (rank, case)
        assert res[case]["returned_model"]
    assert all(res["memory"]["forward"] and res["url"]["forward"] for res in world2)
    assert all(res["memory"]["devices"] == ["cpu"] for res in world2)  # cpu_offload=True


def test_fsdp2_in_memory_sends_each_rank_its_shard(world2: list[dict[str, Any]]) -> None:
    _check_bytes(world2, "memory")
    # The reference is ~60 KiB; a broadcast of it would show up on every rank.
    assert world2[1]["memory"]["expected"] < sum(v.numel() * 4 for v in R.reference().values()) * 0.6


def test_fsdp2_cast_sends_model_dtype(world2: list[dict[str, Any]]) -> None:
    assert world2[1]["cast"]["stats"]["bytes_received"] == world2[1]["memory"]["stats"]["bytes_received"]


def test_url_load_receives_only_shards(world2: list[dict[str, Any]], world4: list[dict[str, Any]]) -> None:
    for results in (world2, world4):
        for rank, res in enumerate(results[1:], start=1):
            expected = R.shard_bytes(R.reference(), rank, len(results))
            assert res["url"]["stats"]["bytes_received"] == expected, rank
            assert res["url"]["broadcast"] < 8192  # metadata and control only
        assert all(res["url"]["mismatched"] == [] for res in results)


def test_world4_uneven_and_hsdp(world4: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world4):
        assert res["memory"]["mismatched"] == [] and res["memory"]["forward"], rank
        assert res["hsdp"]["mismatched"] == [], rank
    _check_bytes(world4, "memory")
    assert world4[3]["memory"]["expected"] < world4[1]["memory"]["expected"]  # the short last blocks
    for rank, res in enumerate(world4[1:], start=1):
        assert res["hsdp"]["stats"]["bytes_received"] == res["hsdp"]["expected"], rank
    assert world4[0]["hsdp"]["stats"]["bytes_local"] == world4[0]["hsdp"]["expected"]
    assert world4[2]["hsdp"]["expected"] == world4[0]["hsdp"]["expected"]  # the replica of rank 0


# ----------------------------------------------------------------------------------------- FSDP1
def test_fsdp1_loads(world2: list[dict[str, Any]], world4: list[dict[str, Any]]) -> None:
    for results, cases in ((world2, ("fsdp1_memory", "fsdp1_url")), (world4, ("fsdp1",))):
        for rank, res in enumerate(results):
            for case in cases:
                assert res[case]["mismatched"] == [], (len(results), rank, case)
                assert res[case]["forward"], (len(results), rank, case)
    # In memory, rank 1 received only its ShardedTensor blocks (and the unsharded buffer).
    ref = R.reference()
    expected = sum(
        torch.chunk(v, 2)[1].numel() * 4 if not k.endswith(".pos") else v.numel() * 4 for k, v in ref.items()
    )
    assert world2[1]["fsdp1_memory"]["stats"]["bytes_received"] == expected


# ----------------------------------------------------------------------------------------- errors
ERRORS = {
    "missing": ("FullStateDictKeysError", ["'head.weight'", "missing"]),
    "unexpected": ("FullStateDictKeysError", ["'extra.bias'", "unexpected"]),
    "shape": ("ShapeMismatchError", ["'embed.weight'", "[129, 24]", "[130, 24]"]),
    "dtype": ("DtypeMismatchError", ["'head.weight'", "torch.int32 -> torch.float32"]),
    "none_on_rank0": ("DcpStorageError", ["rank 0 must pass the full state dict", "got None"]),
    "dtensor_values": ("ValueTypeMismatchError", ["DTensor", "plain, materialised tensors"]),
    "url_shape": ("ShapeMismatchError", ["head.weight"]),
    "url_missing_key": ("IncompatibleKeysError", ["'blocks.1.norm.bias'", "missing"]),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_raise_on_every_rank(world2: list[dict[str, Any]], case: str) -> None:
    cls, fragments = ERRORS[case]
    for rank, res in enumerate(world2):
        err = res["errors"][case]
        assert err["type"] == cls, (rank, err)
        assert err["ours"], (rank, err)
        for fragment in fragments:
            assert fragment in err["text"], (rank, fragment, err["text"])
        assert err["seconds"] < ERROR_BUDGET_S, (rank, err["seconds"])
    if case == "missing":
        assert all(res["errors"][case]["attrs"]["missing_keys"] == ["head.weight"] for res in world2)


def test_missing_file_and_mid_transfer_failure(world2: list[dict[str, Any]]) -> None:
    for case in ("url_missing_file", "mid_transfer"):
        for rank, res in enumerate(world2):
            err = res["errors"][case]
            assert err["type"] is not None and err["seconds"] < ERROR_BUDGET_S, (case, rank, err)
    # Rank 0 raises its own error; the others get it by name.
    for rank, res in enumerate(world2):
        err = res["errors"]["mid_transfer"]
        assert "simulated failure reading 'blocks.1.mlp_up.weight'" in err["text"], (rank, err)
        assert err["type"] == ("OSError" if rank == 0 else "DcpStorageError")
        missing = res["errors"]["url_missing_file"]
        assert "no_such_file.pt" in missing["text"] and "FileNotFoundError" in missing["mro"], (rank, missing)


def test_world4_error_on_every_rank(world4: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world4):
        assert res["missing"]["type"] == "FullStateDictKeysError", rank
        assert "'blocks.0.pos'" in res["missing"]["text"]
        assert res["missing"]["seconds"] < ERROR_BUDGET_S
