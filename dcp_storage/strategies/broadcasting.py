"""``Broadcasting(reader)``: any ``StorageReader``, read by one rank, its slices sent to the others.

For storage that only one host can reach, or to cut request counts at scale: only the coordinator calls
the wrapped reader's ``read_metadata``, ``set_up_storage_reader``, ``prepare_*_plan`` and ``read_data``;
every other rank gets the metadata by broadcast and its slices point to point (see
:mod:`.slice_delivery`), never touching storage::

    dcp.load(sd, storage_reader=Broadcasting(FsspecReader("s3://bucket/ckpt")))

How ``read_data`` works on the coordinator: it runs the wrapped reader's ``read_data`` over every rank's
items, in chunks of at most ``staging_bytes``, with a routing planner in place of the real one. For its own
items the routing planner defers to the real planner; for another rank's items ``resolve_tensor`` hands out
a staging tensor (the stored dtype) and ``commit_tensor``/``load_bytes`` send it to that rank.

Call order (``dcp.load`` drives it; "all" = every rank of the process group):

1. ``reset(checkpoint_id)`` (all; passed on to the wrapped reader, which must not do I/O in it).
2. ``read_metadata()`` (all, collective) - coordinator reads, all receive the Metadata or the error.
3. ``set_up_storage_reader`` (all; the wrapped reader's on the coordinator only).
4. ``prepare_local_plan`` (all: tagged, see :mod:`.coordinator_served`, where everything but the coordinator's
   reading is shared with :class:`~dcp_storage.BroadcastingTorchSaveReader`) / ``prepare_global_plan`` (DCP's
   coordinator, which must be this wrapper's coordinator): the wrapped reader's ``prepare_local_plan`` on
   each rank's plan, then its ``prepare_global_plan``; the results are remembered.
5. ``finish_plan`` (the planner's, all): followed by one agreement that no rank failed in it.
6. ``read_data`` (all, point to point).

Under ``dcp.load(..., no_dist=True)`` each calling rank works alone (:mod:`.collectives`): no collective, the
wrapped reader reads that rank's own plan. The wrapped reader is always called inside
:func:`~.collectives.working_alone`, so a reader that would share metadata itself (``SafetensorsReader``)
reads it on the coordinator instead of starting a collective the other ranks are not in.

The wrapped reader must hand the planner the ``ReadItem`` objects of the plan it was given (DCP's and this
package's readers do) and must be usable for several ``read_data`` calls per load.
"""

from __future__ import annotations

import collections
import inspect
import io
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.byte_items import ensure_vetted
from dcp_storage.runtime import host_buffer, wait_for
from dcp_storage.strategies.collectives import GroupView, reader_location, working_alone
from dcp_storage.strategies.coordinator_served import CoordinatorServedReader, deliver_bytes, deliver_tensor, plan_jobs
from dcp_storage.strategies.slice_delivery import DeliveryConfig, DeliveryStats, SliceSender, StandInPlanner, item_key

__all__ = ["Broadcasting"]


