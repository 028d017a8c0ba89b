"""Data files a killed ``overwrite=True`` save left beside a committed checkpoint (``verify --cleanup``).

Such a save writes its data files under new names and commits by replacing ``.metadata``
(:mod:`dcp_storage.storage.retire`); killed before the commit, its files sit beside the old checkpoint,
which never names them, and cost storage until the next ``overwrite=True`` save retires them. This removes
them sooner, only where that is safe: a committed DCP checkpoint (the global ``.metadata``, no rank-local
``__{rank}.metadata``, which name files of their own) with no save's lock (a running save's files are
unreferenced too, until its commit).
"""

from __future__ import annotations

from typing import Any

from dcp_storage.formats.dcp_native.metadata_io import METADATA_FILE, read_metadata_file
from dcp_storage.formats.paths import LOCK_RE, RANK_METADATA_RE
from dcp_storage.storage.retire import unreferenced_data_files
from dcp_storage.transports.factory import open_transport

__all__ = ["remove_unreferenced_files"]


def remove_unreferenced_files(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Remove the data files under ``url`` that its ``.metadata`` does not name; return their URLs.

    Removes nothing (returns ``[]``) unless ``url`` is a committed DCP checkpoint that no save holds.
    """
    transport, root = open_transport(url, storage_options)
    with transport:
        names = transport.listdir(root)
        if METADATA_FILE not in names or any(RANK_METADATA_RE.match(n) or LOCK_RE.match(n) for n in names):
            return []
        md = read_metadata_file(transport, transport.join(root, METADATA_FILE))
        referenced = {info.relative_path for info in (md.storage_data or {}).values()}
        directories = {name.rpartition("/")[0] for name in referenced if "/" in name}
        gone = unreferenced_data_files(transport, root, referenced, None, directories)
        for name in gone:
            transport.remove(transport.join(root, name))
        return [transport.url(transport.join(root, name)) for name in gone]
