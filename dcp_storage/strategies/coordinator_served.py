"""The coordinator reads and sends: the one mechanism of every reader in which only one rank touches storage.

:class:`~dcp_storage.strategies.Broadcasting` (any reader, wrapped) and
:class:`~dcp_storage.BroadcastingTorchSaveReader` (a ``torch.save`` file) differ only in how the coordinator
gets a slice's bytes (their ``_send_slices``); everything else lives here, in :class:`CoordinatorServedReader`
and the delivery helpers their ``_send_slices`` share, on the wire protocol of :mod:`.slice_delivery`:

1. constructor: ``coordinator_rank``, ``process_group`` and the :class:`~.slice_delivery.DeliveryConfig`.
2. ``read_metadata`` (all, collective): :meth:`~CoordinatorServedReader._share_metadata`: the coordinator
   reads, every rank gets its ``Metadata`` or its error (:func:`~.collectives.share_object`).
3. ``set_up_storage_reader`` (all): :meth:`~CoordinatorServedReader._set_up`: DCP's coordinator must be
   ours (it runs ``prepare_global_plan``), the planner's keys are checked, the metadata kept.
4. ``prepare_local_plan`` (all) / ``prepare_global_plan`` (the coordinator): ``_tag`` / ``_untag``.
5. ``read_data`` (all, point to point): the coordinator serves each rank its slices (``_serve``: a
   :class:`~.slice_delivery.SliceSender` that, on any failure, tells every rank still waiting), every other
   rank receives its own (in the dtype the checkpoint stores, from the shared metadata).

A rank that works alone (``dcp.load(..., no_dist=True)``, see :mod:`.collectives`) is its own coordinator:
it reads its own plan from storage and sends nothing, whatever ``coordinator_rank`` says.

Every rank serves or receives by the plans the coordinator made, so two things are checked first
(:mod:`.rank_agreement`): each rank's local plan carries the reader's kind, and the coordinator refuses a
load in which some rank reads otherwise (``_tag`` / ``_untag``); after the planner's ``finish_plan`` every
rank agrees that none failed and that no receiving rank's plan lost or changed items
(``_check_final_plan``), before any slice is sent.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcp_storage.errors import CorruptCheckpointError, DcpStorageError, RankMismatchError
from dcp_storage.formats.byte_items import VettedBytes
from dcp_storage.formats.columns import stored_dtype
from dcp_storage.planners.planner import check_planned_keys
from dcp_storage.strategies.collectives import (
    SOLO,
    GroupView,
    group_view,
    load_group,
    running_planner,
    share_object,
    works_alone,
)
from dcp_storage.strategies.rank_agreement import check_tags, guard_finish_plan, tag_plan
from dcp_storage.strategies.slice_delivery import (
    DeliveryConfig,
    DeliveryStats,
    SliceSender,
    canonical_order,
    checked_destination,
    item_key,
    receive_items,
    sending,
)

__all__ = ["CoordinatorServedReader", "Job", "deliver_bytes", "deliver_tensor", "plan_jobs"]

T = TypeVar("T")

#: One slice a rank needs: ``(rank, number of the item in that rank's canonical order, the item)``.
Job = tuple[int, int, ReadItem]


class CoordinatorServedReader(StorageReader):
    """A reader whose coordinator reads storage and sends every other rank its slices (module docstring).

    Subclasses call ``__init__`` with the coordinator and delivery settings, and define ``_send_slices``.
    """

    def __init__(
        self, coordinator_rank: int = 0, process_group: Any = None, delivery_config: DeliveryConfig | None = None
    ) -> None:
        super().__init__()
        if coordinator_rank < 0:
            raise ValueError(f"coordinator_rank must be >= 0, got {coordinator_rank}")
        self.coordinator_rank = coordinator_rank
        self.process_group = process_group
        self.delivery_config = delivery_config or DeliveryConfig()
        self._reset_served()

    def _reset_served(self) -> None:
        """What one load learns (``reset``): the metadata, every rank's plan, the delivery counts."""
        self._metadata: Metadata | None = None
        self._plans: list[LoadPlan] | None = None
        self.delivery = DeliveryStats()
        # What read_metadata raised, if it did: torch's fallback then quotes it in an AssertionError, and
        # ds.load / the manager raise this instead (the attribute FsspecReader's MetadataFailure also has).
        self.metadata_failure = _Failure()

    def _view(self) -> GroupView:
        """This rank in the load's group; :data:`~.collectives.SOLO` when it works alone."""
        if works_alone():
            return SOLO
        view = group_view(load_group(self.process_group))
        view.check_src(self.coordinator_rank, "coordinator_rank")
        return view

    # ------------------------------------------------------------------------------------ steps
    def _share_metadata(self, read: Callable[[], Metadata], location: str | None) -> Metadata:
        """``read_metadata``: ``read()`` on the coordinator; every rank gets its Metadata or its error."""
        self.metadata_failure.error = None
        try:
            self._view()  # checks coordinator_rank against the group
            self._metadata = share_object(
                read,
                group=self.process_group,
                src_rank=self.coordinator_rank,
                location=location,
                kind=type(self).__name__,
            )
        except Exception as exc:
            self.metadata_failure.error = exc
            raise
        return self._metadata

    def _set_up(self, metadata: Metadata, is_coordinator: bool) -> None:
        """``set_up_storage_reader``: DCP's coordinator must be ours; keep the metadata."""
        self._check_coordinator(self._view(), is_coordinator)
        check_planned_keys(running_planner(), metadata)
        self._metadata = metadata

    def _check_coordinator(self, view: GroupView, is_coordinator: bool) -> None:
        """``set_up_storage_reader``: DCP's coordinator must be ours (it runs ``prepare_global_plan``)."""
        if view.distributed and is_coordinator != (view.rank == self.coordinator_rank):
            raise ValueError(
                f"{type(self).__name__}(coordinator_rank={self.coordinator_rank}) on rank {view.rank}: DCP's "
                f"coordinator {'is' if is_coordinator else 'is not'} this rank; pass dcp.load's coordinator rank "
                "and process group to the reader"
            )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self._tag(plan)

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

    def _serve(self, view: GroupView, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Coordinator: deliver its own items to ``planner`` and every other rank's slices to that rank; on any
        failure every rank still expecting a slice gets the error instead (:func:`~.slice_delivery.sending`)."""
        plans = self._all_plans(view, plan)
        with sending(
            view, {r: len(p.items) for r, p in enumerate(plans)}, self.delivery, self.delivery_config
        ) as sender:
            self._send_slices(view, plan, plans, planner, sender)

    @abc.abstractmethod
    def _send_slices(
        self, view: GroupView, plan: LoadPlan, plans: list[LoadPlan], planner: LoadPlanner, sender: SliceSender
    ) -> None:
        """Read every rank's items (``plans``, ``plan`` this rank's); deliver this rank's to ``planner`` and send
        the others' by ``sender`` (:func:`deliver_tensor`, :func:`deliver_bytes`)."""

    def _stored_dtype(self, item: ReadItem) -> torch.dtype:
        dtype = stored_dtype(self._metadata, item.storage_index.fqn)
        if dtype is None:
            raise CorruptCheckpointError(f"{self.checkpoint_id}: no tensor {item.storage_index.fqn!r} in the metadata")
        return dtype


