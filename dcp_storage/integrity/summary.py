"""Provenance of a checkpoint for ``inspect``: format, writer, extensions and checksum algorithm."""

from __future__ import annotations

from typing import Any

from ..errors import DcpStorageError
from .dcp_manifest import read_manifest
from .manifest import Manifest

__all__ = ["dcp_provenance", "manifest_provenance"]


def manifest_provenance(manifest: Manifest | None) -> dict[str, Any]:
    """A JSON-ready summary of ``manifest`` (empty when there is none)."""
    if manifest is None:
        return {}
    return {
        "format": manifest.format,
        "writer": manifest.writer,
        "extensions": [
            {"descriptor": e.descriptor, "distribution": e.distribution, "version": e.version}
            for e in manifest.extensions
        ],
        "checksums": manifest.algorithm,
        "checksummed_records": sum(len(f.items) for f in manifest.files.values()),
    }


def dcp_provenance(transport: Any, root: str) -> dict[str, Any]:
    """Provenance of the DCP checkpoint at ``root``; a damaged manifest is shown as such, not raised."""

    try:
        return manifest_provenance(read_manifest(transport, root))
    except DcpStorageError as exc:
        return {"error": str(exc)}
