"""Scanning every safetensors header with a few ranged reads, and loading tensors from the files.

Fetching every safetensors header of a checkpoint with a few small ranged reads.

Per blob: the first ``probe_bytes`` (64 KiB by default) in one request, all blobs in one concurrent
:meth:`~dcp_storage.transports.Transport.read_ranges` call; then, only for headers longer than the
probe, one more request each for the rest. File sizes come first (free on a local disk, one ``HEAD``
each on an object store, concurrently) because validating a header needs them.

Loading the items of a DCP load plan from safetensors blobs: exactly the bytes each item needs.

The storage map (:mod:`.metadata`) already says where every stored chunk's elements lie, so there is no
header round here: each tensor item becomes the byte runs of its slice (one for a ``Shard(0)`` slice,
one per row for ``Shard(1)``, coalesced by the transport), delivered straight into the destination
tensor when it is a contiguous CPU tensor of the stored dtype (see :mod:`..tensor_reads`). Non-tensor
items (DCP ``.metadata`` layouts only) are fetched whole and handed to ``planner.load_bytes``.

With ``verify`` every tensor an item touches is fetched whole instead (a slice cannot be checked), its
digests from the file's header (:mod:`.checksums`) are compared, and the
items are copied out of those same bytes, so what lands in the destination is what was checked. Tensors
are fetched in batches of at most ``staging_bytes`` (or one tensor, if larger). A tensor one item loads
whole into a contiguous CPU destination of its dtype is read straight into it and hashed there.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, ShapeMismatchError
from dcp_storage.formats.byte_items import deliver_byte_item
from dcp_storage.formats.dcp_native.native import lazy_min_entries
from dcp_storage.formats.paths import check_relative
from dcp_storage.formats.reading import SliceRead, dense_gap_of, plan_slice_read, read_slices
from dcp_storage.formats.safetensors.checksums import FileSums, require_checksummed
from dcp_storage.formats.safetensors.header import (
    LENGTH_BYTES,
    HeaderColumns,
    SafetensorsHeader,
    header_length,
    parse_header,
    scan_columns,
)
from dcp_storage.formats.safetensors.metadata import Blob, Layout, StoredBytes, StoredChunk, build_metadata, resolve
from dcp_storage.integrity.blocks import batches_by_bytes
from dcp_storage.runtime import gc_paused, writable_bytes
from dcp_storage.text import printable, redact_urls
from dcp_storage.transports import RangeRequest, Transport

__all__ = [
    "SafetensorsItemLoader",
    "SafetensorsLoaderConfig",
    "SafetensorsScanConfig",
    "blobs_of",
    "read_headers",
    "scan_metadata",
]


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


_MIN_ENTRY_BYTES = 48  # the fewest bytes a canonical header entry takes: ,"":{"dtype":"U8","shape":[],...}


def read_headers(
    transport: Transport,
    layout: Layout,
    blobs: Sequence[Blob],
    config: SafetensorsScanConfig | None = None,
    raw: dict[Blob, bytes] | None = None,
    columns: bool = False,
) -> tuple[dict[Blob, Any], dict[str, str]]:
    """Every blob's parsed header, and the URL of each file (for messages). ``raw``, if given, receives each
    blob's header bytes (length prefix and JSON), for callers that check its digest without reading it again.
    ``columns``: a header that may list :func:`~.dcp_native.native.lazy_min_entries` tensors or more is first
    scanned into arrays (a :class:`~.header.HeaderColumns`, when it is canonical; else parsed as JSON)."""
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

    ends = layout.kind != "dcp"  # torch's DCP-safetensors: further blobs may follow in the file
    scan_from = lazy_min_entries() * _MIN_ENTRY_BYTES if columns and ends else None
    headers: dict[Blob, Any] = {}
    for b in blobs:
        body = memoryview(heads[b])[LENGTH_BYTES : needed[b]]
        found = None
        if scan_from is not None and len(body) >= scan_from:
            found = scan_columns(body, avail[b] - needed[b], where(b), ends_the_file=ends)
        headers[b] = (
            found if found is not None else parse_header(body, avail[b] - needed[b], where(b), ends_the_file=ends)
        )
    if raw is not None:
        raw.update({b: heads[b][: needed[b]] for b in blobs})
    return headers, urls


def scan_metadata(
    transport: Transport,
    layout: Layout,
    config: SafetensorsScanConfig | None = None,
    found: dict[Blob, tuple[SafetensorsHeader | HeaderColumns, bytes, str]] | None = None,
) -> Metadata:
    """Read every header ``layout`` needs and build its DCP ``Metadata`` (with the storage map).

    ``found``, if given, receives each blob's parsed header, its raw bytes and its file's URL.
    """
    raw: dict[Blob, bytes] | None = {} if found is not None else None
    headers, urls = read_headers(transport, layout, blobs_of(layout), config, raw, columns=True)
    if found is not None and raw is not None:
        found.update({b: (headers[b], raw[b], urls[b.file]) for b in headers})
    return build_metadata(layout, headers, urls)


# the names before 0.2 (one scheme for the exported configs: the format, then what it configures)


MiB = 1024 * 1024
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SafetensorsLoaderConfig:
    """``staging_bytes``: most staging memory held at once; ``max_runs_per_item``: slices with more byte
    runs than this read their bounding range instead.

    ``trust_byte_items``: non-tensor items of torch's DCP-safetensors layout (a step counter, extra state)
    are ``torch.save`` payloads that torch's ``DefaultLoadPlanner`` unpickles with ``weights_only=False``.
    By default each is decoded with ``weights_only=True`` and the planner gets a fresh ``torch.save`` of
    the result, or :class:`~dcp_storage.errors.UnsafeCheckpointError` is raised (as the native reader
    does: :mod:`..byte_items`); set ``True`` only for trusted checkpoints that store custom objects."""

    staging_bytes: int = 256 * MiB
    max_runs_per_item: int = 65536
    map_runs_above: int = 16  # local files: slices of more runs are copied from a memory map
    trust_byte_items: bool = False

    def __post_init__(self) -> None:
        if self.staging_bytes < 1 or self.max_runs_per_item < 1:
            raise ValueError("SafetensorsLoaderConfig sizes must be positive")


class SafetensorsItemLoader:
    """Reads one rank's load plan. Built per ``read_data`` call."""

    def __init__(
        self,
        transport: Transport,
        root: str,
        storage_data: Mapping[Any, Any],
        config: SafetensorsLoaderConfig | None = None,
        verify: bool | None = None,
        known_sums: Mapping[str, FileSums] | None = None,
    ) -> None:
        self.transport = transport
        self.root = root
        self.storage_data = storage_data
        self.config = config or SafetensorsLoaderConfig()
        self.verify = verify
        self._known = dict(known_sums or {})  # file -> its header's checksums, read with the metadata
        self._sums: dict[str, FileSums] = {}
        self._resolved: dict[int, torch.Tensor] = {}  # id(item) -> destination, for the items of one load()
        self._paths: dict[str, str] = {}  # relative file -> its checked transport path

    def _entry(self, item: ReadItem) -> StoredChunk | StoredBytes:
        entry = self.storage_data.get(item.storage_index)
        if not isinstance(entry, (StoredChunk, StoredBytes)):
            raise CorruptCheckpointError(
                f"{self.transport.url(self.root)}: metadata has no storage entry for {item.storage_index}"
            )
        return entry

    def _path(self, file: str) -> str:
        return resolve(self.transport, self.root, check_relative(file, self.transport.url(self.root)))

    def load(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        """Fetch and deliver every item: ``load_bytes`` for bytes, ``resolve/commit_tensor`` for tensors."""
        with gc_paused():  # a few small acyclic objects per item: millions at a million tensors
            self._load(items, planner)

    def _load(self, items: Sequence[ReadItem], planner: LoadPlanner) -> None:
        byte_items: list[tuple[ReadItem, StoredBytes]] = []
        works: list[SliceRead] = []
        checked: dict[StoredChunk, list[ReadItem]] = {}
        for item in items:
            entry = self._entry(item)
            if item.type == LoadItemType.BYTE_IO:
                if not isinstance(entry, StoredBytes):
                    raise CorruptCheckpointError(f"{item.storage_index.fqn!r}: stored as a tensor, loaded as bytes")
                byte_items.append((item, entry))
            elif isinstance(entry, StoredChunk) and self._checked(item, entry):
                checked.setdefault(entry, []).append(item)
            elif isinstance(entry, StoredChunk):
                works.append(self._plan_tensor(item, entry, planner))
            else:
                raise CorruptCheckpointError(f"{item.storage_index.fqn!r}: stored as bytes, loaded as a tensor")
        self._load_bytes(byte_items, planner)

        def commit(work: SliceRead) -> None:
            planner.commit_tensor(work.key, work.dest)  # type: ignore[arg-type]

        read_slices(self.transport, works, commit, self.config.staging_bytes)
        self._load_checked(checked, planner)

    def _checked(self, item: ReadItem, entry: StoredChunk) -> bool:
        """Whether ``item`` is read through the checked path: with ``verify=True`` every tensor of a file that
        records checksums; by default (``None``) a whole tensor of such a file (its digest covers exactly the
        bytes read), while a slice is read alone and unchecked (the file records no block digests)."""
        if self.verify is False or (self.verify is None and entry.file not in self._known):
            return False  # by default only whole safetensors files, whose sums came with the metadata
        if not self._file_sums(entry.file).present:
            return False
        whole = not any(int(o) for o in item.storage_offsets) and tuple(int(n) for n in item.lengths) == entry.shape
        return self.verify is True or whole

    def _file_sums(self, file: str) -> FileSums:
        """The checksums ``file``'s header records (header digest checked); warns once if it records none."""
        sums = self._sums.get(file)
        if sums is None:
            sums = self._known.get(file)
            if sums is None:
                sums, _header = FileSums.read(self.transport, self._path(file))
            if sums.present:
                require_checksummed(sums)
            elif self.verify is None:
                _log.debug(
                    "%s: the file records no checksums (not written by dcp-storage's SafetensorsWriter: safetensors "
                    "files written by others carry no checksum); its header is checked, its tensor bytes are not",
                    redact_urls(printable(sums.url)),
                )
            else:
                warnings.warn(
                    f"{redact_urls(printable(sums.url))}: verify=True, but the file records no checksums (not written by dcp-storage's "
                    "SafetensorsWriter); loading it unchecked",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self._sums[file] = sums
        return sums

    def _load_checked(self, checked: dict[StoredChunk, list[ReadItem]], planner: LoadPlanner) -> None:
        """Fetch each tensor whole, check its digests, then deliver its items from the checked bytes.

        A tensor that one item loads whole into a contiguous CPU destination of its dtype is read straight
        into that destination and its digests are computed there (no staging copy; on a mismatch the load
        fails with the destination already written). The others are staged in batches of at most
        ``staging_bytes`` and delivered from the checked bytes.
        """

        def nbytes(entry: StoredChunk) -> int:
            return math.prod(entry.shape) * entry.dtype.itemsize

        in_place: dict[StoredChunk, tuple[ReadItem, torch.Tensor]] = {}
        for entry, group in checked.items():
            item = group[0]
            if len(group) == 1 and not any(item.storage_offsets) and tuple(item.lengths) == tuple(entry.shape):
                dest = self._destination(item, planner)
                if dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == entry.dtype:
                    in_place[entry] = (item, dest)
        if in_place:
            reqs = [
                RangeRequest(self._path(e.file), e.data_offset, e.data_offset + nbytes(e), into=writable_bytes(dest))
                for e, (_item, dest) in in_place.items()
            ]
            self.transport.read_ranges(reqs)
            for entry, (item, dest) in in_place.items():
                span = f"bytes [{entry.data_offset}, {entry.data_offset + nbytes(entry)})"
                full = dest.reshape(-1).view(torch.uint8)
                problem = self._sums[entry.file].check_tensor(
                    entry.tensor, entry.shape, entry.dtype.itemsize, full, span
                )
                if problem:
                    raise CorruptCheckpointError(problem)
                planner.commit_tensor(item, dest)
        staged = [e for e in checked if e not in in_place]
        for batch in batches_by_bytes(staged, nbytes, self.config.staging_bytes):
            reqs = [RangeRequest(self._path(e.file), e.data_offset, e.data_offset + nbytes(e)) for e in batch]
            for entry, buf in zip(batch, self.transport.read_ranges(reqs)):
                raw = bytearray(buf)  # type: ignore[arg-type]
                full = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                span = f"bytes [{entry.data_offset}, {entry.data_offset + len(raw)})"
                itemsize = entry.dtype.itemsize
                problem = self._sums[entry.file].check_tensor(entry.tensor, entry.shape, itemsize, full, span)
                if problem:
                    raise CorruptCheckpointError(problem)
                stored = full.view(entry.dtype).reshape(entry.shape)
                for item in checked[entry]:
                    dest = self._destination(item, planner)
                    region = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                    dest.copy_(stored[region])
                    planner.commit_tensor(item, dest)

    def _destination(self, item: ReadItem, planner: LoadPlanner) -> torch.Tensor:
        """``planner.resolve_tensor(item)``, checked against the slice's shape (memoised: resolved once)."""
        dest = self._resolved.get(id(item))
        if dest is None:
            dest = planner.resolve_tensor(item).detach()
            if tuple(dest.shape) != tuple(item.lengths):
                raise ShapeMismatchError(
                    f"{item.dest_index.fqn}: destination has shape {tuple(dest.shape)} but the checkpoint slice is "
                    f"{tuple(item.lengths)}"
                )
            self._resolved[id(item)] = dest
        return dest

    def _plan_tensor(self, item: ReadItem, entry: StoredChunk, planner: LoadPlanner) -> SliceRead:
        path = self._paths.get(entry.file)
        if path is None:
            path = self._paths[entry.file] = self._path(entry.file)
        dest = self._destination(item, planner)
        lengths = tuple(item.lengths)
        if (
            lengths == entry.shape
            and not any(item.storage_offsets)
            and dest.dtype == entry.dtype
            and dest.device.type == "cpu"
            and dest.is_contiguous()
            and 0 not in lengths
        ):
            # a whole tensor into a contiguous destination of its dtype: one run straight into it, the
            # request plan_slice_read makes for it, without its per-item planning (seconds at 1M tensors)
            nbytes = math.prod(lengths) * entry.dtype.itemsize
            start = entry.data_offset
            request = RangeRequest(path, start, start + nbytes, into=writable_bytes(dest))
            return SliceRead(item, dest, lengths, requests=[request])
        stored = entry.stored(path, self.transport.url(path))
        return plan_slice_read(
            item,
            stored,
            item.storage_offsets,
            item.lengths,
            dest,
            self.config.max_runs_per_item,
            map_runs_above=self.config.map_runs_above if self.transport.is_local else None,
            dense_gap=dense_gap_of(self.transport),
        )

    def _load_bytes(self, byte_items: list[tuple[ReadItem, StoredBytes]], planner: LoadPlanner) -> None:
        if not byte_items:
            return
        for item, entry in byte_items:
            if entry.transforms:
                raise CorruptCheckpointError(
                    f"{self.transport.url(self._path(entry.file))}: item {item.storage_index.fqn!r} was saved "
                    f"through stream extensions {list(entry.transforms)}, which SafetensorsReader does not undo"
                )
        reqs = [RangeRequest(self._path(e.file), e.offset, e.offset + e.length) for _, e in byte_items]
        for (item, entry), buf in zip(byte_items, self.transport.read_ranges(reqs)):
            url = self.transport.url(self._path(entry.file))
            where = f"{url} [{entry.offset}, {entry.offset + entry.length}) (item {item.storage_index.fqn!r})"
            deliver_byte_item(planner, item, buf, where, trust=self.config.trust_byte_items)  # type: ignore[arg-type]


# the names before 0.2 (one scheme for the exported configs: the format, then what it configures)
