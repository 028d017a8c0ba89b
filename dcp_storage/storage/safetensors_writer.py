"""``SafetensorsWriter``: a DCP ``StorageWriter`` that saves Hugging Face safetensors checkpoints directly.

``dcp.save(state_dict, storage_writer=SafetensorsWriter(url))`` writes ``model.safetensors`` (or
``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``) that
``safetensors.torch.load_file`` and ``transformers``' ``from_pretrained`` read as they are: full,
consolidated tensors, even when the state dict holds DTensor shards spread over many ranks. There is no
second consolidation pass and no rank ever holds the whole model.

Checksums (on by default): every file's header ``__metadata__`` records the writer, the algorithm and a
digest of every chunk's bytes (one per tensor when a tensor is written whole) plus a digest of the header
itself; :mod:`dcp_storage.integrity.safetensors_sums` says why per chunk. The header is written before the
data exists, so it is planned with zero-filled digests of fixed width and filled in without moving a byte:

* local (``pwrite``): each rank hashes the chunk bytes it writes, in the same pass, and returns the digests
  with its write results; in ``finish`` the coordinator writes the header into the space the temp file
  reserves for it (so every byte is still written once), ``fsync``s it and only then renames it into
  place, so a committed file always carries its digests.
* object stores (``stream``): the header is the first bytes of an upload that cannot be rewritten, so
  before streaming every rank hashes its own chunks (one extra read of memory it holds, at ~28 GB/s for
  xxh3, chunk by chunk so memory stays bounded by the largest chunk) and the digests (a few bytes each)
  are all-gathered; a failure on any rank is then known to all before any upload starts. A sidecar file
  was the alternative, but it would split one file's integrity over two objects that can drift apart.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import DcpStorageError, NonTensorStateError, UnsupportedDtypeError
from ..formats.safetensors.dtypes import safetensors_dtype
from ..formats.safetensors.encode import as_memoryview, pwrite_all, tensor_bytes
from ..formats.safetensors.write_plan import (
    ChunkWrite,
    LocalOrder,
    PieceKey,
    RankWrites,
    SavePlanResult,
    TensorSchedule,
    fill_header,
    index_name,
    parse_size,
    plan_save,
    single_name,
)
from ..integrity.checksums import DEFAULT_ALGORITHM, check_algorithm, checksum
from ..integrity.safetensors_sums import RESERVED_PREFIX
from ..transports import Transport, TransportConfig
from ..transports.buckets import prepare_output
from ..transports.fsspec_transport import _fsync_dir
from .claim import LOCK_FILE, ClaimingWriter, refuse_existing
from .fsspec_reader import _is_fsspec_url
from .location import BoundLocation
from .retire import retire_safetensors

__all__ = ["EXTRA_STATE_FILE", "SafetensorsWriter"]

EXTRA_STATE_FILE = "extra_state.pt"
_STATUS_OK, _STATUS_FAILED = 1, 0


@dataclass(frozen=True)
class _ExtraState:
    """``WriteResult.storage_data`` of a ``BYTE_IO`` item: its bytes travel to the coordinator's ``finish``."""

    fqn: str
    data: bytes


@dataclass(frozen=True)
class _ChunkDigest:
    """``WriteResult.storage_data`` of a tensor chunk written in place: its file and its bytes' digest."""

    file: str
    key: PieceKey
    digest: str


