"""Something that is no checkpoint sits where a save writes: one of our errors naming it, nothing removed.

A file where the checkpoint directory goes (or above it), a directory where the lock ``.dcp_storage.lock``
or ``.metadata`` goes: before, saves raised bare ``FileExistsError`` / ``NotADirectoryError`` /
``IsADirectoryError``, and for a directory lock the ``overwrite=False`` refusal advised ``overwrite=True``,
which then failed the same way. Now every case raises :class:`~dcp_storage.errors.WrongPathTypeError`
naming the path and saying to remove it or save elsewhere, and leaves what was there untouched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_storage as ds
from dcp_storage.errors import WrongPathTypeError
from dcp_storage_testing.conformance.helpers import unwrap

WRITERS: dict[str, Callable[..., object]] = {"fsspec": ds.FsspecWriter, "safetensors": ds.SafetensorsWriter}


def _save(path: Path, writer: str, overwrite: bool) -> BaseException:
    warnings.filterwarnings("ignore")
    state = {"w": torch.arange(16.0)}
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.save(state, storage_writer=WRITERS[writer](str(path), overwrite=overwrite), no_dist=True)
    return unwrap(info.value)


def _assert_names(error: BaseException, path: Path) -> None:
    assert isinstance(error, WrongPathTypeError), repr(error)
    assert str(path) in str(error) and "save to another path" in str(error), str(error)


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_as_the_lock(tmp_path: Path, writer: str, overwrite: bool) -> None:
    lock = tmp_path / "ckpt" / ".dcp_storage.lock"
    (lock / "inside").mkdir(parents=True)
    _assert_names(_save(tmp_path / "ckpt", writer, overwrite), lock)
    assert (lock / "inside").is_dir()


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_as_the_checkpoint_or_above_it(tmp_path: Path, writer: str, overwrite: bool) -> None:
    target = tmp_path / "ckpt"
    target.write_bytes(b"not a checkpoint")
    _assert_names(_save(target, writer, overwrite), target)
    _assert_names(_save(target / "below", writer, overwrite), target)
    assert target.read_bytes() == b"not a checkpoint"


def test_a_directory_as_the_metadata_of_an_overwrite(tmp_path: Path) -> None:
    metadata = tmp_path / "ckpt" / ".metadata"
    (metadata / "inside").mkdir(parents=True)
    _assert_names(_save(tmp_path / "ckpt", "fsspec", True), metadata)
    assert (metadata / "inside").is_dir()
