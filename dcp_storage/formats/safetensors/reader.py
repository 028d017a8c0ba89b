"""``SafetensorsReader`` and the I/O of safetensors saves (``pwrite`` on local disks, streamed uploads on object
stores).

Raw local I/O of a safetensors save (``pwrite`` mode): temp files, chunks written in place, headers, commit.

Local filesystems (shared by all ranks, as for torch's ``FileSystemWriter``) take positioned writes, so
every byte is written once, by the rank that holds it, with nothing sent between ranks:

1. :func:`create_temp_files` (coordinator, ``prepare_global_plan``): each planned file is created at its
   full size under a hidden temp name (:func:`~dcp_storage.formats.paths.temp_name`), its header written
   now, or, with checksums, in step 3 once the chunk digests are known.
2. :func:`pwrite_chunks` (every rank, ``write_data``): each rank ``pwrite``\\ s its own chunks at their final
   offsets (a ``Shard(0)`` chunk is one run, a ``Shard(1)`` chunk one run per row), hashing each chunk in
   the same pass, and ``fsync``\\ s.
3. :func:`fill_headers` then :func:`commit_files` (coordinator, ``finish``): each header gets every
   digest, in the space the temp file reserved for it, and is ``fsync``\\ ed; only then are the files renamed
   into place and the directory ``fsync``\\ ed, so a committed file always carries its digests.

Paths are local paths; the transport only counts requests and bytes (and removes temp files on failure).

The coordinator's uploads of a streamed safetensors save (``stream`` mode: object stores).

Objects cannot be written at offsets, so the coordinator writes each file in order through one atomic
upload (single PUT or multipart upload), tensor by tensor, taking chunks from a
:class:`~dcp_storage.formats.safetensors.chunk_exchange.ChunkSource` (its own, and the other ranks' as they
arrive). ``Shard(0)`` chunks are written straight through; other shardings are assembled one tensor at a
time, so the coordinator's memory is bounded by the largest tensor. Files are committed one by one (the
index, written last by the writer's ``finish``, commits the checkpoint). On any failure the current upload
is aborted and the source drained, so no other rank waits for the process-group timeout.

``SafetensorsReader``: a drop-in DCP ``StorageReader`` for safetensors checkpoints on any fsspec URL.

Reads a single ``.safetensors`` file, a directory of them, a Hugging Face ``model.safetensors.index.json``
(sharded ``save_pretrained`` output), torch's ``HuggingFaceStorageWriter`` output (with or without
``save_distributed``) and torch's ``FileSystemWriter(serialization_format=SAFETENSORS)`` output, into any
state dict ``dcp.load`` accepts: plain tensors, or DTensors resharded any way. See
:mod:`dcp_storage.formats.safetensors.metadata` for how each layout is recognised.

Call order (torch's ``dcp.load`` drives it; every rank calls every step unless noted):

1. ``reset(checkpoint_id)`` - point at a checkpoint (also done by the constructor).
2. ``read_metadata()`` - builds DCP ``Metadata`` from the safetensors headers (8-byte length + JSON,
   fetched with one small ranged read per file, all files concurrently). When ``dcp.load`` runs
   distributed over a group of more than one rank, only its coordinator reads storage and broadcasts the
   ``Metadata`` (a collective: every rank of the group must call it, as ``dcp.load`` does), so header
   requests grow with files, not with ranks x files. A coordinator's failure is re-raised on every rank.
   Under ``dcp.load(..., no_dist=True)`` each caller reads the headers itself.
3. ``set_up_storage_reader(metadata, is_coordinator)`` - keeps the storage map.
4. ``prepare_local_plan`` / ``prepare_global_plan`` (coordinator only) - the read strategy's (see
   :mod:`dcp_storage.strategies.read_strategy`; ``read_once`` on object stores by default).
5. ``read_data(plan, planner)`` - fetches exactly the byte ranges of this rank's plan (its share of the
   slices several ranks need, under ``read_once``), coalesced and concurrent, straight into the
   destination tensors where it can.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_storage import errors
from dcp_storage.errors import CheckpointExistsError, CheckpointNotFoundError, DcpStorageError
from dcp_storage.formats.dcp_native.reader import MetadataFailure
from dcp_storage.formats.location import LoadingLocation, raise_explained
from dcp_storage.formats.paths import temp_name
from dcp_storage.formats.safetensors.checksums import FileSums
from dcp_storage.formats.safetensors.chunk_exchange import ChunkSource
from dcp_storage.formats.safetensors.encode import as_memoryview, pwrite_all
from dcp_storage.formats.safetensors.loader import (
    SafetensorsItemLoader,
    SafetensorsLoaderConfig,
    SafetensorsScanConfig,
    scan_metadata,
)
from dcp_storage.formats.safetensors.metadata import INDEX_FILE, SUFFIX, discover
from dcp_storage.formats.safetensors.write_plan import (
    ChunkWrite,
    PieceKey,
    RankWrites,
    SavePlanResult,
    TensorSchedule,
    fill_header,
)
from dcp_storage.integrity.checksums import checksum
from dcp_storage.planners.planner import check_planned_keys
from dcp_storage.runtime import gc_paused
from dcp_storage.strategies.collectives import reader_location, running_planner, share_object
from dcp_storage.strategies.read_strategy import MetadataItems, ReadStrategy, StrategyReading
from dcp_storage.transports import ClientSetUp, Transport, TransportConfig
from dcp_storage.transports.local_io import fsync_dir

__all__ = [
    "SafetensorsReader",
    "commit_files",
    "create_temp_files",
    "fill_headers",
    "pwrite_chunks",
    "stream_files",
    "temp_path",
]


def temp_path(transport: Transport, root: str, name: str, save_id: str) -> str:
    """Where file ``name`` of save ``save_id`` is written until :func:`commit_files` renames it."""
    return transport.join(root, temp_name(name, save_id))


def create_temp_files(transport: Transport, root: str, planned: SavePlanResult, save_id: str) -> None:
    """Create every planned file at its full size (its header too, when it carries no digests)."""
    created: list[str] = []
    try:
        for f in planned.files:
            tmp = temp_path(transport, root, f.name, save_id)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            created.append(tmp)
            try:
                os.ftruncate(fd, f.size)
                if f.algorithm is None:  # with checksums the header is written once, in finish
                    pwrite_all(fd, memoryview(f.header), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            if f.algorithm is None:
                transport.counters.add(requests=1, bytes_written=len(f.header))
    except BaseException:
        for tmp in created:
            transport.remove(tmp)
        raise


def _open_temp(transport: Transport, path: str) -> int:
    """The temp file this save created in ``prepare_global_plan``, opened for writing."""
    try:
        return os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        raise CheckpointExistsError(
            f"{transport.url(path)}: this save's temp file is gone: another save (overwrite=True) took this "
            "location over and removed it while this one was writing; this save was not committed. Save again "
            "with overwrite=True to replace that save's checkpoint, or save to another path"
        ) from None


def pwrite_chunks(
    transport: Transport,
    root: str,
    rw: RankWrites,
    indexes: Iterable[MetadataIndex],
    chunk_bytes: Callable[[ChunkWrite], torch.Tensor],
    algorithm: str | None,
) -> dict[MetadataIndex, str]:
    """Write this rank's chunks (those of ``indexes`` that ``rw`` plans) in place; ``fsync`` every file.

    Returns each chunk's digest under ``algorithm`` (hashed from the bytes written; none when ``None``).
    """
    fds: dict[int, int] = {}
    digests: dict[MetadataIndex, str] = {}
    try:
        for index in indexes:
            cw = rw.chunks.get(index)
            if cw is None:
                continue
            src = as_memoryview(chunk_bytes(cw).cpu())
            if algorithm is not None:
                digests[index] = checksum(src, algorithm)
            fd = fds.get(cw.file)
            if fd is None:
                fd = fds[cw.file] = _open_temp(transport, temp_path(transport, root, rw.files[cw.file], rw.save_id))
            n, length = 0, cw.runs.length
            for j, offset in enumerate(cw.runs.offsets()):
                pwrite_all(fd, src[j * length : (j + 1) * length], cw.begin + offset)
                n += 1
            transport.counters.add(requests=n, bytes_written=cw.nbytes)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return digests


def fill_headers(
    transport: Transport, root: str, planned: SavePlanResult, save_id: str, digests: Mapping[PieceKey, str]
) -> None:
    """Put every chunk's digest into its temp file's header (same length as planned), then ``fsync``."""
    for f in planned.files:
        header = fill_header(f, digests)
        fd = _open_temp(transport, temp_path(transport, root, f.name, save_id))
        try:
            pwrite_all(fd, memoryview(header), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        transport.counters.add(requests=1, bytes_written=len(header))


def commit_files(transport: Transport, root: str, planned: SavePlanResult, save_id: str) -> None:
    """Rename every temp file into place, then ``fsync`` the directory."""
    for f in planned.files:
        os.replace(temp_path(transport, root, f.name, save_id), transport.join(root, f.name))
        transport.counters.add(requests=1)
    fsync_dir(root)


def stream_files(
    transport: Transport,
    root: str,
    rw: RankWrites,
    planned: SavePlanResult | None,
    source: ChunkSource,
    failure: BaseException | None,
    digests: Mapping[PieceKey, str] | None = None,
) -> None:
    """Upload every file of ``rw.schedule`` (headers with ``digests``, when given); raises ``failure`` first."""
    if rw.schedule is None:
        raise DcpStorageError("stream-mode plan for the coordinator carries no schedule")
    try:
        if failure is not None:
            raise failure
        specs = {f.name: f for f in planned.files} if planned is not None else {}
        for fs in rw.schedule:
            header = fs.header if digests is None else fill_header(specs[fs.name], digests)
            with transport.open_atomic(transport.join(root, fs.name)) as out:
                out.write(header)
                for ts in fs.tensors:
                    _write_tensor(out, ts, source)
    except BaseException as exc:
        source.drain(exc)  # let the other ranks finish sending, so none waits for the timeout
        raise


def _write_tensor(out: Any, ts: TensorSchedule, source: ChunkSource) -> None:
    """Write one tensor's bytes: chunk by chunk if they are consecutive single runs, else assembled first."""
    if ts.nbytes == 0:
        return
    position, straight = 0, True
    for c in ts.chunks:
        if c.runs.count != 1 or c.runs.start != position:
            straight = False
            break
        position += c.runs.length
    if straight and position == ts.nbytes:
        for c in ts.chunks:
            out.write(as_memoryview(source.next(c)))
        return
    full = torch.empty(ts.nbytes, dtype=torch.uint8)
    for c in ts.chunks:
        data = source.next(c)
        r = c.runs
        # The runs are a strided view of the full tensor's bytes; the chunk's bytes fill it in order.
        dest = full.as_strided((*r.counts, r.length), (*r.strides, 1), r.start)
        dest.copy_(data.view(*r.counts, r.length))
    out.write(as_memoryview(full))


