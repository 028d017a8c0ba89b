"""The read step of every reader in which only the coordinator touches storage.

:class:`~dcp_storage.strategies.Broadcasting` (any reader, wrapped) and
:class:`~dcp_storage.storage.BroadcastingTorchSaveReader` (a ``torch.save`` file) differ in how the
coordinator gets tensor bytes; what every rank does in ``read_data`` is the same and lives here: the
coordinator serves each rank its slices (``_serve``), every other rank receives its own (in the dtype the
checkpoint stores, from the shared metadata).

A rank that works alone (``dcp.load(..., no_dist=True)``, see :mod:`.dcp_call`) is its own coordinator:
it reads its own plan from storage and sends nothing, whatever ``coordinator_rank`` says.

Every rank serves or receives by the plans the coordinator made, so two things are checked first
(:mod:`.rank_agreement`): each rank's local plan carries the reader's kind, and the coordinator refuses a
load in which some rank reads otherwise (``_tag`` / ``_untag``); after the planner's ``finish_plan`` every
rank agrees that none failed and that no receiving rank's plan lost or changed items
(``_check_final_plan``), before any slice is sent.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_storage.errors import CorruptCheckpointError, DcpStorageError, RankMismatchError
from dcp_storage.formats.dcp_native.record_match import stored_dtype
from dcp_storage.strategies.dcp_call import load_group, works_alone
from dcp_storage.strategies.group import SOLO, GroupView, group_view
from dcp_storage.strategies.rank_agreement import check_tags, guard_finish_plan, tag_plan
from dcp_storage.strategies.slice_delivery import DeliveryStats, item_key, receive_items

__all__ = ["CoordinatorServedReader"]


class CoordinatorServedReader(StorageReader):
    """Subclasses set ``process_group``, ``coordinator_rank``, ``_metadata``, ``_plans`` and ``delivery``;
    define ``_serve``."""

    process_group: Any
    coordinator_rank: int
    _metadata: Metadata | None
    _plans: list[LoadPlan] | None
    delivery: DeliveryStats

    def _view(self) -> GroupView:
        """This rank in the load's group; :data:`~.group.SOLO` when it works alone."""
        if works_alone():
            return SOLO
        view = group_view(load_group(self.process_group))
        view.check_src(self.coordinator_rank, "coordinator_rank")
        return view

    def _check_coordinator(self, view: GroupView, is_coordinator: bool) -> None:
        """``set_up_storage_reader``: DCP's coordinator must be ours (it runs ``prepare_global_plan``)."""
        if view.distributed and is_coordinator != (view.rank == self.coordinator_rank):
            raise ValueError(
                f"{type(self).__name__}(coordinator_rank={self.coordinator_rank}) on rank {view.rank}: DCP's "
                f"coordinator {'is' if is_coordinator else 'is not'} this rank; pass dcp.load's coordinator rank "
                "and process group to the reader"
            )

    def _tag(self, plan: LoadPlan) -> LoadPlan:
        """``prepare_local_plan`` (every rank): say how this rank reads, and guard ``finish_plan``."""
        if not self._view().distributed:
            return plan
        guard_finish_plan(lambda central: True, self._check_final_plan, group=self.process_group)
        return tag_plan(plan, type(self).__name__)

    def _untag(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """``prepare_global_plan`` (the coordinator): every rank must read through this kind of reader."""
        view = self._view()
        return check_tags(plans, type(self).__name__, untagged_ok=not view.distributed or view.world == 1)

    def _check_final_plan(self, central: LoadPlan, final: LoadPlan, view: GroupView) -> None:
        """A receiving rank's plan after ``finish_plan`` must hold the items the coordinator will send."""
        if view.rank == self.coordinator_rank or final.items is central.items or final.items == central.items:
            return
        if sorted(map(item_key, final.items)) == sorted(map(item_key, central.items)):
            return
        raise RankMismatchError(
            f"{type(self).__name__}: on rank {view.rank} the planner's finish_plan changed the plan "
            f"({len(central.items)} items planned, {len(final.items)} after finish_plan); the coordinator sends "
            "every rank the items of the global plan, so finish_plan must keep them"
        )

    def _all_plans(self, view: GroupView, plan: LoadPlan) -> list[LoadPlan]:
        """Every rank's plan, this rank's being its final one (after the planner's ``finish_plan``)."""
        if not view.distributed:
            return [plan]
        plans = list(self._plans) if self._plans is not None else [plan]
        if len(plans) != view.world:
            raise DcpStorageError(
                f"{type(self).__name__}: the coordinator saw {len(plans)} plans for a group of {view.world} ranks "
                "(was prepare_global_plan called on this rank?)"
            )
        plans[view.rank] = plan
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        view = self._view()
        self.delivery = DeliveryStats()
        if not view.distributed or view.rank == self.coordinator_rank:
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
        dtype = stored_dtype(self._metadata, item.storage_index.fqn)
        if dtype is None:
            raise CorruptCheckpointError(f"{self.checkpoint_id}: no tensor {item.storage_index.fqn!r} in the metadata")
        return dtype