class SafetensorsWriter(ClaimingWriter, BoundLocation, StorageWriter):
    """Save a DCP state dict as Hugging Face safetensors on a local path or any fsspec URL.

    Args:
        url: output directory (local path or fsspec URL such as ``s3://bucket/model``).
        storage_options: passed to the fsspec filesystem.
        max_shard_size: data bytes per file, an int or a string like ``"500MB"``/``"5GB"`` (powers of 10)
            or ``"2GiB"`` (powers of 2). Everything fits: one ``{prefix}.safetensors``. Otherwise:
            ``{prefix}-0000k-of-0000N.safetensors`` plus ``{prefix}.safetensors.index.json``. A tensor larger
            than the limit gets a file of its own (as in ``huggingface_hub``).
        overwrite: ``False`` (the default) refuses a directory that already holds ``{prefix}.safetensors``
            or the index, or that another save holds (running, or interrupted before its commit: see
            :mod:`~dcp_storage.storage.claim`), with :class:`~dcp_storage.errors.CheckpointExistsError`: of
            two concurrent saves exactly one succeeds. ``True`` deletes the old files (and stale temp files
            of an interrupted save) before any rank writes.
        filename_prefix: the ``model`` in the file names.
        allow_extra_state: ``False`` (the default) refuses non-tensor entries (ints, lists, optimizer step
            counters) with :class:`~dcp_storage.errors.NonTensorStateError` naming them. ``True`` writes
            them, as DCP serialized them, to ``extra_state.pt``: ``torch.save`` of ``{fqn: bytes}``; read
            with ``torch.load(path, weights_only=True)`` and ``torch.load(io.BytesIO(value))``. The values
            travel to the coordinator with the write results, so keep them small.
        metadata: extra ``__metadata__`` strings for every file header (``{"format": "pt"}`` is always
            there; ``transformers`` requires it). Keys starting with ``dcp_storage.`` are reserved.
        checksum_algorithm: digest of every chunk recorded in the headers (``"xxh3_64"``, ``"xxh64"``,
            ``"crc32c"``, ``"crc32"``); ``None`` records none (and no provenance).
        process_group: the group given to ``dcp.save`` (default: the default group); object-store saves
            send chunks to the coordinator over it.
        transport_config: concurrency, part size and retry settings.
        transport: an existing transport to share.
        create_bucket: create the URL's bucket (Azure: container) if it does not exist; ``False`` (the
            default) raises :class:`~dcp_storage.errors.BucketNotFoundError` naming it instead.

    How bytes reach storage (chosen per filesystem, not by a flag):

    * Local filesystems (must be shared by all ranks, as for torch's ``FileSystemWriter``): positioned
      writes. In ``prepare_global_plan`` the coordinator plans every file, creates each one at its full
      size under a hidden temp name ``.{name}.{save_id}.tmp`` (writing its header now, or in ``finish``
      once the chunk digests are known). Each rank then ``pwrite``s its own chunks at their final offsets
      (a ``Shard(0)`` chunk is one run, a ``Shard(1)`` chunk one run per row), hashing them as it goes,
      and ``fsync``s. In ``finish`` the coordinator writes the headers, renames the files into place and
      writes the index last, so an interrupted save never looks complete. Each byte is written once.
    * Object stores (any non-local fsspec filesystem): objects cannot be written at offsets, so the
      coordinator streams each file in order through one atomic upload (single PUT or multipart upload),
      tensor by tensor. In ``write_data`` every rank sends its chunks to the coordinator over the process
      group (on the group's device: CPU for gloo, CUDA for NCCL) in the planned global order; the
      coordinator writes ``Shard(0)`` chunks straight through and assembles other shardings one tensor at
      a time, so its memory is bounded by the largest tensor. Files are committed one by one and the
      index is written last. If any rank fails mid-stream, the others finish the exchange (failed chunks
      are announced, not sent) so no rank waits for the process-group timeout, and the current upload is
      aborted.
    * Without a process group (one process) both paths just write the process's own tensors.

    Replicated tensors (the same chunk on several ranks) are written once: DCP's planner deduplicates
    them and this writer drops any duplicate box that remains. Dtypes safetensors lacks raise
    :class:`~dcp_storage.errors.UnsupportedDtypeError` naming each key and dtype. An interrupted local save
    leaves its hidden temp files behind; the next ``overwrite=True`` save removes them.

    Call order (torch's ``dcp.save`` drives it): ``reset`` and ``set_up_storage_writer`` (every rank),
    ``prepare_local_plan`` (every rank: dtype and non-tensor checks; the coordinator refuses existing
    output), ``prepare_global_plan`` (coordinator: plan files and offsets, claim the location, retire old
    output, create the temp files), ``write_data`` (every rank), ``finish`` (coordinator: extra state,
    renames, index, release the claim).
    DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``) is not supported.
    """

    # Not pickled: in a checkpoint process (async_save PROCESS mode) the default group stands for it.
    _process_local = ("process_group",)
    process_group: dist.ProcessGroup | None = None

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        max_shard_size: int | str = "5GB",
        overwrite: bool = False,
        filename_prefix: str = "model",
        allow_extra_state: bool = False,
        metadata: Mapping[str, str] | None = None,
        checksum_algorithm: str | None = DEFAULT_ALGORITHM,
        process_group: dist.ProcessGroup | None = None,
        transport_config: TransportConfig | None = None,
        transport: Transport | None = None,
        create_bucket: bool = False,
    ) -> None:
        super().__init__()
        self.max_shard_size = parse_size(max_shard_size)
        if (
            not filename_prefix
            or "/" in filename_prefix
            or os.sep in filename_prefix
            or filename_prefix.startswith(".")
        ):
            raise ValueError(f"filename_prefix must be a plain, non-hidden file name, got {filename_prefix!r}")
        header_md = {"format": "pt"}
        for k, v in (metadata or {}).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must map str to str; {k!r}: {type(v).__name__} is not")
            if k.startswith(RESERVED_PREFIX):
                raise ValueError(f"metadata key {k!r}: keys starting with {RESERVED_PREFIX!r} are the writer's own")
            header_md[k] = v
        self.checksum_algorithm = check_algorithm(checksum_algorithm)  # refused before any planning
        self.header_metadata = header_md
        self.storage_options = dict(storage_options or {})
        self.overwrite = overwrite
        self.create_bucket = create_bucket
        self.filename_prefix = filename_prefix
        self.allow_extra_state = allow_extra_state
        self.process_group = process_group
        self.transport_config = transport_config
        self._given_transport = transport
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True
        self.save_id = uuid.uuid4().hex
        self._planned: SavePlanResult | None = None
        self._open(url)

    # ------------------------------------------------------------------------------------ set-up
    def _path(self, name: str) -> str:
        return self.transport.join(self.root, name)

    def _markers(self) -> list[str]:
        return [self._path(name) for name in (single_name(self.filename_prefix), index_name(self.filename_prefix))]

    def _tmp_path(self, name: str, save_id: str) -> str:
        return self._path(f".{name}.{save_id}.tmp")

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._open(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._planned = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_fsspec_url(checkpoint_id)

    # ------------------------------------------------------------------------------------ planning
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        bad_dtypes: dict[str, object] = {}
        byte_keys: list[str] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                byte_keys.append(item.index.fqn)
            elif item.tensor_data is not None and safetensors_dtype(item.tensor_data.properties.dtype) is None:
                bad_dtypes[item.index.fqn] = item.tensor_data.properties.dtype
        if bad_dtypes:
            raise UnsupportedDtypeError(bad_dtypes)
        if byte_keys and not self.allow_extra_state:
            raise NonTensorStateError(
                byte_keys,
                fix=f"pass allow_extra_state=True to write them to {EXTRA_STATE_FILE} beside the weights, "
                "or leave them out of the state dict",
            )
        if self.is_coordinator:
            prepare_output(self.transport, self.root, coordinator=True, create_bucket=self.create_bucket)
            if not self.overwrite:
                refuse_existing(self.transport, self._markers())  # early: the claim decides
        fqns = tuple(dict.fromkeys(i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO))
        return dataclasses.replace(plan, storage_data=LocalOrder(fqns))

    def _coordinator_index(self, n_plans: int) -> int:
        if n_plans == 1:
            return 0
        if self.rank is not None:
            return self.rank
        return dist.get_rank(self.process_group)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not all(getattr(p, "usable", True) for p in plans):
            raise DcpStorageError(
                "SafetensorsWriter does not support DCP plan caching (enable_plan_caching=True): each save "
                "plans its own files and temp names"
            )
        mode = "pwrite" if self.transport.is_local else "stream"
        planned = plan_save(
            plans,
            max_shard_size=self.max_shard_size,
            prefix=self.filename_prefix,
            metadata=self.header_metadata,
            coordinator=self._coordinator_index(len(plans)),
            mode=mode,
            save_id=self.save_id,
            checksum_algorithm=self.checksum_algorithm,
        )
        # Claim the location, then retire the old checkpoint, before any rank writes (see .claim).
        self._take_claim(self._path(LOCK_FILE), self._markers())
        if self.overwrite:
            prefix = self.filename_prefix
            retire_safetensors(self.transport, self.root, prefix, index_name(prefix), EXTRA_STATE_FILE)
        if mode == "pwrite":
            self._create_temp_files(planned)
        self._planned = planned
        return [dataclasses.replace(p, storage_data=rw) for p, rw in zip(plans, planned.rank_writes)]

    def _create_temp_files(self, planned: SavePlanResult) -> None:
        created: list[str] = []
        try:
            for f in planned.files:
                tmp = self._tmp_path(f.name, self.save_id)
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
                    self.transport.counters.add(requests=1, bytes_written=len(f.header))
        except BaseException:
            for tmp in created:
                self.transport.remove(tmp)
            raise

    # ------------------------------------------------------------------------------------ writing
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rw = plan.storage_data
        if not isinstance(rw, RankWrites):
            raise DcpStorageError(
                "SafetensorsWriter.write_data got a plan its prepare_global_plan did not make "
                f"(storage_data is {type(rw).__name__}); DCP plan caching is not supported"
            )
        results: list[WriteResult] = []
        tensor_items: list[WriteItem] = []
        early: BaseException | None = None  # in stream mode, raised only after the exchange (no rank may hang)
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                tensor_items.append(item)
                continue
            try:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)  # type: ignore[arg-type]
            except Exception as exc:
                if rw.mode == "pwrite":
                    raise
                early = early or exc
                continue
            extra = _ExtraState(item.index.fqn, raw)
            results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=extra))
        digests: dict[MetadataIndex, str] = {}
        if rw.mode == "pwrite":
            digests = self._pwrite_chunks(rw, tensor_items, planner)
        else:
            all_digests = self._exchange_digests(rw, tensor_items, planner, early) if self.checksum_algorithm else None
            if rw.rank == rw.coordinator:
                self._stream_files(rw, tensor_items, planner, early, all_digests)
            else:
                self._send_chunks(rw, tensor_items, planner, early)
        for item in tensor_items:
            cw = rw.chunks.get(item.index)  # None: an empty chunk, or a replica another rank writes
            where: Any = rw.files[cw.file] if cw is not None else None
            if cw is not None and item.index in digests:
                where = _ChunkDigest(rw.files[cw.file], (cw.fqn, cw.offsets), digests[item.index])
            results.append(WriteResult(index=item.index, size_in_bytes=cw.nbytes if cw else 0, storage_data=where))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _chunk_bytes(self, cw: ChunkWrite, item: WriteItem, planner: SavePlanner) -> torch.Tensor:
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"{cw.fqn}: tensor item resolved to {type(data).__name__}")
        raw = tensor_bytes(data)
        if raw.numel() != cw.nbytes:
            raise DcpStorageError(
                f"{cw.fqn}: the chunk at offsets {list(item.index.offset or ())} has {raw.numel()} bytes but the "
                f"plan expects {cw.nbytes}; the state dict changed between planning and writing?"
            )
        return raw

    def _pwrite_chunks(self, rw: RankWrites, items: list[WriteItem], planner: SavePlanner) -> dict[MetadataIndex, str]:
        """Write this rank's chunks in place; returns each chunk's digest (hashed from the bytes written)."""
        fds: dict[int, int] = {}
        digests: dict[MetadataIndex, str] = {}
        try:
            for item in items:
                cw = rw.chunks.get(item.index)
                if cw is None:
                    continue
                src = as_memoryview(self._chunk_bytes(cw, item, planner).cpu())
                if self.checksum_algorithm is not None:
                    digests[item.index] = checksum(src, self.checksum_algorithm)
                fd = fds.get(cw.file)
                if fd is None:
                    fd = fds[cw.file] = os.open(self._tmp_path(rw.files[cw.file], rw.save_id), os.O_WRONLY)
                n, length = 0, cw.runs.length
                for j, offset in enumerate(cw.runs.offsets()):
                    pwrite_all(fd, src[j * length : (j + 1) * length], cw.begin + offset)
                    n += 1
                self.transport.counters.add(requests=n, bytes_written=cw.nbytes)
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        return digests

    def _exchange_digests(
        self, rw: RankWrites, items: list[WriteItem], planner: SavePlanner, failure: BaseException | None
    ) -> dict[PieceKey, str]:
        """Stream mode: hash this rank's chunks, then all-gather every rank's digests (or its failure).

        Runs before any chunk is sent, so a failure anywhere is raised on every rank with no upload begun.
        """
        algorithm = self.checksum_algorithm or DEFAULT_ALGORITHM
        mine: dict[PieceKey, str] = {}
        if failure is None:
            try:
                by_index = {item.index: item for item in items}
                for index, cw in rw.chunks.items():
                    mine[(cw.fqn, cw.offsets)] = checksum(
                        as_memoryview(self._chunk_bytes(cw, by_index[index], planner).cpu()), algorithm
                    )
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is re-raised
                failure = exc
        payload: Any = ("error", f"{type(failure).__name__}: {failure}") if failure is not None else ("ok", mine)
        gathered = [payload]
        if rw.world > 1:
            gathered = [None] * rw.world
            dist.all_gather_object(gathered, payload, group=self.process_group)
        if failure is not None:
            raise failure
        out: dict[PieceKey, str] = {}
        for rank, (status, value) in enumerate(gathered):
            if status != "ok":
                raise DcpStorageError(f"rank {rank} could not hash its chunks, so nothing was uploaded: {value}")
            out.update(value)
        return out

    def _comm_device(self) -> torch.device:
        from torch.distributed.distributed_c10d import _get_pg_default_device

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            device = _get_pg_default_device(self.process_group)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _send_chunks(
        self, rw: RankWrites, items: list[WriteItem], planner: SavePlanner, failure: BaseException | None
    ) -> None:
        """Stream mode, non-coordinator: send each planned chunk (status, then bytes) in the global order.

        After a failure the remaining chunks are announced as failed instead of sent, so the coordinator
        stays in step and aborts its upload; the failure is raised once the exchange is over.
        """
        by_index = {item.index: item for item in items}
        device = self._comm_device()
        group, dst = self.process_group, rw.coordinator
        for index in rw.sends:
            payload = None
            if failure is None:
                try:
                    payload = self._chunk_bytes(rw.chunks[index], by_index[index], planner).to(device)
                except Exception as exc:  # noqa: BLE001 - announced to the coordinator, then re-raised
                    failure = exc
            ok = _STATUS_OK if payload is not None else _STATUS_FAILED
            dist.send(torch.tensor([ok], dtype=torch.uint8, device=device), group=group, group_dst=dst)
            if payload is not None:
                dist.send(payload, group=group, group_dst=dst)
        if failure is not None:
            raise failure

    def _stream_files(
        self,
        rw: RankWrites,
        items: list[WriteItem],
        planner: SavePlanner,
        failure: BaseException | None,
        digests: dict[PieceKey, str] | None = None,
    ) -> None:
        """Stream mode, coordinator: write every file in order, receiving other ranks' chunks as they come."""
        if rw.schedule is None:
            raise DcpStorageError("stream-mode plan for the coordinator carries no schedule")
        source = _ChunkSource(self, rw, {item.index: item for item in items}, planner)
        try:
            if failure is not None:
                raise failure
            specs = {f.name: f for f in self._planned.files} if self._planned is not None else {}
            for fs in rw.schedule:
                header = fs.header if digests is None else fill_header(specs[fs.name], digests)
                with self.transport.open_atomic(self._path(fs.name)) as out:
                    out.write(header)
                    for ts in fs.tensors:
                        _write_tensor(out, ts, source)
        except BaseException as exc:
            source.drain(exc)  # let the other ranks finish sending, so none waits for the timeout
            raise

    # ------------------------------------------------------------------------------------ finishing
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        planned = self._planned
        if planned is None:
            raise DcpStorageError("SafetensorsWriter.finish called without prepare_global_plan on this writer")
        extra = {
            wr.storage_data.fqn: wr.storage_data.data
            for rank in results
            for wr in rank
            if isinstance(wr.storage_data, _ExtraState)
        }
        if extra:
            buf = io.BytesIO()
            torch.save(extra, buf)
            self.transport.write_file(self._path(EXTRA_STATE_FILE), buf.getbuffer())
        if self.transport.is_local:
            if self.checksum_algorithm is not None:
                self._fill_headers(planned, results)
            for f in planned.files:
                os.replace(self._tmp_path(f.name, self.save_id), self._path(f.name))
                self.transport.counters.add(requests=1)
            _fsync_dir(self.root)
        if planned.sharded:
            self.transport.write_file(self._path(index_name(self.filename_prefix)), planned.index_json())
        self._planned = None
        self._release_claim()

    def _fill_headers(self, planned: SavePlanResult, results: list[list[WriteResult]]) -> None:
        """Local mode: put every chunk's digest into its temp file's header (same length), then ``fsync``."""
        digests = {
            wr.storage_data.key: wr.storage_data.digest
            for rank in results
            for wr in rank
            if isinstance(wr.storage_data, _ChunkDigest)
        }
        for f in planned.files:
            header = fill_header(f, digests)
            fd = os.open(self._tmp_path(f.name, self.save_id), os.O_WRONLY)
            try:
                pwrite_all(fd, memoryview(header), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.transport.counters.add(requests=1, bytes_written=len(header))


class _RemoteChunkError(DcpStorageError):
    """Another rank announced that it could not produce a chunk (its own error says why)."""


class _ChunkSource:
    """The coordinator's side of the stream: chunks in schedule order, own ones resolved, others received."""

    def __init__(
        self, writer: SafetensorsWriter, rw: RankWrites, own: dict[MetadataIndex, WriteItem], planner: SavePlanner
    ) -> None:
        self.writer = writer
        self.rw = rw
        self.own = own
        self.planner = planner
        self.order = [c for fs in rw.schedule or () for ts in fs.tensors for c in ts.chunks]
        self.pos = 0
        self.device = writer._comm_device() if rw.world > 1 else torch.device("cpu")
        self.broken = False  # a collective failed: the group is unusable, do not drain

    def next(self, cw: ChunkWrite) -> torch.Tensor:
        """The bytes of ``cw`` (a CPU uint8 tensor); chunks must be asked for in schedule order."""
        if self.order[self.pos] is not cw:
            raise RuntimeError(f"chunk of {cw.fqn} asked out of schedule order")
        if cw.rank == self.rw.rank:
            self.pos += 1
            return self.writer._chunk_bytes(cw, self.own[cw.index], self.planner).cpu()
        status = torch.empty(1, dtype=torch.uint8, device=self.device)
        try:
            dist.recv(status, group=self.writer.process_group, group_src=cw.rank)
            if int(status.item()) != _STATUS_OK:
                self.pos += 1
                raise _RemoteChunkError(f"rank {cw.rank} could not produce its chunk of {cw.fqn!r} (see its error)")
            buf = torch.empty(cw.nbytes, dtype=torch.uint8, device=self.device)
            dist.recv(buf, group=self.writer.process_group, group_src=cw.rank)
        except _RemoteChunkError:
            raise
        except BaseException:
            self.broken = True
            raise
        self.pos += 1
        return buf.cpu()

    def drain(self, cause: BaseException) -> None:
        """After a failure: receive (and drop) every chunk still due, so senders do not block until timeout."""
        if self.broken:
            return
        try:
            for cw in self.order[self.pos :]:
                if cw.rank == self.rw.rank:
                    continue
                status = torch.empty(1, dtype=torch.uint8, device=self.device)
                dist.recv(status, group=self.writer.process_group, group_src=cw.rank)
                if int(status.item()) == _STATUS_OK:
                    scratch = torch.empty(cw.nbytes, dtype=torch.uint8, device=self.device)
                    dist.recv(scratch, group=self.writer.process_group, group_src=cw.rank)
        except Exception as exc:  # noqa: BLE001 - the original failure is what the caller raises
            cause.__context__ = exc
        finally:
            self.pos = len(self.order)


def _write_tensor(out: Any, ts: TensorSchedule, source: _ChunkSource) -> None:
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