class SafetensorsReader(LoadingLocation, StorageReader):
    """Read safetensors checkpoints with ``dcp.load`` from a local path or any fsspec URL.

    Args:
        path: a ``.safetensors`` file, a ``*.index.json`` file, or a directory (local path, ``file://``,
            ``memory://``, ``s3://bucket/key``, anything fsspec resolves).
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        transport_config: concurrency, coalescing, in-flight and retry settings.
        scan_config: how much of each file the first header request fetches.
        loader_config: staging limit and run limits for data reads.
        transport: an existing transport to share (its counters then add up across readers).
        process_group: the group whose coordinator reads the headers and broadcasts the metadata; if
            ``None``, the group ``dcp.load`` runs on (its ``process_group``, else the default group).
        coordinator_rank: the rank, within ``process_group``, that reads the headers.
        broadcast_metadata: ``False``: every caller reads the headers itself, never sharing them. Not needed
            for ``dcp.load(..., no_dist=True)`` (on one rank or on all), which the reader detects: each
            caller then reads the headers itself anyway (see :mod:`dcp_storage.strategies.collectives`). It is
            needed to call ``read_metadata()`` on one rank alone while a process group is up (outside
            ``dcp.load``, to look at keys): with sharing on, every rank of the group must call it.
        read_strategy: who fetches stored bytes that several ranks need (see :class:`FsspecReader`).
        verify: check every tensor this rank reads against the digests ``SafetensorsWriter`` recorded in
            the file's header (and the header against its own digest). Each tensor touched is fetched whole
            (a slice cannot be checked); a mismatch raises :class:`~dcp_storage.errors.CorruptCheckpointError`
            naming the URL, the byte range and the key. Files without checksums load unchecked, with a warning.
            ``None`` (the default): a tensor read whole is checked against its recorded digest, a slice is read
            alone and unchecked (the file records no block digests); safetensors files written by others carry
            no checksum, so only their header is checked (the debug log says so). ``False``: nothing is checked.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        transport_config: TransportConfig | None = None,
        scan_config: SafetensorsScanConfig | None = None,
        loader_config: SafetensorsLoaderConfig | None = None,
        transport: Transport | None = None,
        process_group: dist.ProcessGroup | None = None,
        coordinator_rank: int = 0,
        broadcast_metadata: bool = True,
        verify: bool | None = None,
        read_strategy: ReadStrategy | str | None = None,
    ) -> None:
        super().__init__()
        if coordinator_rank < 0:
            raise ValueError(f"coordinator_rank must be >= 0, got {coordinator_rank}")
        self.storage_options = dict(storage_options or {})
        self._reading = StrategyReading(read_strategy, self.storage_options)  # takes the storage option out
        self._sums: dict[str, FileSums] = {}  # under verify: each file's header checksums, read with the metadata
        self.transport_config = transport_config
        self.scan_config = scan_config or SafetensorsScanConfig()
        self.loader_config = loader_config or SafetensorsLoaderConfig()
        self.process_group = process_group
        self.coordinator_rank = coordinator_rank
        self.broadcast_metadata = broadcast_metadata
        self.verify = verify
        self._given_transport = transport
        self.storage_data: dict[Any, Any] = {}
        self.metadata_failure = MetadataFailure()
        self._open_load(path)

    def _open(self, url: str | os.PathLike[str]) -> None:
        super()._open(url)
        self.target = self.root  # what the user named; root becomes the layout's root once metadata is read
        self._reading.choose(self.transport.is_local)

    @property
    def read_strategy(self) -> ReadStrategy:
        return self._reading.strategy

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self._reading.reset()
        self._sums = {}
        self._next_load(checkpoint_id)

    # ---------------------------------------------------------------------------------------- metadata
    def _scan(self) -> tuple[str, Metadata, dict[str, FileSums]]:
        """The layout's root, its metadata and, under ``verify``, each file's header checksums (from the same
        header bytes: a header is fetched once per load)."""
        try:
            layout = discover(self.transport, self.target)
            found: dict[Any, Any] | None = {} if self.verify is not False else None
            with gc_paused():  # a few small acyclic objects per tensor: millions in a 1M-tensor header
                metadata = scan_metadata(self.transport, layout, self.scan_config, found)
            sums = {
                blob.file: FileSums(url, header.metadata, raw)
                for blob, (header, raw, url) in (found or {}).items()
                if blob.base == 0  # a whole safetensors file (a DCP layout's blobs sit inside .distcp files)
            }
            return layout.root, metadata, sums
        except (CheckpointNotFoundError, errors.CorruptCheckpointError, NotADirectoryError, IsADirectoryError) as exc:
            # A missing bucket, or another format at the URL (a DCP directory, a torch.save file): say which.
            raise_explained(self.transport, self.target, "safetensors", "SafetensorsReader", exc)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # dcp.load asks for per-rank metadata only after the global read failed; there is none here, and
            # None makes torch report the global failure alone (see metadata_fallback).
            return None  # type: ignore[return-value]
        if isinstance(self.transport, ClientSetUp):  # the other ranks build theirs while the coordinator scans
            self.transport.set_up_client()
        if self.broadcast_metadata:
            # The coordinator scans; its result or its error reaches every rank (see share_object).
            shared = self.metadata_failure.global_read(
                lambda: share_object(
                    self._scan,
                    group=self.process_group,
                    src_rank=self.coordinator_rank,
                    location=reader_location(self),
                    kind=type(self).__name__,
                )
            )
        else:
            shared = self.metadata_failure.global_read(self._scan)
        self.root, metadata, self._sums = shared
        return self._stamp_load(metadata)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointNotFoundError(f"{self.path}: metadata carries no storage map")
        check_planned_keys(running_planner(), metadata)
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self._reading.set_up(MetadataItems(metadata, lambda item: self.verify is not True))  # checked: read whole

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self._reading.local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self._reading.global_plan(plans)

    # -------------------------------------------------------------------------------------------- data
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        loader = SafetensorsItemLoader(
            self.transport, self.root, self.storage_data, self.loader_config, verify=self.verify, known_sums=self._sums
        )
        return self._reading.read(plan, planner, loader.load)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Only URLs that name a safetensors file or index; directories are ambiguous without I/O."""
        text = os.fspath(checkpoint_id)
        return text.endswith((SUFFIX, INDEX_FILE))
