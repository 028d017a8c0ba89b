"""The manifest of a DCP native checkpoint: building it, reading it, and verifying records in place with it.

Building and reading the manifest of a DCP native checkpoint (see :mod:`dcp_storage.integrity.manifest`).

Verified loads of whole records straight into their destinations, hashed where they land.

A checked load (``FsspecReader(verify=True)``) must hash every byte of each record it reads. The general
path fetches the record whole into a fresh buffer, hashes it, decodes it and copies the tensor into the
destination: a second copy of every byte plus the page faults of the fresh buffer, which made a local
verified load 3.5x slower than an unchecked one (+247%; +17-21% in place: ``benchmarks/RESULTS-integrity.md``).
When a rank needs a record's whole tensor (same world size, ``Shard(0)`` to the same ``Shard(0)``, a full
tensor on one process) and the destination is a contiguous CPU tensor of the stored dtype, the record is
read in three pieces that tile it exactly: its header (zip entries and ``data.pkl``, from the probe), the
raw elements straight into the destination, and its tail (zip index). The pieces are hashed in order,
which gives the digest of the whole record.

On a mismatch the error names the file, byte range and keys as on the general path; the destination
then already holds the unchecked bytes, and the load fails. Records that do not fit (slices, casts, GPU
destinations, stream extensions, small records, headers that do not parse) are returned to the caller
for the general path, which also gives a damaged header its checksum error instead of a parse error.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.dcp_native.framed_items import RecordEntry, check_record_matches
from dcp_storage.formats.dcp_native.torch_record import TensorRecord
from dcp_storage.formats.paths import METADATA_FILE
from dcp_storage.formats.reading import StoredTensor, slice_extent
from dcp_storage.integrity.blocks import BlockCover, Cover, DataCrc, RecordVerifier, key_name
from dcp_storage.integrity.checksums import BLOCK_SIZE, DEFAULT_ALGORITHM, Hasher, checksum
from dcp_storage.integrity.manifest import (
    MANIFEST_FILE,
    ExtensionInfo,
    Manifest,
    describe_extension,
    file_checksums,
    format_distribution,
    manifest_bytes,
    metadata_matches,
    writer_descriptor,
)
from dcp_storage.runtime import writable_bytes
from dcp_storage.text import printable, redact_urls
from dcp_storage.transports import RangeRequest, Transport

__all__ = [
    "SliceCovers",
    "build_manifest",
    "default_sums",
    "load_verified_in_place",
    "read_checked_manifest",
    "read_manifest",
    "record_verifier",
]

_log = logging.getLogger(__name__)


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
    :func:`trusted_manifest` for what a default load does with it). One that cannot be parsed raises.
    """
    return read_checked_manifest(transport, root, metadata, strict=True)[0]


_READ = object()  # record_verifier's default: read the manifest now


def read_checked_manifest(
    transport: Any, root: str, metadata: bytes | None, *, strict: bool, raw: Any = _READ
) -> tuple[Manifest | None, bool]:
    """``(manifest, stale)`` for a load that read the ``.metadata`` bytes ``metadata`` (``None``: not
    compared).

    ``stale``: the manifest describes another ``.metadata`` (ignored, warned once). Outside ``strict``
    (``verify=True``) a manifest that cannot be read is ignored with a warning, so a damaged manifest never
    stops a load that torch's reader would do; the zip CRC-32s still check what they cover. ``raw``: the
    manifest's bytes (``None``: it has none) if the caller fetched them already.
    """
    raw = manifest_bytes(transport, root) if raw is _READ else raw
    if raw is None:
        return None, False
    url = transport.url(transport.join(root, MANIFEST_FILE))
    try:
        manifest = Manifest.from_json(raw, url)
    except DcpStorageError as exc:
        if strict:
            raise
        warnings.warn(f"{exc}; ignoring the manifest (zip CRC-32s still checked)", RuntimeWarning, stacklevel=3)
        return None, False
    if metadata is not None:
        metadata_url = transport.url(transport.join(root, METADATA_FILE))
        if metadata_matches(manifest, metadata, url, metadata_url) is False:
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


class InPlaceLoader(Protocol):
    """What the in-place path uses of the item loader (:class:`~.item_loader.DcpItemLoader`), which calls it
    from ``load`` with its planner set: the record each item lives in, its path, the header round, and the
    destination tensor the planner resolves."""

    transport: Transport
    config: Any  # the loader's DcpLoaderConfig: small_item_bytes, probe_bytes
    metadata: Any  # the checkpoint's Metadata (or None): each record must hold the chunk it names

    def _where(self, entry: RecordEntry) -> str: ...

    def _entry(self, item: ReadItem) -> RecordEntry: ...

    def _path(self, entry: RecordEntry) -> str: ...

    def _probe_headers(
        self,
        probe: dict[RecordEntry, int],
        whole: dict[RecordEntry, memoryview | None],
        records: dict[RecordEntry, TensorRecord],
        headers: dict[RecordEntry, memoryview] | None = None,
    ) -> None: ...

    def _destination(self, item: ReadItem) -> torch.Tensor: ...


