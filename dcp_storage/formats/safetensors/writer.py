"""``SafetensorsWriter``: a DCP ``StorageWriter`` that saves Hugging Face safetensors checkpoints directly.

``dcp.save(state_dict, storage_writer=SafetensorsWriter(url))`` writes ``model.safetensors`` (or
``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``) that
``safetensors.torch.load_file`` and ``transformers``' ``from_pretrained`` read as they are: full,
consolidated tensors, even when the state dict holds DTensor shards spread over many ranks. There is no
second consolidation pass and no rank ever holds the whole model.

This module is the writer protocol: checks, planning (:mod:`dcp_storage.formats.safetensors.write_plan`),
the claim, and results. How bytes reach storage is chosen per filesystem, not by a flag: positioned writes
on local disks (:mod:`.safetensors_local`), or one atomic upload per file streamed by the coordinator
(:mod:`.safetensors_stream`), fed over the process group by :mod:`dcp_storage.formats.safetensors.chunk_exchange`.

Checksums (on by default): every file's header ``__metadata__`` records the writer, the algorithm, a digest
of every chunk's bytes and one of the header itself (:mod:`dcp_storage.formats.safetensors.checksums` says why
per chunk). Headers are planned with zero-filled digests of fixed width and filled in without moving a
byte: in ``finish`` on local disks, before any upload on object stores (each mode's module says how).
A sidecar file was the alternative, but it would split one file's integrity over two objects that can drift
apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.commit_claim import ClaimingWriter, refuse_existing, retire_safetensors
from dcp_storage.formats.dcp_native.reader import _is_fsspec_url
from dcp_storage.formats.location import SavingLocation, remove_stale_temp_files
from dcp_storage.formats.paths import EXTRA_STATE_FILE, LOCK_FILE, check_prefix, index_name, single_name
from dcp_storage.formats.safetensors.chunk_exchange import ChunkSource, exchange_digests, send_chunks
from dcp_storage.formats.safetensors.encode import header_metadata, tensor_bytes
from dcp_storage.formats.safetensors.reader import (
    commit_files,
    create_temp_files,
    fill_headers,
    pwrite_chunks,
    stream_files,
    temp_path,
)
from dcp_storage.formats.safetensors.write_plan import (
    ChunkWrite,
    PieceKey,
    RankWrites,
    SavePlanResult,
    local_order,
    parse_size,
    plan_save,
)
from dcp_storage.formats.writing import write_error
from dcp_storage.integrity.checksums import DEFAULT_ALGORITHM, check_algorithm
from dcp_storage.strategies.collectives import GroupView, group_view, load_group
from dcp_storage.strategies.rank_agreement import guard_finish_plan
from dcp_storage.transports import Transport, TransportConfig
from dcp_storage.transports.access import prepare_output

__all__ = ["EXTRA_STATE_FILE", "SafetensorsWriter"]


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


class SafetensorsWriter(ClaimingWriter, SavingLocation, StorageWriter):
    """Save a DCP state dict as Hugging Face safetensors on a local path or any fsspec URL.

    Args:
        path: output directory (local path or fsspec URL such as ``s3://bucket/model``).
        storage_options: passed to the fsspec filesystem.
        max_shard_size: data bytes per file, an int or a string like ``"500MB"``/``"5GB"`` (powers of 10)
            or ``"2GiB"`` (powers of 2). Everything fits: one ``{prefix}.safetensors``. Otherwise:
            ``{prefix}-0000k-of-0000N.safetensors`` plus ``{prefix}.safetensors.index.json``. A tensor larger
            than the limit gets a file of its own (as in ``huggingface_hub``).
        overwrite: ``False`` (the default) refuses a directory that already holds ``{prefix}.safetensors``
            or the index, or that another save holds (running, or interrupted before its commit: see
            :mod:`~dcp_storage.formats.commit_claim`), with :class:`~dcp_storage.errors.CheckpointExistsError`: of
            two concurrent saves exactly one succeeds. ``True`` replaces the old files: they stay loadable
            until the new ones are committed, then go (README, "overwrite=True": what a sharded save over
            the same shard names cannot keep); stale temp files of an interrupted save are removed first.
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
        process_group: the group of the save (default: the one given to ``dcp.save``, else the default
            group); object-store saves send chunks to its coordinator over it.
        transport_config: concurrency, part size and retry settings.
        transport: an existing transport to share.
        create_bucket: create the URL's bucket (Azure: container) if it does not exist; ``False`` (the
            default) raises :class:`~dcp_storage.errors.BucketNotFoundError` naming it instead.

    How bytes reach storage: local filesystems (shared by all ranks, as for torch's ``FileSystemWriter``)
    get positioned writes into hidden temp files that ``finish`` renames into place, each byte written once
    by the rank that holds it (:mod:`.safetensors_local`); object stores get one atomic upload per file,
    streamed by the coordinator with every rank's chunks sent to it in the planned order, its memory bounded
    by the largest tensor (:mod:`.safetensors_stream`, :mod:`dcp_storage.formats.safetensors.chunk_exchange`). The
    index is written last, so an interrupted save never looks complete; if any rank fails mid-stream, no
    rank waits for the process-group timeout and the current upload is aborted; nor if one fails in its
    planner's ``finish_plan`` (every rank agrees first: :mod:`dcp_storage.strategies.rank_agreement`).
    Without a process group (one process) both paths just write the process's own tensors.

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
    _alone = False  # set by the coordinator's prepare_global_plan: the save's only rank
    _retired = False  # overwrite=True retired the old files before writing (same shard names)

    def __init__(
        self,
        path: str | os.PathLike[str],
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
        self.filename_prefix = check_prefix(filename_prefix)
        self.header_metadata = header_metadata(metadata)
        self.checksum_algorithm = check_algorithm(checksum_algorithm)  # refused before any planning
        self.storage_options = dict(storage_options or {})
        self.overwrite = overwrite
        self.create_bucket = create_bucket
        self.allow_extra_state = allow_extra_state
        self.process_group = process_group
        self.transport_config = transport_config
        self._given_transport = transport
        self._planned: SavePlanResult | None = None
        self._open_save(path)

    # ------------------------------------------------------------------------------------ set-up
    def _path(self, name: str) -> str:
        return self.transport.join(self.root, name)

    def _markers(self) -> list[str]:
        return [self._path(name) for name in (single_name(self.filename_prefix), index_name(self.filename_prefix))]

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._next_save(checkpoint_id)
        self._planned = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_fsspec_url(checkpoint_id)

    # ------------------------------------------------------------------------------------ planning
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        order = local_order(plan, allow_extra_state=self.allow_extra_state)  # refuses what safetensors cannot hold
        if (
            not self.transport.is_local
        ):  # write_data streams chunks over the group: no rank may fail in finish_plan alone
            guard_finish_plan(_streams, _check_streamed_plan, group=self.process_group)
        if self.is_coordinator:
            prepare_output(self.transport, self.root, coordinator=True, create_bucket=self.create_bucket)
            if not self.overwrite:
                refuse_existing(self.transport, self._markers())  # early: the claim decides
        return self._locate_plan(dataclasses.replace(plan, storage_data=order))  # type: ignore[no-any-return]

    def _coordinator_index(self, n_plans: int) -> int:
        if n_plans == 1:
            return 0
        return self.rank if self.rank is not None else self._view().rank

    def _view(self) -> GroupView:
        """The save's group: the writer's ``process_group``, else the one ``dcp.save`` was given."""
        return group_view(load_group(self.process_group))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = self._check_plan_locations(plans)
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
        # Claim the location before any rank writes (see .claim); the old files stay until the commit where
        # the new names allow it (the class docstring: what overwrite=True keeps).
        with self._claimed(self._path(LOCK_FILE), self._markers()):  # released if this fails: nothing written yet
            self._alone = len(plans) == 1
            self._retired = False
            if self.overwrite:
                self._retired = self._prepare_overwrite(planned)
            if mode == "pwrite":
                try:
                    create_temp_files(self.transport, self.root, planned, self.save_id)
                except Exception as exc:
                    raise _write_error(exc, self.transport.url(self.root), sum(f.size for f in planned.files))
        self._planned = planned
        return [dataclasses.replace(p, storage_data=rw) for p, rw in zip(plans, planned.rank_writes)]

    def _prepare_overwrite(self, planned: SavePlanResult) -> bool:
        """Remove a killed save's temp files; retire the old checkpoint now only if the new files would be
        written over its files one by one (a sharded save with the same shard names). Returns whether it did."""
        prefix = self.filename_prefix
        names = set(self.transport.listdir(self.root))
        if planned.sharded and any(f.name in names for f in planned.files):
            retire_safetensors(self.transport, self.root, prefix, index_name(prefix), EXTRA_STATE_FILE)
            return True
        remove_stale_temp_files(self.transport, self.root)
        return False

    # ------------------------------------------------------------------------------------ writing
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rw = _rank_writes(plan)
        results: list[WriteResult] = []
        tensor_items: dict[MetadataIndex, WriteItem] = {}
        early: BaseException | None = None  # in stream mode, raised only after the exchange (no rank may hang)
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                tensor_items[item.index] = item
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

        def chunk_bytes(cw: ChunkWrite) -> torch.Tensor:
            return self._chunk_bytes(cw, tensor_items[cw.index], planner)

        digests: dict[MetadataIndex, str] = {}
        if rw.mode == "pwrite":
            try:
                digests = pwrite_chunks(
                    self.transport, self.root, rw, tensor_items, chunk_bytes, self.checksum_algorithm
                )
            except Exception as exc:
                if self._alone and self._planned is not None and isinstance(exc, OSError):  # nothing may stay
                    self._abandon(self._planned)
                raise _write_error(exc, self.transport.url(self.root), sum(c.nbytes for c in rw.chunks.values()))
        else:
            view = self._view()
            all_digests = None
            if self.checksum_algorithm is not None:
                all_digests = exchange_digests(view, rw, chunk_bytes, self.checksum_algorithm, early)
            if rw.rank == rw.coordinator:
                early = early or self._claim_lost()  # taken over: upload nothing over the other save's files
                source = ChunkSource(view, rw, chunk_bytes)
                try:
                    stream_files(self.transport, self.root, rw, self._planned, source, early, all_digests)
                except BaseException as exc:
                    if self._alone and self._planned is not None and isinstance(exc, OSError):
                        self._abandon(self._planned)  # the upload was aborted: only the lock is left
                    raise
            else:
                send_chunks(view, rw, chunk_bytes, early)
        for item in tensor_items.values():
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

    # ------------------------------------------------------------------------------------ finishing
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        planned = self._planned
        if planned is None:
            raise DcpStorageError("SafetensorsWriter.finish called without prepare_global_plan on this writer")
        self._confirm_claim()  # another save took the location over: it commits, not this one
        written = [wr.storage_data for rank in results for wr in rank]
        extra = {sd.fqn: sd.data for sd in written if isinstance(sd, _ExtraState)}
        try:
            if extra:
                buf = io.BytesIO()
                torch.save(extra, buf)
                self.transport.write_file(self._path(EXTRA_STATE_FILE), buf.getbuffer())
            if self.transport.is_local:
                if self.checksum_algorithm is not None:
                    digests = {sd.key: sd.digest for sd in written if isinstance(sd, _ChunkDigest)}
                    fill_headers(self.transport, self.root, planned, self.save_id, digests)
                commit_files(self.transport, self.root, planned, self.save_id)
            if planned.sharded:
                self.transport.write_file(self._path(index_name(self.filename_prefix)), planned.index_json())
        except Exception as exc:
            self._abandon(planned)
            raise _write_error(exc, self.transport.url(self.root))  # its cause is set there
        if self.overwrite and not self._retired:  # the new files are in place: the old ones go
            kept = [f.name for f in planned.files]
            kept += [index_name(self.filename_prefix)] if planned.sharded else []
            kept += [EXTRA_STATE_FILE] if extra else []
            prefix = self.filename_prefix
            retire_safetensors(self.transport, self.root, prefix, index_name(prefix), EXTRA_STATE_FILE, kept)
        self._planned = None
        self._release_claim()

    def _abandon(self, planned: SavePlanResult) -> None:
        """After a failure (on the coordinator): remove this save's temp files, then release its lock.

        Best effort: a temp file that cannot be removed is a leftover the next ``overwrite=True`` save removes.
        """
        if self.transport.is_local:
            for f in planned.files:
                with contextlib.suppress(Exception):
                    self.transport.remove(temp_path(self.transport, self.root, f.name, self.save_id))
        self._planned = None
        self._release_claim()


def _write_error(exc: BaseException, url: str, needed: int | None = None) -> BaseException:
    """:func:`~dcp_storage.formats.writing.write_error`, keeping ``exc`` as the cause of a new error."""
    error = write_error(exc, url, needed)
    if error is not exc:
        error.__cause__ = exc
    return error


def _rank_writes(plan: SavePlan) -> RankWrites:
    rw = plan.storage_data
    if not isinstance(rw, RankWrites):
        raise DcpStorageError(
            "SafetensorsWriter.write_data got a plan its prepare_global_plan did not make "
            f"(storage_data is {type(rw).__name__}); DCP plan caching is not supported"
        )
    return rw


def _streams(central_plan: SavePlan) -> bool:
    """Whether ``write_data`` exchanges chunks over the group (a streamed save of more than one rank)."""
    rw = central_plan.storage_data
    return isinstance(rw, RankWrites) and rw.mode == "stream" and rw.world > 1


def _check_streamed_plan(central: SavePlan, final: SavePlan, view: GroupView) -> None:
    """After ``finish_plan``: ``write_data`` can follow the plan (else it would fail before the exchange)."""
    _rank_writes(final)
