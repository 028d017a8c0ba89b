"""One key-mismatch report for every path: the same ``IncompatibleKeysError``, with its key-map hint.

A Hugging Face style checkpoint (every key under ``model.``) loaded into a state dict without the prefix,
through every reader (each class, ``Broadcasting`` around each, ``open_reader``'s picks) with torch's
default planner, through the ``torch.save`` readers with both ``DynamicMetaLoadPlanner`` s, and with
``RemappingLoadPlanner`` (the report the others must match): in one process, and on 2 gloo ranks, where
every rank must raise it. Partial loads that match nothing warn; partial loads that match something load it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner as TorchDynamicMetaLoadPlanner

from dcp_storage import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner, FsspecReader
from dcp_storage.planners import IncompatibleKeysError, RemappingLoadPlanner
from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.every_format import every_reader, write_every_format

HINT = "key_map=KeyMap.add_prefix('model.') would match 4 of the missing keys"
WORLD = 2


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    return {
        "embed.weight": torch.randn(16, 4, generator=g),
        "layer.weight": torch.randn(4, 4, generator=g),
        "layer.bias": torch.randn(4, generator=g),
        "norm.weight": torch.randn(4, generator=g),
    }


def blank() -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, float("nan")) for k, v in model_state().items()}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root: Path = tmp_path_factory.mktemp("key_report")
    return write_every_format(str(root), {f"model.{k}": v for k, v in model_state().items()})


def _cases(paths: dict[str, str]) -> dict[str, tuple[Any, Any]]:
    """name -> (reader factory, planner factory): every reader with DCP's default planner, and more."""
    cases: dict[str, tuple[Any, Any]] = {name: (make, lambda: None) for name, make in every_reader(paths).items()}
    torch_save = every_reader(paths)["BroadcastingTorchSaveReader"]
    cases["BroadcastingTorchSaveReader+DynamicMetaLoadPlanner"] = (torch_save, DynamicMetaLoadPlanner)
    cases["BroadcastingTorchSaveReader+torch DynamicMetaLoadPlanner"] = (torch_save, TorchDynamicMetaLoadPlanner)
    cases["FsspecReader+RemappingLoadPlanner"] = (every_reader(paths)["FsspecReader"], RemappingLoadPlanner)
    return cases


def _raised(make_reader: Any, make_planner: Any, no_dist: bool) -> BaseException | None:
    try:
        dcp.load(blank(), storage_reader=make_reader(), planner=make_planner(), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the test looks at what it is (DCP's is a
        return exc  # BaseException)
    return None


def _check(exc: BaseException | None, name: str) -> None:
    if isinstance(exc, CheckpointException):  # DCP wraps what a step raises, with or without no_dist
        ((exc, _trace),) = exc.failures.values()
    assert isinstance(exc, IncompatibleKeysError), f"{name}: {type(exc).__name__}: {exc}"
    assert sorted(exc.missing_keys) == sorted(model_state()), name
    assert exc.hint == HINT, name
    assert HINT in str(exc), name


def test_every_path_raises_the_same_report(paths: dict[str, str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled"
        for name, (make_reader, make_planner) in _cases(paths).items():
            _check(_raised(make_reader, make_planner, no_dist=True), name)


def _raise_on_ranks(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    out: dict[str, Any] = {}
    for name, (make_reader, make_planner) in _cases(paths).items():
        exc = _raised(make_reader, make_planner, no_dist=False)
        if not isinstance(exc, CheckpointException):
            out[name] = f"not a CheckpointException: {type(exc).__name__}: {exc}"
            continue
        out[name] = {r: (type(e).__name__, getattr(e, "hint", str(e))) for r, (e, _tb) in exc.failures.items()}
    return out


def test_every_path_raises_the_same_report_on_every_rank(paths: dict[str, str]) -> None:
    results = run_ranks(_raise_on_ranks, WORLD, paths, timeout=90.0)
    for rank, result in enumerate(results):
        for name, failures in result.items():
            assert failures == {r: ("IncompatibleKeysError", HINT) for r in range(WORLD)}, f"rank {rank}, {name}"


@pytest.mark.parametrize(
    "planner", [RemappingLoadPlanner(strict=False), DefaultLoadPlanner(allow_partial_load=True)], ids=type
)
def test_a_partial_load_that_matches_nothing_warns(paths: dict[str, str], planner: Any) -> None:
    dest = blank()
    with pytest.warns(UserWarning, match=r"none of the 4 state-dict keys .*loads nothing.*add_prefix\('model\.'\)"):
        dcp.load(dest, storage_reader=FsspecReader(paths["dcp"]), planner=planner, no_dist=True)
    assert all(v.isnan().all() for v in dest.values())


def test_a_partial_load_that_matches_some_keys_loads_them_quietly(paths: dict[str, str]) -> None:
    dest = {f"model.{k}": v for k, v in blank().items()}
    dest["extra.weight"] = torch.zeros(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = FsspecReader(paths["dcp"])
        dcp.load(dest, storage_reader=reader, planner=RemappingLoadPlanner(strict=False), no_dist=True)
    assert not [w for w in caught if "loads nothing" in str(w.message)]
    assert all(torch.equal(dest[f"model.{k}"], v) for k, v in model_state().items())


@pytest.mark.parametrize("planner_cls", [DynamicMetaLoadPlanner, TorchDynamicMetaLoadPlanner])
def test_torch_save_partial_load_skips_keys_the_file_lacks(paths: dict[str, str], planner_cls: Any) -> None:
    dest = {f"model.{k}": v for k, v in blank().items()}
    dest["extra.weight"] = torch.zeros(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            dest,
            storage_reader=BroadcastingTorchSaveReader(paths["torch_save"]),
            planner=planner_cls(allow_partial_load=True),
            no_dist=True,
        )
    assert all(torch.equal(dest[f"model.{k}"], v) for k, v in model_state().items())
    assert torch.equal(dest["extra.weight"], torch.zeros(3))