class Broadcasting(CoordinatorServedReader):
    """Make ``reader`` coordinator-only: one rank reads storage, every rank gets the slices it needs.

    Args:
        reader: any DCP ``StorageReader`` (e.g. :class:`~dcp_storage.FsspecReader`).
        coordinator_rank: the rank of ``process_group`` that reads; must be DCP's coordinator.
        process_group: the group ``dcp.load`` uses; ``None``: the one ``dcp.load`` runs on (its
            ``process_group``, else the default group, or none at all).
        delivery_config: in-flight and staging limits of the coordinator.
    """

    def __init__(
        self,
        reader: StorageReader,
        coordinator_rank: int = 0,
        process_group: Any = None,
        *,
        delivery_config: DeliveryConfig | None = None,
    ) -> None:
        if not isinstance(reader, StorageReader):
            raise TypeError(f"Broadcasting wraps a StorageReader, got {type(reader).__name__}")
        super().__init__(coordinator_rank, process_group, delivery_config)
        self.reader = reader

    @property
    def checkpoint_id(self) -> Any:
        return getattr(self.reader, "checkpoint_id", None)

    @property
    def stats(self) -> dict[str, Any]:
        out = self.delivery.as_dict()
        counters = getattr(self.reader, "counters", None)
        if isinstance(counters, dict):
            out["storage"] = dict(counters)
        return out

    # ------------------------------------------------------------------------------------ steps
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.reader.reset(checkpoint_id)
        self._reset_served()

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        def read() -> Metadata:
            with working_alone():
                return self.reader.read_metadata()

        return self._share_metadata(read, reader_location(self.reader))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._set_up(metadata, is_coordinator)
        if is_coordinator:
            with working_alone():
                if "kwargs" in inspect.signature(self.reader.set_up_storage_reader).parameters:
                    self.reader.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
                else:
                    self.reader.set_up_storage_reader(metadata, is_coordinator)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = self._untag(plans)
        with working_alone():
            plans = [self.reader.prepare_local_plan(p) for p in plans]
            plans = self.reader.prepare_global_plan(plans)
        self._plans = list(plans)
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # a wrapper is never picked by checkpoint_id; wrap an explicit reader

    # ------------------------------------------------------------------------------------ internals
    def _send_slices(
        self, view: GroupView, plan: LoadPlan, plans: list[LoadPlan], planner: LoadPlanner, sender: SliceSender
    ) -> None:
        router = _RoutingPlanner(planner, view.rank, sender, self._stored_dtype, self.delivery)
        jobs = plan_jobs(plans)
        jobs.sort(key=lambda j: (item_key(j[2])[1:5], j[0]))  # storage order: neighbours coalesce
        jobs, copies = _fold_copies(jobs)  # a slice several ranks need (replicas) is read once
        for chunk in self._chunks(jobs, view.rank, copies):
            router.route(chunk, copies)
            inner_plan = LoadPlan([item for _r, _i, item in chunk], plan.storage_data, plan.planner_data)
            with working_alone():
                wait_for(self.reader.read_data(inner_plan, router), self.reader)
            router.check_done()

    def _chunks(
        self, jobs: list[tuple[int, int, ReadItem]], me: int, copies: dict[int, list[tuple[int, int, ReadItem]]]
    ) -> list[list[tuple[int, int, ReadItem]]]:
        chunks: list[list[tuple[int, int, ReadItem]]] = []
        current: list[tuple[int, int, ReadItem]] = []
        held = 0
        for job in jobs:
            rank, _index, item = job
            size = 0
            if (rank != me or id(item) in copies) and item.type != LoadItemType.BYTE_IO:
                size = (
                    math.prod(int(n) for n in item.lengths)
                    * torch.empty((), dtype=self._stored_dtype(item)).element_size()
                )
            if current and held + size > self.delivery_config.staging_bytes:
                chunks.append(current)
                current, held = [], 0
            current.append(job)
            held += size
        if current:
            chunks.append(current)
        return chunks


def _fold_copies(
    jobs: list[tuple[int, int, ReadItem]],
) -> tuple[list[tuple[int, int, ReadItem]], dict[int, list[tuple[int, int, ReadItem]]]]:
    """Jobs (in storage order) with each run of jobs for the same stored slice folded into its first one;
    ``copies`` maps that job's item (by id) to the other ranks' jobs for the same bytes."""
    out: list[tuple[int, int, ReadItem]] = []
    copies: dict[int, list[tuple[int, int, ReadItem]]] = {}
    last: tuple[Any, ...] | None = None
    for job in jobs:
        key = item_key(job[2])[:5]  # type, stored key, chunk, offsets in it, lengths
        if out and key == last:
            copies.setdefault(id(out[-1][2]), []).append(job)
        else:
            out.append(job)
            last = key
    return out, copies


