"""A rank's half of "each stored byte read once per job": read its share, send it on, receive the rest.

Follows the :class:`~.read_once_plan.ExchangePlan` the coordinator attached to this rank's plan:

1. One read, through the reader's own loader, of the *solo* items (this rank's alone) and of every slice
   it reads for others whose destination can hold and send it: a contiguous tensor of the stored dtype
   on the transfer device (the reader always needs the slice itself). No memory beyond the
   destinations, and the loader sees everything at once: full concurrency, coalescing across slices.
2. Then every rank steps through the same rounds. In a round a rank first reads the slices it sends in
   that round that need staging (another dtype, device or layout: a buffer of the stored dtype, copied
   into the destination and kept until sent), then all of the round's sends and receives are posted at
   once (``batch_isend_irecv``: grouped for NCCL, plain non-blocking operations on gloo) and waited for.
   Payloads are the stored dtype's raw bytes on the group's device (CPU for gloo, the current CUDA device
   for NCCL); receivers land them in their destination directly when they can, else in a staging buffer
   then copied (and cast). Slices below ``pack_below`` travel packed, one message per pair of ranks.
3. After the first read, and in every round once its staged reads are done and every buffer it sends
   from or receives into is allocated (and every destination checked), a one-element ``all_reduce``
   checks that no rank failed (a storage error while reading, a destination of the wrong shape, memory
   that ran out): if one did, every rank raises its error (same class when it is one of ours) before any
   message of the round is posted, instead of waiting for slices that will never come. A failure while
   delivering received bytes is reported by the next round's check (or the last one).

Memory per rank and round, beyond the destinations: staging for the slices it sends that round and for
those it receives that round (each at most ``max_inflight_bytes``, or one larger slice), and packed copies
of small slices.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from dcp_storage.errors import DcpStorageError
from dcp_storage.runtime import host_buffer
from dcp_storage.strategies.collectives import RANK_FAILURES, GroupView
from dcp_storage.strategies.rank_agreement import agree as _agree
from dcp_storage.strategies.read_once_plan import ExchangePlan, RoundPlan, nbytes_of
from dcp_storage.strategies.slice_delivery import StandInPlanner, checked_destination

__all__ = ["run_exchange"]


class _Stored(Protocol):
    def dtype(self, item: ReadItem) -> torch.dtype: ...


ReadItems = Callable[[Sequence[ReadItem], LoadPlanner], None]


def run_exchange(
    plan: LoadPlan,
    exchange: ExchangePlan,
    planner: LoadPlanner,
    read_items: ReadItems,
    stored: _Stored,
    view: GroupView,
) -> None:
    """Carry out this rank's part (see the module docstring). Collective over ``view.group``."""
    items = plan.items
    failure: BaseException | None = None
    router = _Router(planner, stored, view.device)
    in_place: set[int] = set()
    if len(items) != exchange.items:
        failure = DcpStorageError(
            f"read_once: this rank's plan has {len(items)} items but the coordinator planned {exchange.items} "
            "(did the planner's finish_plan change the plan?)"
        )
    else:
        try:  # everything that needs no staging in one read: full concurrency and coalescing
            for part in exchange.rounds.values():
                for index, _packed, _to in part.reads:
                    router.share(items[index])
                    if router.in_place(items[index]):
                        in_place.add(index)
            first = [items[i] for i in exchange.solo] + [items[i] for i in sorted(in_place)]
            if first:
                read_items(first, router)
        except RANK_FAILURES as exc:  # every rank must hear of it (see _agree)
            failure = exc
    _agree(view, failure)
    for number in range(exchange.round_count):
        part = exchange.rounds.get(number)
        ready: _Round | None = None
        if part is not None and failure is None:
            try:
                staged = [items[i] for i, _p, _t in part.reads if i not in in_place]
                if staged:  # slices read for others through staging: one round's worth at a time
                    read_items(staged, router)
                ready = _Round(part, router, items, planner, stored, view)
            except RANK_FAILURES as exc:  # as above: nothing is posted until every rank is ready
                failure = exc
        _agree(view, failure)
        if ready is not None and part is not None:
            failure = ready.run(planner)
            router.release(items[index] for index, _p, _t in part.reads)
    _agree(view, failure)


