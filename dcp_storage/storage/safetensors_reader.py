"""``SafetensorsReader``: a drop-in DCP ``StorageReader`` for safetensors checkpoints on any fsspec URL.

Reads a single ``.safetensors`` file, a directory of them, a Hugging Face ``model.safetensors.index.json``
(sharded ``save_pretrained`` output), torch's ``HuggingFaceStorageWriter`` output (with or without
``save_distributed``) and torch's ``FileSystemWriter(serialization_format=SAFETENSORS)`` output, into any
state dict ``dcp.load`` accepts: plain tensors, or DTensors resharded any way. See
:mod:`dcp_storage.formats.safetensors.layout` for how each layout is recognised.

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
import uuid
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_storage import errors
from dcp_storage.errors import CheckpointNotFoundError
from dcp_storage.formats.misdirected import raise_explained
from dcp_storage.formats.safetensors.checksums import FileSums
from dcp_storage.formats.safetensors.layout import INDEX_FILE, SUFFIX, discover
from dcp_storage.formats.safetensors.loader import SafetensorsItemLoader, SafetensorsLoaderConfig
from dcp_storage.formats.safetensors.scan import SafetensorsScanConfig, scan_metadata
from dcp_storage.planners.key_check import check_planned_keys
from dcp_storage.storage.location import BoundLocation
from dcp_storage.storage.metadata_fallback import MetadataFailure
from dcp_storage.strategies.dcp_call import running_planner
from dcp_storage.strategies.metadata_sharing import reader_location, share_object
from dcp_storage.strategies.read_strategy import READ_STRATEGY_OPTION, MetadataItems, ReadStrategy, choose_read_strategy
from dcp_storage.transports import Transport, TransportConfig
from dcp_storage.transports.versions import begin_load

__all__ = ["SafetensorsReader"]


class SafetensorsReader(BoundLocation, StorageReader):
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
            caller then reads the headers itself anyway (see :mod:`dcp_storage.strategies.dcp_call`). It is
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
        self._strategy_choice = (read_strategy, self.storage_options.pop(READ_STRATEGY_OPTION, None))
        self._sums: dict[str, FileSums] = {}  # under verify: each file's header checksums, read with the metadata
        self._stored: MetadataItems | None = None
        self.transport_config = transport_config
        self.scan_config = scan_config or SafetensorsScanConfig()
        self.loader_config = loader_config or SafetensorsLoaderConfig()
        self.process_group = process_group
        self.coordinator_rank = coordinator_rank
        self.broadcast_metadata = broadcast_metadata
        self.verify = verify
        self._given_transport = transport
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex
        self.metadata_failure = MetadataFailure()
        self._open(path)

    def _open(self, url: str | os.PathLike[str]) -> None:
        super()._open(url)
        self.target = self.root  # what the user named; root becomes the layout's root once metadata is read
        self.read_strategy = choose_read_strategy(*self._strategy_choice, is_local=self.transport.is_local)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self._stored = None
        self._sums = {}
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._open(checkpoint_id)
        begin_load(self.transport)  # each object pinned anew to the version this load sees first
        self.load_id = uuid.uuid4().hex

    # ---------------------------------------------------------------------------------------- metadata
    def _scan(self) -> tuple[str, Metadata, dict[str, FileSums]]:
        """The layout's root, its metadata and, under ``verify``, each file's header checksums (from the same
        header bytes: a header is fetched once per load)."""
        try:
            layout = discover(self.transport, self.target)
            found: dict[Any, Any] | None = {} if self.verify is not False else None
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
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointNotFoundError(f"{self.path}: metadata carries no storage map")
        check_planned_keys(running_planner(), metadata)
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self._stored = MetadataItems(metadata, lambda item: self.verify is not True)  # checked tensors are read whole

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.read_strategy.local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self._stored is None:
            return plans
        return self.read_strategy.global_plan(plans, self._stored)

    # -------------------------------------------------------------------------------------------- data
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        loader = SafetensorsItemLoader(
            self.transport, self.root, self.storage_data, self.loader_config, verify=self.verify, known_sums=self._sums
        )
        if self._stored is None:
            loader.load(plan.items, planner)
        else:
            self.read_strategy.read(plan, planner, loader.load, self._stored)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Only URLs that name a safetensors file or index; directories are ambiguous without I/O."""
        text = os.fspath(checkpoint_id)
        return text.endswith((SUFFIX, INDEX_FILE))
