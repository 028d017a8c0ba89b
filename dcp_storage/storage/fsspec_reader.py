"""``FsspecReader``: a drop-in DCP ``StorageReader`` for the native layout on any fsspec URL.

Call order (torch's ``dcp.load`` drives it; every rank calls every step unless noted):

1. ``reset(checkpoint_id)`` - point at a checkpoint (also done by the constructor).
2. ``read_metadata()`` - reads ``.metadata`` through an allow-list unpickler; never runs code from it.
3. ``set_up_storage_reader(metadata, is_coordinator)`` - keeps the storage map; with torch's planners,
   reports key mismatches as :class:`~dcp_storage.planners.IncompatibleKeysError`
   (:mod:`dcp_storage.planners.key_check`).
4. ``prepare_local_plan`` / ``prepare_global_plan`` (coordinator only) - unchanged plans.
5. ``read_data(plan, planner)`` - fetches only the byte ranges of this rank's plan, coalesced and
   concurrent, and writes them straight into the destination tensors where it can.

Compared with torch's ``FileSystemReader``/``FsspecReader`` (which read each saved chunk whole and then
narrow it, one item at a time), a rank reads only the bytes it needs: when resharding, each byte once.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointNotFoundError
from ..formats.completeness import find_leftovers
from ..formats.dcp_native.item_loader import DcpItemLoader, ItemLoaderConfig
from ..formats.dcp_native.metadata_io import METADATA_FILE, load_metadata
from ..formats.limits import METADATA, read_limited
from ..formats.misdirected import raise_explained
from ..integrity.dcp_manifest import record_verifier
from ..planners.key_check import check_planned_keys
from ..strategies.dcp_call import running_planner
from ..transports import Transport, TransportConfig
from .location import BoundLocation

__all__ = ["FsspecReader"]


class FsspecReader(BoundLocation, StorageReader):
    """Read a DCP checkpoint (``.metadata`` + ``*.distcp``) from a local path or any fsspec URL.

    Args:
        path: checkpoint directory: ``/local/dir``, ``file://...``, ``memory://...``, ``s3://bucket/key``,
            ``gs://...``, or anything fsspec resolves.
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
        transport_config: concurrency, coalescing, in-flight and retry settings.
        loader_config: header probe size, staging limit (see :class:`ItemLoaderConfig`).
        extension_registry: torch stream extensions for items saved with ``_extensions``; not needed for
            torch's own (``stream.zstd``) nor for extension plugins (the ``dcp_storage.extensions``
            entry-point group), which are found when an item names them. Items stored through a seekable
            transform (``dcp-storage-zstd``) that a rank needs only part of are read frame by frame.
        transport: an existing transport to share (its counters then add up across readers).
        verify: check every record this rank reads against the checksum our writer recorded for it in
            ``.dcp_storage.json`` (records are then fetched whole, even when resharding), raising
            :class:`~dcp_storage.errors.CorruptCheckpointError` naming the URL, byte range and keys on a
            mismatch. Checkpoints without recorded checksums (torch's writers) load unchecked, with a warning.
            Every record read whole also gets its zip layout and CRC32s checked.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        transport_config: TransportConfig | None = None,
        loader_config: ItemLoaderConfig | None = None,
        extension_registry: ExtensionRegistry | None = None,
        transport: Transport | None = None,
        verify: bool = False,
    ) -> None:
        super().__init__()
        self.verify = verify
        self.storage_options = dict(storage_options or {})
        self.transport_config = transport_config
        self.loader_config = loader_config or ItemLoaderConfig()
        self.extension_registry = extension_registry
        self._given_transport = transport
        self.storage_data: dict[Any, Any] = {}
        self.metadata: Metadata | None = None
        self.load_id = uuid.uuid4().hex
        self._open(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self.metadata = None
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._open(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        path = self.transport.join(self.root, name)
        try:
            data = read_limited(self.transport, path, METADATA)
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
        metadata = load_metadata(data, self.transport.url(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointNotFoundError(f"{self.path}: metadata carries no storage map")
        check_planned_keys(running_planner(), metadata)
        self.storage_data = metadata.storage_data
        self.metadata = metadata  # chunk sizes: whole-chunk vs partial reads of framed (compressed) items
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        verifier = record_verifier(self.transport, self.root, self.storage_data) if self.verify else None
        loader = DcpItemLoader(
            self.transport,
            self.root,
            self.storage_data,
            self.loader_config,
            self.extension_registry,
            verifier,
            metadata=self.metadata,
            check_zips=self.verify,
        )
        loader.load(plan.items, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_fsspec_url(checkpoint_id)


def _is_fsspec_url(checkpoint_id: str | os.PathLike[str]) -> bool:
    import fsspec

    try:
        fsspec.core.url_to_fs(os.fspath(checkpoint_id))
    except (ValueError, ImportError, TypeError):
        return False
    return True
