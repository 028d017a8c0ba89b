"""Ranks of one ``dcp.load`` given different checkpoints: refused on every rank, never a silent mix.

The coordinator reads the metadata for every rank (``share_object``). A rank given another checkpoint
used to read its own checkpoint's data through the coordinator's metadata, and with ``read_once`` the
ranks exchanged slices of both checkpoints: a load returned ``a`` from one checkpoint and ``b`` from the
other, with no error. Each rank now sends the checkpoint it was given with the metadata, and a rank given
another raises :class:`~dcp_storage.errors.LocationMismatchError` naming both; DCP gathers it to every rank.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_storage as ds
from dcp_storage_testing.distributed import run_ranks

from . import _location_fns as F

WORLD = 2
DEADLINE_S = 60.0  # a healthy run takes a few seconds


def _save(root: Path, kind: str, value: float) -> str:
    warnings.filterwarnings("ignore")
    path = str(root / f"{kind}-{value}")
    if kind == "torch_save":
        path += ".pt"
        torch.save(F.state(value), path)
        return path
    writer = ds.SafetensorsWriter(path) if kind == "safetensors" else ds.FsspecWriter(path)
    dcp.save(F.state(value), storage_writer=writer, no_dist=True)
    return path


@pytest.mark.parametrize("kind", ["read_once", "per_rank", "broadcasting", "safetensors", "torch_save"])
def test_ranks_given_different_checkpoints_fail_naming_both(tmp_path: Path, kind: str) -> None:
    fmt = kind if kind in ("safetensors", "torch_save") else "dcp"
    paths = [_save(tmp_path, fmt, 1.0), _save(tmp_path, fmt, 2.0)]
    results = run_ranks(F.load_own_path, WORLD, kind, paths, timeout=DEADLINE_S)
    for rank, (outcome, message) in enumerate(results):
        # dcp.load re-raises a failed read_metadata of a reader with a rank-local fallback (FsspecReader) as
        # its own AssertionError quoting our message (tests/README.md): the message is what must be ours.
        assert outcome in ("LocationMismatchError", "AssertionError"), f"rank {rank}: {outcome}: {message}"
        assert "every rank of one dcp.load must load the same checkpoint" in message, message
        assert paths[0] in message and paths[1] in message, message


def test_the_same_checkpoint_named_two_ways_still_loads(tmp_path: Path) -> None:
    """A relative path on one rank and the absolute one on the other are one checkpoint: no refusal."""
    path = _save(tmp_path, "dcp", 3.0)
    relative = os.path.relpath(path)
    results = run_ranks(F.load_own_path, WORLD, "read_once", [path, relative + "/"], timeout=DEADLINE_S)
    expected = repr({key: value[0].item() for key, value in F.state(3.0).items()})
    assert results == [("loaded", expected)] * WORLD


@pytest.mark.parametrize("kind", ["read_once", "broadcasting"])
def test_the_same_checkpoint_through_a_symlink_on_one_rank_still_loads(tmp_path: Path, kind: str) -> None:
    """Issue 20: a symlink on one rank and the real path on the other were refused as a mismatch (with a
    misleading message about missing metadata). Locations are compared resolved."""
    path = _save(tmp_path, "dcp", 4.0)
    link = tmp_path / "latest"
    link.symlink_to(path, target_is_directory=True)
    results = run_ranks(F.load_own_path, WORLD, kind, [str(link), path], timeout=DEADLINE_S)
    expected = repr({key: value[0].item() for key, value in F.state(4.0).items()})
    assert results == [("loaded", expected)] * WORLD
