"""Local reads stay inside the checkpoint even when a directory inside it is swapped while a file is opened.

The containment check resolves a path, then opens it with ``O_NOFOLLOW``; that guards the last component
only. Attack: whoever can rename entries inside the checkpoint (a prefix directory of a DCP save, a shared
scratch directory) swaps a directory on the path for a symlink to a directory outside between the check and
the ``open``, and back for the next check. Modelled deterministically: the swap happens right after each
containment check returns (the moments a racing attacker aims for). Before: the second ``stat``/``open`` pair
followed the swapped-in link, both saw the outside file (so the inode check agreed), and its bytes were read.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.transports import local_io as local_open
from dcp_storage.transports import open_transport

SECRET = b"S" * 4096


def _checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    inside = tmp_path / "ckpt" / "sub"
    inside.mkdir(parents=True)
    (inside / "data").write_bytes(b"d" * 4096)
    outside = tmp_path / "elsewhere" / "sub"
    outside.mkdir(parents=True)
    (outside / "data").write_bytes(SECRET)
    return inside, outside


def _swap_after_each_check(monkeypatch: pytest.MonkeyPatch, inside: Path, outside: Path) -> None:
    """Each containment check sees the real directory; right after it, ``sub`` is a link out of the checkpoint."""
    real_check = local_open.Confinement.check
    parked = inside.with_name("sub.parked")

    def restore() -> None:
        if inside.is_symlink():
            inside.unlink()
            parked.rename(inside)

    def check(self: local_open.Confinement, path: str, where: str | None = None) -> str:
        restore()
        resolved = real_check(self, path, where)
        inside.rename(parked)
        inside.symlink_to(outside, target_is_directory=True)
        return resolved

    monkeypatch.setattr(local_open.Confinement, "check", check)


@pytest.mark.parametrize("how", ["read_range", "read_file"])
def test_a_directory_swapped_for_a_link_out_after_the_check_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    inside, outside = _checkpoint(tmp_path)
    transport, root = open_transport(tmp_path / "ckpt")
    path = os.path.join(root, "sub", "data")
    _swap_after_each_check(monkeypatch, inside, outside)
    with transport, pytest.raises(CorruptCheckpointError, match=r"outside the checkpoint") as info:
        got = bytes(transport.read_range(path, 0, 16) if how == "read_range" else transport.read_file(path))
        pytest.fail(f"read {len(got)} bytes, the secret's: {got == SECRET[: len(got)]}")
    assert "S" * 8 not in str(info.value)


def test_without_a_swap_the_same_file_reads(tmp_path: Path) -> None:
    _checkpoint(tmp_path)
    transport, root = open_transport(tmp_path / "ckpt")
    with transport:
        assert bytes(transport.read_range(os.path.join(root, "sub", "data"), 0, 16)) == b"d" * 16


def test_listed_sizes_vouch_only_for_regular_files_and_the_swapped_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``listed_sizes`` (``describe``'s one listing for a million data files) gives a size only where ``size``
    would give the same after the same checks: regular files, no links (in or out), no FIFO, no directory;
    and a listed directory that is swapped for a link out after its check gives none."""
    inside, outside = _checkpoint(tmp_path)
    ckpt = inside.parent
    (ckpt / "a.distcp").write_bytes(b"x" * 10)
    (ckpt / "in.distcp").symlink_to(ckpt / "a.distcp")
    (ckpt / "out.distcp").symlink_to(outside / "data")
    os.mkfifo(ckpt / "fifo.distcp")
    transport, root = open_transport(ckpt)
    with transport:
        assert transport.listed_sizes(root) == {
            "a.distcp": 10,
            "in.distcp": None,
            "out.distcp": None,
            "fifo.distcp": None,
            "sub": None,
        }
        assert transport.size(os.path.join(root, "in.distcp")) == 10  # what size() decides for the rest
        with pytest.raises(CorruptCheckpointError):
            transport.size(os.path.join(root, "out.distcp"))
        assert transport.listed_sizes(os.path.join(root, "sub")) == {"data": 4096}
        assert transport.listed_sizes(os.path.join(root, "missing")) == {}
        _swap_after_each_check(monkeypatch, inside, outside)
        assert transport.listed_sizes(os.path.join(root, "sub")) == {}  # the opened directory lies outside
