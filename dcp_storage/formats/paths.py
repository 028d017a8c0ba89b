"""Checking file names a checkpoint records (index entries, storage maps) before any I/O uses them.

A checkpoint names its own files: an HF index's ``weight_map``, DCP's ``.metadata`` storage map. A hostile
one could name ``../../etc/passwd``, an absolute path or a URL to another bucket and have a reader fetch
it with the caller's credentials. Every recorded name must be a plain relative path below the checkpoint.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

__all__ = ["check_relative"]


def check_relative(name: Any, where: str) -> str:
    """``name`` if it is a plain relative path that stays under the checkpoint root, else an error."""
    if not isinstance(name, str) or not name:
        raise CorruptCheckpointError(f"{where}: file name must be a non-empty string, got {name!r}")
    parts = name.replace("\\", "/").split("/")
    if (
        "://" in name
        or name.startswith(("/", "\\", "~"))
        or (len(name) > 1 and name[1] == ":")  # C:\..., or a scheme without //
        or ".." in parts
        or "\x00" in name
    ):
        raise CorruptCheckpointError(
            f"{where}: file name {name!r} escapes the checkpoint directory (absolute path, URL or '..'); refusing it"
        )
    if "" in parts or "." in parts:  # "x/", ".", "a//b", "a/./b": a directory, or a name no writer produces
        raise CorruptCheckpointError(
            f"{where}: file name {name!r} is not a plain file name (an empty or '.' part, or a trailing '/': it names "
            "a directory, or the checkpoint itself); refusing it"
        )
    return name
