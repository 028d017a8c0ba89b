"""The read step of every reader in which only the coordinator touches storage.

:class:`~dcp_storage.strategies.Broadcasting` (any reader, wrapped) and
:class:`~dcp_storage.storage.BroadcastingTorchSaveReader` (a ``torch.save`` file) differ in how the
coordinator gets tensor bytes; what every rank does in ``read_data`` is the same and lives here: the
coordinator serves each rank its slices (``_serve``), every other rank receives its own (in the dtype the
checkpoint stores, from the shared metadata).
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CorruptCheckpointError
from .group import GroupView, group_view
from .slice_delivery import DeliveryStats, receive_items

__all__ = ["CoordinatorServedReader"]


class CoordinatorServedReader(StorageReader):
    """Subclasses set ``process_group``, ``coordinator_rank``, ``_metadata`` and ``delivery``; define ``_serve``."""

    process_group: Any
    coordinator_rank: int
    _metadata: Metadata | None
    delivery: DeliveryStats

    def _view(self) -> GroupView:
        view = group_view(self.process_group)
        view.check_src(self.coordinator_rank, "coordinator_rank")
        return view

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        view = self._view()
        self.delivery = DeliveryStats()
        if view.rank == self.coordinator_rank:
            self._serve(view, plan, planner)
        else:
            receive_items(plan.items, planner, view, self.coordinator_rank, self._stored_dtype, self.delivery)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @abc.abstractmethod
    def _serve(self, view: GroupView, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Coordinator: deliver its own items to ``planner`` and every other rank's slices to that rank."""

    def _stored_dtype(self, item: ReadItem) -> torch.dtype:
        md = self._metadata.state_dict_metadata.get(item.storage_index.fqn) if self._metadata else None
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{self.checkpoint_id}: no tensor {item.storage_index.fqn!r} in the metadata")
        return md.properties.dtype
