"""Hostile cases made of file-system objects rather than bytes: special files, sparse giants, symlinks out.

Each replaces one file of a valid checkpoint (see :mod:`.corpus`) with:

* a FIFO (``open`` blocks until a writer comes), a symlink to ``/dev/zero`` (never ends), a socket, a
  character device node inside the checkpoint (what a bind mount of ``/dev/zero`` looks like; made only
  where ``mknod`` is permitted), a directory;
* a sparse 8 GiB file (the real bytes, then 8 GiB of holes: costs no disk, but a whole read costs 8 GiB);
* a symlink leading out of the checkpoint, to a file in :data:`OUTSIDE` that is either a valid copy of the
  file it replaces (so only the link is wrong) or text holding :data:`SECRET`; or a symlinked directory
  that storage entries reach through;
* a ``torch.save`` of a broadcast view (``torch.zeros(1).expand(2**28)``: 4 stored bytes, 1 GiB of view).

Every one must be refused with our error naming the file, at once: none of its bytes read, nothing quoted.
"""

from __future__ import annotations

import os
import pickle
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["OUTSIDE", "SECRET", "SPARSE_BYTES", "add_file_cases", "can_mknod_device", "replace_with"]

SECRET = "TOP-SECRET-7f3a9c-not-for-any-output"
OUTSIDE = "_outside"  # beside the cases, never inside one
SPARSE_BYTES = 8 << 30
KINDS = ("fifo", "dev-zero", "socket", "device", "dir", "sparse-8GiB")


def can_mknod_device(where: Path) -> bool:
    """Whether this process may create a device node (root, or CAP_MKNOD) under ``where``."""
    probe = where / ".mknod-probe"
    try:
        os.mknod(probe, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except (PermissionError, OSError):
        return False
    probe.unlink()
    return True


def replace_with(path: Path, kind: str) -> None:
    """Replace the file at ``path`` by a special file of ``kind`` (one of :data:`KINDS`)."""
    if kind == "sparse-8GiB":
        with open(path, "r+b") as f:  # the real bytes stay in front: a parser that reads on gets them
            f.truncate(SPARSE_BYTES)
        return
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o600)
    elif kind == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    elif kind == "dir":
        path.mkdir()
        (path / "x").write_bytes(b"\0" * 64)
    else:
        raise ValueError(kind)


def _link_out(builder: Any, family: str, name: str, target: str) -> Callable[[Path], None]:
    """Replace ``name`` by a symlink to ``target``, a file of the outside directory."""

    def mutate(d: Path) -> None:
        (d / name).unlink()
        os.symlink(builder.root / OUTSIDE / target, d / name)

    return mutate


def _write_outside(builder: Any) -> None:
    out = builder.root / OUTSIDE
    out.mkdir()
    from .corpus import DISTCP, INDEX_FILE, METADATA, SHARDS

    text = f"root:x:0:0:{SECRET}:/root:/bin/bash\n" * 4
    (out / "secret.txt").write_text(text)
    (out / "secret.json").write_text('{"weight_map": "%s", "%s": [1, 2]}' % (SECRET, SECRET))  # noqa: UP031
    (out / "secret.safetensors").write_bytes(len(text).to_bytes(8, "little") + text.encode())
    for family in ("dcp", "dcp_st"):
        for name in (METADATA, DISTCP):
            shutil.copyfile(builder.good / family / name, out / f"{family}{name}")
    for name in (*SHARDS, INDEX_FILE):
        shutil.copyfile(builder.good / "hf" / name, out / f"hf-{name}")
    sub = out / "subdir"
    sub.mkdir()
    shutil.copyfile(builder.good / "dcp" / DISTCP, sub / DISTCP)
    shutil.copyfile(builder.good / "hf" / SHARDS[1], sub / SHARDS[1])


def add_file_cases(builder: Any) -> None:
    """Add every file-system case to ``builder`` (a :class:`~tests.hostile.corpus._Builder`)."""
    from .corpus import DISTCP, INDEX_FILE, METADATA, PT_FILE, SHARDS, ST_FILE

    _write_outside(builder)
    device = can_mknod_device(builder.root)
    kinds = [k for k in KINDS if k != "device" or device]

    def special(family: str, name: str, culprit_kinds: list[str], *, in_metadata: bool = True) -> None:
        tag = name.lstrip(".").replace(".", "-")
        for kind in culprit_kinds:
            builder.case(
                family,
                f"{tag}-is-{kind}",
                name,
                lambda d, k=kind: replace_with(d / name, k),
                in_metadata=in_metadata,
            )

    not_sparse = [k for k in kinds if k != "sparse-8GiB"]
    special("dcp", METADATA, kinds)
    special("dcp", DISTCP, not_sparse)
    special("dcp_st", METADATA, kinds)
    special("dcp_st", DISTCP, not_sparse)
    special("st", ST_FILE, [k for k in kinds if k not in ("dir", "sparse-8GiB")])  # a directory: another kind

    def sparse_header(d: Path) -> None:  # a header length that spans the whole sparse file
        replace_with(d / ST_FILE, "sparse-8GiB")
        with open(d / ST_FILE, "r+b") as f:
            f.write((SPARSE_BYTES - 8).to_bytes(8, "little"))

    builder.case("st", "header-spans-sparse-8GiB", ST_FILE, sparse_header)
    special("hf", INDEX_FILE, [k for k in kinds if k != "dir"])
    special("hf", SHARDS[1], not_sparse)
    special("zip", PT_FILE, [k for k in kinds if k != "dir"])

    # Symlinks out: to a valid copy (only the link is wrong) and to a secret.
    for family in ("dcp", "dcp_st"):
        valid_metadata = _link_out(builder, family, METADATA, f"{family}{METADATA}")
        builder.case(family, "escape-metadata-valid", METADATA, valid_metadata)
        builder.case(family, "escape-metadata-secret", METADATA, _link_out(builder, family, METADATA, "secret.txt"))
        builder.case(family, "escape-data-valid", DISTCP, _link_out(builder, family, DISTCP, f"{family}{DISTCP}"))
        builder.case(family, "escape-data-secret", DISTCP, _link_out(builder, family, DISTCP, "secret.safetensors"))
    builder.case("hf", "escape-shard-valid", SHARDS[1], _link_out(builder, "hf", SHARDS[1], f"hf-{SHARDS[1]}"))
    builder.case("hf", "escape-shard-secret", SHARDS[1], _link_out(builder, "hf", SHARDS[1], "secret.safetensors"))

    def dir_link_dcp(d: Path) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        os.symlink(builder.root / OUTSIDE / "subdir", d / "sub")
        md = pickle.loads((d / METADATA).read_bytes())
        md.storage_data = {i: _StorageInfo(f"sub/{DISTCP}", s.offset, s.length) for i, s in md.storage_data.items()}
        (d / METADATA).write_bytes(pickle.dumps(md))

    builder.case("dcp", "escape-through-dir-symlink", f"sub/{DISTCP}", dir_link_dcp)

    def dir_link_hf(d: Path) -> None:
        import json

        os.symlink(builder.root / OUTSIDE / "subdir", d / "sub")
        doc = json.loads((d / INDEX_FILE).read_text())
        doc["weight_map"]["big"] = f"sub/{SHARDS[1]}"
        (d / INDEX_FILE).write_text(json.dumps(doc))

    builder.case("hf", "escape-through-dir-symlink", f"sub/{SHARDS[1]}", dir_link_hf)

    # Broadcast views: a few stored bytes that describe 1 GiB.
    builder.case(
        "zip",
        "broadcast-stride-0",
        PT_FILE,
        lambda d: torch.save({"w": torch.zeros(1).expand(2**28)}, d / PT_FILE),
        keys=("w",),
    )
    builder.case(
        "zip",
        "broadcast-row",
        PT_FILE,
        lambda d: torch.save({"w": torch.arange(8.0).expand(2**25, 8)}, d / PT_FILE),
        keys=("w",),
    )
