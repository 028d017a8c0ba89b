"""No tool replaces or deletes its input (issue 20, turn 3): an output in the input's own directory, or one
reached through a symlink or a hard link, is refused with ``TargetError`` before anything is written, even
with ``overwrite=True``. Before, ``convert d/model.safetensors d --to safetensors --dtype bf16 --overwrite``
replaced the fp32 input with its bf16 copy (exit 0), and a sharded input lost its shards and index."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ._helpers import run_cli


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (by relative name) with its bytes: what must stay exactly as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _st(path: Path, n: int = 4) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(n)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return state


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_convert_into_the_directory_of_a_single_file_input_is_refused(tmp_path: Path, kind: str) -> None:
    from dcp_storage import convert
    from dcp_storage.errors import TargetError

    d = tmp_path / "d"
    if kind == "safetensors":
        src = d / "model.safetensors"
        _st(src)
    else:
        src = d / "pytorch_model.bin"
        d.mkdir()
        torch.save({"w": torch.randn(8, 8)}, src)
    before = snapshot(d)
    with pytest.raises(TargetError, match="holds .*a file of the input"):
        convert(str(src), str(d), to=kind, dtype="bf16", overwrite=True)
    assert snapshot(d) == before


def test_convert_of_a_sharded_input_into_its_own_directory_keeps_every_shard(tmp_path: Path) -> None:
    from dcp_storage import convert
    from dcp_storage.errors import TargetError

    _st(tmp_path / "one.safetensors", n=6)
    sharded = tmp_path / "sharded"
    convert(str(tmp_path / "one.safetensors"), str(sharded), to="safetensors", max_shard_size="40KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    before = snapshot(sharded)
    (tmp_path / "alias").symlink_to(sharded, target_is_directory=True)
    for src, dst in [
        (sharded / "model.safetensors.index.json", sharded),
        (sharded / "model.safetensors.index.json", tmp_path / "alias"),
        (tmp_path / "alias" / "model.safetensors.index.json", sharded),
    ]:
        with pytest.raises(TargetError):
            convert(str(src), str(dst), to="safetensors", dtype="fp16", overwrite=True)
    with pytest.raises(TargetError):  # a single-file output that is one of the index's shards
        first = sorted(sharded.glob("model-*.safetensors"))[0]
        convert(str(sharded / "model.safetensors.index.json"), str(first), dtype="fp16", overwrite=True)
    assert snapshot(sharded) == before


def test_a_hard_linked_or_symlinked_output_file_is_refused(tmp_path: Path) -> None:
    from dcp_storage import convert
    from dcp_storage.errors import TargetError

    src = tmp_path / "in" / "model.safetensors"
    _st(src)
    os.link(src, tmp_path / "hard.safetensors")
    (tmp_path / "soft.safetensors").symlink_to(src)
    before = snapshot(tmp_path / "in")
    for dst in ("hard.safetensors", "soft.safetensors"):
        with pytest.raises(TargetError, match="is a file of the input|is the input itself"):
            convert(str(src), str(tmp_path / dst), dtype="bf16", overwrite=True)
    assert snapshot(tmp_path / "in") == before
    assert (tmp_path / "hard.safetensors").stat().st_ino == src.stat().st_ino


def test_merge_into_its_checkpoint_directory_is_refused(tmp_path: Path, sources: dict[str, Path]) -> None:
    import shutil

    from dcp_storage import merge_fsdp_weights
    from dcp_storage.errors import TargetError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(sources["dcp_tensors"], ckpt)
    before = snapshot(ckpt)
    with pytest.raises(TargetError, match="a file of the input"):
        merge_fsdp_weights(str(ckpt), str(ckpt), overwrite=True)
    assert snapshot(ckpt) == before


def test_convert_into_the_input_prefix_on_s3_is_refused(s3_url) -> None:
    import fsspec

    from dcp_storage import convert
    from dcp_storage.errors import TargetError

    from .conftest import reference_tensors

    url, options = s3_url
    fs = fsspec.filesystem("s3", **options)
    from safetensors.torch import save

    fs.pipe_file(f"{url}/d/model.safetensors", save(reference_tensors()))
    with pytest.raises(TargetError, match="holds 'model.safetensors'"):
        convert(
            f"{url}/d/model.safetensors",
            f"{url}/d/",
            to="safetensors",
            dtype="bf16",
            overwrite=True,
            storage_options=options,
        )
    assert fs.cat_file(f"{url}/d/model.safetensors") == save(reference_tensors())


def test_cli_convert_into_the_input_directory_exits_1_with_one_line(tmp_path: Path) -> None:
    src = tmp_path / "d" / "model.safetensors"
    _st(src)
    before = snapshot(tmp_path / "d")
    got = run_cli("convert", str(src), str(tmp_path / "d"), "--to", "safetensors", "--dtype", "bf16", "--overwrite")
    assert got.rc == 1, got
    assert "TargetError" in got.stderr and len(got.stderr.strip().splitlines()) == 1, got
    assert snapshot(tmp_path / "d") == before


def test_merge_remove_checkpoint_dir_through_a_symlink_is_refused_before_writing(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    """Before: the merge was written, then ``rmtree`` failed with a bare ``OSError`` (exit 1, output left)."""
    import shutil

    real = tmp_path / "elsewhere" / "ckpt"
    shutil.copytree(sources["dcp_tensors"], real)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    before = snapshot(real)
    got = run_cli("merge", str(tmp_path / "link"), str(tmp_path / "out"), "--remove-checkpoint-dir")
    assert got.rc == 1, got
    assert "TargetError" in got.stderr and "symbolic link" in got.stderr, got
    assert len(got.stderr.strip().splitlines()) == 1, got
    assert not (tmp_path / "out").exists()  # checked before anything was written
    assert (tmp_path / "link").is_symlink() and snapshot(real) == before


def test_cli_merge_refuses_an_existing_output_without_overwrite(tmp_path: Path, sources: dict[str, Path]) -> None:
    """Issue 23: ``merge`` silently replaced an existing output, where ``convert`` refuses it."""
    from ._helpers import run_batch

    out = tmp_path / "out"
    first, again, forced = run_batch(
        [
            ["merge", str(sources["dcp_tensors"]), str(out)],
            ["merge", str(sources["dcp_tensors"]), str(out)],
            ["merge", str(sources["dcp_tensors"]), str(out), "--overwrite"],
        ]
    )
    assert first.rc == 0, first
    assert again.rc == 1 and "CheckpointExistsError" in again.stderr and "--overwrite" in again.stderr, again
    assert forced.rc == 0, forced
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("spelling", ["simplecache::file://{d}", "file://localhost{d}"])
def test_an_output_spelled_as_a_chain_or_with_localhost_is_still_the_input(tmp_path: Path, spelling: str) -> None:
    """An fsspec chain over the input's own directory (a cache layered on it) and ``file://localhost/...`` name
    the input's location: refused like a plain path (was: the chain's other transport type skipped the check,
    and the fp32 input was replaced by its fp16 copy; ``file://localhost/d`` wrote to ``./localhost/d``)."""
    from dcp_storage import convert
    from dcp_storage.errors import TargetError

    d = tmp_path / "d"
    src = d / "model.safetensors"
    _st(src)
    before = snapshot(d)
    with pytest.raises(TargetError, match="holds .*a file of the input"):
        convert(str(src), spelling.format(d=d), to="safetensors", dtype="fp16", overwrite=True)
    assert snapshot(d) == before