class _Failure:
    """The error of the last ``read_metadata`` (``None`` after a success)."""

    error: BaseException | None = None


def plan_jobs(plans: Sequence[LoadPlan]) -> list[Job]:
    """Every rank's items as jobs, numbered as the receiving rank numbers them (:func:`canonical_order`)."""
    return [(rank, index, item) for rank, p in enumerate(plans) for index, item in enumerate(canonical_order(p.items))]


def deliver_bytes(
    jobs: Sequence[Job], data: bytes, me: int, planner: LoadPlanner, sender: SliceSender, stats: DeliveryStats
) -> None:
    """A non-tensor value (vetted bytes) to every job that loads it: this rank's planner, or sent."""
    for rank, index, item in jobs:
        if rank == me:
            stats.bytes_local += len(data)
            planner.load_bytes(item, VettedBytes(data))  # a fresh stream per destination
        else:
            sender.send_bytes(rank, index, data)


def deliver_tensor(
    jobs: Sequence[Job],
    staged: torch.Tensor,
    me: int,
    planner: LoadPlanner,
    sender: SliceSender,
    stats: DeliveryStats,
    committed: torch.Tensor | None = None,
    in_place: bool = False,
) -> None:
    """A slice read once (``staged``: its stored bytes) to every job that needs it.

    One job of this rank alone: ``staged`` is its destination, committed as it is (or as ``committed``, the
    tensor the reader handed back). Several jobs: ``staged`` is a staging buffer, copied into this rank's
    destination (checked first) and sent to the other ranks; with ``in_place``, ``staged`` is this rank's
    destination itself: sent from, and committed only once those sends are done
    (:meth:`~.slice_delivery.SliceSender.after_sent`), so that nothing writes to bytes in flight.
    """
    shared = len(jobs) > 1
    deferred: list[ReadItem] = []
    for rank, index, item in jobs:
        if rank != me:
            sender.send_tensor(rank, index, staged)
            continue
        stats.bytes_local += staged.numel() * staged.element_size()
        if in_place:
            deferred.append(item)  # after every send of the slice has been issued
            continue
        dest = staged if committed is None else committed
        if shared:
            dest = checked_destination(planner, item)
            dest.copy_(staged)
        planner.commit_tensor(item, dest)
    for item in deferred:
        sender.after_sent(lambda item=item: planner.commit_tensor(item, staged))
