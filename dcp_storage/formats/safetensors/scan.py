"""Fetching every safetensors header of a checkpoint with a few small ranged reads.

Per blob: the first ``probe_bytes`` (64 KiB by default) in one request, all blobs in one concurrent
:meth:`~dcp_storage.transports.Transport.read_ranges` call; then, only for headers longer than the
probe, one more request each for the rest. File sizes come first (free on a local disk, one ``HEAD``
each on an object store, concurrently) because validating a header needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError
from dcp_storage.formats.safetensors.header import LENGTH_BYTES, SafetensorsHeader, header_length, parse_header
from dcp_storage.formats.safetensors.layout import Layout, resolve
from dcp_storage.formats.safetensors.metadata import Blob, build_metadata
from dcp_storage.transports import RangeRequest, Transport

__all__ = ["SafetensorsScanConfig", "blobs_of", "read_headers", "scan_metadata"]

KiB = 1024


@dataclass(frozen=True)
class SafetensorsScanConfig:
    """``probe_bytes``: how much of each blob the first header request fetches."""

    probe_bytes: int = 64 * KiB

    def __post_init__(self) -> None:
        if self.probe_bytes < LENGTH_BYTES + 2:
            raise ValueError(f"SafetensorsScanConfig.probe_bytes must be >= {LENGTH_BYTES + 2}, got {self.probe_bytes}")


def blobs_of(layout: Layout) -> list[Blob]:
    """The safetensors blobs whose headers ``layout``'s metadata needs."""
    if layout.kind != "dcp":
        return [Blob(f) for f in layout.files]
    md: Metadata | None = layout.dcp_metadata
    if md is None or md.storage_data is None:
        raise CorruptCheckpointError(f"{layout.source_url}: metadata carries no storage map")
    blobs = {
        Blob(info.relative_path, int(info.offset))
        for index, info in md.storage_data.items()
        if isinstance(md.state_dict_metadata.get(index.fqn), TensorStorageMetadata)
    }
    return sorted(blobs, key=lambda b: (b.file, b.base))


def _missing_context(layout: Layout, file: str) -> str:
    if layout.kind == "index":
        names = sorted(t for t, f in layout.weight_map.items() if f == file)
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        return f"named by {layout.source_url} for {shown}"
    if layout.kind == "dcp":
        return f"named by {layout.source_url}"
    return "listed a moment ago"


def _sizes(transport: Transport, layout: Layout, files: Sequence[str]) -> dict[str, int]:
    def one(file: str) -> int:
        path = resolve(transport, layout.root, file)
        try:
            return transport.size(path)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{transport.url(path)}: no such file ({_missing_context(layout, file)})"
            ) from exc

    if transport.is_local or len(files) <= 1:
        return {f: one(f) for f in files}
    workers = min(len(files), transport.config.max_workers or 16)
    with ThreadPoolExecutor(workers, thread_name_prefix="dcp-storage-size") as pool:
        return dict(zip(files, pool.map(one, files)))


def read_headers(
    transport: Transport,
    layout: Layout,
    blobs: Sequence[Blob],
    config: SafetensorsScanConfig | None = None,
    raw: dict[Blob, bytes] | None = None,
) -> tuple[dict[Blob, SafetensorsHeader], dict[str, str]]:
    """Every blob's parsed header, and the URL of each file (for messages). ``raw``, if given, receives each
    blob's header bytes (length prefix and JSON), for callers that check its digest without reading it again."""
    config = config or SafetensorsScanConfig()
    files = sorted({b.file for b in blobs})
    paths = {f: resolve(transport, layout.root, f) for f in files}
    urls = {f: transport.url(p) for f, p in paths.items()}
    sizes = _sizes(transport, layout, files)

    def where(blob: Blob) -> str:
        return urls[blob.file] if blob.base == 0 else f"{urls[blob.file]} (safetensors at byte {blob.base})"

    avail: dict[Blob, int] = {}
    for blob in blobs:
        avail[blob] = sizes[blob.file] - blob.base
        if avail[blob] < 0:
            raise CorruptCheckpointError(
                f"{urls[blob.file]}: is {sizes[blob.file]} bytes but {layout.source_url} places a safetensors "
                f"blob at byte {blob.base} (truncated?)"
            )
    probes = [RangeRequest(paths[b.file], b.base, b.base + min(config.probe_bytes, avail[b])) for b in blobs]
    heads = {b: bytes(buf) for b, buf in zip(blobs, transport.read_ranges(probes))}  # type: ignore[arg-type]

    needed: dict[Blob, int] = {}
    for blob in blobs:
        head = heads[blob]
        if layout.kind == "dcp" and head[:4] == b"PK\x03\x04":
            raise CorruptCheckpointError(
                f"{where(blob)}: holds a torch.save record, not safetensors: this is a native DCP checkpoint; "
                "read it with dcp_storage.FsspecReader"
            )
        needed[blob] = LENGTH_BYTES + header_length(head, avail[blob], where(blob))
    short = [b for b in blobs if needed[b] > len(heads[b])]
    if short:
        rest = [RangeRequest(paths[b.file], b.base + len(heads[b]), b.base + needed[b]) for b in short]
        for blob, buf in zip(short, transport.read_ranges(rest)):
            heads[blob] += bytes(buf)  # type: ignore[arg-type]

    headers = {
        b: parse_header(
            memoryview(heads[b])[LENGTH_BYTES : needed[b]],
            avail[b] - needed[b],
            where(b),
            ends_the_file=layout.kind != "dcp",  # torch's DCP-safetensors: further blobs may follow in the file
        )
        for b in blobs
    }
    if raw is not None:
        raw.update({b: heads[b][: needed[b]] for b in blobs})
    return headers, urls


def scan_metadata(
    transport: Transport,
    layout: Layout,
    config: SafetensorsScanConfig | None = None,
    found: dict[Blob, tuple[SafetensorsHeader, bytes, str]] | None = None,
) -> Metadata:
    """Read every header ``layout`` needs and build its DCP ``Metadata`` (with the storage map).

    ``found``, if given, receives each blob's parsed header, its raw bytes and its file's URL.
    """
    raw: dict[Blob, bytes] | None = {} if found is not None else None
    headers, urls = read_headers(transport, layout, blobs_of(layout), config, raw)
    if found is not None and raw is not None:
        found.update({b: (headers[b], raw[b], urls[b.file]) for b in headers})
    return build_metadata(layout, headers, urls)


# the names before 0.2 (one scheme for the exported configs: the format, then what it configures)
