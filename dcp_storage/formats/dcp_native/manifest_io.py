"""Building and reading the manifest of a DCP native checkpoint (see :mod:`dcp_storage.integrity.manifest`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any, cast

from dcp_storage.errors import CheckpointNotFoundError, DcpStorageError
from dcp_storage.formats.limits import MANIFEST, read_limited
from dcp_storage.formats.paths import METADATA_FILE
from dcp_storage.integrity.checksums import BLOCK_SIZE, DEFAULT_ALGORITHM, checksum
from dcp_storage.integrity.manifest import MANIFEST_FILE, ExtensionInfo, Manifest, file_checksums, metadata_matches
from dcp_storage.integrity.provenance import describe_extension, format_distribution, writer_descriptor
from dcp_storage.integrity.read_verify import RecordVerifier
from dcp_storage.text import printable

__all__ = ["build_manifest", "default_sums", "read_checked_manifest", "read_manifest", "record_verifier"]


def build_manifest(
    format_descriptor: str,
    storage: dict[Any, Any],
    records: Sequence[tuple[Any, ...]],
    algorithms: set[str],
    extensions: Iterable[Any] = (),
    *,
    metadata: bytes | None = None,
    block_size: int | None = BLOCK_SIZE,
) -> Manifest:
    """The manifest ``finish`` writes: descriptors of the format and of every extension used, and checksums.

    ``extensions`` are the writer's extension objects; descriptors found only in the records'
    ``transform_descriptors`` (torch wrote them) are described through the registry. ``metadata``: the
    ``.metadata`` bytes the manifest goes with (their digest is recorded: :func:`metadata_matches`);
    ``block_size``: the block size the records' block digests were computed with.
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
    if metadata is not None:
        manifest.metadata_digest = (DEFAULT_ALGORITHM, checksum(metadata, DEFAULT_ALGORITHM), len(metadata))
    if algorithms and records:
        manifest.algorithm = next(iter(algorithms))
        manifest.files = file_checksums(records)
        if any(len(r) > 4 for r in records):  # our writers' records: a record without blocks is one block
            manifest.block_size = block_size
    return manifest


def read_manifest(transport: Any, root: str, metadata: bytes | None = None) -> Manifest | None:
    """The manifest of the checkpoint at ``root``; ``None`` when it has none (torch or an older writer).

    ``metadata``: the ``.metadata`` bytes the caller read; a manifest recording the digest of other
    bytes is stale (torch's writer saved over the checkpoint) and is ignored, with one warning naming both
    files. A manifest of an older dcp-storage records no digest: it is returned as it is (see
    :func:`trusted_manifest` for what a default load does with it).
    """
    path = transport.join(root, MANIFEST_FILE)
    try:
        data = read_limited(transport, path, MANIFEST)
    except (CheckpointNotFoundError, FileNotFoundError):
        return None
    manifest = Manifest.from_json(data, transport.url(path))
    if metadata is not None:
        metadata_url = transport.url(transport.join(root, METADATA_FILE))
        if metadata_matches(manifest, metadata, transport.url(path), metadata_url) is False:
            return None
    return manifest


_READ = object()  # record_verifier's default: read the manifest now


def read_checked_manifest(transport: Any, root: str, metadata: bytes, *, strict: bool) -> tuple[Manifest | None, bool]:
    """``(manifest, stale)`` for a load that read the ``.metadata`` bytes ``metadata``.

    ``stale``: the manifest describes another ``.metadata`` (ignored, warned once). Outside ``strict``
    (``verify=True``) a manifest that cannot be read is ignored with a warning, so a damaged manifest never
    stops a load that torch's reader would do; the zip CRC-32s still check what they cover.
    """
    path = transport.join(root, MANIFEST_FILE)
    try:
        raw = read_limited(transport, path, MANIFEST)
    except (CheckpointNotFoundError, FileNotFoundError):
        return None, False
    try:
        manifest = Manifest.from_json(raw, transport.url(path))
    except DcpStorageError as exc:
        if strict:
            raise
        warnings.warn(f"{exc}; ignoring the manifest (zip CRC-32s still checked)", RuntimeWarning, stacklevel=3)
        return None, False
    metadata_url = transport.url(transport.join(root, METADATA_FILE))
    if metadata_matches(manifest, metadata, transport.url(path), metadata_url) is False:
        return None, True
    return manifest, False


def default_sums(
    transport: Any, root: str, storage: dict[Any, Any], manifest: Manifest | None
) -> RecordVerifier | None:
    """The digests a default load checks: a manifest's that records the digest of the ``.metadata`` read
    (one of an older dcp-storage records none, and could be stale: only ``verify=True`` uses it)."""
    if manifest is None or manifest.algorithm is None or manifest.metadata_digest is None:
        return None
    return RecordVerifier.for_storage(manifest, lambda name: transport.url(transport.join(root, name)), storage)


def record_verifier(
    transport: Any,
    root: str,
    storage: dict[Any, Any],
    manifest: Manifest | None | object = _READ,
    warn: bool = True,
) -> RecordVerifier | None:
    """A verifier for the records of the checkpoint at ``root``; ``None`` (and a warning) if none were recorded.

    ``manifest``: the checkpoint's manifest (or ``None`` for none) when the caller already read it (a
    reader that read it once for every rank); by default it is read here. ``warn=False``: the caller
    already warned (a stale manifest).
    """
    if manifest is _READ:
        manifest = read_manifest(transport, root)
    manifest = cast("Manifest | None", manifest)
    if (manifest is None or manifest.algorithm is None) and not warn:
        return None
    if manifest is None or manifest.algorithm is None:
        warnings.warn(
            f"{transport.url(root)}: verify=True, but the checkpoint records no checksums (written by "
            f"{printable(manifest.writer) if manifest else 'a writer without a manifest, e.g. torch'}); loading with "
            "its zip CRC-32s checked only",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return RecordVerifier.for_storage(manifest, lambda name: transport.url(transport.join(root, name)), storage)
