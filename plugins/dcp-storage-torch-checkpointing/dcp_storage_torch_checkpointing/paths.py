"""Turning the paths torch_checkpointing passes into URLs under the configured root.

torch_checkpointing hands a ``Storage`` ``pathlib.Path`` objects built from the checkpoint id the user
gave (``Path("step-1") / "model" / "0.pt"``, ``Path("_tmp_step-1")``). ``Path`` collapses ``//``, so a full
URL arrives as ``s3:/bucket/run/step-1``; it is recognised and restored (``s3://bucket/run/step-1``).

* a relative path resolves under ``root_url``;
* an absolute path also resolves under ``root_url`` (leading ``/`` dropped), unless it is already inside a
  local root (``/ckpt/run/step-1`` for ``root_url="/ckpt/run"`` is that path itself): the root is the
  storage's whole world, as a ``chroot`` is;
* a full URL (``s3://...``, ``file:///...``, mangled or not) is used as given;
* a relative path that climbs out of the root (``../other``) raises :class:`TargetError`: nothing outside
  the root is read or written through a relative path.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import PurePath

from dcp_storage.plugin_api import TargetError

__all__ = ["as_url", "resolve"]

# "s3://b/k" as given, or "s3:/b/k" after pathlib collapsed the "//"; one-letter schemes are drive letters.
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+):/+(?P<rest>.*)$")


def as_url(path: str | os.PathLike[str]) -> str | None:
    """The URL ``path`` names (with its ``//`` restored), or ``None`` if it is a plain path."""
    text = os.fspath(path)
    match = _URL.match(text)
    if match is None:
        return None
    scheme, rest = match["scheme"].lower(), match["rest"]
    if scheme == "file":
        return f"file:///{rest}"
    if scheme == "memory":
        return f"memory:///{rest}"
    return f"{scheme}://{rest}"


def resolve(root: str, path: str | os.PathLike[str] | PurePath, *, local_root: bool) -> str:
    """The URL (or local path, for a local root) of ``path`` as seen from a storage rooted at ``root``."""
    url = as_url(path)
    if url is not None:
        return url
    text = os.fspath(path).replace(os.sep, "/")
    if local_root and text.startswith("/"):
        base = os.path.abspath(root)
        if text == base or text.startswith(base.rstrip("/") + "/"):
            return posixpath.normpath(text)
    parts = [p for p in text.split("/") if p not in ("", ".")]
    depth = 0
    for part in parts:
        depth += -1 if part == ".." else 1
        if depth < 0:
            raise TargetError(
                f"{os.fspath(path)!r} climbs out of the storage root {root!r}: give a path under it, or a full URL"
            )
    rel = posixpath.normpath("/".join(parts)) if parts else ""
    if rel in ("", "."):
        return root
    return root.rstrip("/") + "/" + rel
