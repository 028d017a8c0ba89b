"""A plugin format gets every tool: the ``npz`` test plugin (``site/dcp_storage_npz``), found through its
entry point, is read, inspected, verified (shallow and deep) and converted from and to, through the API and
the CLI, on real files. Before formats carried their own hooks, a plugin's format was described without
files or byte ranges, verified by loading its metadata only, and could not be a ``convert`` target."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import convert, describe, open_reader, open_writer, registry, verify
from dcp_storage.errors import NonTensorStateError, UnsafeCheckpointError, UnsupportedDtypeError
from dcp_storage.inspection import FileInfo
from dcp_storage.plugin_api import FormatSpec, TargetError
from tests.cli._helpers import cli_env, run_batch

SITE = Path(__file__).with_name("site")


@pytest.fixture
def npz_plugin() -> Iterator[None]:
    """The plugin's folder (package and ``.dist-info``) on the path: found exactly as an installed wheel."""
    sys.path.insert(0, str(SITE))
    registry.reload()
    try:
        yield
    finally:
        sys.path.remove(str(SITE))
        for name in [m for m in sys.modules if m.split(".")[0] == "dcp_storage_npz"]:
            del sys.modules[name]
        registry.reload()


def _arrays() -> dict[str, np.ndarray]:
    return {
        "layer.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "layer.0.bias": np.array([1.5, -2.0, 3.25], dtype=np.float16),
        "step_counts": np.arange(5, dtype=np.int64) * 7,
        "mask": np.array([True, False, True]),
        "big_endian": np.arange(6, dtype=">f8").reshape(2, 3),
    }


@pytest.fixture
def npz_file(tmp_path: Path) -> Path:
    path = tmp_path / "weights.npz"
    np.savez(path, **_arrays())
    return path


def _same(got: dict[str, torch.Tensor], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for key, array in want.items():
        expected = torch.from_numpy(array.astype(array.dtype.newbyteorder("=")))
        assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), key


