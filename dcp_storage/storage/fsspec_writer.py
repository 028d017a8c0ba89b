"""``FsspecWriter``: a drop-in DCP ``StorageWriter`` for the native layout on any fsspec URL.

Output is byte-compatible with torch's ``FileSystemWriter``: ``__{rank}_{n}.distcp`` files of
``torch.save`` records and a pickled ``.metadata`` (so torch's readers load it, and ours load torch's).

Call order (torch's ``dcp.save`` drives it):

1. ``reset(checkpoint_id)``, ``set_up_storage_writer(is_coordinator)`` - every rank.
2. ``prepare_local_plan`` - every rank; refuses an existing checkpoint unless ``overwrite=True`` (early:
   the claim in step 3 decides).
3. ``prepare_global_plan`` - coordinator only, *before* any rank writes data. It claims the location
   (:mod:`~dcp_storage.storage.claim`: the lock ``.dcp_storage.lock``, created only if absent, so of two
   concurrent ``overwrite=False`` saves exactly one goes on and the other raises ``CheckpointExistsError``
   having written nothing). With ``overwrite=True`` it then retires the old checkpoint: its ``.metadata``
   first (a crash can never leave old metadata pointing at new files), then its data files.
4. ``write_data`` - every rank; ``thread_count`` files written concurrently, each committed atomically.
5. ``finish`` - coordinator only; writes the manifest ``.dcp_storage.json`` (format, writer and extension
   descriptors, a checksum of every record, computed while writing), then ``.metadata`` last, atomically
   (one PUT, or temp+fsync+rename), so an interrupted save never looks complete; then removes the lock.

Data files are ``__{rank}_{n}.distcp`` as torch names them, except that an ``overwrite=True`` save to a
location that holds files adds its save id (``__{rank}_{save id}_{n}.distcp``; readers find files through
``.metadata``, torch's too): a file name is never reused for other bytes, so a load that read the old
``.metadata`` and is still running reads the old bytes or finds the file gone (``CheckpointNotFoundError``),
never the new bytes under the old metadata.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..formats.completeness import DATA_SUFFIX
from ..formats.dcp_native.metadata_io import METADATA_FILE, dump_metadata
from ..formats.dcp_native.spec import FORMAT as DCP_FORMAT
from ..formats.dcp_native.transform_write import ItemEncoder
from ..integrity.checksums import DEFAULT_ALGORITHM, HashingWriter, digest_width
from ..integrity.dcp_manifest import build_manifest
from ..integrity.manifest import MANIFEST_FILE
from ..integrity.write_results import ChecksummedStorage, unwrap_results
from ..transports import Transport, TransportConfig
from ..transports.buckets import prepare_output
from .claim import ClaimingWriter, lock_name, refuse_existing
from .fsspec_reader import _is_fsspec_url
from .location import BoundLocation
from .retire import retire_dcp

__all__ = ["FsspecWriter"]

DCP_VERSION = "1.0.0"
_SAVE_TAG = 12  # hex digits of the save id in the data file names of an overwrite=True save over files


class FsspecWriter(ClaimingWriter, BoundLocation, StorageWriter):
    """Write a DCP checkpoint to a local path or any fsspec URL.

    Args:
        path: checkpoint directory or URL.
        storage_options: passed to the fsspec filesystem.
        thread_count: files written concurrently by each rank (one thread each).
        single_file_per_rank: ``True`` writes ``thread_count`` files per rank; ``False`` one per item.
        overwrite: ``False`` (the default) refuses a path that already holds a complete checkpoint, or
            that another save holds (running, or interrupted before its commit), with
            :class:`~dcp_storage.errors.CheckpointExistsError`; of two concurrent saves to one path exactly
            one succeeds. ``True`` replaces whatever is there.
        transport_config: concurrency, part size and retry settings.
        transport: an existing transport to share.
        extensions: torch ``StreamTransformExtension`` objects (compression: ``dcp_storage_zstd.ZstdSeekable()``,
            torch's ``ZStandard()``) every tensor and byte item is written through, recorded in the metadata as
            torch's ``FileSystemWriter(_extensions=...)`` records them (each side reads the other's output).
        checksum_algorithm: checksum of every record, recorded in ``.dcp_storage.json`` (``"xxh3_64"``,
            ``"xxh64"``, ``"crc32c"``, ``"crc32"``; see :mod:`dcp_storage.integrity.checksums`).
        create_bucket: create the URL's bucket (Azure: container) if it does not exist. ``False`` (the
            default) raises :class:`~dcp_storage.errors.BucketNotFoundError` instead, so a typo in a bucket
            name never becomes a new bucket (see :mod:`dcp_storage.transports.buckets`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: dict[str, Any] | None = None,
        *,
        thread_count: int = 2,
        single_file_per_rank: bool = True,
        overwrite: bool = False,
        transport_config: TransportConfig | None = None,
        transport: Transport | None = None,
        checksum_algorithm: str = DEFAULT_ALGORITHM,
        extensions: Sequence[StreamTransformExtension] | None = None,
        create_bucket: bool = False,
    ) -> None:
        super().__init__()
        digest_width(checksum_algorithm)  # refuses an unknown algorithm before any planning
        self.checksum_algorithm = checksum_algorithm
        self._encoder = ItemEncoder(extensions)  # refuses a non-extension before any planning
        self.extensions = self._encoder.extensions
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.storage_options = dict(storage_options or {})
        self.thread_count = thread_count
        self.single_file_per_rank = single_file_per_rank
        self.overwrite = overwrite
        self.create_bucket = create_bucket
        self.transport_config = transport_config
        self._given_transport = transport
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True
        self.save_id = uuid.uuid4().hex
        self._open(path)

    def _metadata_path(self) -> str:
        name = METADATA_FILE if self.use_collectives or self.rank is None else f"__{self.rank}{METADATA_FILE}"
        return self.transport.join(self.root, name)

    def _manifest_path(self) -> str:
        name = MANIFEST_FILE if self.use_collectives or self.rank is None else f"__{self.rank}{MANIFEST_FILE}"
        return self.transport.join(self.root, name)

    def _rank_local(self) -> bool:
        return self.rank is not None and not self.use_collectives

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._open(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _shadowing_metadata_paths(self) -> list[str]:
        """Metadata files that would describe this path after the save: ours, and the global one.

        Loaders read the global ``.metadata`` first and fall back to ``__{rank}.metadata``; a rank-local
        save (``use_collectives=False``) over a collective checkpoint must therefore treat the old global
        file as the existing checkpoint (it would shadow the new one and point at overwritten files).
        """
        return list(dict.fromkeys([self._metadata_path(), self.transport.join(self.root, METADATA_FILE)]))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        checks_bucket = self.is_coordinator or not self.use_collectives  # rank-local saves: each rank on its own
        prepare_output(self.transport, self.root, coordinator=checks_bucket, create_bucket=self.create_bucket)
        if not self.overwrite:
            refuse_existing(self.transport, self._shadowing_metadata_paths())
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator (every rank without collectives) before any rank writes data.
        local_rank = self.rank if self._rank_local() else None
        lock = lock_name(local_rank)
        markers = self._shadowing_metadata_paths()
        self._take_claim(self.transport.join(self.root, lock), markers)
        tag = ""
        if self.overwrite and retire_dcp(self.transport, self.root, markers, local_rank, lock):
            tag = f"{self.save_id[:_SAVE_TAG]}_"  # a location that held files: new names (module docstring)
        ranks = [self.rank] if self._rank_local() else range(len(plans))
        prefixes = [_StoragePrefix(f"__{rank}_{tag}") for rank in ranks]
        return [
            plan if plan.storage_data is not None else dataclasses.replace(plan, storage_data=prefix)
            for prefix, plan in zip(prefixes, plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: str = plan.storage_data.prefix
        if self.single_file_per_rank:
            buckets = [b for b in _split_by_size_and_type(self.thread_count, list(plan.items)) if b]
        else:
            buckets = [[item] for item in plan.items]
        files = [(f"{prefix}{n}{DATA_SUFFIX}", bucket) for n, bucket in enumerate(buckets)]
        results: list[WriteResult] = []
        if len(files) <= 1 or self.thread_count == 1:
            for name, bucket in files:
                results += self._write_file(name, bucket, planner)
        else:
            with ThreadPoolExecutor(min(self.thread_count, len(files)), thread_name_prefix="dcp-storage-write") as pool:
                for part in pool.map(lambda f: self._write_file(f[0], f[1], planner), files):
                    results += part
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """Write one data file; byte items first, then tensors (torch's order), committed atomically."""
        path = self.transport.join(self.root, name)
        results = []
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
            i for i in items if i.type != WriteItemType.BYTE_IO
        ]
        with self.transport.open_atomic(path) as raw:
            stream = HashingWriter(raw, self.checksum_algorithm)  # checksums of the stored bytes, in one pass
            for item in ordered:
                stream.begin()
                offset = stream.tell()
                data = planner.resolve_data(item)
                with self._encoder.open(stream) as out:  # through the extensions, if any
                    if item.type == WriteItemType.BYTE_IO:
                        if not isinstance(data, io.BytesIO):
                            raise TypeError(
                                f"{item.index.fqn}: BYTE_IO item resolved to {type(data).__name__}, expected BytesIO"
                            )
                        out.write(data.getbuffer())
                    else:
                        torch.save(_compact_cpu(data), out)  # type: ignore[arg-type]
                _start, length, digest = stream.end()
                stored = _StorageInfo(name, offset, length, transform_descriptors=self._encoder.descriptors)
                info = ChecksummedStorage(stored, self.checksum_algorithm, digest)
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        storage_md, checksums, algorithms = unwrap_results(results)
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        extensions = getattr(self, "extensions", None) or ()
        manifest = build_manifest(DCP_FORMAT.descriptor, storage_md, checksums, algorithms, extensions)
        self.transport.write_file(self._manifest_path(), manifest.to_json())  # before the commit marker
        self.transport.write_file(self._metadata_path(), dump_metadata(metadata))
        self._release_claim()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_fsspec_url(checkpoint_id)


def _compact_cpu(data: Any) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its elements (``torch.save`` writes whole storages)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"tensor item resolved to {type(data).__name__}")
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor
