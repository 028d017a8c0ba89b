"""torch_checkpointing's ``Storage`` ABC, its whole documented contract, on local, ``memory://``, ``s3://``
(moto) and ``gs://`` (fake-gcs-server): reads and writes, the tree calls, and the ``rename`` table row by row.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from dcp_storage.plugin_api import CheckpointExistsError, CorruptCheckpointError, TargetError, WrongPathTypeError
from torch_checkpointing.storage.base_storage import ReadArgs, Storage

from dcp_storage_torch_checkpointing import DcpStorage, DcpStorageConfig, rename
from dcp_storage_torch_checkpointing._unstable import METADATA_FILE_NAME


@pytest.fixture
def storage(root: tuple[str, dict[str, Any]]) -> DcpStorage:
    url, options = root
    made = DcpStorageConfig(url, options).create_storage()
    assert isinstance(made, Storage)
    return made


def _tree(storage: DcpStorage, top: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        parent = str(Path(top, rel).parent)
        storage.mkdir(Path(parent))
        storage.write(Path(top, rel), data)


def _files(storage: DcpStorage, top: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name in storage.ls(Path(top)):
        path = Path(top, name)
        if storage.isdir(path):
            out.update({f"{name}/{k}": v for k, v in _files(storage, str(path)).items()})
        else:
            out[name] = storage.read(path)
    return out


# --------------------------------------------------------------------------------------- read / write
@pytest.mark.parametrize("size", [0, 1, 4095, 4097, 64 * 64 * 4 + 3, (1 << 20) + 17])
def test_unaligned_sizes_round_trip(storage: DcpStorage, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    storage.write(Path("a.bin"), data)
    with storage.stream_write(Path("b.bin")) as f:
        f.write(memoryview(data))
    for name in ("a.bin", "b.bin"):
        assert storage.getsize(Path(name)) == size
        assert storage.read(Path(name)) == data
        with storage.stream_read(Path(name), ReadArgs(pre_read_full_file=False)) as f:
            buf = bytearray(size)
            got = 0
            while got < size:
                n = f.readinto(memoryview(buf)[got:])
                assert n
                got += n
            assert bytes(buf) == data and f.readinto(bytearray(1)) == 0


def test_ranged_reads_seek_and_readinto(storage: DcpStorage) -> None:
    data = torch.arange(300_000, dtype=torch.int32).numpy().tobytes()
    storage.write(Path("t.bin"), data)
    for pre in (True, False):
        with storage.stream_read(Path("t.bin"), ReadArgs(pre_read_full_file=pre)) as f:
            assert isinstance(f, io.RawIOBase) and f.seekable()
            assert f.seek(1000) == 1000 and f.read(10) == data[1000:1010]
            assert f.seek(-5, io.SEEK_END) == len(data) - 5 and f.read() == data[-5:]
            f.seek(3)
            buf = bytearray(len(data) - 3)
            assert f.readinto(buf) == len(buf) and bytes(buf) == data[3:]


def test_torch_save_and_load_through_streams(storage: DcpStorage) -> None:
    tensor = torch.randn(64, 64)
    with storage.get_write_stream(Path("step/model.pt"), tensor) as f:
        torch.save({"w": tensor}, f)
    loaded = torch.load(storage.stream_read(Path("step/model.pt")), weights_only=True)
    assert torch.equal(loaded["w"], tensor)


def test_known_size_is_checked(storage: DcpStorage) -> None:
    storage.write(Path("k.bin"), b"12345")
    assert storage.read(Path("k.bin"), ReadArgs(known_size_bytes=5)) == b"12345"
    with pytest.raises(CorruptCheckpointError, match="5 bytes stored but 4 expected"):
        storage.read(Path("k.bin"), ReadArgs(known_size_bytes=4))


def test_missing_file_raises_file_not_found(storage: DcpStorage) -> None:
    for call in (storage.read, storage.stream_read, storage.getsize, storage.ls):
        with pytest.raises(FileNotFoundError):
            call(Path("nope"))


def test_a_failed_write_leaves_nothing(storage: DcpStorage) -> None:
    with pytest.raises(RuntimeError, match="boom"), storage.stream_write(Path("w.bin")) as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    assert not storage.exists(Path("w.bin"))
    f = storage.stream_write(Path("dropped.bin"))
    f.write(b"partial")
    del f  # never closed: discarded, not committed
    assert not storage.exists(Path("dropped.bin"))


# ----------------------------------------------------------------------------------------- the tree
def test_tree_calls(storage: DcpStorage) -> None:
    assert not storage.exists(Path("d")) and not storage.isdir(Path("d"))
    _tree(storage, "d", {"x.pt": b"x", "sub/y.pt": b"yy"})
    assert storage.exists(Path("d")) and storage.isdir(Path("d")) and storage.isdir(Path("d/sub"))
    assert not storage.isdir(Path("d/x.pt")) and storage.exists(Path("d/x.pt"))
    assert sorted(storage.ls(Path("d"))) == ["sub", "x.pt"]
    assert sorted(storage.glob(str(Path("d", "*.pt")))) == [str(Path("d", "x.pt"))]
    storage.delete(Path("d/x.pt"))
    assert not storage.exists(Path("d/x.pt"))
    storage.rmdir(Path("d"))
    assert not storage.exists(Path("d")) and not storage.exists(Path("d/sub/y.pt"))


def test_paths_resolve_under_the_root_and_full_urls_work(storage: DcpStorage, root: tuple[str, Any]) -> None:
    url, _ = root
    storage.write(Path("step-1/a.pt"), b"a")
    remapped = storage.remap_path(Path("step-1/a.pt"))
    assert remapped.endswith("run/step-1/a.pt")
    assert storage.read(Path(remapped)) == b"a", "a full URL (pathlib-mangled s3:/...) names the same file"
    assert storage.read(Path(f"{url}/step-1/a.pt")) == b"a"
    assert storage.read(Path("/step-1/a.pt")) == b"a", "an absolute path is under the root too"
    with pytest.raises(TargetError, match="climbs out"):
        storage.read(Path("../outside"))


def test_pickles_without_its_transports(storage: DcpStorage) -> None:
    storage.write(Path("p.bin"), b"p")
    if storage.remap_path(Path("p.bin")).startswith("memory://"):
        return  # memory:// lives in this process only; nothing else to show
    again = pickle.loads(pickle.dumps(storage))
    assert again.read(Path("p.bin")) == b"p"


# ---------------------------------------------------------------------------------- the rename table
CKPT = {"model/0.pt": b"m0", "model/1.pt": b"m1" * 1000, METADATA_FILE_NAME: b"meta", "z.pt": b"z"}


@pytest.mark.parametrize("background", [False, True])
def test_rename_directory_onto_absent(storage: DcpStorage, background: bool) -> None:
    _tree(storage, "tmp_step-1", CKPT)
    storage.rename(Path("tmp_step-1"), Path("step-1"), is_directory=True, background_cleanup=background)
    assert _files(storage, "step-1") == CKPT, "the contents land AT dst, not nested under it"
    if not background:
        assert not storage.exists(Path("tmp_step-1"))


def test_rename_copies_the_metadata_last(storage: DcpStorage, monkeypatch: pytest.MonkeyPatch) -> None:
    if storage.is_local:
        pytest.skip("a local rename is one os.rename: nothing is copied")
    copied: list[str] = []
    copy = rename.copy_object

    def recording(src_t: Any, src: str, dst_t: Any, dst: str) -> str:
        copied.append(dst.rsplit("/", 1)[-1])
        return copy(src_t, src, dst_t, dst)

    monkeypatch.setattr(rename, "copy_object", recording)
    _tree(storage, "tmp_step-1", CKPT)
    storage.rename(Path("tmp_step-1"), Path("step-1"), is_directory=True)
    assert sorted(copied) == sorted(p.rsplit("/", 1)[-1] for p in CKPT) and copied[-1] == METADATA_FILE_NAME
    assert _files(storage, "step-1") == CKPT


def test_rename_directory_onto_empty_directory(storage: DcpStorage) -> None:
    _tree(storage, "tmp_step-1", CKPT)
    storage.mkdir(Path("step-1"))
    storage.rename(Path("tmp_step-1"), Path("step-1"), is_directory=True)
    assert _files(storage, "step-1") == CKPT
    assert not storage.exists(Path("tmp_step-1"))


def test_rename_directory_onto_populated_directory_raises(storage: DcpStorage) -> None:
    _tree(storage, "tmp_step-1", CKPT)
    _tree(storage, "step-1", {"old.pt": b"old"})
    with pytest.raises(OSError) as raised:
        storage.rename(Path("tmp_step-1"), Path("step-1"), is_directory=True)
    assert isinstance(raised.value, CheckpointExistsError)
    assert _files(storage, "step-1") == {"old.pt": b"old"} and _files(storage, "tmp_step-1") == CKPT


def test_rename_directory_onto_file_raises(storage: DcpStorage) -> None:
    _tree(storage, "tmp_step-1", CKPT)
    storage.write(Path("step-1"), b"file")
    with pytest.raises(OSError) as raised:
        storage.rename(Path("tmp_step-1"), Path("step-1"), is_directory=True)
    assert isinstance(raised.value, WrongPathTypeError)
    assert storage.read(Path("step-1")) == b"file" and _files(storage, "tmp_step-1") == CKPT


def test_rename_file_onto_absent_and_onto_file(storage: DcpStorage) -> None:
    storage.write(Path("a.tmp"), b"new")
    storage.rename(Path("a.tmp"), Path("a"))
    assert storage.read(Path("a")) == b"new" and not storage.exists(Path("a.tmp"))
    storage.write(Path("a.tmp"), b"newer")
    storage.rename(Path("a.tmp"), Path("a"))
    assert storage.read(Path("a")) == b"newer" and not storage.exists(Path("a.tmp"))


@pytest.mark.parametrize("populated", [False, True])
def test_rename_file_onto_directory_raises(storage: DcpStorage, populated: bool) -> None:
    storage.write(Path("a.tmp"), b"new")
    if populated:
        _tree(storage, "a", {"inside.pt": b"i"})
    else:
        storage.mkdir(Path("a"))
        if not storage.isdir(Path("a")):
            pytest.skip("no empty directories on this store (a key prefix exists only with objects under it)")
    with pytest.raises(OSError) as raised:
        storage.rename(Path("a.tmp"), Path("a"))
    assert isinstance(raised.value, WrongPathTypeError)
    assert storage.read(Path("a.tmp")) == b"new" and storage.isdir(Path("a"))