class _Router(StandInPlanner):
    """Stands in for the real planner while this rank reads: slices it also sends are *shared*.

    A shared slice is read into the rank's own destination when the bytes can be sent from there (a
    contiguous tensor of the stored dtype on the transfer device: no extra memory), else into a staging
    buffer of the stored dtype that ``commit_tensor`` copies into the destination and that is kept until
    the slice is sent. Every other item goes to the real planner untouched.
    """

    def __init__(self, real: LoadPlanner, stored: _Stored, device: torch.device) -> None:
        super().__init__(real)
        self._stored = stored
        self._device = device
        self._shared: dict[int, ReadItem] = {}
        self._by_value: dict[ReadItem, ReadItem] = {}
        self._dest: dict[int, torch.Tensor] = {}
        self._buffer: dict[int, torch.Tensor] = {}
        self._sendable: dict[int, torch.Tensor] = {}

    def share(self, item: ReadItem) -> None:
        self._shared[id(item)] = item
        self._by_value[item] = item

    def _find(self, item: ReadItem) -> ReadItem | None:
        return self._shared.get(id(item)) or self._by_value.get(item)

    def in_place(self, item: ReadItem) -> bool:
        """Whether ``item`` (shared) is read straight into its destination and sent from there."""
        dest = self._dest.get(id(item))
        if dest is None:
            dest = self._dest[id(item)] = checked_destination(self._real, item)
        return dest.is_contiguous() and dest.dtype == self._stored.dtype(item) and dest.device == self._device

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        item = self._find(read_item)
        if item is None:
            return self._real.resolve_tensor(read_item)
        buffer = self._buffer.get(id(item))
        if buffer is None:
            dest = self._dest[id(item)] if id(item) in self._dest else checked_destination(self._real, item)
            self._dest[id(item)] = dest
            in_place = self.in_place(item)
            buffer = dest if in_place else host_buffer(tuple(dest.shape), self._stored.dtype(item), self._device)
            self._buffer[id(item)] = buffer
        return buffer

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        item = self._find(read_item)
        if item is None:
            self._real.commit_tensor(read_item, tensor)
            return
        dest, buffer = self._dest[id(item)], self._buffer[id(item)]
        if buffer is not dest:
            dest.copy_(buffer)
        self._real.commit_tensor(item, dest)
        self._sendable[id(item)] = buffer

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        self._real.load_bytes(read_item, value)

    def payload(self, item: ReadItem) -> torch.Tensor:
        """The committed bytes of shared ``item``, raw, on the transfer device."""
        buffer = self._sendable.get(id(item))
        if buffer is None:
            raise DcpStorageError(f"read_once: the reader left {item.dest_index.fqn!r} undelivered")
        return _raw(buffer, self._device)

    def release(self, items: Any) -> None:
        """Drop what was kept for sending ``items`` (they were sent)."""
        for item in items:
            for held in (self._sendable, self._buffer, self._dest):
                held.pop(id(item), None)


