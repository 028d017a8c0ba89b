"""A DCP ``StorageReader`` for ``.npz`` files: ``dcp.load(sd, storage_reader=open_reader("x.npz"))``.

Each array is one tensor stored whole (one chunk at the origin). ``read_data`` decodes each requested
array once (``numpy.load(allow_pickle=False)``) and copies the requested slice into the planner's tensor.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_storage.plugin_api import CorruptCheckpointError, open_transport

from .archive import NpzArchive, torch_dtype

__all__ = ["NpzReader"]


class NpzReader(StorageReader):
    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.url = os.fspath(url)
        self.transport, self.path = open_transport(self.url, storage_options)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).endswith(".npz")

    def read_metadata(self) -> Metadata:
        archive = NpzArchive(self.transport, self.path)
        try:
            state: dict[str, Any] = {}
            storage: dict[MetadataIndex, str] = {}
            for m in archive.members():
                size = torch.Size(m.shape)
                zeros = torch.Size([0] * len(m.shape))
                dtype = torch_dtype(m.dtype, f"{archive.url} (member {m.member!r})")
                state[m.key] = TensorStorageMetadata(
                    TensorProperties(dtype=dtype), size, [ChunkStorageMetadata(zeros, size)]
                )
                storage[MetadataIndex(m.key, zeros)] = m.key
        finally:
            archive.close()
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        archive = NpzArchive(self.transport, self.path)
        try:
            by_key: dict[str, list[Any]] = {}
            for item in plan.items:
                by_key.setdefault(item.storage_index.fqn, []).append(item)
            for key, items in by_key.items():
                array = archive.load(key)
                for item in items:
                    if item.type.name != "TENSOR":
                        raise CorruptCheckpointError(f"{archive.url}: {key!r} is an array; .npz holds no other values")
                    source = array
                    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        source = source.narrow(dim, offset, length)
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(source)
                    planner.commit_tensor(item, target)
                del array
        finally:
            archive.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def close(self) -> None:
        self.transport.close()
