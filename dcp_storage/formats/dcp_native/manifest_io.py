"""Building and reading the manifest of a DCP native checkpoint (see :mod:`dcp_storage.integrity.manifest`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any, cast

from ...errors import CheckpointNotFoundError, DcpStorageError
from ...integrity.manifest import MANIFEST_FILE, ExtensionInfo, Manifest, file_checksums
from ...integrity.provenance import describe_extension, format_distribution, writer_descriptor
from ...integrity.read_verify import RecordVerifier
from ...text import printable
from ..limits import MANIFEST, read_limited

__all__ = ["build_manifest", "read_manifest", "record_verifier"]


def build_manifest(
    format_descriptor: str,
    storage: dict[Any, Any],
    records: Sequence[tuple[str, int, int, str]],
    algorithms: set[str],
    extensions: Iterable[Any] = (),
) -> Manifest:
    """The manifest ``finish`` writes: descriptors of the format and of every extension used, and checksums.

    ``extensions`` are the writer's extension objects; descriptors found only in the records'
    ``transform_descriptors`` (torch wrote them) are described through the registry.
    """
    if len(algorithms) > 1:
        raise DcpStorageError(f"ranks used different checksum algorithms ({', '.join(sorted(algorithms))})")
    infos: dict[str, ExtensionInfo] = {}
    for ext in extensions:
        get = getattr(ext, "get_descriptor", None)
        if callable(get):
            descriptor = str(get())
            infos.setdefault(descriptor, describe_extension(descriptor, ext))
    for info in storage.values():
        for descriptor in getattr(info, "transform_descriptors", None) or ():
            if descriptor not in infos:
                infos[descriptor] = describe_extension(descriptor)
    manifest = Manifest(format_descriptor, writer_descriptor(), sorted(infos.values(), key=lambda e: e.descriptor))
    manifest.format_distribution = format_distribution(manifest.format_name)
    if algorithms and records:
        manifest.algorithm = next(iter(algorithms))
        manifest.files = file_checksums(records)
    return manifest


def read_manifest(transport: Any, root: str) -> Manifest | None:
    """The manifest of the checkpoint at ``root``; ``None`` when it has none (torch or an older writer)."""
    path = transport.join(root, MANIFEST_FILE)
    try:
        data = read_limited(transport, path, MANIFEST)
    except (CheckpointNotFoundError, FileNotFoundError):
        return None
    return Manifest.from_json(data, transport.url(path))


_READ = object()  # record_verifier's default: read the manifest now


def record_verifier(
    transport: Any, root: str, storage: dict[Any, Any], manifest: Manifest | None | object = _READ
) -> RecordVerifier | None:
    """A verifier for the records of the checkpoint at ``root``; ``None`` (and a warning) if none were recorded.

    ``manifest``: the checkpoint's manifest (or ``None`` for none) when the caller already read it (a
    reader that read it once for every rank); by default it is read here.
    """
    if manifest is _READ:
        manifest = read_manifest(transport, root)
    manifest = cast("Manifest | None", manifest)
    if manifest is None or manifest.algorithm is None:
        warnings.warn(
            f"{transport.url(root)}: verify=True, but the checkpoint records no checksums (written by "
            f"{printable(manifest.writer) if manifest else 'a writer without a manifest, e.g. torch'}); loading unchecked",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return RecordVerifier.for_storage(manifest, lambda name: transport.url(transport.join(root, name)), storage)