@dataclass
class _Job:
    item: ReadItem
    entry: RecordEntry
    header: memoryview
    record: TensorRecord
    dest: torch.Tensor | None = None


def load_verified_in_place(
    loader: InPlaceLoader, verifier: RecordVerifier, items: Sequence[ReadItem], planner: LoadPlanner
) -> list[ReadItem]:
    """Load, check and commit the items that can be read in place; return the others, untouched.

    Local files only: in place takes a header round before the data (the elements' offset is in the
    record's header), which on an object store costs a request per record more than fetching it whole
    (measured on moto: +31% against +19% for a verified load), while the staging copy it saves is cheap
    next to the network.
    """
    if not loader.transport.is_local:
        return list(items)
    by_entry: dict[RecordEntry, list[ReadItem]] = {}
    for item in items:
        by_entry.setdefault(loader._entry(item), []).append(item)
    candidates = {
        entry: group[0]
        for entry, group in by_entry.items()
        if len(group) == 1
        and group[0].type != LoadItemType.BYTE_IO
        and not entry.transforms
        and entry.length > loader.config.small_item_bytes
        and not any(group[0].storage_offsets)
    }
    jobs = _probe(loader, candidates)
    for job in jobs:
        job.dest = _direct_destination(loader, job)
    jobs = [j for j in jobs if j.dest is not None]
    if not jobs:
        return list(items)
    requests: list[RangeRequest] = []
    hashes: list[_HashAsLanded] = []
    for job in jobs:
        path, rec, start = loader._path(job.entry), job.record, job.entry.offset
        data_start = start + rec.data_start
        data_end = data_start + rec.storage_nbytes
        landed = _HashAsLanded(verifier.hasher(), job.header, data_start)
        hashes.append(landed)
        requests.append(
            RangeRequest(path, data_start, data_end, into=writable_bytes(job.dest), on_piece=landed.piece)  # type: ignore[arg-type]
        )
        requests.append(RangeRequest(path, data_end, start + job.entry.length))
    fetched = loader.transport.read_ranges(requests)
    for job, landed, tail in zip(jobs, hashes, fetched[1::2]):
        hasher = landed.finished(writable_bytes(job.dest), verifier)  # type: ignore[arg-type]
        hasher.update(tail)
        verifier.check_digest(job.entry.relative_path, job.entry.offset, job.entry.length, hasher.hexdigest())
    for job in jobs:
        planner.commit_tensor(job.item, job.dest)  # type: ignore[arg-type]
    done = {id(job.item) for job in jobs}
    return [i for i in items if id(i) not in done]


class _HashAsLanded:
    """A record's digest, hashed piece by piece as its elements land in the destination (a read's
    ``on_piece``, in the worker thread that just read them, while they are in the CPU's cache). Hashing the
    whole destination after the read found it out of cache and on one thread: +42-49% on a warm local load.
    The record's header is hashed first, its tail by the caller."""

    __slots__ = ("_data_start", "_hasher", "_header", "_next")

    def __init__(self, hasher: Hasher, header: memoryview, data_start: int) -> None:
        self._header = header
        self._hasher = hasher
        hasher.update(header)
        self._data_start = data_start
        self._next = data_start  # the next byte the pieces must start at; -1 once one came out of order

    def piece(self, offset: int, view: memoryview) -> None:
        if offset != self._next:
            self._next = -1
            return
        self._hasher.update(view)
        self._next += view.nbytes

    def finished(self, data: memoryview, verifier: RecordVerifier) -> Hasher:
        """The hasher after the header and all of ``data``: as the pieces left it, or, when they did not all
        come in order (a transport need not honour ``on_piece``), hashed again from the start."""
        if self._next == self._data_start + data.nbytes:
            return self._hasher
        hasher = verifier.hasher()
        hasher.update(self._header)
        hasher.update(data)
        return hasher


def _probe(loader: InPlaceLoader, candidates: dict[RecordEntry, ReadItem]) -> list[_Job]:
    """Parse each candidate record's header (the loader's header round); keep those that parse.

    Records the header round cannot slice stay with the general path; if any header is damaged, all
    candidates do: it fetches each record whole and checks its checksum before decoding it, so the damage
    is reported as a checksum mismatch naming the file and key.
    """
    whole: dict[RecordEntry, memoryview | None] = {}
    records: dict[RecordEntry, TensorRecord] = {}
    headers: dict[RecordEntry, memoryview] = {}
    try:
        loader._probe_headers(dict.fromkeys(candidates, loader.config.probe_bytes), whole, records, headers)
    except DcpStorageError:
        return []
    return [_Job(candidates[e], e, headers[e], records[e]) for e in candidates if e in headers and e not in whole]


