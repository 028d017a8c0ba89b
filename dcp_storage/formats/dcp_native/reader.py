"""``FsspecReader``: a drop-in DCP ``StorageReader`` for the native layout on any fsspec URL.

torch's rank-local metadata fallback, made to fail once.

``dcp.load`` first calls ``reader.read_metadata()``; if that raises, it logs a traceback ("Global metadata is
not found. Falling back to rank local metadata."), calls ``reader.read_metadata(rank=r)`` (for checkpoints
saved without collectives, which write ``__r.metadata``), and when that fails too raises one
``AssertionError("metadata is None; global metadata read failed: X; rank local metadata read failed: Y")``
where X and Y are, for a bad password or a missing bucket, the same message twice (with a second logged
traceback).

A reader records its global failure (:class:`MetadataFailure`), and the fallback tries the rank-local file
only when the global one was simply missing; when it is missing too, or the global read failed otherwise,
the fallback returns ``None``, which torch takes as "no metadata" and reports with the global error alone.
``dcp_storage.load`` (:mod:`dcp_storage.opening`) then raises the recorded error itself.

``FsspecReader``: a drop-in DCP ``StorageReader`` for the native layout on any fsspec URL.

Call order (torch's ``dcp.load`` drives it; every rank calls every step unless noted):

1. ``reset(checkpoint_id)`` - point at a checkpoint (also done by the constructor).
2. ``read_metadata()`` - reads ``.metadata`` through an allow-list unpickler; never runs code from it.
   Inside a distributed ``dcp.load`` one rank reads it (with the manifest when ``verify``) and every rank
   gets it, or that rank's error, over the load's process group: one request per load, whatever the world
   size. torch's per-rank fallback (``read_metadata(rank=r)``, ``__r.metadata`` of a save without
   collectives) is read by each rank alone, as is any call outside ``dcp.load``.
3. ``set_up_storage_reader(metadata, is_coordinator)`` - keeps the storage map; with torch's planners,
   reports key mismatches as :class:`~dcp_storage.planners.IncompatibleKeysError`
   (:mod:`dcp_storage.planners.planner`).
4. ``prepare_local_plan`` / ``prepare_global_plan`` (coordinator only) - the read strategy's: with
   ``read_once`` (the default on object stores) the coordinator assigns every stored slice that several
   ranks need to one of them (see :mod:`dcp_storage.strategies.read_strategy`).
5. ``read_data(plan, planner)`` - fetches only the byte ranges of this rank's plan (its share of them,
   under ``read_once``, receiving the rest over the process group), coalesced and concurrent, and writes
   them straight into the destination tensors where it can.

Compared with torch's ``FileSystemReader``/``FsspecReader`` (which read each saved chunk whole and then
narrow it, one item at a time), a rank reads only the bytes it needs: when resharding, each byte once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_storage._torch import ExtensionRegistry
from dcp_storage.errors import BucketNotFoundError, CheckpointNotFoundError, IncompleteCheckpointError
from dcp_storage.formats.columns import columns_of
from dcp_storage.formats.dcp_native.item_loader import DcpItemLoader, DcpLoaderConfig
from dcp_storage.formats.dcp_native.manifest_io import default_sums, read_checked_manifest, record_verifier
from dcp_storage.formats.dcp_native.native import METADATA_FILE, load_metadata, read_metadata_file
from dcp_storage.formats.location import LoadingLocation, find_leftovers, raise_explained
from dcp_storage.formats.paths import METADATA, read_limited
from dcp_storage.integrity.manifest import manifest_bytes
from dcp_storage.planners.planner import check_planned_keys
from dcp_storage.strategies.collectives import reader_location, running_planner, share_within_load
from dcp_storage.strategies.read_strategy import MetadataItems, ReadStrategy, StrategyReading
from dcp_storage.transports import ClientSetUp, Transport, TransportConfig

__all__ = ["FsspecReader", "MetadataFailure"]


T = TypeVar("T")


class MetadataFailure:
    """What the last global ``read_metadata()`` of one reader raised (``error``), for the fallback to see."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def global_read(self, read: Callable[[], T]) -> T:
        """``read()``, remembering its error (``None`` after a success)."""
        try:
            value = read()
        except Exception as exc:
            self.error = exc
            raise
        self.error = None
        return value

    def rank_read(self, read: Callable[[], T]) -> T | None:
        """torch's fallback: ``read()`` if the global metadata was only missing, else ``None`` (reported once)."""
        first = self.error
        if first is not None and not _only_missing(first):
            return None
        try:
            return read()
        except CheckpointNotFoundError:
            if first is None:
                raise  # a direct call (not torch's fallback): the caller asked for this rank's file
            return None


