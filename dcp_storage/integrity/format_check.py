"""Does this installation have the format plugin a checkpoint's manifest names?

A checkpoint written through dcp-storage records its format as a ``name/version`` descriptor in
``.dcp_storage.json``. Format detection asks here first, so a checkpoint whose format plugin is not installed
fails with the descriptor and the distribution to install, instead of "unrecognised checkpoint".
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.limits import MANIFEST, read_limited
from dcp_storage.integrity.manifest import MANIFEST_FILE, Manifest, install_hint

__all__ = ["missing_format_plugin"]


def missing_format_plugin(probe: Any, known_formats: Container[str]) -> str | None:
    """A message naming the descriptor and distribution, if the probed directory's format is not registered."""
    if not probe.is_dir or MANIFEST_FILE not in probe.names:
        return None
    path = probe.transport.join(probe.path, MANIFEST_FILE)
    try:
        manifest = Manifest.from_json(read_limited(probe.transport, path, MANIFEST), probe.transport.url(path))
    except DcpStorageError:
        return None  # a damaged manifest does not decide the format; verify reports it
    if manifest.format_name in known_formats:
        return None
    dist = manifest.format_distribution
    hint = install_hint(dist, what="it") if dist else "install the dcp-storage plugin that provides it"
    return (
        f"{probe.transport.url(probe.path)}: written in format {manifest.format!r} by {manifest.writer}, but no "
        f"installed plugin provides format {manifest.format_name!r}; {hint} (see `dcp-storage plugins`)"
    )