def _data_range(path: Path, key: str) -> tuple[int, int]:
    """``(offset, length)`` of a member's array bytes, from the zip and ``.npy`` headers (not the plugin)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(key + ".npy")
        with zf.open(info) as member:
            assert np.lib.format.read_magic(member) == (1, 0)
            np.lib.format.read_array_header_1_0(member)
            header = member.tell()
    raw = path.read_bytes()
    name_len, extra_len = (
        int.from_bytes(raw[info.header_offset + i : info.header_offset + i + 2], "little") for i in (26, 28)
    )
    return info.header_offset + 30 + name_len + extra_len + header, info.file_size - header


# ------------------------------------------------------------------------------------------------ read
def test_plugin_format_is_detected_and_loads(npz_plugin: None, npz_file: Path) -> None:
    want = _arrays()
    state = {k: torch.empty_like(torch.from_numpy(a.astype(a.dtype.newbyteorder("=")))) for k, a in want.items()}
    dcp.load(state, storage_reader=open_reader(npz_file))
    _same(state, want)


# --------------------------------------------------------------------------------------------- inspect
def test_inspect_shows_the_file_and_each_arrays_byte_range(npz_plugin: None, npz_file: Path) -> None:
    info = describe(npz_file)
    assert (info.format, info.layout) == ("npz/1", "NumPy .npz archive")
    assert info.files == [FileInfo("weights.npz", npz_file.stat().st_size)]
    raw = npz_file.read_bytes()
    want = _arrays()
    assert [t.key for t in info.tensors] == list(want)
    for t in info.tensors:
        array = want[t.key]
        assert t.shape == list(array.shape) and t.nbytes == array.nbytes and t.files == ["weights.npz"]
        (chunk,) = t.chunks
        assert chunk.offset is not None and chunk.length == array.nbytes
        assert raw[chunk.offset : chunk.offset + chunk.length] == array.tobytes(), t.key  # the real bytes
    assert {t.key: t.dtype for t in info.tensors}["big_endian"] == "float64"


# ---------------------------------------------------------------------------------------------- verify
def test_verify_checks_every_member_and_deep_checks_every_crc(npz_plugin: None, npz_file: Path) -> None:
    shallow = verify(npz_file)
    assert shallow.ok and shallow.format == "npz/1", shallow
    assert shallow.checked == {"files": 1, "tensors": 5, "chunks": 5}
    assert not any("no checks of its own" in n for n in shallow.notes)
    deep = verify(npz_file, deep=True)
    assert deep.ok, deep
    assert deep.checked["tensors_read"] == 5 and deep.checked["crc32_records"] == 5
    assert "CRC32 of every .npz member checked" in deep.notes
    assert not any(n.startswith("no checksums recorded") for n in deep.notes)


def test_verify_names_a_flipped_byte_a_truncation_and_a_stranger(npz_plugin: None, npz_file: Path) -> None:
    offset, _length = _data_range(npz_file, "step_counts")
    data = bytearray(npz_file.read_bytes())
    flipped = npz_file.with_name("flipped.npz")
    data[offset + 3] ^= 0x40
    flipped.write_bytes(bytes(data))
    assert verify(flipped).ok  # sizes and headers are intact: only the bytes say otherwise
    deep = verify(flipped, deep=True)
    assert not deep.ok
    assert any("flipped.npz" in p and "step_counts.npy" in p and "CRC" in p for p in deep.problems), deep.problems

    cut = npz_file.with_name("cut.npz")
    cut.write_bytes(npz_file.read_bytes()[: npz_file.stat().st_size // 2])
    report = verify(cut, format="npz")
    assert not report.ok and any("cut.npz" in p for p in report.problems), report.problems

    mixed = npz_file.with_name("mixed.npz")
    np.savez(mixed, a=np.ones(3))
    with zipfile.ZipFile(mixed, "a") as zf:
        zf.writestr("notes.txt", "not an array")
    report = verify(mixed)
    assert report.problems == [f"{mixed} (member 'notes.txt'): not a .npy array; an .npz archive holds only those"]


class _Payload:
    """Pickles to a call that creates ``marker``: loading it runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_an_object_array_is_refused_everywhere_and_runs_nothing(npz_plugin: None, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.npz"
    np.savez(hostile, ok=np.ones(2), evil=np.array([_Payload(marker)], dtype=object))
    assert not marker.exists()
    report = verify(hostile, deep=True)
    assert not report.ok and any("evil.npy" in p and "object array" in p for p in report.problems), report
    with pytest.raises(UnsafeCheckpointError, match="evil.npy"):
        describe(hostile)
    with pytest.raises(UnsafeCheckpointError, match="evil.npy"):
        open_reader(hostile).read_metadata()
    with pytest.raises(UnsafeCheckpointError, match="evil.npy"):
        convert(hostile, tmp_path / "out.safetensors")
    assert not marker.exists()
    np.load(hostile, allow_pickle=True)["evil"]  # the payload is live: loading it unsafely runs it
    assert marker.exists()


# --------------------------------------------------------------------------------------------- convert
def test_convert_from_npz(npz_plugin: None, npz_file: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    result = convert(npz_file, tmp_path / "model.safetensors")
    assert (result.src_format, result.to, result.tensors) == ("npz/1", "safetensors", 5)
    _same(load_file(tmp_path / "model.safetensors"), _arrays())
    convert(npz_file, tmp_path / "ckpt", to="dcp")
    state = {k: torch.empty_like(v) for k, v in load_file(tmp_path / "model.safetensors").items()}
    dcp.load(state, storage_reader=open_reader(tmp_path / "ckpt"))
    _same(state, _arrays())


def test_convert_to_npz_streams_a_file_numpy_loads(npz_plugin: None, tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(4, 6), "b": torch.arange(3, dtype=torch.int32)}, "lr": torch.tensor(0.5)}
    dcp.save(state, storage_writer=open_writer(tmp_path / "ckpt"))
    result = convert(tmp_path / "ckpt", tmp_path / "out.npz")  # the target from the suffix the plugin declared
    assert (result.to, result.output, [f.name for f in result.files]) == ("npz", str(tmp_path / "out.npz"), ["out.npz"])
    with np.load(tmp_path / "out.npz", allow_pickle=False) as npz:
        got = {k: torch.from_numpy(npz[k]) for k in npz.files}
    want = {"model.w": state["model"]["w"], "model.b": state["model"]["b"], "lr": state["lr"]}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert verify(tmp_path / "out.npz", deep=True).ok

    directory = convert(tmp_path / "out.npz", tmp_path / "as_dir", to="npz")  # npz -> npz, a directory output
    assert directory.output == str(tmp_path / "as_dir" / "arrays.npz")
    assert (tmp_path / "as_dir" / "arrays.npz").read_bytes() == (tmp_path / "out.npz").read_bytes()


def test_convert_to_npz_refuses_what_npz_cannot_hold_before_writing(npz_plugin: None, tmp_path: Path) -> None:
    dcp.save(
        {"w": torch.ones(2, dtype=torch.bfloat16), "x": torch.ones(2)}, storage_writer=open_writer(tmp_path / "bf")
    )
    with pytest.raises(UnsupportedDtypeError, match=r"npz has no dtype for 'w' \(torch.bfloat16\)"):
        convert(tmp_path / "bf", tmp_path / "bf.npz")
    assert not (tmp_path / "bf.npz").exists()
    converted = convert(tmp_path / "bf", tmp_path / "bf32.npz", dtype="fp32")  # cast on the way: fine
    assert converted.tensors == 2
    dcp.save({"w": torch.ones(2), "step": 7}, storage_writer=open_writer(tmp_path / "vals"))
    with pytest.raises(NonTensorStateError, match="'step'"):
        convert(tmp_path / "vals", tmp_path / "vals.npz")
    dropped = convert(tmp_path / "vals", tmp_path / "vals.npz", drop_non_tensors=True)
    assert dropped.dropped_values == ["step"]


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_inspects_verifies_and_converts_a_plugin_format(npz_file: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    env = cli_env(PYTHONPATH=os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]))
    bad = tmp_path / "bad.npz"
    offset, _length = _data_range(npz_file, "mask")
    data = bytearray(npz_file.read_bytes())
    data[offset] ^= 0x01
    bad.write_bytes(bytes(data))
    results = run_batch(
        [
            ["inspect", str(npz_file), "--json"],
            ["inspect", str(npz_file), "--chunks"],
            ["verify", "--deep", str(npz_file)],
            ["verify", "--deep", str(bad)],
            ["convert", str(npz_file), str(tmp_path / "m.safetensors")],
            ["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "back"), "--to", "npz"],
            ["convert", str(npz_file), str(tmp_path / "x"), "--to", "nope"],
        ],
        env=env,
    )
    as_json, table, ok, broken, to_st, to_npz, nope = results
    assert as_json.rc == 0, as_json
    doc = json.loads(as_json.stdout)
    assert doc["format"] == "npz/1" and doc["files"] == [{"name": "weights.npz", "size": npz_file.stat().st_size}]
    assert table.rc == 0 and "NumPy .npz archive" in table.stdout and "weights.npz [" in table.stdout, table
    assert ok.rc == 0 and "CRC32 of every .npz member checked" in ok.stdout and "OK" in ok.stdout, ok
    assert broken.rc == 1 and "mask.npy" in broken.stdout and "CRC" in broken.stdout, broken
    assert to_st.rc == 0, to_st
    _same(load_file(tmp_path / "m.safetensors"), _arrays())
    assert to_npz.rc == 0 and "(npz," in to_npz.stdout, to_npz
    with np.load(tmp_path / "back" / "arrays.npz", allow_pickle=False) as npz:
        _same({k: torch.from_numpy(npz[k]) for k in npz.files}, _arrays())
    assert nope.rc == 2 and "invalid choice" in nope.stderr and "'npz'" in nope.stderr, nope


# ---------------------------------------------------------------------------------- hooks left out, or broken
def test_a_format_without_hooks_gets_the_readers_view(npz_plugin: None, npz_file: Path) -> None:
    """The fallbacks: ``describe`` from the reader's metadata, ``verify`` by loading it and reading back."""
    full = registry.get("formats", "npz")
    bare = FormatSpec("bare", "1", lambda _probe: None, full.open_reader)
    with registry.registered("formats", "bare", bare):
        info = describe(npz_file, format="bare")
        assert (info.format, info.layout, info.files) == ("bare/1", "bare", [])
        assert [(t.key, t.shape, t.files) for t in info.tensors] == [
            (k, list(a.shape), []) for k, a in _arrays().items()
        ]
        report = verify(npz_file, deep=True, format="bare")
        assert report.ok and report.checked == {"tensors_read": 5}, report
        assert "format bare/1 has no checks of its own: only its reader's metadata is checked" in report.notes
        with pytest.raises(TargetError, match="unknown output format 'bare'"):
            convert(npz_file, npz_file.with_name("x"), to="bare", src_format="bare")


def test_a_hook_that_raises_is_a_problem_not_a_crash(npz_plugin: None, npz_file: Path) -> None:
    def broken(_report: object, _url: str, _options: object) -> None:
        raise RuntimeError("the plugin did not expect this")

    full = registry.get("formats", "npz")
    spec = dataclasses.replace(full, name="broken", check=None, deep_check=broken)
    with registry.registered("formats", "broken", spec):
        report = verify(npz_file, deep=True, format="broken")
    assert report.problems == ["RuntimeError: the plugin did not expect this"]
    assert report.checked["tensors_read"] == 5  # everything before the broken hook still ran
