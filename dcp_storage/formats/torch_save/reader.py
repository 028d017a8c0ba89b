"""``BroadcastingTorchSaveReader``: load a ``torch.save`` file through DCP, read by one rank, safely.

A drop-in for ``torch.distributed.checkpoint.format_utils.BroadcastingTorchSaveReader``::

    dcp.load(sd, storage_reader=BroadcastingTorchSaveReader(), planner=DynamicMetaLoadPlanner(),
             checkpoint_id="s3://bucket/model.pt")

Differences from torch's class:

* any fsspec URL, through :class:`~dcp_storage.transports.Transport` (retries, ranged reads);
* never runs code from the file: ``data.pkl`` is decoded with an allow-list (like ``weights_only=True``,
  honouring ``torch.serialization.add_safe_globals``), unless you pass ``trust=True`` for a trusted file;
* the coordinator never holds the whole checkpoint: it indexes the zip, then reads tensor data slice by
  slice with ranged reads, holding at most about one tensor plus bounded send buffers;
* each rank receives only the slices of its own plan (point to point), not every full tensor;
* ``read_metadata`` returns real ``Metadata`` (so DCP's ``DefaultLoadPlanner`` works too, including
  non-tensor values, which torch's class refuses), read by the coordinator and broadcast;
* a bad file fails on every rank at once with the coordinator's error.

Call order (DCP's ``load`` drives it; "all" = every rank of the process group):

1. ``reset(checkpoint_id)`` (all) - point at a file.
2. ``read_metadata()`` (all, collective) - the coordinator indexes the archive; all get its Metadata or
   its error.
3. ``set_up_storage_reader(metadata, is_coordinator)`` (all).
4. ``prepare_local_plan`` (all) / ``prepare_global_plan`` (DCP's coordinator, which must be this reader's
   coordinator) - the coordinator checks every plan against the archive and keeps them.
5. ``read_data(plan, planner)`` (all, point to point) - the coordinator reads and sends; the others receive.

Pass the same ``process_group`` as to ``dcp.load`` (default: the default group).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, ShapeMismatchError
from dcp_storage.formats.location import raise_explained
from dcp_storage.formats.reading import SliceRead, plan_slice_read, read_slices
from dcp_storage.formats.torch_save import TorchSaveArchive, TorchSaveArchiveConfig
from dcp_storage.planners.planner import enforce_for, rules_of
from dcp_storage.runtime import HostBufferPool
from dcp_storage.strategies.collectives import GroupView, reader_location, running_planner
from dcp_storage.strategies.coordinator_served import (
    CoordinatorServedReader,
    Job,
    deliver_bytes,
    deliver_tensor,
    plan_jobs,
)
from dcp_storage.strategies.slice_delivery import DeliveryConfig, DeliveryStats, SliceSender
from dcp_storage.transports import Transport, TransportConfig, bind_transport
from dcp_storage.transports.guards import begin_load

__all__ = ["BroadcastingTorchSaveReader"]


class BroadcastingTorchSaveReader(CoordinatorServedReader):
    """Read a ``torch.save`` file on one rank and send every rank the slices it needs.

    Args:
        checkpoint_id: the file: a local path or any fsspec URL (``s3://b/model.pt``); may be given to
            ``dcp.load(checkpoint_id=...)`` instead.
        coordinator_rank: the rank (of ``process_group``) that reads; must be DCP's coordinator (rank 0
            unless ``dcp.load`` is told otherwise).
        storage_options: fsspec filesystem options (credentials, endpoint, ...).
        process_group: the group ``dcp.load`` uses; ``None``: the one ``dcp.load`` runs on (its
            ``process_group``, else the default group, or none at all).
        transport_config / archive_config / delivery_config: tuning (see each class).
        transport: an existing transport to read through (its counters then add up).
        trust: ``False`` (default): ``data.pkl`` is decoded by an allow-list (what a state dict pickles to,
            plus what you registered with ``torch.serialization.add_safe_globals`` or inside
            ``torch.serialization.safe_globals``); anything else raises
            :class:`~dcp_storage.errors.UnsafeCheckpointError` naming the global, and nothing runs.
            ``True``: an explicit opt-in for files from a source you trust: the file is decoded as
            ``torch.load(weights_only=False)`` would, so it may hold any object (an ``argparse.Namespace``,
            a config) and may run code while it is decoded, on the coordinator. Its non-tensor values then
            reach the planner's ``load_bytes`` as ``torch.save`` bytes: DCP's ``DefaultLoadPlanner`` decodes
            them with ``weights_only=False``; this package's planners with ``weights_only=True`` plus their
            ``safe_globals=[...]``.
        verify: check the zip CRC32 of every tensor the coordinator reads whole (a full-tensor load; a
            slice is not covered by its record's CRC) before any byte is delivered; on by default (the CRC
            is the format's own; ISA-L computes it at ~12 GB/s here), ``False`` turns it off
            (``dcp-storage verify --deep`` checks every record). ``data.pkl`` is always checked.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str] | None = None,
        coordinator_rank: int = 0,
        storage_options: dict[str, Any] | None = None,
        *,
        process_group: Any = None,
        transport_config: TransportConfig | None = None,
        archive_config: TorchSaveArchiveConfig | None = None,
        delivery_config: DeliveryConfig | None = None,
        transport: Transport | None = None,
        trust: bool = False,
        verify: bool = True,
    ) -> None:
        if not isinstance(trust, bool):
            raise TypeError(f"trust must be True or False, got {trust!r}")
        super().__init__(coordinator_rank, process_group, delivery_config)
        self.trust = trust
        self.checkpoint_id = os.fspath(checkpoint_id) if checkpoint_id is not None else None
        self.storage_options = dict(storage_options or {})
        self.transport_config = transport_config
        self.archive_config = archive_config or TorchSaveArchiveConfig()
        self.verify = verify
        self._given_transport = transport
        self._transport: Transport | None = None
        self._archive: TorchSaveArchive | None = None

    # ------------------------------------------------------------------------------------ state
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            new_id = os.fspath(checkpoint_id)
            if new_id != self.checkpoint_id:
                self._transport = None
            self.checkpoint_id = new_id
        self._archive = None
        self._reset_served()
        begin_load(
            self._transport or self._given_transport
        )  # each object pinned anew to the version this load sees first

    @property
    def stats(self) -> dict[str, Any]:
        """What this rank moved: delivery bytes/messages, and storage counters (coordinator only)."""
        out = self.delivery.as_dict()
        if self._transport is not None:
            out["storage"] = self._transport.counters.snapshot()
        else:
            out["storage"] = {"requests": 0, "bytes_read": 0, "bytes_written": 0, "retries": 0}
        return out

    def _open_transport(self) -> tuple[Transport, str]:
        if self.checkpoint_id is None:
            raise ValueError("BroadcastingTorchSaveReader: no checkpoint_id; pass it here or to dcp.load")
        given = self._given_transport or self._transport  # one transport for every checkpoint_id
        self._transport, path = bind_transport(self.checkpoint_id, self.storage_options, self.transport_config, given)
        return self._transport, path

    def _open_archive(self) -> TorchSaveArchive:
        if self._archive is None:
            transport, path = self._open_transport()
            try:
                self._archive = TorchSaveArchive.open(transport, path, self.archive_config, trust=self.trust)
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                # A missing bucket, or another format at the URL (a directory, a safetensors file): say which.
                raise_explained(transport, path, "torch_save", "BroadcastingTorchSaveReader", exc)
        return self._archive

    # ------------------------------------------------------------------------------------ metadata
    def read_metadata(self) -> Metadata:  # type: ignore[override]  # no rank-local metadata: no **kwargs
        """Index the file on the coordinator; every rank gets the Metadata, or raises the coordinator's error."""
        return self._share_metadata(lambda: self._open_archive().metadata(), reader_location(self))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._set_up(metadata, is_coordinator)
        self.is_coordinator = is_coordinator

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator only: check every rank's plan against the archive and remember it.

        Keys the file lacks (planned by a planner that describes the checkpoint from the state dict) raise
        :class:`~dcp_storage.planners.IncompatibleKeysError`, or are left out of the plans when the
        planner loads partially (``allow_partial_load=True``, ``strict=False``).
        """
        plans = self._untag(plans)
        archive = self._open_archive()
        held = archive.flat
        items = [i for p in plans for i in p.items]
        absent = {i.dest_index.fqn: i.storage_index.fqn for i in items if i.storage_index.fqn not in held}
        if absent:
            planner = running_planner()
            if rules_of(planner).fail_on_missing:
                wanted = {i.storage_index.fqn for i in items}
                unexpected = [k for k in held if k not in wanted]
                enforce_for(planner, sorted(absent), unexpected, len(wanted) - len(set(absent.values())))
            plans = [dataclasses.replace(p, items=[i for i in p.items if i.storage_index.fqn in held]) for p in plans]
        for rank, plan in enumerate(plans):
            for item in plan.items:
                _check_item(archive, item, rank)
        self._plans = list(plans)
        return plans

    # ------------------------------------------------------------------------------------ data
    def _send_slices(
        self, view: GroupView, plan: LoadPlan, plans: list[LoadPlan], planner: LoadPlanner, sender: SliceSender
    ) -> None:
        archive = self._open_archive()
        _check_global_shapes(archive, planner, plans)
        _Server(archive, planner, view, plans, sender, self.delivery_config, self.delivery, self.verify).run()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A local file, or a URL fsspec understands (not checked for existence: that needs I/O)."""
        text = os.fspath(checkpoint_id)
        if "://" not in text:
            return os.path.isfile(text)
        import fsspec

        try:
            fsspec.core.url_to_fs(text)
        except (ValueError, ImportError, TypeError):
            return False
        return True