def test_merge_remove_checkpoint_dir_into_a_chained_url_inside_it_is_refused(
    tmp_path: Path, sources: dict[str, Path]
) -> None:
    """``merge ckpt simplecache::file://ckpt/merged --remove-checkpoint-dir`` removed the input and, with it, the
    merged output inside it (exit 0)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(sources["dcp_tensors"], ckpt)
    before = snapshot(ckpt)
    got = run_cli("merge", str(ckpt), f"simplecache::file://{ckpt}/merged", "--remove-checkpoint-dir")
    assert got.rc == 1 and "TargetError" in got.stderr and "lies inside" in got.stderr, got
    assert snapshot(ckpt) == before


def test_a_file_url_naming_another_host_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec reads ``file://host/path`` as ``./host/path``: a save went under the working directory."""
    import dcp_storage as ds

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ds.errors.StorageOptionsError, match="naming the host 'otherhost'"):
        ds.save({"w": torch.ones(2)}, "file://otherhost/tmp/x")
    assert not (tmp_path / "otherhost").exists()


def test_dir_chained_urls_save_and_load(tmp_path: Path) -> None:
    """``dir::`` (fsspec's DirFileSystem over the local disk) is async only over an async filesystem: its
    directory creation raised a raw AttributeError."""
    import dcp_storage as ds

    url = f"dir::{tmp_path / 'ckpt'}"
    ds.save({"w": torch.arange(4.0)}, url)
    state = {"w": torch.zeros(4)}
    ds.load(state, url)
    assert torch.equal(state["w"], torch.arange(4.0))
