"""Everything this plugin reaches past a stable API, in one place, so that an upgrade breaks here only.

Two kinds of reach:

* **dcp-storage's private transport attribute** ``transport.fs`` (the fsspec filesystem under the built-in
  transports). The :class:`~dcp_storage.plugin_api.Transport` protocol has no "is this a directory" and no
  server-side copy, and a directory rename on an object store needs both: without ``fs``, directories are
  told from files by listing, and a copy streams the bytes through this process (correct, but a commit
  then costs the checkpoint's size in traffic). Every built-in transport has ``fs``; a plugin transport
  (obstore) does not, and gets the fallback.
* **torch_checkpointing's metadata file name** (``metadata_serialization.METADATA_FILE_NAME``,
  ``metadata.pkl``, not exported by the package): a directory rename copies it last, so a reader never sees it before the data it
  describes.
"""

from __future__ import annotations

import posixpath
from typing import Any

from dcp_storage.plugin_api import Transport
from torch_checkpointing.metadata_serialization import METADATA_FILE_NAME

__all__ = ["METADATA_FILE_NAME", "filesystem", "kind", "server_copy", "walk_files"]


def filesystem(transport: Transport) -> Any | None:
    """The fsspec filesystem under ``transport``, or ``None`` for a transport without one."""
    fs = getattr(transport, "fs", None)
    return fs if fs is not None and hasattr(fs, "isdir") and hasattr(fs, "copy") else None


def kind(transport: Transport, path: str) -> str | None:
    """``"file"``, ``"dir"`` or ``None`` (nothing there) for a path of a non-local ``transport``.

    On an object store a directory is a prefix with objects under it; fsspec's memory filesystem also keeps
    empty directories (``mkdir``), which count as directories too.
    """
    fs = filesystem(transport)
    if fs is not None:
        fs.invalidate_cache(path)
        if fs.isfile(path):
            return "file"
        return "dir" if fs.isdir(path) else None
    if transport.listdir(path):
        return "dir"
    return "file" if transport.exists(path) else None


def walk_files(transport: Transport, path: str) -> list[str]:
    """Every file under the directory ``path``, as paths relative to it (``a/b.distcp``), sorted."""
    fs = filesystem(transport)
    if fs is not None:
        fs.invalidate_cache(path)
        root = path.rstrip("/") + "/"
        return sorted(p[len(root) :] for p in fs.find(path) if p.startswith(root))
    found: list[str] = []
    pending = [""]
    while pending:
        rel = pending.pop()
        for name in transport.listdir(transport.join(path, rel) if rel else path):
            child = posixpath.join(rel, name) if rel else name
            if transport.listdir(transport.join(path, child)):
                pending.append(child)
            else:
                found.append(child)
    return sorted(found)


def server_copy(transport: Transport, src: str, dst: str) -> bool:
    """Copy one object inside the store, without its bytes passing through this process.

    ``True`` when done server-side (S3 ``CopyObject``/``UploadPartCopy``, GCS ``rewrite``, an in-memory copy
    for ``memory://``); ``False`` when the transport offers no such call and the caller must stream it.
    """
    fs = filesystem(transport)
    if fs is None:
        return False
    fs.copy(src, dst)
    pins = getattr(transport, "versions", None)  # written past the transport: its version pin must go too
    if pins is not None:
        pins.forget(dst)
    return True
