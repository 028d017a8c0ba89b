"""The coordinator's half of "each stored byte read once per job": who reads which shared slice, and when.

Input: every rank's load plan (DCP gathers them on the coordinator for ``prepare_global_plan``). Output:
the same plans, each carrying in ``storage_data`` an :class:`ExchangePlan` for its rank. Steps:

1. **Group** read items by the stored slice they name (storage index, offsets, lengths; with hosts, also
   the host). A slice in one rank's plan only is *solo*: that rank reads it as usual. ``BYTE_IO`` items
   (small non-tensor values whose decoded size the coordinator cannot know) are always solo.
2. **Split** shared slices whose reader says they can be fetched in parts into row blocks (along dim 0)
   of at most ``split_bytes``, smaller when the shared bytes are few (about four blocks per rank, never
   below 1 MiB), so a big replicated tensor is read by all its replicas, a block each.
3. **Assign** each shared slice to one of the ranks that need it, largest first, to the one with the
   fewest bytes to read so far (solo bytes included): bytes read per rank balanced, each slice fetched by
   exactly one rank.
4. **Schedule** the deliveries in rounds. In a round a rank holds at most ``max_inflight_bytes`` of
   slices it read for others and at most as much received into staging (a single larger slice travels
   alone). Rounds follow every reader's progress through its list, so all ranks read and send at once.

Everything here is plain data in, plain data out: no process group, no I/O (the scale model in
``benchmarks/scale_model.py`` runs it for thousands of ranks in one process).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from dcp_storage.strategies.slice_delivery import DeliveryConfig

__all__ = ["ExchangePlan", "RankInfo", "ReadOnceConfig", "RoundPlan", "plan_read_once"]


class _Stored(Protocol):
    def dtype(self, item: ReadItem) -> torch.dtype: ...

    def splittable(self, item: ReadItem) -> bool: ...


@dataclass(frozen=True)
class ReadOnceConfig:
    """Limits of :func:`plan_read_once` (see :meth:`~.read_strategy.ReadStrategies.read_once`)."""

    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    split_bytes: int = 8 << 20
    pack_below: int = 64 << 10

    def __post_init__(self) -> None:
        if self.split_bytes < 1 or self.pack_below < 0:
            raise ValueError("ReadOnceConfig: split_bytes must be >= 1 and pack_below >= 0")

    @property
    def round_bytes(self) -> int:
        return self.delivery.max_inflight_bytes


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the coordinator in its local plan's ``storage_data``: its host."""

    host: str


