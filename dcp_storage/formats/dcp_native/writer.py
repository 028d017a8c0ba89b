"""``FsspecWriter``: a drop-in DCP ``StorageWriter`` for the native layout on any fsspec URL.

Output is byte-compatible with torch's ``FileSystemWriter``: ``__{rank}_{n}.distcp`` files of
``torch.save`` records and a pickled ``.metadata`` (so torch's readers load it, and ours load torch's).

Call order (torch's ``dcp.save`` drives it):

1. ``reset(checkpoint_id)``, ``set_up_storage_writer(is_coordinator)`` - every rank.
2. ``prepare_local_plan`` - every rank; refuses an existing checkpoint unless ``overwrite=True`` (early:
   the claim in step 3 decides).
3. ``prepare_global_plan`` - coordinator only, *before* any rank writes data. It refuses a data directory
   that is a symlink leading out of the checkpoint, then claims the location
   (:mod:`~dcp_storage.formats.commit_claim`: the lock ``.dcp_storage.lock``, created only if absent, so of two
   concurrent ``overwrite=False`` saves exactly one goes on and the other raises ``CheckpointExistsError``
   having written nothing). With ``overwrite=True`` it removes only a killed save's temp files: the old
   checkpoint stays whole until the new one is committed (:mod:`~dcp_storage.formats.commit_claim`).
4. ``write_data`` - every rank; ``thread_count`` files written concurrently, each committed atomically.
5. ``finish`` - coordinator only; writes the manifest ``.dcp_storage.json`` (format, writer and extension
   descriptors, a checksum of every record, computed while writing), then ``.metadata`` last, atomically
   (one PUT, or temp+fsync+rename), so an interrupted save never looks complete; then removes the lock.
   Replacing a checkpoint, the order keeps a manifest from ever sitting beside a ``.metadata`` it does not
   belong to: the old manifest is removed, the new ``.metadata`` committed over the old one, the new
   manifest written, and only then are the data files the new ``.metadata`` does not name retired.

Data files are ``__{rank}_{n}.distcp`` as torch names them, except that an ``overwrite=True`` save to a
location that holds files adds its save id (``__{rank}_{save id}_{n}.distcp``; readers find files through
``.metadata``, torch's too): a file name is never reused for other bytes, so the old checkpoint stays
loadable until the commit, and a load that read the old ``.metadata`` and is still running reads the old
bytes or finds the file gone (``CheckpointNotFoundError``), never the new bytes under the old metadata.

A write that fails (``ENOSPC``, ``EDQUOT``: :class:`~dcp_storage.errors.StorageFullError` naming the file
and the bytes it needed; any other storage error as itself) removes what this save wrote: each rank its own
data files (temp files are removed by the transport), and a coordinator saving alone, or any coordinator
failing in ``finish``, its lock too. The lock of a save of several ranks that failed in ``write_data``, or
of any save that failed otherwise (a state that cannot be serialized), stays until the writer retries (it
takes its own lock back) or an ``overwrite=True`` save: another rank may still be writing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_storage._torch import StorageInfo, StoragePrefix, StreamTransformExtension
from dcp_storage.errors import StorageFullError
from dcp_storage.formats.commit_claim import (
    ClaimingWriter,
    lock_name,
    prepare_dcp_overwrite,
    refuse_existing,
    refuse_links_out,
    retire_unreferenced,
)
from dcp_storage.formats.dcp_native.extensions import ItemEncoder
from dcp_storage.formats.dcp_native.manifest_io import build_manifest
from dcp_storage.formats.dcp_native.native import DCP_VERSION, METADATA_FILE, dump_metadata
from dcp_storage.formats.dcp_native.reader import _is_fsspec_url
from dcp_storage.formats.dcp_native.spec import FORMAT as DCP_FORMAT
from dcp_storage.formats.location import SavingLocation
from dcp_storage.formats.paths import DATA_SUFFIX, LOCK_RE, RANK_METADATA_RE
from dcp_storage.formats.writing import (
    MemoryFile,
    RecordingWriter,
    estimated_bytes,
    group_items,
    save_record,
    write_error,
    write_order,
)
from dcp_storage.integrity.blocks import ChecksummedStorage, unwrap_results
from dcp_storage.integrity.checksums import (
    BLOCK_SIZE,
    DEFAULT_ALGORITHM,
    HashingWriter,
    block_size_for,
    check_algorithm,
)
from dcp_storage.integrity.manifest import MANIFEST_FILE
from dcp_storage.runtime import gc_paused
from dcp_storage.strategies.prefixes import PrefixStrategy, rank_directory, resolve_prefix_strategy
from dcp_storage.transports import Transport, TransportConfig
from dcp_storage.transports.access import prepare_output
from dcp_storage.transports.ranges import ByteBudget
from dcp_storage.transports.s3_upload import upload_memory

__all__ = ["FsspecWriter"]

_SAVE_TAG = 12  # hex digits of the save id in the data file names of an overwrite=True save over files


class FsspecWriter(ClaimingWriter, SavingLocation, StorageWriter):
    """Write a DCP checkpoint to a local path or any fsspec URL.

    Args:
        path: checkpoint directory or URL.
        storage_options: passed to the fsspec filesystem.
        thread_count: files written concurrently by each rank (one thread each) on a local disk; on an object
            store each rank packs its items into objects of about ``transport_config.part_size``, written up to
            ``max_workers`` at once within ``max_inflight_bytes`` (see :mod:`~dcp_storage.formats.writing`).
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
        checksum_algorithm: checksum of every record and of every 1 MiB block of it, recorded in
            ``.dcp_storage.json`` (``"xxh3_64"``, ``"xxh64"``, ``"crc32c"``, ``"crc32"``; see
            :mod:`dcp_storage.integrity.checksums`), with the digest of the ``.metadata`` it describes. ``None``
            computes and records none (the manifest still names the format, writer and extensions); ``verify``
            then says so, loads check the zip CRC-32s only, and ``FsspecReader(verify=True)`` warns.
        create_bucket: create the URL's bucket (Azure: container) if it does not exist. ``False`` (the
            default) raises :class:`~dcp_storage.errors.BucketNotFoundError` instead, so a typo in a bucket
            name never becomes a new bucket (see :mod:`dcp_storage.transports.access`).
        prefix_strategy: spreads data files over key prefixes (object stores throttle per prefix): a
            :class:`~dcp_storage.strategies.prefixes.PrefixStrategy` such as ``HexPrefixStrategy()``, or the
            name of one registered under ``dcp_storage.strategies``. Each rank's files go to the directory
            it names inside the checkpoint; readers (torch's too) find them through ``.metadata``.
    """

    # Set by the coordinator's prepare_global_plan for its finish (and a failed write_data):
    _alone = False  # the save's only rank (or a rank-local save): a failure releases the lock at once
    _replacing = False  # overwriting files: new names, the old checkpoint retired after the commit
    _directories: Sequence[str] = ()  # the prefix strategy's data directories

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
        checksum_algorithm: str | None = DEFAULT_ALGORITHM,
        extensions: Sequence[StreamTransformExtension] | None = None,
        create_bucket: bool = False,
        prefix_strategy: PrefixStrategy | str | None = None,
    ) -> None:
        super().__init__()
        self.checksum_algorithm = check_algorithm(checksum_algorithm)  # refused before any planning
        self.prefix_strategy = resolve_prefix_strategy(prefix_strategy)
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
        self._open_save(path)

    def _metadata_path(self) -> str:
        name = METADATA_FILE if self.use_collectives or self.rank is None else f"__{self.rank}{METADATA_FILE}"
        return self.transport.join(self.root, name)

    def _manifest_path(self) -> str:
        name = MANIFEST_FILE if self.use_collectives or self.rank is None else f"__{self.rank}{MANIFEST_FILE}"
        return self.transport.join(self.root, name)

    def _rank_local(self) -> bool:
        return self.rank is not None and not self.use_collectives

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._next_save(checkpoint_id)

    def _shadowing_metadata_paths(self) -> list[str]:
        """Metadata files that would describe this path after the save: ours, and the global one.

        Loaders read the global ``.metadata`` first and fall back to ``__{rank}.metadata``; a rank-local
        save (``use_collectives=False``) over a collective checkpoint must therefore treat the old global
        file as the existing checkpoint (it would shadow the new one and point at overwritten files).
        """
        return list(dict.fromkeys([self._metadata_path(), self.transport.join(self.root, METADATA_FILE)]))

    def _committed_markers(self) -> list[str]:
        """The metadata files whose presence means a checkpoint this save would replace: the shadowing ones,
        and for a collective save every rank-local save's ``__{rank}.metadata`` too (both kinds of save name
        their data files ``__{rank}_{n}.distcp``: a collective save would rewrite the rank-local one's)."""
        markers = self._shadowing_metadata_paths()
        if not self._rank_local():
            names = self.transport.listdir(self.root)
            markers += [self.transport.join(self.root, n) for n in names if RANK_METADATA_RE.match(n)]
        return markers

    def _rival_locks(self) -> list[str]:
        """The locks of running saves of the other kind, which write the same data file names: a rank-local
        save's rival is a collective save's ``.dcp_storage.lock``, a collective save's any ``__{rank}`` lock."""
        if self._rank_local():
            return [self.transport.join(self.root, lock_name())]
        names = self.transport.listdir(self.root)
        return [self.transport.join(self.root, n) for n in names if LOCK_RE.match(n) and n != lock_name()]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        checks_bucket = self.is_coordinator or not self.use_collectives  # rank-local saves: each rank on its own
        prepare_output(self.transport, self.root, coordinator=checks_bucket, create_bucket=self.create_bucket)
        if not self.overwrite:
            refuse_existing(self.transport, self._shadowing_metadata_paths())
        return self._locate_plan(plan)  # type: ignore[no-any-return]

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator (every rank without collectives) before any rank writes data.
        plans = self._check_plan_locations(plans)
        local_rank = self.rank if self._rank_local() else None
        lock = lock_name(local_rank)
        ranks = [self.rank] if self._rank_local() else list(range(len(plans)))
        world = _world_size(len(plans), self._rank_local())
        directories = [rank_directory(self.prefix_strategy, rank, world) for rank in ranks]
        refuse_links_out(self.transport, self.root, directories)  # before the claim: nothing written yet
        with self._claimed(self.transport.join(self.root, lock), self._committed_markers, self._rival_locks):
            self._alone = len(ranks) == 1  # no other rank can be writing: a failure may release the lock at once
            self._directories = directories
            tag = ""
            took_over = self._claim is not None and self._claim.took_over  # another save may still write
            self._replacing = False
            if (self.overwrite or took_over) and (  # a stale lock taken over: the dead save's files retired too
                prepare_dcp_overwrite(self.transport, self.root, local_rank, lock, directories) or took_over
            ):
                self._replacing = True
                tag = f"{self.save_id[:_SAVE_TAG]}_"  # a location that held files: new names (module docstring)
        prefixes = [StoragePrefix(f"{d}/__{r}_{tag}" if d else f"__{r}_{tag}") for d, r in zip(directories, ranks)]
        return [
            plan if plan.storage_data is not None else dataclasses.replace(plan, storage_data=prefix)
            for prefix, plan in zip(prefixes, plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: str = plan.storage_data.prefix
        local = bool(self.transport.is_local)
        config = getattr(self.transport, "config", None)
        part_size = getattr(config, "part_size", TransportConfig.part_size)
        groups = group_items(
            plan.items,
            local=local,
            thread_count=self.thread_count,
            single_file_per_rank=self.single_file_per_rank,
            object_bytes=part_size,
        )
        files = [(f"{prefix}{n}{DATA_SUFFIX}", group) for n, group in enumerate(groups)]
        # Object stores: more objects in flight than threads of CPU work, bounded by the in-flight budget.
        workers = self.thread_count if local else max(self.thread_count, getattr(config, "max_workers", 1) or 1)
        budget = ByteBudget(getattr(config, "max_inflight_bytes", 512 * 1024 * 1024))
        parts = getattr(self.transport, "parts_in_flight", 2)

        committed: list[str] = []  # files this rank committed, removed if another one fails

        def write(name: str, items: list[WriteItem]) -> list[WriteResult]:
            size = estimated_bytes(items)
            # What the file costs in memory while in flight: its buffer (or its upload's parts) and, measured
            # on moto and s3rver, about twice that again in the HTTP stack (copies of what the socket has not
            # taken yet): peak RSS was 3x the budget when it counted the buffer once, 1.7-1.9x when twice.
            held = 3 * upload_memory(size, part_size, parts) if not local else 0
            budget.acquire(held)
            try:
                written = self._write_file(name, items, planner, in_memory=not local and size <= part_size)
                committed.append(name)
                return written
            finally:
                budget.release(held)

        results: list[WriteResult] = []
        try:
            # The cyclic collector paused while the files are written: a full collection of a training
            # process's heap (90-110 ms here, torch imported) holds the GIL, and the disk thread, back from
            # its write, waited for it: one such stall came in nearly every 0.3 s save measured.
            with gc_paused():
                if len(files) <= 1 or workers == 1:
                    for name, group in files:
                        results += write(name, group)
                else:
                    with ThreadPoolExecutor(min(workers, len(files)), thread_name_prefix="dcp-storage-write") as pool:
                        for part in pool.map(lambda f: write(*f), files):
                            results += part
        except BaseException as exc:
            # A storage error of a save no other rank writes for releases the lock; any other failure keeps it
            # for this writer's retry (see .claim), as a save of several ranks must (another may still write).
            self._undo(committed, release=self._alone and isinstance(exc, OSError))
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, *, in_memory: bool
    ) -> list[WriteResult]:
        """Write one data file in :func:`write_order` (byte items first), committed atomically.

        ``in_memory``: build it in memory and send it by one request (small objects on object stores);
        otherwise stream it through the transport's atomic writer (local temp file, multipart upload).
        """
        path = self.transport.join(self.root, name)
        ordered = write_order(items)
        recorder: RecordingWriter | None = None
        try:
            if in_memory:
                buffer = MemoryFile(estimated_bytes(items))
                results = self._write_records(buffer, name, ordered, planner)
                self.transport.write_file(path, buffer.close_buffer())
                return results
            with self.transport.open_atomic(path) as raw:
                recorder = RecordingWriter(raw)  # keeps the OSError that torch.save turns into a RuntimeError
                return self._write_records(recorder, name, ordered, planner)
        except Exception as exc:
            error = write_error(exc, self.transport.url(path), estimated_bytes(items), recorder and recorder.error)
            if error is exc:
                raise
            raise error from exc

    def _undo(self, names: Sequence[str], *, release: bool) -> None:
        """After a failure: remove the data files ``names`` this save committed, and the lock if ``release``.

        Best effort (the storage may be failing): what cannot be removed is a leftover the next
        ``overwrite=True`` save retires; it is never part of a checkpoint (no ``.metadata`` names it).
        """
        for name in names:
            try:
                self.transport.remove(self.transport.join(self.root, name))
            except Exception:  # noqa: BLE001 - see the docstring
                pass
        if release:
            self._release_claim()

    def _write_records(self, raw: Any, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        results = []
        stream = HashingWriter(raw, self.checksum_algorithm, BLOCK_SIZE)  # record and block checksums, in one pass
        for item in items:
            data = planner.resolve_data(item)
            stream.begin(block_size_for(_nbytes(data)))  # blocks of 1/64 of the record, 16 KiB to 1 MiB
            offset = stream.tell()
            with self._encoder.open(stream) as out:  # through the extensions, if any
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(data, io.BytesIO):
                        raise TypeError(
                            f"{item.index.fqn}: BYTE_IO item resolved to {type(data).__name__}, expected BytesIO"
                        )
                    out.write(data.getbuffer())
                else:
                    save_record(_compact_cpu(data), out)  # torch.save, its CRC-32s by ISA-L
            _start, length, digest = stream.end()
            stored = StorageInfo(name, offset, length, transform_descriptors=self._encoder.descriptors)
            info = (
                stored
                if digest is None
                else ChecksummedStorage(
                    stored, self.checksum_algorithm, digest, stream.blocks, stream.first_block, stream.blocks_size
                )
            )
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        storage_md, checksums, algorithms = unwrap_results(results)
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        extensions = getattr(self, "extensions", None) or ()
        committed = dump_metadata(metadata)  # the manifest records its digest: a stale manifest is told apart
        manifest = build_manifest(
            DCP_FORMAT.descriptor, storage_md, checksums, algorithms, extensions, metadata=committed
        )
        self._confirm_claim()  # another save took the location over: it commits, not this one
        data_files = sorted({info.relative_path for info in storage_md.values()})
        manifest_path, metadata_path = self._manifest_path(), self._metadata_path()
        try:
            if self._replacing:
                self.transport.remove(manifest_path)  # the old one: never beside the new .metadata
            else:
                self.transport.write_file(manifest_path, manifest.to_json())  # before the commit marker
            self.transport.write_file(metadata_path, committed)  # the commit
        except Exception as exc:
            error = write_error(exc, self.transport.url(metadata_path))
            # Not committed, for sure on a local disk or a full store: nothing of it may stay. An object store's
            # other errors may come after it took the PUT (a lost response): its files then stay, as leftovers.
            if self.transport.is_local or isinstance(error, StorageFullError):
                if not self._replacing:
                    with contextlib.suppress(Exception):
                        self.transport.remove(manifest_path)
                self._undo(data_files, release=True)
            else:
                self._release_claim()
            if error is exc:
                raise
            raise error from exc
        if self._replacing:
            self._retire_replaced(data_files, manifest.to_json())
        self._release_claim()

    def _retire_replaced(self, data_files: list[str], manifest: bytes) -> None:
        """After the commit over an old checkpoint: the new manifest, then retire what ``.metadata`` no longer
        names (the old data files, a killed save's leftovers, a shadowing global ``.metadata``)."""
        try:
            self.transport.write_file(self._manifest_path(), manifest)
        except Exception as exc:  # noqa: BLE001 - committed: the checkpoint loads, only its checksums are missing
            warnings.warn(
                f"{self.transport.url(self._manifest_path())}: the checkpoint is committed, but its manifest "
                f"could not be written ({exc}); it loads without record checksums",
                RuntimeWarning,
                stacklevel=3,
            )
        shadowing = [p for p in self._shadowing_metadata_paths() if p != self._metadata_path()]
        local_rank = self.rank if self._rank_local() else None
        retire_unreferenced(self.transport, self.root, data_files, local_rank, self._directories, shadowing)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_fsspec_url(checkpoint_id)


def _world_size(n_plans: int, rank_local: bool) -> int:
    """Ranks saving: the plans gathered, or for a rank-local save the process group's size (1 without one)."""
    if not rank_local:
        return n_plans
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _nbytes(data: Any) -> int:
    """The bytes of a resolved write item: a tensor's elements, a ``BytesIO``'s buffer."""
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return memoryview(data.getbuffer()).nbytes if isinstance(data, io.BytesIO) else 0


def _compact_cpu(data: Any) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its elements (``torch.save`` writes whole storages)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"tensor item resolved to {type(data).__name__}")
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor
