"""Retiring the files an ``overwrite=True`` save replaces, only once the new checkpoint is committed.

A save killed at any moment must leave the location loading as the old checkpoint or as the new one,
never as neither. So the old checkpoint is left whole until the new commit marker is in place:

1. before any rank writes (:func:`prepare_dcp_overwrite`): only what no checkpoint uses goes, the temp
   files of a killed save (local disks); the new data files get names the old ones cannot have (the
   writer's per-save tag), so nothing of the old checkpoint is rewritten;
2. the commit: the new ``.metadata`` replaces the old one in one step (a rename, or one PUT);
3. after it (:func:`retire_unreferenced`): every data file the committed ``.metadata`` does not name, the
   old checkpoint's and any killed save's leftovers alike (they were never part of a checkpoint: readers
   find files through ``.metadata`` only).

Nothing is removed through a link that leads out of the checkpoint (:func:`refuse_links_out`): a prefix
strategy's directory that is a symlink to another checkpoint would otherwise have that checkpoint's files
retired. Safetensors has fixed file names; :func:`retire_safetensors` and the writer say what it can keep.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from typing import Any

from dcp_storage.errors import WrongPathTypeError
from dcp_storage.formats.completeness import remove_stale_temp_files
from dcp_storage.formats.paths import DATA_SUFFIX, HF_SHARD_RE, TEMP_RE, single_name

__all__ = [
    "prepare_dcp_overwrite",
    "refuse_links_out",
    "retire_safetensors",
    "retire_unreferenced",
    "unreferenced_data_files",
]

_DCP_DATA_FILE = re.compile(rf"^__(\d+)_.*{re.escape(DATA_SUFFIX)}$")  # ours and torch's FileSystemWriter's; (1): rank


def refuse_links_out(transport: Any, root: str, directories: Iterable[str]) -> None:
    """Raise :class:`~dcp_storage.errors.WrongPathTypeError` if a data directory under ``root`` (local disks)
    is, or passes through, a symlink that leads outside the checkpoint: a save would write into, and retire
    the files of, whatever lies there (torch's writer deletes nothing; neither may ours)."""
    if not getattr(transport, "is_local", False):
        return  # object stores have no links
    real_root = os.path.realpath(root)
    for where in sorted(set(directories) - {""}):
        path = transport.join(root, where)
        real = os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root:
            raise WrongPathTypeError(
                f"{transport.url(path)}: this data directory of the checkpoint is a symlink leading outside it "
                f"(to {real}); a save would write into, and retire files of, whatever lies there. Nothing was "
                "written or removed: remove the link, or save to another path"
            )


def _data_files(transport: Any, root: str, rank: int | None, directories: Iterable[str]) -> list[str]:
    """Relative names of the data files under ``root`` and ``directories`` (a rank-local save: its rank's)."""
    found = []
    for where in ["", *sorted(set(directories) - {""})]:
        folder = transport.join(root, where) if where else root
        for name in transport.listdir(folder):
            data_file = _DCP_DATA_FILE.match(name)
            if data_file and (rank is None or data_file.group(1) == str(rank)):
                found.append(f"{where}/{name}" if where else name)
    return found


def prepare_dcp_overwrite(
    transport: Any, root: str, rank: int | None, own_lock: str, directories: Iterable[str] = ()
) -> bool:
    """Before an ``overwrite=True`` save writes: remove a killed save's temp files (local disks; not for a
    rank-local save, ``rank`` set, whose fellow ranks may be writing theirs), and nothing else.

    Returns whether the location held anything but the save's own lock (``own_lock``, a name): then the
    new data files must not reuse the old names (see :class:`~dcp_storage.FsspecWriter`).
    """
    names = transport.listdir(root)
    held = any(name != own_lock for name in names) or bool(_data_files(transport, root, rank, directories))
    if rank is None:
        remove_stale_temp_files(transport, root)
    return held


def unreferenced_data_files(
    transport: Any, root: str, referenced: Iterable[str], rank: int | None = None, directories: Iterable[str] = ()
) -> list[str]:
    """The data files under ``root`` (and ``directories``) that ``referenced`` (relative names) does not name."""
    keep = set(referenced)
    return [name for name in _data_files(transport, root, rank, directories) if name not in keep]


def retire_unreferenced(
    transport: Any,
    root: str,
    referenced: Iterable[str],
    rank: int | None,
    directories: Iterable[str] = (),
    markers: Iterable[str] = (),
) -> list[str]:
    """After the commit: remove ``markers`` (metadata files that would shadow the new one), then every data
    file the committed ``.metadata`` does not name (``referenced``); returns the data files removed."""
    for path in markers:
        transport.remove(path)
    gone = unreferenced_data_files(transport, root, referenced, rank, directories)
    for name in gone:
        transport.remove(transport.join(root, name))
    return gone


def retire_safetensors(
    transport: Any, root: str, prefix: str, index: str, extra: str, keep: Iterable[str] = (), *, marker: bool = True
) -> None:
    """Remove the ``index`` file (``marker``), then ``{prefix}.safetensors`` and its shards, ``extra`` and stale
    temp files, except the names in ``keep`` (the files a committed save just wrote)."""
    kept = set(keep)
    if marker and index not in kept:
        transport.remove(transport.join(root, index))  # first: the old checkpoint stops looking complete
    names = transport.listdir(root)
    if transport.is_local:
        with contextlib.suppress(FileNotFoundError):
            names = sorted(set(names) | set(os.listdir(root)))  # listdir hides temp files
    for name in names:
        if name in kept:
            continue
        temp = TEMP_RE.match(name)  # a killed save's temp file of one of ours
        if _is_ours(name, prefix) or (temp is not None and _is_ours(temp.group("name"), prefix)) or name == extra:
            transport.remove(transport.join(root, name))


def _is_ours(name: str, prefix: str) -> bool:
    """Whether ``name`` is ``{prefix}.safetensors`` or one of the ``{prefix}-0000k-of-0000N`` shards."""
    shard = HF_SHARD_RE.match(name)
    return name == single_name(prefix) or (shard is not None and shard.group("prefix") == prefix)
