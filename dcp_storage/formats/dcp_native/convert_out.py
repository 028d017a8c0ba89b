"""Streaming a DCP native checkpoint (``__0_N.distcp`` + ``.metadata``), one tensor in memory at a time.

The bytes are what torch's ``FileSystemWriter`` (and our :class:`~dcp_storage.FsspecWriter`) write for a
single-rank save: each tensor a ``torch.save`` record appended to a data file, non-tensor values (their
``torch.save`` bytes) first in the first file, and a pickled ``Metadata`` whose ``planner_data`` is DCP's
flatten mapping, so ``dcp.load``, ``FileSystemReader`` and ``dcp_to_torch_save`` read the result.

Commit order: an old ``.metadata`` is removed first (``overwrite=True``), each data file is committed
atomically, the manifest ``.dcp_storage.json`` (provenance and a checksum of every record, hashed while
writing, exactly as :class:`~dcp_storage.FsspecWriter` records them: :mod:`dcp_storage.integrity`) follows,
and the new ``.metadata`` is written last, so an interrupted conversion never looks complete.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_storage.errors import CheckpointExistsError
from dcp_storage.formats.convert_target import ConvertTarget, Fetch, OutTensor, OutValue, WriteDestination, WriteOptions
from dcp_storage.formats.dcp_native.manifest_io import build_manifest
from dcp_storage.formats.dcp_native.metadata_io import DCP_VERSION, METADATA_FILE, dump_metadata
from dcp_storage.formats.paths import DATA_SUFFIX
from dcp_storage.formats.safetensors.convert_out import pack_by_bytes
from dcp_storage.integrity.checksums import BLOCK_SIZE, DEFAULT_ALGORITHM, HashingWriter, block_size_for
from dcp_storage.integrity.manifest import MANIFEST_FILE
from dcp_storage.interrupts import held_interrupts
from dcp_storage.transports.buckets import make_output_root

__all__ = ["TARGET", "write_dcp"]


def _groups(tensors: Sequence[OutTensor], max_shard_size: int | None) -> list[list[OutTensor]]:
    return [list(tensors)] if max_shard_size is None else pack_by_bytes(tensors, max_shard_size)


def write_dcp(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Fetch,
    *,
    descriptor: str,
    max_shard_size: int | None = None,
    checksum_algorithm: str = DEFAULT_ALGORITHM,
) -> None:
    """Write ``tensors`` and ``values`` as a DCP checkpoint in the directory ``dest``, with its manifest
    (which records ``descriptor``, the format's ``name/version``, as what the checkpoint is)."""
    transport = dest.transport
    metadata_path = dest.join(METADATA_FILE)
    if transport.exists(metadata_path):
        if not dest.overwrite:
            raise CheckpointExistsError(
                f"{dest.url_of(metadata_path)}: a checkpoint already exists here; pass overwrite=True (--overwrite) "
                "to replace it"
            )
        transport.remove(metadata_path)  # retire the old checkpoint before any data file is replaced
    make_output_root(transport, dest.path)  # object stores: nothing to make (Destination checked the bucket)

    state: dict[str, object] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    records: list[tuple[object, ...]] = []  # (file, offset, length, digest, blocks) of every record
    for i, group in enumerate(_groups(tensors, max_shard_size)):
        name = f"__0_{i}{DATA_SUFFIX}"
        first = i == 0
        if not group and not (first and values):
            continue
        with transport.open_atomic(dest.join(name)) as raw:
            stream = HashingWriter(raw, checksum_algorithm, BLOCK_SIZE)  # record and block checksums, one pass
            for value in values if first else ():
                data = fetch.value_bytes(value)
                stream.begin(block_size_for(len(data)))
                stream.write(data)
                offset, length, digest = stream.end()
                records.append((name, offset, length, digest, stream.blocks, stream.first_block, stream.blocks_size))
                storage[MetadataIndex(value.key)] = _StorageInfo(name, offset, length)
                state[value.key] = BytesStorageMetadata()
            for out, tensor in fetch.tensors(group):
                stream.begin(block_size_for(tensor.numel() * tensor.element_size()))
                with held_interrupts():  # torch's C++ zip writer calls stream.write (dcp_storage.interrupts)
                    torch.save(tensor, stream)  # type: ignore[arg-type]
                offset, length, digest = stream.end()
                del tensor
                records.append((name, offset, length, digest, stream.blocks, stream.first_block, stream.blocks_size))
                zeros = torch.Size([0] * len(out.shape))
                storage[MetadataIndex(out.key, zeros, 0)] = _StorageInfo(name, offset, length)
                size = torch.Size(out.shape)
                state[out.key] = TensorStorageMetadata(
                    TensorProperties(dtype=out.dtype), size, [ChunkStorageMetadata(offsets=zeros, sizes=size)]
                )
                dest.advance(out.nbytes)
            written = stream.tell()
        dest.record(name, written)

    ordered = {k: state[k] for k in [*(v.key for v in values), *(t.key for t in tensors)] if k in state}
    metadata = Metadata(
        state_dict_metadata=ordered,  # type: ignore[arg-type]
        planner_data={k: p for k, p in [*((v.key, v.path) for v in values), *((t.key, t.path) for t in tensors)]},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=dest.url, save_id=uuid.uuid4().hex),
    )
    metadata.version = DCP_VERSION
    data = dump_metadata(metadata)
    manifest = build_manifest(descriptor, storage, records, {checksum_algorithm}, metadata=data).to_json()
    transport.write_file(dest.join(MANIFEST_FILE), manifest)  # before the commit marker
    dest.record(MANIFEST_FILE, len(manifest))
    transport.write_file(metadata_path, data)
    dest.record(METADATA_FILE, len(data))


def _write(
    dest: WriteDestination,
    tensors: Sequence[OutTensor],
    values: Sequence[OutValue],
    fetch: Fetch,
    options: WriteOptions,
) -> tuple[str, list[str]]:
    write_dcp(dest, tensors, values, fetch, max_shard_size=options.max_shard_size, descriptor=options.descriptor)
    return dest.path, []


TARGET = ConvertTarget("dcp", _write, single_file=False)