def _only_missing(exc: Any) -> bool:
    """A missing ``.metadata`` (a rank-local one may exist): not an interrupted save, a missing bucket, or else."""
    return isinstance(exc, CheckpointNotFoundError) and not isinstance(
        exc, (IncompleteCheckpointError, BucketNotFoundError)
    )


class FsspecReader(LoadingLocation, StorageReader):
    """Read a DCP checkpoint (``.metadata`` + ``*.distcp``) from a local path or any fsspec URL.

    Args:
        path: checkpoint directory: ``/local/dir``, ``file://...``, ``memory://...``, ``s3://bucket/key``,
            ``gs://...``, or anything fsspec resolves.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        transport_config: concurrency, coalescing, in-flight and retry settings.
        loader_config: header probe size, staging limit (see :class:`DcpLoaderConfig`).
        extension_registry: torch stream extensions for items saved with ``_extensions``; not needed for
            torch's own (``stream.zstd``) nor for extension plugins (the ``dcp_storage.extensions``
            entry-point group), which are found when an item names them. Items stored through a seekable
            transform (``dcp-storage-zstd``) that a rank needs only part of are read frame by frame.
        transport: an existing transport to share (its counters then add up across readers).
        read_strategy: who fetches stored bytes that several ranks need: a
            :class:`~dcp_storage.strategies.ReadStrategy` or its name (``"per_rank"``, ``"read_once"``,
            ``"per_host"``); default: the ``"read_strategy"`` storage option, else ``read_once`` on object
            stores and ``per_rank`` on local files.
        verify: ``None`` (the default) checks every byte the load delivers against what the checkpoint
            carries, reading no more than the ranks need: a record read whole against its digest in
            ``.dcp_storage.json`` (or its zip CRC-32s), a slice against the block digests that cover it (reading
            at most a block more on each side), a whole tensor of a checkpoint without block digests (torch's
            writer) against its zip CRC-32; only a slice of such a checkpoint is delivered unchecked (the debug
            log says so). A manifest that does not describe the ``.metadata`` (another writer saved over the
            checkpoint) is ignored with one warning; one of an older dcp-storage, which records no digest of
            the ``.metadata``, is used only with ``verify=True``. ``True``: every record this rank reads is
            fetched whole (even when resharding) and checked against its recorded checksum; checkpoints
            without recorded checksums load with a warning, their records' zip CRC-32s checked. ``False``:
            nothing is checked. A mismatch raises :class:`~dcp_storage.errors.CorruptCheckpointError` naming
            the URL, byte range, keys and what to do.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        transport_config: TransportConfig | None = None,
        loader_config: DcpLoaderConfig | None = None,
        extension_registry: ExtensionRegistry | None = None,
        transport: Transport | None = None,
        verify: bool | None = None,
        read_strategy: ReadStrategy | str | None = None,
    ) -> None:
        super().__init__()
        self.verify = verify
        self.storage_options = dict(storage_options or {})
        self._reading = StrategyReading(read_strategy, self.storage_options)  # takes the storage option out
        self.transport_config = transport_config
        self.loader_config = loader_config or DcpLoaderConfig()
        self.extension_registry = extension_registry
        self._given_transport = transport
        self.storage_data: dict[Any, Any] = {}
        self.metadata: Metadata | None = None
        self._manifest: Any = _UNREAD
        self.metadata_failure = MetadataFailure()
        self._open_load(path)

    def _open(self, path: str | os.PathLike[str]) -> None:
        super()._open(path)
        self._reading.choose(self.transport.is_local)

    @property
    def read_strategy(self) -> ReadStrategy:
        return self._reading.strategy

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self.metadata = None
        self._manifest = _UNREAD
        self._reading.reset()
        self._next_load(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:  # torch's fallback after the global read failed: this rank's own file
            found = self.metadata_failure.rank_read(lambda: self._read_metadata_file(f"__{rank}{METADATA_FILE}"))
            if found is None:  # torch then reports the global failure alone (see metadata_fallback)
                return None  # type: ignore[return-value]
            metadata = found
        else:
            if isinstance(self.transport, ClientSetUp):  # the other ranks build theirs while one reads
                self.transport.set_up_client()
            metadata, manifest = self.metadata_failure.global_read(
                lambda: share_within_load(
                    self._read_per_load_files, location=reader_location(self), kind=type(self).__name__
                )
            )
            self._manifest = manifest[0] if manifest else _UNREAD
        return self._stamp_load(metadata)

    def _read_per_load_files(self) -> tuple[Metadata, tuple[Any, ...]]:
        """``.metadata``, and ``((manifest, stale),)`` unless ``verify=False``: what one rank reads for all."""
        raw: list[bytes] = []
        if self.verify is False:
            return self._read_metadata_file(METADATA_FILE, raw), ()
        transport, root = self.transport, self.root
        # On an object store the manifest is fetched while .metadata is: one round trip instead of two.
        early = None if transport.is_local else transport.executor().submit(manifest_bytes, transport, root)
        try:
            metadata = self._read_metadata_file(METADATA_FILE, raw)
        except BaseException:
            if early is not None:
                wait([early])  # not left running once the load has failed
            raise
        found = manifest_bytes(transport, root) if early is None else early.result()
        return metadata, (read_checked_manifest(transport, root, raw[0], strict=self.verify is True, raw=found),)

    def _read_metadata_file(self, name: str, raw: list[bytes] | None = None) -> Metadata:
        path = self.transport.join(self.root, name)
        try:
            if raw is not None:  # the caller keeps the bytes (the manifest records their digest)
                raw.append(bytes(read_limited(self.transport, path, METADATA)))
                return load_metadata(raw[-1], self.transport.url(path))
            return read_metadata_file(self.transport, path)
        except (CheckpointNotFoundError, NotADirectoryError) as exc:  # NotADirectory: the URL is a file
            leftovers = find_leftovers(self.transport, self.root)  # an interrupted save: say so
            if leftovers is not None:
                raise leftovers.error() from exc
            missing = CheckpointNotFoundError(
                f"{self.transport.url(path)}: no checkpoint metadata; the checkpoint does not exist or its save "
                "did not complete (metadata is written last)"
            )
            # A missing bucket, or another format at the URL (a safetensors file, an HF directory): say which.
            raise_explained(self.transport, self.root, "dcp", "FsspecReader", exc, missing)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointNotFoundError(f"{self.path}: metadata carries no storage map")
        check_planned_keys(running_planner(), metadata)
        self.storage_data = metadata.storage_data
        self.metadata = metadata  # chunk sizes: whole-chunk vs partial reads of framed (compressed) items
        self.is_coordinator = is_coordinator
        # torch's per-rank fallback (``use_collectives=False``): each rank's metadata describes other files,
        # so equal storage indices of two ranks are not the same bytes: every rank reads its own. The global
        # read fails on every rank at once (it is shared), so all ranks fall back together.
        rank_local = kwargs.get("use_collectives") is False
        self._reading.set_up(None if rank_local else MetadataItems(metadata, self._splittable))

    def _splittable(self, item: ReadItem) -> bool:
        """Row blocks of a record can be fetched alone unless it is checked or decoded whole."""
        if self.verify is True:
            return False
        cols = columns_of(self.metadata)
        if cols is not None and not cols.transforms:  # no record is decoded whole: no entry to look up
            return True
        info = self.storage_data.get(item.storage_index)
        return not getattr(info, "transform_descriptors", None)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self._reading.local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self._reading.global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        verifier = sums = None
        if self.verify is True:
            known: dict[str, Any] = {}
            if self._manifest is not _UNREAD:
                known = {"manifest": self._manifest[0], "warn": not self._manifest[1]}  # stale: warned already
            verifier = record_verifier(self.transport, self.root, self.storage_data, **known)
        elif self.verify is None and self._manifest is not _UNREAD:
            sums = default_sums(self.transport, self.root, self.storage_data, self._manifest[0])
        loader = DcpItemLoader(
            self.transport,
            self.root,
            self.storage_data,
            self.loader_config,
            self.extension_registry,
            verifier,
            metadata=self.metadata,
            check_zips=self.verify is not False,
            sums=sums,
        )
        return self._reading.read(plan, planner, loader.load)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_fsspec_url(checkpoint_id)


_UNREAD = object()  # the manifest was not read with the metadata: read_data reads it if it needs it


def _is_fsspec_url(checkpoint_id: str | os.PathLike[str]) -> bool:
    import fsspec

    try:
        fsspec.core.url_to_fs(os.fspath(checkpoint_id))
    except (ValueError, ImportError, TypeError):
        return False
    return True