@dataclass
class RoundPlan:
    """One round, for one rank.

    ``reads``: ``(item index, packed, ((rank, that rank's item index), ...))``: slices this rank fetches
    (into its own destination) and sends on. ``receives``: ``(source rank, item index, packed)``. Between
    two ranks, a round's slices travel in the receiver's item order: the packed ones in one message
    first, then each other one in a message of its own.
    """

    reads: list[tuple[int, bool, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    receives: list[tuple[int, int, bool]] = field(default_factory=list)


@dataclass
class ExchangePlan:
    """A rank's part of a read-once load: ``items`` is how many items its plan has (checked on arrival).

    ``rounds`` holds the rounds this rank takes part in, by number; every rank steps through all
    ``round_count`` rounds (each ends with a check that no rank failed).
    """

    items: int
    solo: list[int]
    round_count: int
    rounds: dict[int, RoundPlan] = field(default_factory=dict)


_MIN_BLOCK = 1 << 20  # smaller row blocks would cost more in requests than they gain in balance


def nbytes_of(item: ReadItem, dtype: torch.dtype) -> int:
    return math.prod(int(n) for n in item.lengths) * dtype.itemsize


def _slice_key(item: ReadItem) -> tuple[Any, ...]:
    return (item.storage_index, tuple(item.storage_offsets), tuple(item.lengths))


def _blocks(item: ReadItem, nbytes: int, target: int) -> list[tuple[int, int]]:
    """Row blocks ``(start, rows)`` of about ``target`` bytes along dim 0 (the whole item if it cannot be cut)."""
    rows = int(item.lengths[0]) if len(item.lengths) else 0
    if rows < 2 or nbytes <= target:
        return [(0, rows)]
    count = min(rows, math.ceil(nbytes / target))
    step, extra = divmod(rows, count)
    out, start = [], 0
    for i in range(count):
        n = step + (1 if i < extra else 0)
        out.append((start, n))
        start += n
    return out


def _block_of(item: ReadItem, start: int, rows: int) -> ReadItem:
    if start == 0 and (not item.lengths or rows == int(item.lengths[0])):
        return item

    def shift(offsets: Any) -> torch.Size:
        return torch.Size([int(offsets[0]) + start, *offsets[1:]])

    return dataclasses.replace(
        item,
        dest_offsets=shift(item.dest_offsets),
        storage_offsets=shift(item.storage_offsets),
        lengths=torch.Size([rows, *item.lengths[1:]]),
    )


@dataclass
class _Shared:
    """One shared slice (or block): who needs it, at which item index, and who reads it."""

    members: list[tuple[int, int]]  # (rank, item index in that rank's new plan)
    nbytes: int
    order: tuple[Any, ...]  # storage order, so a reader's slices of one file stay together
    reader: int = -1


def plan_read_once(
    plans: Sequence[LoadPlan], stored: _Stored, config: ReadOnceConfig, hosts: Sequence[str] | None = None
) -> list[LoadPlan]:
    """Every rank's plan with its :class:`ExchangePlan` (see the module docstring)."""
    world = len(plans)
    groups: dict[tuple[Any, ...], list[tuple[int, ReadItem]]] = {}
    new_items: list[list[ReadItem]] = [[] for _ in plans]
    solo: list[list[int]] = [[] for _ in plans]
    load = [0] * world
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                solo[rank].append(len(new_items[rank]))
                new_items[rank].append(item)
                continue
            key = _slice_key(item) if hosts is None else (*_slice_key(item), hosts[rank])
            groups.setdefault(key, []).append((rank, item))

    sized = []
    for members in groups.values():
        rank0, item0 = members[0]
        dtype = stored.dtype(item0)
        nbytes = nbytes_of(item0, dtype)
        if len(members) == 1:
            solo[rank0].append(len(new_items[rank0]))
            new_items[rank0].append(item0)
            load[rank0] += nbytes
        else:
            sized.append((members, dtype, nbytes))
    total = sum(nbytes for _m, _d, nbytes in sized)
    block_bytes = max(min(config.split_bytes, _MIN_BLOCK), min(config.split_bytes, total // (4 * world)))

    shared: list[_Shared] = []
    for members, dtype, nbytes in sized:
        rank0, item0 = members[0]
        cut = nbytes > block_bytes and stored.splittable(item0)
        blocks = _blocks(item0, nbytes, block_bytes) if cut else [(0, -1)]
        order = (item0.storage_index.fqn, tuple(item0.storage_index.offset or ()), tuple(item0.storage_offsets))
        for start, rows in blocks:
            placed = []
            made: dict[int, ReadItem] = {}  # replicas often share one item object: one block object too
            for rank, item in members:
                block = made.get(id(item))
                if block is None:
                    block = made[id(item)] = item if rows < 0 else _block_of(item, start, rows)
                placed.append((rank, len(new_items[rank])))
                new_items[rank].append(block)
            size = nbytes if rows < 0 else nbytes_of(new_items[rank0][placed[0][1]], dtype)
            shared.append(_Shared(placed, size, (*order, start)))

    for entry in sorted(shared, key=lambda s: -s.nbytes):  # largest first, to the least loaded member
        entry.reader = min((load[rank], rank) for rank, _i in entry.members)[1]
        load[entry.reader] += entry.nbytes

    rounds = _schedule(shared, world, config.round_bytes)
    exchanges = [ExchangePlan(len(new_items[rank]), solo[rank], len(rounds)) for rank in range(world)]
    for number, entries in enumerate(rounds):
        for entry in entries:
            packed = entry.nbytes < config.pack_below
            mine = next(i for rank, i in entry.members if rank == entry.reader)
            others = tuple(sorted((rank, i) for rank, i in entry.members if rank != entry.reader))
            exchanges[entry.reader].rounds.setdefault(number, RoundPlan()).reads.append((mine, packed, others))
            for rank, index in others:
                exchanges[rank].rounds.setdefault(number, RoundPlan()).receives.append((entry.reader, index, packed))
    return [
        dataclasses.replace(plan, items=new_items[rank], storage_data=exchanges[rank])
        for rank, plan in enumerate(plans)
    ]


def _schedule(shared: list[_Shared], world: int, budget: int) -> list[list[_Shared]]:
    """Rounds of deliveries: each rank sends and receives at most ``budget`` bytes per round (a larger slice
    alone), in the order of every reader's progress through its own slices."""
    queues: list[list[_Shared]] = [[] for _ in range(world)]
    for entry in shared:
        queues[entry.reader].append(entry)
    timeline: list[tuple[int, int, int, _Shared]] = []
    for reader, queue in enumerate(queues):
        queue.sort(key=lambda s: s.order)
        done = 0
        for position, entry in enumerate(queue):
            timeline.append((done, reader, position, entry))
            done += entry.nbytes
    timeline.sort(key=lambda t: t[:3])
    rounds: list[list[_Shared]] = []
    current: list[_Shared] = []
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for _start, reader, _position, entry in timeline:
        n = entry.nbytes
        receivers = [rank for rank, _i in entry.members if rank != reader]
        held = sent.get(reader, 0)
        full = 0 < held and held + n > budget
        full = full or any(0 < received.get(r, 0) and received.get(r, 0) + n > budget for r in receivers)
        if full:
            rounds.append(current)
            current, sent, received = [], {}, {}
        current.append(entry)
        sent[reader] = sent.get(reader, 0) + n
        for r in receivers:
            received[r] = received.get(r, 0) + n
    if current:
        rounds.append(current)
    return rounds
