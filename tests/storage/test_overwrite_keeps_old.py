"""``overwrite=True`` keeps the previous checkpoint loadable until the new one is committed, never retires
anything through a link out of the checkpoint, and a full disk leaves nothing but the previous checkpoint.

The kill trials (real processes, SIGKILL at random moments) are in ``tests/crash/test_overwrite_kill.py``;
here each step of the save is checked in one process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_storage as ds
from dcp_storage import FsspecReader, FsspecWriter, SafetensorsWriter
from dcp_storage.errors import StorageFullError, WrongPathTypeError
from dcp_storage.formats.paths import LOCK_FILE
from dcp_storage.strategies import HexPrefixStrategy
from dcp_storage_testing.conformance.helpers import unwrap

MiB = 1024 * 1024


def state(seed: int, n: int = 4, numel: int = 64 * 1024) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}


def load(path: Path | str) -> dict[str, Any]:
    dest = {k: torch.zeros_like(v) for k, v in state(0).items()}
    dcp.load(dest, storage_reader=FsspecReader(path), no_dist=True)
    return dest


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def save(sd: dict[str, Any], path: Path | str, **kw: Any) -> None:
    dcp.save(sd, storage_writer=FsspecWriter(path, overwrite=True, **kw), no_dist=True)


class _StopAt(FsspecWriter):
    """Raises at one step of the save, as a kill there would stop it (``finish``: just before the commit)."""

    stop_at = "finish"

    def finish(self, *args: Any, **kwargs: Any) -> None:
        if self.stop_at == "finish":
            raise KeyboardInterrupt("stopped before the commit")
        super().finish(*args, **kwargs)


def test_the_old_checkpoint_loads_until_the_new_metadata_is_committed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save(state(1), ckpt)
    old_files = sorted(os.listdir(ckpt))
    with pytest.raises(CheckpointException):  # dcp wraps the stop
        dcp.save(state(2), storage_writer=_StopAt(ckpt, overwrite=True), no_dist=True)
    # All the new data files are written, under new names; the old checkpoint is whole and verifies.
    assert set(old_files) <= set(os.listdir(ckpt))
    assert len([n for n in os.listdir(ckpt) if n.endswith(".distcp")]) > len([n for n in old_files if ".distcp" in n])
    assert same(load(ckpt), state(1))
    report = ds.verify(ckpt)
    assert report.ok, report.problems
    # The next save retires the old files and the killed save's leftovers: only what .metadata names stays.
    save(state(3), ckpt)
    assert same(load(ckpt), state(3)) and ds.verify(ckpt).ok
    referenced = {i.relative_path for i in FsspecReader(ckpt).read_metadata().storage_data.values()}
    assert {n for n in os.listdir(ckpt) if n.endswith(".distcp")} == referenced
    assert not (ckpt / LOCK_FILE).exists()


def test_verify_cleanup_removes_a_killed_overwrites_files_once_no_save_holds_the_location(tmp_path: Path) -> None:
    from dcp_storage.cli import main

    ckpt = tmp_path / "ckpt"
    save(state(1), ckpt)
    old_files = sorted(os.listdir(ckpt))
    with pytest.raises(CheckpointException):
        dcp.save(state(2), storage_writer=_StopAt(ckpt, overwrite=True), no_dist=True)
    leftovers = sorted(set(os.listdir(ckpt)) - set(old_files) - {LOCK_FILE})
    assert leftovers and all(n.endswith(".distcp") for n in leftovers)
    assert ds.inspection.remove_unreferenced_files(str(ckpt)) == []  # a lock: that save may still be running
    (ckpt / LOCK_FILE).unlink()  # its holder is gone
    assert main(["verify", str(ckpt), "--cleanup"]) == 0
    assert sorted(os.listdir(ckpt)) == old_files
    assert same(load(ckpt), state(1)) and ds.verify(ckpt).ok


def test_safetensors_single_file_over_single_file_keeps_the_old_until_the_rename(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    dcp.save(state(1), storage_writer=SafetensorsWriter(out), no_dist=True)

    class Stop(SafetensorsWriter):
        def finish(self, *args: Any, **kwargs: Any) -> None:
            raise KeyboardInterrupt("stopped before the commit")

    with pytest.raises(CheckpointException):  # dcp wraps the stop
        dcp.save(state(2), storage_writer=Stop(out, overwrite=True), no_dist=True)
    from safetensors.torch import load_file

    assert same(load_file(out / "model.safetensors"), state(1))  # still the old file
    dcp.save(state(3), storage_writer=SafetensorsWriter(out, overwrite=True), no_dist=True)
    assert same(load_file(out / "model.safetensors"), state(3))
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # the killed save's temp file is gone


def test_safetensors_sharded_over_another_shard_count_keeps_the_old_until_the_index(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file

    def loaded(out: Path) -> dict[str, Any]:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        got: dict[str, Any] = {}
        for name in sorted(set(index["weight_map"].values())):
            got.update(load_file(out / name))
        return got

    out, shard = tmp_path / "hf", 300 * 1024  # 256 KiB tensors: one per shard
    dcp.save(state(1, n=2), storage_writer=SafetensorsWriter(out, max_shard_size=shard), no_dist=True)

    class Stop(SafetensorsWriter):
        def finish(self, *args: Any, **kwargs: Any) -> None:
            raise KeyboardInterrupt("stopped before the commit")

    with pytest.raises(CheckpointException):
        dcp.save(state(2, n=3), storage_writer=Stop(out, overwrite=True, max_shard_size=shard), no_dist=True)
    assert same(loaded(out), state(1, n=2))  # the old index and its two shards, whole
    dcp.save(state(3, n=3), storage_writer=SafetensorsWriter(out, overwrite=True, max_shard_size=shard), no_dist=True)
    assert same(loaded(out), state(3, n=3))
    names = sorted(os.listdir(out))
    assert names == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)] + ["model.safetensors.index.json"]
    dcp.save(state(4, n=2), storage_writer=SafetensorsWriter(out, overwrite=True), no_dist=True)  # one file now
    assert sorted(os.listdir(out)) == ["model.safetensors"]


# ---------------------------------------------------------------------------------------- links out
def test_overwrite_never_retires_through_a_prefix_directory_linked_to_another_checkpoint(tmp_path: Path) -> None:
    strategy = HexPrefixStrategy()
    victim, ckpt = tmp_path / "victim", tmp_path / "ckpt"
    save(state(1), victim, prefix_strategy=strategy)
    directory = strategy.directory(0, 1)
    before = sorted(os.listdir(victim / directory))
    ckpt.mkdir()
    (ckpt / directory).symlink_to(victim / directory)
    with pytest.raises(CheckpointException) as info:
        save(state(2), ckpt, prefix_strategy=strategy)
    error = unwrap(info.value)
    assert isinstance(error, WrongPathTypeError), repr(error)
    assert "symlink leading outside" in str(error) and directory in str(error)
    assert sorted(os.listdir(victim / directory)) == before  # nothing written into, nothing retired from it
    assert same(load(victim), state(1)) and ds.verify(victim).ok
    assert sorted(os.listdir(ckpt)) == [directory]  # no lock left behind either


def test_a_link_inside_the_checkpoint_is_fine(tmp_path: Path) -> None:
    strategy = HexPrefixStrategy()
    ckpt = tmp_path / "ckpt"
    directory = strategy.directory(0, 1)
    (ckpt / "real").mkdir(parents=True)
    (ckpt / directory).symlink_to(ckpt / "real")
    save(state(1), ckpt, prefix_strategy=strategy)
    save(state(2), ckpt, prefix_strategy=strategy)
    assert same(load(ckpt), state(2))


# ---------------------------------------------------------------------------------------- disk full
@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "2m") -> Iterator[Path]:
    """A real filesystem of ``size`` at ``where`` (needs root; skips otherwise), unmounted afterwards."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _full_error(info: pytest.ExceptionInfo[BaseException]) -> StorageFullError:
    error = unwrap(info.value)
    assert isinstance(error, StorageFullError), repr(error)
    return error


