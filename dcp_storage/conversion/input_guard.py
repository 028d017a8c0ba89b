"""No tool replaces or deletes its input: the input's files, and the output's place, compared by identity.

A conversion's writer owns its output location: it writes that format's file names there and, with
``overwrite=True``, retires the files an earlier run left (an old index, stale shards, an old
``.metadata``). An output in the directory that holds the input therefore replaced an fp32
``model.safetensors`` with its bf16 copy, or deleted a sharded input's shards and index, and exited 0.
So, before anything is read or written (and whatever ``overwrite`` says), :func:`refuse_overwriting_input`
refuses an output that is one of the input's files or a directory holding one.

Identity, not spelling: local paths are compared resolved (``os.path.realpath``, so through symlinks) and
by ``(st_dev, st_ino)`` (so through hard links); object-store paths by their normalised URL. The input's
files are the file given, every file under a directory given, and for an index (``*.index.json``) every
file beside it (its shards).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from dcp_storage.errors import TargetError
from dcp_storage.transports import Transport
from dcp_storage.transports.factory import open_transport

__all__ = ["InputFiles", "refuse_overwriting_input"]

MAX_LISTED = 100_000  # files of an input looked at (a checkpoint with more is compared by its first ones)


class InputFiles:
    """The identities of a checkpoint's files: resolved paths and inodes (local), or URLs (object stores)."""

    def __init__(self, transport: Transport, root: str) -> None:
        self.local = transport.is_local
        self.keys: set[Any] = set()
        for path in _files_of(transport, root):
            self.keys.update(_identities(transport, path))

    def holds(self, transport: Transport, path: str) -> bool:
        """Whether ``path`` on ``transport`` is one of the input's files (by any of its identities)."""
        if transport.is_local != self.local:
            return False
        return any(key in self.keys for key in _identities(transport, path))


def _identities(transport: Transport, path: str) -> list[Any]:
    if not transport.is_local:
        return [("url", transport.url(path).rstrip("/"))]
    keys: list[Any] = [("path", os.path.realpath(path))]
    try:
        st = os.stat(path)
    except OSError:
        return keys
    return [*keys, ("inode", st.st_dev, st.st_ino)]


def _is_dir(transport: Transport, path: str) -> bool:
    """Local: a directory. Object stores have no directories: any path may prefix objects, so list it."""
    return os.path.isdir(path) if transport.is_local else True


def _files_of(transport: Transport, root: str) -> Iterator[str]:
    """The input's files: ``root`` itself, what lies under a directory, the shards beside an index."""
    count = 0
    if transport.is_local:
        if os.path.isdir(root):
            for here, _dirs, names in os.walk(root):
                for name in names:
                    count += 1
                    if count > MAX_LISTED:
                        return
                    yield os.path.join(here, name)
            return
        yield root
        if root.endswith(".index.json"):
            parent = os.path.dirname(root) or "."
            for name in os.listdir(parent):
                if os.path.isfile(os.path.join(parent, name)):
                    yield os.path.join(parent, name)
        return
    yield root
    parent = root.rpartition("/")[0] if root.endswith(".index.json") else root
    try:
        names = transport.listdir(parent)
    except (OSError, ValueError):
        return
    for name in names[:MAX_LISTED]:
        yield transport.join(parent, name)


def refuse_overwriting_input(
    src: str, src_opts: dict[str, Any] | None, dst: str, dst_opts: dict[str, Any] | None, *, tool: str = "convert"
) -> None:
    """:class:`TargetError` when ``dst`` is one of ``src``'s files, or a directory that holds one.

    Called before the output is opened, whatever ``overwrite`` says: a writer replaces and retires files in
    its output location, and no tool may replace or delete its input (module docstring).
    """
    src_transport, src_root = open_transport(src, src_opts)
    dst_transport, dst_root = open_transport(dst, dst_opts)
    try:
        if type(src_transport) is not type(dst_transport):
            return
        given = InputFiles(src_transport, src_root)
        if given.holds(dst_transport, dst_root):
            raise TargetError(
                f"{dst!r} is a file of the input {src!r}; {tool} would replace it (even with overwrite, which "
                "replaces only earlier outputs): write the output to another location"
            )
        if _is_dir(dst_transport, dst_root):
            try:
                names = dst_transport.listdir(dst_root)[:MAX_LISTED]
            except (OSError, ValueError):
                names = []
            for name in names:
                if given.holds(dst_transport, dst_transport.join(dst_root, name)):
                    raise TargetError(
                        f"the output directory {dst!r} holds {name!r}, a file of the input {src!r}; {tool} writes "
                        "its format's files there and retires stale ones, so it could replace or delete the "
                        "input (even with overwrite): write the output to another directory"
                    )
    finally:
        src_transport.close()
        dst_transport.close()
