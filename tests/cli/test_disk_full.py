"""A full disk during ``convert`` and ``merge`` (issue 20, failure paths), on a real small tmpfs.

Before: to ``.pt`` the process aborted (SIGABRT: torch's zip writer raised from its destructor) and left a
2 MiB temp file, so the disk stayed full and every later conversion failed too; to the other targets a bare
``OSError: [Errno 28]`` naming no path, with a temp file left (the temp file's close failed as well, and the
removal after it never ran). Now: ``StorageFullError`` naming the output, nothing left on the disk (no temp
file, no lock, no directory), and the same conversion succeeds once space is freed.

Needs root to mount a tmpfs; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ._helpers import run_cli

DISK = "4m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount)], capture_output=True, check=False
        )
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "in.safetensors"
    save_file({f"t{i}": torch.full((128, 256), float(i)) for i in range(8)}, str(path))  # 1 MiB of tensors
    return path


def _fill(disk: Path, leave: int = 200_000) -> Path:
    """A file taking all the space but ``leave`` bytes (less than any output here needs)."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - leave))
    return filler


TARGETS = {
    "pt": ("out.pt", {}),
    "safetensors": ("out.safetensors", {}),
    "dcp": ("out_dcp", {"to": "dcp", "max_shard_size": "300KB"}),
    "safetensors-sharded": ("out_st", {"to": "safetensors", "max_shard_size": "300KB"}),
    "torch-sharded": ("out_pt", {"to": "torch", "max_shard_size": "300KB"}),
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_convert_on_a_full_disk_names_it_leaves_nothing_and_the_retry_succeeds(
    small_disk: Path, src: Path, target: str
) -> None:
    from dcp_storage import convert, open_reader
    from dcp_storage.errors import StorageFullError

    name, options = TARGETS[target]
    filler = _fill(small_disk)
    with pytest.raises(StorageFullError) as caught:
        convert(src, small_disk / name, **options)
    assert str(small_disk / name) in str(caught.value) and "free space and retry" in str(caught.value)
    assert isinstance(caught.value, OSError) and caught.value.errno == 28
    assert sorted(os.listdir(small_disk)) == ["filler"]  # no temp file, no lock, no directory
    filler.unlink()
    result = convert(src, small_disk / name, **options)
    assert result.tensors == 8 and all(
        (small_disk / name / f.name if (small_disk / name).is_dir() else small_disk / name).stat().st_size == f.size
        for f in result.files
    )
    if target != "torch-sharded":  # torch's sharded index is for Hugging Face's loader, not a reader's
        assert open_reader(result.output).read_metadata().state_dict_metadata.keys() >= {"t0", "t7"}


def test_cli_convert_and_merge_on_a_full_disk_exit_1_with_one_line(
    small_disk: Path, src: Path, sources: dict[str, Path]
) -> None:
    filler = _fill(small_disk, leave=8_000)  # the merged output is 24 KiB
    for argv in (
        ["convert", str(src), str(small_disk / "out.pt")],
        ["merge", str(sources["dcp_tensors"]), str(small_disk / "merged")],
    ):
        got = run_cli(*argv)
        assert got.rc == 1, got
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1 and "StorageFullError" in lines[0] and str(small_disk) in lines[0], got
        assert sorted(os.listdir(small_disk)) == ["filler"], got
    filler.unlink()
    assert run_cli("merge", str(sources["dcp_tensors"]), str(small_disk / "merged")).rc == 0