def test_disk_full_during_a_dcp_save(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk") as disk:
        ckpt = disk / "ckpt"
        small, big = state(1, n=2, numel=16 * 1024), state(2, n=2, numel=16 * 1024)
        save(small, ckpt)  # 128 KiB: fits
        before = sorted(os.listdir(ckpt))
        big = {k: torch.randn(512 * 1024) for k in small}  # 4 MiB: does not
        with pytest.raises(CheckpointException) as info:
            save(big, ckpt)
        error = _full_error(info)
        assert str(ckpt) in str(error) and "bytes needed" in str(error) and error.errno == 28, str(error)
        assert "enforce fail" not in str(info.value)
        assert sorted(os.listdir(ckpt)) == before  # no temp file, no new data file, no lock
        dest = {k: torch.zeros_like(v) for k, v in small.items()}
        dcp.load(dest, storage_reader=FsspecReader(ckpt), no_dist=True)
        assert same(dest, small) and ds.verify(ckpt).ok
        # Space freed (a smaller state): the retry succeeds, overwrite=False included once the old is gone.
        retry = {k: torch.randn(16 * 1024) for k in small}
        save(retry, ckpt)
        dcp.load(dest, storage_reader=FsspecReader(ckpt), no_dist=True)
        assert same(dest, retry) and not (ckpt / LOCK_FILE).exists()


def test_disk_full_during_a_fresh_dcp_save_then_a_retry_by_a_new_writer(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk") as disk:
        ckpt = disk / "ckpt"
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.randn(1024 * 1024)}, storage_writer=FsspecWriter(ckpt), no_dist=True)
        _full_error(info)
        assert os.listdir(ckpt) == []
        small = {"w": torch.randn(1024)}
        dcp.save(small, storage_writer=FsspecWriter(ckpt), no_dist=True)  # a new writer: no lock in the way
        dest = {"w": torch.zeros(1024)}
        dcp.load(dest, storage_reader=FsspecReader(ckpt), no_dist=True)
        assert torch.equal(dest["w"], small["w"])


def test_disk_full_during_a_safetensors_save(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    with small_tmpfs(tmp_path / "disk") as disk:
        out = disk / "hf"
        small = {"w": torch.randn(16 * 1024)}
        dcp.save(small, storage_writer=SafetensorsWriter(out), no_dist=True)
        with pytest.raises(CheckpointException) as info:
            big = {"w": torch.randn(1024 * 1024)}
            dcp.save(big, storage_writer=SafetensorsWriter(out, overwrite=True), no_dist=True)
        error = _full_error(info)
        assert str(out) in str(error) and "bytes needed" in str(error), str(error)
        assert sorted(os.listdir(out)) == ["model.safetensors"]  # no 4 MiB temp file, no lock
        assert torch.equal(load_file(out / "model.safetensors")["w"], small["w"])
        retry = {"w": torch.randn(32 * 1024)}
        dcp.save(retry, storage_writer=SafetensorsWriter(out, overwrite=True), no_dist=True)
        assert torch.equal(load_file(out / "model.safetensors")["w"], retry["w"])
        assert sorted(os.listdir(out)) == ["model.safetensors"]
