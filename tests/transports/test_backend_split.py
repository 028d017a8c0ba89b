"""The per-backend transports: chosen for the filesystem a URL resolves to, compatible with code written
against the single ``FsspecTransport`` of earlier versions, and the local strided-copy fast path as a
transport method that reads only regular files inside the checkpoint."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import fsspec
import pytest

import dcp_storage
from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_storage.transports import (
    FsspecTransport,
    HttpTransport,
    LocalFileAccess,
    LocalRunReads,
    LocalTransport,
    RunsRead,
    Transport,
    TransportConfig,
    open_transport,
)
from dcp_storage.transports.ranges import LocalRuns, Region

PACKAGE = Path(dcp_storage.__file__).parent


class Audited(FsspecTransport):
    """A subclass as a plugin wrote one against the single class: it overrides one method."""

    def exists(self, path: str) -> bool:
        self.asked = [*getattr(self, "asked", []), path]
        return super().exists(path)


@pytest.mark.parametrize(
    ("url", "expected"),
    [("{tmp}/ckpt", LocalTransport), ("file://{tmp}/ckpt", LocalTransport), ("memory://split/x", FsspecTransport),
     ("http://127.0.0.1:9/x", HttpTransport)],
)  # fmt: skip
def test_the_factory_picks_the_backend_of_the_url(tmp_path: Path, url: str, expected: type) -> None:
    transport, _ = open_transport(url.format(tmp=tmp_path))
    with transport:
        assert type(transport) is expected and isinstance(transport, Transport)
        assert isinstance(transport, LocalRunReads) == (expected is LocalTransport)
        assert isinstance(transport, LocalFileAccess) == (expected is LocalTransport)


def test_fsspec_transport_on_a_filesystem_builds_its_backend(tmp_path: Path) -> None:
    transport = FsspecTransport(fsspec.filesystem("file"), TransportConfig(max_workers=2))
    assert type(transport) is LocalTransport and transport.is_local
    transport.write_file(str(tmp_path / "a"), b"abc")
    assert transport.read_file(str(tmp_path / "a")) == b"abc"


def test_an_old_subclass_keeps_its_method_and_gets_the_backend(tmp_path: Path) -> None:
    transport, root = Audited.from_url(tmp_path)
    assert isinstance(transport, Audited) and isinstance(transport, LocalTransport) and transport.is_local
    assert transport.exists(os.path.join(root, "x")) is False and transport.asked == [os.path.join(root, "x")]
    again = pickle.loads(pickle.dumps(transport))  # the combined class pickles by the subclass's name
    assert type(again) is type(transport) and again.asked == transport.asked
    other = transport.reconfigured(TransportConfig(max_workers=1))
    assert type(other) is type(transport) and other.counters is transport.counters
    for t in (transport, again, other):
        t.close()


def test_pickled_backends_stay_backends(tmp_path: Path) -> None:
    for url in (str(tmp_path), "memory://split/y"):
        transport, _ = open_transport(url)
        assert type(pickle.loads(pickle.dumps(transport))) is type(transport)
        transport.close()


def test_no_module_outside_transports_names_the_concrete_class() -> None:
    """The attack: a format or tool typed against (or building) ``FsspecTransport`` instead of the protocol."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("transports/") or rel == "__init__.py":
            continue
        text = path.read_text()
        for pattern in (r"\bFsspecTransport\b", r"\.fs\b", r"[\"']fs[\"']", r"\._executor\(", r"\._workers\b"):
            if re.search(pattern, text):
                offenders.append(f"{rel}: {pattern}")
    assert not offenders, offenders


def test_the_package_stays_small_modules_of_at_most_500_lines() -> None:
    """The redesign's bar (issue 21): at most 120 modules under ``dcp_storage/``, none over 500 lines."""
    files = list(PACKAGE.rglob("*.py"))
    long = {str(p.relative_to(PACKAGE)): n for p in files if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
    assert len(files) <= 120, len(files)


# ------------------------------------------------------------------------- the local fast path
def _file(tmp_path: Path, nbytes: int = 4096) -> tuple[LocalTransport, str, bytes]:
    data = bytes(range(256)) * (nbytes // 256)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "data").write_bytes(data)
    transport, root = open_transport(tmp_path / "ckpt")
    assert isinstance(transport, LocalTransport)
    return transport, os.path.join(root, "data"), data


class OnlyLocalFiles:
    """A third-party local transport offering ``local_files()`` but not the fast-path methods."""

    def __init__(self, inner: LocalTransport) -> None:
        self.local_files, self.executor, self.counters = inner.local_files, inner.executor, inner.counters


@pytest.mark.parametrize("own", [True, False])
def test_read_runs_fill_the_buffer_with_each_run(tmp_path: Path, own: bool) -> None:
    transport, path, data = _file(tmp_path)
    starts = list(range(0, 4096, 512))  # 8 runs of 100 bytes, 412 bytes apart
    into = memoryview(bytearray(8 * 100))
    runs = transport if own else LocalRuns(OnlyLocalFiles(transport))
    before = transport.counters.snapshot()
    runs.read_runs([RunsRead(path, starts, 100, into, "w")])
    assert bytes(into) == b"".join(data[s : s + 100] for s in starts)
    assert transport.counters.snapshot()["requests"] - before["requests"] == 8
    transport.close()


def test_read_runs_past_the_end_names_the_tensor(tmp_path: Path) -> None:
    transport, path, _ = _file(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w'.*short read at byte 4000"):
        transport.read_runs([RunsRead(path, [0, 4000], 200, memoryview(bytearray(400)), "tensor 'w'")])
    transport.close()


def test_map_regions_map_each_span_and_refuse_a_short_file(tmp_path: Path) -> None:
    transport, path, data = _file(tmp_path)
    maps = transport.map_regions([Region(path, 1000, 4000), Region(path, 7, 9)])
    mm, at = next(maps)
    assert mm[at : at + 3000] == data[1000:4000]
    mm2, at2 = next(maps)
    assert mm.closed and mm2[at2 : at2 + 2] == data[7:9]  # the previous map is closed once the next is asked
    maps.close()
    assert mm2.closed
    with pytest.raises(CorruptCheckpointError, match=r"t: the data ends at byte 5000 but the file has 4096"):
        next(transport.map_regions([Region(path, 100, 5000, "t")]))
    transport.close()


@pytest.mark.parametrize("method", ["read_runs", "map_regions"])
def test_the_fast_path_reads_no_file_outside_the_checkpoint(tmp_path: Path, method: str) -> None:
    """Attack: a checkpoint whose data file is a symlink to a file outside it (or a FIFO, which would hang)."""
    transport, path, _ = _file(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 4096)
    os.symlink(secret, path + ".link")
    os.mkfifo(path + ".fifo")
    for bad in (path + ".link", path + ".fifo"):
        with pytest.raises(CorruptCheckpointError):
            if method == "read_runs":
                transport.read_runs([RunsRead(bad, [0], 16, memoryview(bytearray(16)))])
            else:
                next(transport.map_regions([Region(bad, 0, 16)]))
    with pytest.raises(CheckpointNotFoundError):
        transport.read_runs([RunsRead(path + ".gone", [0], 16, memoryview(bytearray(16)))])
    transport.close()