def _direct_destination(loader: InPlaceLoader, job: _Job) -> torch.Tensor | None:
    """The destination tensor when the record's elements can land in it as they are stored, else ``None``."""
    rec, item = job.record, job.item
    check_record_matches(loader.metadata, item.storage_index, tuple(rec.shape), rec.dtype, loader._where(job.entry))
    whole = rec.is_row_major and rec.storage_offset == 0 and tuple(rec.shape) == tuple(item.lengths)
    if not whole or rec.storage_nbytes != rec.itemsize * math.prod(rec.shape):
        return None
    dest = loader._destination(item)
    if dest.device.type != "cpu" or dest.dtype != rec.dtype or not dest.is_contiguous():
        return None
    return dest


class SliceCovers:
    """What checks each slice a default load reads by ranges (``DcpItemLoader(check_zips=True)``): the covering
    blocks of the record's digests in the manifest (``sums``), else a whole tensor's zip CRC-32, else nothing
    (said once in the debug log). One per loader: it says each thing once."""

    def __init__(self, sums: RecordVerifier | None, root_url: str) -> None:
        self.sums = sums
        self.root_url = root_url
        self._unchecked_said = False
        self._costly_said = False

    def cover(
        self, item: ReadItem, entry: RecordEntry, rec: TensorRecord, stored: StoredTensor, where: str
    ) -> Cover | None:
        """The check of ``item``'s slice of ``entry`` (``rec`` its layout, ``stored`` where its elements lie)."""
        return self._affordable(self._cover(item, entry, rec, where), stored, item)

    def _affordable(self, cover: Cover | None, stored: StoredTensor, item: ReadItem) -> Cover | None:
        """``cover`` unless reading what it covers adds more than a quarter (or two blocks) to the slice's
        bytes: a column slice (``Shard(1)``) would read its whole record on every rank. Such a slice is read
        alone and unchecked (the debug log says so once; ``verify=True`` reads and checks whole records)."""
        if cover is None or not isinstance(cover, BlockCover) or math.prod(item.lengths) == 0:
            return cover
        needed = math.prod(item.lengths) * stored.itemsize
        start, end = cover.covering(*slice_extent(stored, item.storage_offsets, item.lengths))
        if end - start <= needed + max(needed // 4, 2 * cover.block_size):
            return cover
        if not self._costly_said:
            self._costly_said = True
            _log.debug(
                "%s: slices whose covering blocks would read more than a quarter beyond their bytes (column slices, "
                "Shard(1)) are read alone and delivered unchecked; verify=True checks them by reading whole records",
                redact_urls(self.root_url),
            )
        return None

    def _cover(self, item: ReadItem, entry: RecordEntry, rec: TensorRecord, where: str) -> Cover | None:
        """What checks the slice ``item`` reads of the record ``entry``: its covering blocks when the manifest
        records them, else the zip CRC-32 of a whole tensor; ``None`` (unchecked, said once) otherwise."""
        where = f"{where} (holding {key_name(item.storage_index)})"
        start = entry.offset
        expected = self.sums.manifest.item(entry.relative_path, entry.offset, entry.length) if self.sums else None
        block_size = self.sums.manifest.block_size if self.sums else None
        if expected is not None and block_size is not None and self.sums is not None:
            if expected.blocks:
                algorithm = self.sums.algorithm
                size = expected.block_size or block_size
                return BlockCover(start, entry.length, size, expected.blocks, algorithm, where, expected.first_block)
            else:  # a record without blocks (at most WHOLE_BELOW bytes of data) is its own block
                return BlockCover(
                    start, entry.length, max(entry.length, 1), (expected.digest,), self.sums.algorithm, where
                )
        whole = (
            rec.storage_offset == 0
            and rec.is_row_major
            and not any(item.storage_offsets)
            and tuple(item.lengths) == tuple(rec.shape)
            and rec.storage_nbytes == rec.itemsize * math.prod(rec.shape)
        )
        if whole:
            return DataCrc(start + rec.data_start, rec.storage_nbytes, start + entry.length, where)
        if not self._unchecked_said:
            self._unchecked_said = True
            _log.debug(
                "%s: the checkpoint records no block checksums (torch's writer, or an older dcp-storage): slices of "
                "its records are delivered unchecked; whole records and whole tensors are checked",
                redact_urls(self.root_url),
            )
        return None
