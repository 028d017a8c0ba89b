"""open_reader / open_writer: detection by probing, explicit formats, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_storage
from dcp_storage import FsspecReader, FsspecWriter, open_reader, open_writer, registry
from dcp_storage.formats.spec import FormatSpec
from dcp_storage.opening import UnknownFormatError


def test_detects_dcp_directory(tmp_path: Path) -> None:
    sd = {"w": torch.arange(12.0).reshape(3, 4)}
    dcp.save(sd, storage_writer=open_writer(str(tmp_path), "dcp"))
    reader = open_reader(str(tmp_path))
    assert isinstance(reader, FsspecReader)
    out = {"w": torch.zeros(3, 4)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], sd["w"])
    assert isinstance(open_writer(str(tmp_path / "x"), "dcp"), FsspecWriter)


def test_unknown_input_lists_what_was_tried(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UnknownFormatError, match=r"notes\.txt.*tried formats: .*dcp"):
        open_reader(str(tmp_path))
    with pytest.raises(UnknownFormatError, match="starting with b'hello'"):
        open_reader(str(tmp_path / "notes.txt"))


def test_missing_input(tmp_path: Path) -> None:
    with pytest.raises(dcp_storage.CheckpointNotFoundError, match="no such file"):
        open_reader(str(tmp_path / "nope"))


def test_plugin_format_is_detected_and_ties_are_ambiguous(tmp_path: Path) -> None:
    (tmp_path / "blob.magic").write_bytes(b"MAGIC123" + bytes(100))
    sentinel = object()
    spec = FormatSpec("magic", "1", lambda p: 50 if p.head.startswith(b"MAGIC") else None, lambda url, **kw: sentinel)
    with registry.registered("formats", "magic", spec):
        assert open_reader(str(tmp_path / "blob.magic")) is sentinel
        twin = FormatSpec("magic2", "1", spec.sniff, spec.open_reader)
        with registry.registered("formats", "magic2", twin):
            with pytest.raises(UnknownFormatError, match="ambiguous.*magic, magic2"):
                open_reader(str(tmp_path / "blob.magic"))
    with pytest.raises(UnknownFormatError, match="read-only"):
        with registry.registered("formats", "magic", spec):
            open_writer(str(tmp_path / "out"), "magic")


def test_detects_safetensors_layouts(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from dcp_storage import SafetensorsReader, SafetensorsWriter

    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(sd, str(tmp_path / "one.safetensors"))
    assert isinstance(open_reader(str(tmp_path / "one.safetensors")), SafetensorsReader)
    assert isinstance(open_reader(str(tmp_path)), SafetensorsReader)  # a directory of .safetensors files
    out_dir = tmp_path / "sharded"
    dcp.save(sd, storage_writer=open_writer(str(out_dir), "safetensors", max_shard_size=20))
    assert isinstance(open_writer(str(tmp_path / "x"), "safetensors"), SafetensorsWriter)
    assert (out_dir / "model.safetensors.index.json").exists()
    reader = open_reader(str(out_dir / "model.safetensors.index.json"))
    out = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"])
    assert isinstance(open_reader(str(out_dir)), SafetensorsReader)


def test_detects_torch_save_files(tmp_path: Path) -> None:
    from dcp_storage import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner
    from dcp_storage.formats.torch_save.spec import looks_like_legacy_torch_pickle

    sd = {"w": torch.arange(10.0), "b": torch.ones(2, 2)}
    torch.save(sd, tmp_path / "model.pt")
    reader = open_reader(str(tmp_path / "model.pt"))
    assert isinstance(reader, BroadcastingTorchSaveReader)
    out = {"w": torch.zeros(10), "b": torch.zeros(2, 2)}
    dcp.load(out, storage_reader=reader, planner=DynamicMetaLoadPlanner(), checkpoint_id=str(tmp_path / "model.pt"))
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    torch.save(sd, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert looks_like_legacy_torch_pickle((tmp_path / "legacy.pt").read_bytes()[:64])
    with pytest.raises(UnknownFormatError, match="read-only"):
        open_writer(str(tmp_path / "out.pt"), "torch_save")


def test_storage_options_passed_as_the_format_are_named(tmp_path: Path) -> None:
    """``open_reader(url, opts)`` puts the options in ``format``: the error says so (before: the registry's
    bare ``TypeError: unhashable type: 'dict'``)."""
    options = {"anon": True}
    for opener in (open_reader, open_writer):
        with pytest.raises(TypeError, match=r"storage_options=\.\.\.") as info:
            opener(str(tmp_path), options)  # type: ignore[arg-type]
        assert opener.__name__ in str(info.value) and "got a dict" in str(info.value)
