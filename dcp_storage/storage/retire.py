"""Retiring the old checkpoint before an ``overwrite=True`` save replaces it.

Runs on the save's coordinator, after it claimed the location (:mod:`.claim`) and before any rank writes.
The commit marker goes first, so that from then on the location reads as an interrupted save (never as the
old checkpoint pointing at new files, nor the new one missing files); then the old data files, so an
overwrite does not leave them to pile up; then the temp files of a killed save (local disks).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from typing import Any

from ..formats.completeness import remove_stale_temp_files
from ..formats.paths import DATA_SUFFIX, HF_SHARD_RE, TEMP_RE, single_name

__all__ = ["retire_dcp", "retire_safetensors"]

_DCP_DATA_FILE = re.compile(rf"^__(\d+)_.*{re.escape(DATA_SUFFIX)}$")  # ours and torch's FileSystemWriter's; (1): rank


def retire_dcp(
    transport: Any,
    root: str,
    markers: Iterable[str],
    rank: int | None,
    own_lock: str,
    directories: Iterable[str] = (),
) -> bool:
    """Remove ``markers`` (``.metadata`` files), then the ``*.distcp`` files, then stale temp files.

    ``rank``: a rank-local save (``use_collectives=False``), whose coordinator is every rank: only that
    rank's data files are removed, and no temp files (another rank may be writing its own right now).
    ``directories``: the subdirectories a prefix strategy puts data files in, searched as well.
    Returns whether the location held anything but the save's own lock (``own_lock``, a name): then the
    new data files must not reuse the old names (see :class:`~dcp_storage.FsspecWriter`).
    """
    names = transport.listdir(root)
    folders = {where: transport.listdir(transport.join(root, where)) for where in sorted(set(directories) - {""})}
    for path in markers:
        transport.remove(path)  # first: the old checkpoint stops looking complete
    for where, listed in [("", names), *folders.items()]:
        folder = transport.join(root, where) if where else root
        for name in listed:
            data_file = _DCP_DATA_FILE.match(name)
            if data_file and (rank is None or data_file.group(1) == str(rank)):
                transport.remove(transport.join(folder, name))
    if rank is None:
        remove_stale_temp_files(transport, root)
    return any(name != own_lock for name in names) or any(folders.values())


def retire_safetensors(transport: Any, root: str, prefix: str, index: str, extra: str) -> None:
    """Remove the ``index`` file, then ``{prefix}.safetensors`` and its shards, ``extra`` and stale temp files."""
    transport.remove(transport.join(root, index))  # first: the old checkpoint stops looking complete
    names = transport.listdir(root)
    if transport.is_local:
        with contextlib.suppress(FileNotFoundError):
            names = sorted(set(names) | set(os.listdir(root)))  # listdir hides temp files
    for name in names:
        temp = TEMP_RE.match(name)  # a killed save's temp file of one of ours
        if _is_ours(name, prefix) or (temp is not None and _is_ours(temp.group("name"), prefix)) or name == extra:
            transport.remove(transport.join(root, name))


def _is_ours(name: str, prefix: str) -> bool:
    """Whether ``name`` is ``{prefix}.safetensors`` or one of the ``{prefix}-0000k-of-0000N`` shards."""
    shard = HF_SHARD_RE.match(name)
    return name == single_name(prefix) or (shard is not None and shard.group("prefix") == prefix)