class _RoutingPlanner(StandInPlanner):
    """Stands in for the real planner inside the wrapped reader's ``read_data`` on the coordinator.

    A slice that several ranks need is read once, into a staging buffer of the stored dtype, and then
    copied into the coordinator's own destination and sent to every other rank that needs it.
    """

    def __init__(
        self, real: LoadPlanner, me: int, sender: SliceSender, stored_dtype: Any, stats: DeliveryStats
    ) -> None:
        super().__init__(real)
        self._me = me
        self._sender = sender
        self._stored_dtype = stored_dtype
        self._stats = stats
        self._by_id: dict[int, tuple[int, int, ReadItem]] = {}
        self._by_value: dict[ReadItem, collections.deque[tuple[int, int, ReadItem]]] = {}
        self._staged: dict[int, tuple[tuple[int, int, ReadItem], torch.Tensor]] = {}
        self._copies: dict[int, list[tuple[int, int, ReadItem]]] = {}
        self._open = 0

    def route(self, chunk: list[tuple[int, int, ReadItem]], copies: dict[int, list[tuple[int, int, ReadItem]]]) -> None:
        self._copies = copies
        self._by_id = {id(item): job for job in chunk for item in [job[2]]}
        self._by_value = {}
        for job in chunk:
            self._by_value.setdefault(job[2], collections.deque()).append(job)
        self._staged = {}
        self._open = len(chunk)

    def _claim(self, item: ReadItem) -> tuple[int, int, ReadItem]:
        job = self._by_id.pop(id(item), None)
        if job is not None:
            queue = self._by_value.get(job[2])
            if queue is not None and job in queue:
                queue.remove(job)
            return job
        queue = self._by_value.get(item)
        if not queue:
            raise DcpStorageError(
                f"Broadcasting: the wrapped reader delivered an unplanned item {item.dest_index.fqn!r}"
            )
        job = queue.popleft()
        self._by_id.pop(id(job[2]), None)
        return job

    def check_done(self) -> None:
        if self._open:
            raise DcpStorageError(f"Broadcasting: the wrapped reader left {self._open} planned items undelivered")

    # ----------------------------------------------------------------------------- planner API
    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise DcpStorageError("Broadcasting: the routing planner is only used inside read_data")

    def create_local_plan(self) -> LoadPlan:
        raise DcpStorageError("Broadcasting: the routing planner is only used inside read_data")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise DcpStorageError("Broadcasting: the routing planner is only used inside read_data")

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise DcpStorageError("Broadcasting: the routing planner is only used inside read_data")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        job = self._claim(read_item)
        self._open -= 1
        # Our readers hand over VettedBytes; bytes from any other reader are vetted here, before they
        # reach a planner (this rank's or, through the process group, another's).
        vetted = ensure_vetted(value, f"item {read_item.storage_index.fqn!r} read by the wrapped reader")
        jobs = [job, *self._copies.get(id(job[2]), ())]
        deliver_bytes(jobs, vetted.getvalue(), self._me, self._real, self._sender, self._stats)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        job = self._claim(read_item)
        rank, _index, item = job
        if rank == self._me and id(item) not in self._copies:
            tensor = self._real.resolve_tensor(item)
        else:
            lengths = tuple(int(n) for n in item.lengths)
            tensor = host_buffer(lengths, self._stored_dtype(item), self._sender.view.device)
        self._staged[id(read_item)] = (job, tensor)
        if tensor.numel():
            self._staged[-tensor.data_ptr()] = (job, tensor)  # for readers that hand back another ReadItem
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        entry = self._staged.pop(id(read_item), None)
        if entry is None and tensor.numel():
            entry = self._staged.pop(-tensor.data_ptr(), None)
        if entry is None:
            raise DcpStorageError(f"Broadcasting: commit of an unresolved item {read_item.dest_index.fqn!r}")
        (rank, index, item), staged = entry
        if staged.numel():
            self._staged.pop(-staged.data_ptr(), None)
        self._open -= 1
        jobs = [(rank, index, item), *self._copies.get(id(item), ())]  # staged holds the stored bytes: deliver all
        deliver_tensor(jobs, staged, self._me, self._real, self._sender, self._stats, committed=tensor)
