"""Trusted ``torch.save`` files: ``trust=True``, ``convert --trust``, and torch's ``add_safe_globals``.

A file holding an ``argparse.Namespace`` next to its tensors (what training scripts save) is refused by
the allow-list with a message naming the global and both ways out; it loads and converts when the class
is registered with torch (``add_safe_globals`` or the ``safe_globals`` context, only while registered) or
when the file is trusted as a whole. Loads run on 2 real gloo ranks (the CLI: ``tests/cli/test_convert_trust.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_storage import BroadcastingTorchSaveReader, FsspecReader, convert
from dcp_storage.conversion import torch_save_to_dcp
from dcp_storage.errors import UnsafeCheckpointError
from dcp_storage.formats.dcp_native.item_loader import DcpLoaderConfig
from dcp_storage_testing.distributed import run_ranks

ARGS = argparse.Namespace(lr=0.1, name="run-7", sizes=[1, 2])


def _state() -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "args": ARGS, "step": 3}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(4, 3), "args": None, "step": 0}


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("trust") / "train.pt")
    torch.save(_state(), out)
    return out


def _load(path: str, **reader_options: Any) -> dict[str, Any]:
    state = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled"
        dcp.load(state, storage_reader=BroadcastingTorchSaveReader(path, **reader_options), no_dist=True)
    return state


def _assert_loaded(state: dict[str, Any]) -> None:
    assert torch.equal(state["w"], _state()["w"])
    assert state["args"] == ARGS and state["step"] == 3


def _assert_refused(exc: BaseException, path: str) -> None:
    text = str(exc)
    assert "argparse.Namespace" in text and path in text
    assert "torch.serialization.add_safe_globals([argparse.Namespace])" in text
    assert "trust=True" in text and "--trust" in text


def test_refusal_names_the_global_and_both_ways_out(path: str) -> None:
    with pytest.raises(UnsafeCheckpointError) as info:
        BroadcastingTorchSaveReader(path).read_metadata()
    _assert_refused(info.value, path)
    with pytest.raises(UnsafeCheckpointError) as info:
        torch_save_to_dcp(path, str(Path(path).parent / "refused"))
    _assert_refused(info.value, path)


def test_safe_globals_context_allows_the_class_while_it_is_open(path: str) -> None:
    with torch.serialization.safe_globals([argparse.Namespace]):
        _assert_loaded(_load(path))
    with pytest.raises(UnsafeCheckpointError):
        BroadcastingTorchSaveReader(path).read_metadata()


@contextlib.contextmanager
def _registered(entries: list[Any]) -> Iterator[None]:
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(entries)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


@pytest.mark.parametrize("entry", [argparse.Namespace, (argparse.Namespace, "argparse.Namespace")], ids=["obj", "path"])
def test_add_safe_globals_allows_the_class(path: str, entry: Any) -> None:
    with _registered([entry]):
        _assert_loaded(_load(path))


def test_trust_loads_the_file(path: str) -> None:
    _assert_loaded(_load(path, trust=True))


def _load_on_ranks(rank: int, world: int, path: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    state = _blank()
    dcp.load(state, storage_reader=BroadcastingTorchSaveReader(path, trust=True))
    trusted = {"w": state["w"].tolist(), "args": vars(state["args"]), "step": state["step"]}
    try:
        dcp.load(_blank(), storage_reader=BroadcastingTorchSaveReader(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException
        return {"trusted": trusted, "untrusted": f"{type(exc).__name__}: {exc}"}
    return {"trusted": trusted, "untrusted": "loaded"}


def test_trust_on_two_ranks(path: str) -> None:
    results = run_ranks(_load_on_ranks, 2, path, timeout=60.0)
    expected = {"w": _state()["w"].tolist(), "args": vars(ARGS), "step": 3}
    for result in results:
        assert result["trusted"] == expected
        assert "argparse.Namespace" in result["untrusted"] and "trust=True" in result["untrusted"]


def test_torch_save_to_dcp_with_trust(path: str, tmp_path: Path) -> None:
    out = str(tmp_path / "dcp")
    torch_save_to_dcp(path, out, trust=True)
    state = _blank()
    reader = FsspecReader(out, loader_config=DcpLoaderConfig(trust_byte_items=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    _assert_loaded(state)
    back = str(tmp_path / "back.pt")  # and on to torch.save again: the value is decoded with weights_only=False
    convert(out, back, to="torch", trust=True)
    _assert_loaded(torch.load(back, weights_only=False))
