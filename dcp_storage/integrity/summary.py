"""Provenance of a checkpoint for ``inspect``: format, writer, extensions and checksum algorithm."""

from __future__ import annotations

from typing import Any

from dcp_storage.integrity.manifest import Manifest

__all__ = ["manifest_provenance"]


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