def _check_item(archive: TorchSaveArchive, item: ReadItem, rank: int) -> None:
    """Fail in the global plan step (which DCP reports on every rank) rather than mid-transfer."""
    fqn = item.storage_index.fqn
    if item.type == LoadItemType.BYTE_IO:
        if fqn not in archive.flat or fqn in archive.tensors:
            raise CorruptCheckpointError(
                f"{archive.url}: rank {rank} loads value {fqn!r}, which the file does not hold"
            )
        return
    desc = archive.tensors.get(fqn)
    if desc is None:
        what = "a non-tensor value" if fqn in archive.flat else "no such key"
        raise CorruptCheckpointError(f"{archive.url}: rank {rank} loads tensor {fqn!r}, but the file has {what}")
    offsets = _global_offsets(item)
    lengths = tuple(int(n) for n in item.lengths)
    if len(offsets) != len(desc.shape) or any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, desc.shape)):
        raise ShapeMismatchError(
            f"{archive.url}: tensor {fqn!r} has shape {list(desc.shape)} in the file, but rank {rank} loads the slice "
            f"at {list(offsets)} of size {list(lengths)} (does the state dict have the file's shapes?)"
        )


def _check_global_shapes(archive: TorchSaveArchive, planner: LoadPlanner, plans: Sequence[LoadPlan]) -> None:
    """Refuse a file tensor whose shape differs from the one the planner describes.

    A planner that builds Metadata from the state dict (``DynamicMetaLoadPlanner``) plans slices of the
    *destination's* shape; a smaller destination would otherwise silently get a corner of a bigger tensor.
    """
    md = getattr(getattr(planner, "metadata", None), "state_dict_metadata", None)
    if not isinstance(md, Mapping):  # a dict, or views of columns (lazy_metadata)
        return
    for fqn in {item.storage_index.fqn for plan in plans for item in plan.items}:
        entry, desc = md.get(fqn), archive.tensors.get(fqn)
        if isinstance(entry, TensorStorageMetadata) and desc is not None and tuple(entry.size) != desc.shape:
            raise ShapeMismatchError(
                f"{archive.url}: tensor {fqn!r} has shape {list(desc.shape)} in the file but {list(entry.size)} in "
                "the state dict being loaded"
            )