def _raw(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
    return flat if flat.device == device else flat.to(device)


class _Arrival:
    """A slice this rank receives: where its bytes land (its destination, or staging), and where they go."""

    def __init__(self, item: ReadItem, nbytes: int, dtype: torch.dtype) -> None:
        self.item = item
        self.nbytes = nbytes
        self.dtype = dtype
        self.dest: torch.Tensor | None = None
        self.landing: torch.Tensor | None = None  # raw bytes to receive into (None: nothing to receive)
        self.direct = False

    def prepare(self, planner: LoadPlanner, device: torch.device) -> None:
        self.dest = checked_destination(planner, self.item)
        self.direct = self.dest.is_contiguous() and self.dest.dtype == self.dtype and self.dest.device == device
        if self.nbytes:
            self.landing = (
                _raw(self.dest, device) if self.direct else torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            )

    def finish(self, planner: LoadPlanner, packed: torch.Tensor | None) -> None:
        """Deliver: from ``packed`` (this slice's bytes in a packed message), else from staging."""
        assert self.dest is not None  # prepared before the round's agreement
        raw = packed.clone() if packed is not None else (None if self.direct else self.landing)  # clone: aligned
        if raw is not None and raw.numel():
            self.dest.copy_(raw.view(self.dtype).reshape(self.dest.shape))
        planner.commit_tensor(self.item, self.dest)


class _Round:
    """One round's messages, made ready before the round's agreement: every buffer it sends or receives into
    is allocated and every destination checked first, so a rank that cannot take part (out of memory, a
    destination of the wrong shape) fails in the agreement, with every other rank, instead of leaving its
    peers in point-to-point operations it never posts until the process group's timeout."""

    def __init__(
        self,
        part: RoundPlan,
        router: _Router,
        items: Sequence[ReadItem],
        planner: LoadPlanner,
        stored: _Stored,
        view: GroupView,
    ) -> None:
        import torch.distributed as dist

        self.ops: list[Any] = []
        self.pending: list[tuple[_Arrival, torch.Tensor | None, int]] = []  # arrival, packed buffer, offset
        sends = {index: router.payload(items[index]) for index, _p, _t in part.reads}

        def peer(rank: int) -> int:
            return rank if view.group is None else dist.get_global_rank(view.group, rank)

        outgoing: dict[int, list[tuple[int, int, bool]]] = collections.defaultdict(list)
        for index, packed, targets in part.reads:
            for rank, their_index in targets:
                outgoing[rank].append((their_index, index, packed))
        for rank in sorted(outgoing):
            order = sorted(outgoing[rank])
            small = [sends[index] for _t, index, packed in order if packed and sends[index].numel()]
            if small:
                self.ops.append(dist.P2POp(dist.isend, torch.cat(small), peer(rank), view.group))
            for _t, index, packed in order:
                if not packed and sends[index].numel():
                    self.ops.append(dist.P2POp(dist.isend, sends[index], peer(rank), view.group))

        incoming: dict[int, list[tuple[int, bool]]] = collections.defaultdict(list)
        for src, index, packed in part.receives:
            incoming[src].append((index, packed))
        for src in sorted(incoming):
            arrivals = []
            for index, packed in sorted(incoming[src]):
                item = items[index]
                dtype = stored.dtype(item)
                arrival = _Arrival(item, nbytes_of(item, dtype), dtype)
                arrival.prepare(planner, view.device)
                arrivals.append((arrival, packed))
            total = sum(a.nbytes for a, packed in arrivals if packed)
            box = torch.empty(total, dtype=torch.uint8, device=view.device) if total else None
            if box is not None:
                self.ops.append(dist.P2POp(dist.irecv, box, peer(src), view.group))
            offset = 0
            for arrival, packed in arrivals:
                if packed:
                    self.pending.append((arrival, box, offset))
                    offset += arrival.nbytes
            for arrival, packed in arrivals:
                if not packed:
                    if arrival.landing is not None:
                        self.ops.append(dist.P2POp(dist.irecv, arrival.landing, peer(src), view.group))
                    self.pending.append((arrival, None, 0))

    def run(self, planner: LoadPlanner) -> BaseException | None:
        """Post the round's sends and receives, wait, deliver; returns the first local failure (not raised:
        the next agreement reports it on every rank)."""
        import torch.distributed as dist

        if self.ops:
            for work in dist.batch_isend_irecv(self.ops):
                work.wait()
        failure: BaseException | None = None
        for arrival, box, offset in self.pending:
            try:
                raw = box[offset : offset + arrival.nbytes] if box is not None else None
                arrival.finish(planner, raw)
            except RANK_FAILURES as exc:  # reported once the round is over on every rank
                failure = failure or exc
        return failure