def _global_offsets(item: ReadItem) -> tuple[int, ...]:
    """Slice start in the whole tensor: the chunk's offset (DCP metadata) plus the offset within the chunk.

    With our Metadata the one chunk starts at 0; with torch's ``DynamicMetaLoadPlanner`` the chunk is the
    rank's own shard, described by the state dict, and ``storage_offsets`` are relative to it.
    """
    base = item.storage_index.offset
    rel = tuple(int(o) for o in item.storage_offsets)
    if base is None:
        return rel
    return tuple(int(b) + o for b, o in zip(base, rel))


class _Server:
    """The coordinator's ``read_data``: read slices tensor by tensor in file order; deliver or send each."""

    def __init__(
        self,
        archive: TorchSaveArchive,
        planner: LoadPlanner,
        view: GroupView,
        plans: Sequence[LoadPlan],
        sender: SliceSender,
        config: DeliveryConfig,
        stats: DeliveryStats,
        verify: bool = False,
    ) -> None:
        self.archive = archive
        self.verify = verify  # check the zip CRC32 of every tensor read whole
        self.planner = planner
        self.view = view
        self.plans = plans
        self.sender = sender
        self.config = config
        self.stats = stats
        self._largest = max((d.nbytes for d in archive.tensors.values()), default=0)
        self._own: dict[int, torch.Tensor | None] = {}  # id of a slice's jobs -> _own_buffer
        # Staging of slices only sent, reused once their sends are done; within the bytes a full load stages.
        self._pool = HostBufferPool(view.device, max(self._largest, config.staging_bytes))
        self._pooled: set[int] = set()  # ids of the staging tensors taken from the pool and in use

    def run(self) -> None:
        # Identical slices wanted by several ranks (replicated tensors, full loads) are read once.
        slices: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, int, ReadItem]]] = {}
        values: dict[str, list[tuple[int, int, ReadItem]]] = {}
        for rank, index, item in plan_jobs(self.plans):
            if item.type == LoadItemType.BYTE_IO:
                values.setdefault(item.storage_index.fqn, []).append((rank, index, item))
            else:
                key = (item.storage_index.fqn, _global_offsets(item), tuple(int(n) for n in item.lengths))
                slices.setdefault(key, []).append((rank, index, item))
        for fqn, jobs in values.items():  # each value decoded once, for every rank that loads it, then dropped
            data = self.archive.value_bytes(fqn)  # torch.save of an allow-list decode: vetted
            deliver_bytes(jobs, data, self.view.rank, self.planner, self.sender, self.stats)
            del data
        by_tensor: dict[str, list[tuple[tuple[int, ...], list[tuple[int, int, ReadItem]]]]] = {}
        for (fqn, offsets, _lengths), jobs in slices.items():
            by_tensor.setdefault(fqn, []).append((offsets, jobs))
        # Slices only this rank loads are read between the batches of slices it sends, in proportion, so that
        # the sends in flight and this rank's own reading overlap all along (in file order, a 2 GiB Shard(0)
        # load at 2 ranks spent 0.35 s of its 0.98 s waiting for sends; 0.95 s now, with the pooled staging).
        # An own slice whose stored bytes interleave with a sent one's (columns of one tensor) stays beside it:
        # one read of the shared span serves both. So do all of them from object stores, where a separate
        # request per slice would fetch more (each request's read-ahead) for a network that is not the bound.
        apart_ok = bool(self.archive.transport.is_local)
        remote: list[list[tuple[int, int, ReadItem]]] = []
        own: collections.deque[list[tuple[int, int, ReadItem]]] = collections.deque()
        for fqn in self.archive.file_order():
            entries = sorted(by_tensor.pop(fqn, []), key=lambda entry: entry[0])
            sent = [self._span(jobs) for _o, jobs in entries if any(r != self.view.rank for r, _i, _t in jobs)]
            for _offsets, jobs in entries:
                mine = all(rank == self.view.rank for rank, _i, _item in jobs)
                low, high = self._span(jobs)
                apart = all(high <= a or b <= low for a, b in sent)
                (own if mine and apart and apart_ok else remote).append(jobs)
        if by_tensor:  # _check_item ran in prepare_global_plan; this is a plan that changed after it
            raise CorruptCheckpointError(f"{self.archive.url}: the file has no tensors {sorted(by_tensor)}")
        own_total = sum(self._slice_bytes(jobs) for jobs in own)
        remote_total = sum(self._slice_bytes(jobs) for jobs in remote) or 1
        own_read = remote_read = 0
        for batch, held in self._batches(remote):
            remote_read += sum(self._slice_bytes(jobs) for jobs in batch)
            own_read += self._read_own(own, own_total * remote_read // remote_total - own_read)
            self._flush(batch, held)
        while own:
            self._read_own(own, self.config.staging_bytes)

    def _batches(
        self, entries: list[list[tuple[int, int, ReadItem]]]
    ) -> Iterator[tuple[list[list[tuple[int, int, ReadItem]]], int]]:
        """``entries`` in order, cut into batches of at most one staging budget (at least one entry each),
        with the staging bytes each holds."""
        batch: list[list[tuple[int, int, ReadItem]]] = []
        held = 0
        for jobs in entries:
            size = self._staging_size(jobs)
            if batch and held + size > self.config.staging_bytes:
                yield batch, held
                batch, held = [], 0
            batch.append(jobs)
            held += size
        if batch:
            yield batch, held

    def _read_own(self, own: collections.deque[list[tuple[int, int, ReadItem]]], nbytes: int) -> int:
        """Read the next of this rank's own slices, about ``nbytes`` of them in batches of at most one staging
        budget (none when ``nbytes`` <= 0); the bytes read."""
        done = 0
        while own and done < nbytes:
            batch, size = [], 0
            while own and done + size < nbytes and (not batch or size < self.config.staging_bytes):
                jobs = own.popleft()
                size += self._slice_bytes(jobs)
                batch.append(jobs)
            self._flush(batch, 0)
            done += size
        return done

    def _span(self, jobs: list[tuple[int, int, ReadItem]]) -> tuple[int, int]:
        """The elements of the tensor's storage a slice lies within: [first, last + 1) ((0, 0) when empty)."""
        item = jobs[0][2]
        desc = self.archive.tensors[item.storage_index.fqn]
        offsets, lengths = _global_offsets(item), [int(n) for n in item.lengths]
        if any(n == 0 for n in lengths):
            return 0, 0
        first = sum(o * st for o, st in zip(offsets, desc.stride))
        return first, first + sum((n - 1) * st for n, st in zip(lengths, desc.stride)) + 1

    def _slice_bytes(self, jobs: list[tuple[int, int, ReadItem]]) -> int:
        item = jobs[0][2]
        return math.prod(int(n) for n in item.lengths) * self.archive.tensors[item.storage_index.fqn].itemsize

    def _staging_size(self, jobs: list[tuple[int, int, ReadItem]]) -> int:
        if all(rank == self.view.rank for rank, _i, _item in jobs):
            return 0  # read straight into the destination (or a staging buffer of its own size)
        # A slice sent from this rank's destination (_own_buffer) counts too: resolving every destination here,
        # before any read, would make a planner that hands out staging tensors allocate them all at once.
        return self._slice_bytes(jobs)

    def _flush(self, batch: list[list[tuple[int, int, ReadItem]]], held: int) -> None:
        # Let earlier sends drain before holding more, but read on while they and these slices fit in the bytes
        # of the largest tensor, which a full load stages anyway: reads overlap sends, the peak stays the same.
        self.sender.reserve(held, limit=self._largest)
        works: list[SliceRead] = []
        for jobs in batch:
            item = jobs[0][2]
            stored = self.archive.stored(item.storage_index.fqn)
            lengths = tuple(int(n) for n in item.lengths)
            own = self._own_buffer(jobs)
            if len(jobs) == 1 and jobs[0][0] == self.view.rank:
                dest = self.planner.resolve_tensor(item).detach()
            elif own is not None:  # read into this rank's destination, sent from there
                dest = own
            else:
                dest = self._pool.take(lengths, stored.dtype)
                self._pooled.add(id(dest))
            work = plan_slice_read(jobs, stored, _global_offsets(item), lengths, dest)
            if self.verify:
                work.check = self.archive.crc_check(item.storage_index.fqn, _global_offsets(item), lengths)
            works.append(work)
        read_slices(self.archive.transport, works, self._done, staging_bytes=1 << 62)

    def _own_buffer(self, jobs: list[tuple[int, int, ReadItem]]) -> torch.Tensor | None:
        """This rank's destination of a slice other ranks load too, when the read can land there and the sends
        go from it (contiguous, the stored dtype, on the transfer device, the slice's shape): no staging buffer
        and no copy (a load into full tensors: every tensor). Resolved once per slice."""
        key = id(jobs)
        if key not in self._own:
            mine = [item for rank, _i, item in jobs if rank == self.view.rank]
            dest = self.planner.resolve_tensor(mine[0]).detach() if len(jobs) > 1 and len(mine) == 1 else None
            desc = self.archive.tensors.get(jobs[0][2].storage_index.fqn)
            fits = (
                dest is not None
                and desc is not None
                and dest.is_contiguous()
                and dest.dtype == desc.dtype
                and dest.device == self.view.device
                and list(dest.shape) == [int(n) for n in mine[0].lengths]
            )
            self._own[key] = dest if fits else None
        return self._own[key]

    def _done(self, work: SliceRead) -> None:
        jobs: list[Job] = work.key  # type: ignore[assignment]
        own = self._own.get(id(jobs))
        in_place = own is not None and work.dest is own  # read into this rank's destination: sent from it
        deliver_tensor(jobs, work.dest, self.view.rank, self.planner, self.sender, self.stats, in_place=in_place)
        if id(work.dest) in self._pooled:  # back to the pool once every send of it is done
            self._pooled.discard(id(work.dest))
            self.sender.after_sent(lambda staged=work.dest: self._pool.give_back(staged))
