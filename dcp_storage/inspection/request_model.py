"""What a distributed load asks of storage, worked out without storage, processes or tensors.

For a checkpoint's DCP ``Metadata`` (a real one, or :func:`~.synthetic_metadata.synthetic_transformer`'s) and a job layout
(:class:`JobLayout`: world size, GPUs per host, a ``(replicate, shard)`` mesh), :func:`model_load` runs
the planning code a real load runs on every rank and counts, per read strategy, the storage requests and
bytes each rank makes, the metadata requests, and the bytes ranks send each other:

* each rank's load plan: torch's ``create_read_items_for_chunk_list`` (what ``DefaultLoadPlanner`` calls
  for a sharded tensor) with the rank's local box (``Replicate``/``Shard(0)`` placements);
* who reads what: ``per_rank`` (each rank its plan), ``broadcasting`` (rank 0 every distinct slice any
  rank needs, chunked as :class:`~dcp_storage.strategies.Broadcasting` chunks them), ``read_once`` / ``per_host``
  (:func:`~dcp_storage.strategies.read_once_plan.plan_read_once`; one read of a rank's solo items and of
  every slice it reads for others, as for destinations that hold their slices in place);
* how a read becomes requests: what :class:`~dcp_storage.formats.dcp_native.item_loader.DcpItemLoader`
  does per read call (a ``HEAD`` per data file, records up to 256 KiB fetched whole, a 4 KiB header probe
  per larger record, then each slice's byte runs from :func:`~dcp_storage.formats.slices.slice_runs`; or,
  when every larger record's layout is guessed from its length, its header with its runs and the whole
  records in one round), grouped by the transport's :func:`~dcp_storage.transports.ranges.plan_fetches`
  (256 KiB coalescing, 32 MiB parts).

Ranks whose plans are equal (replicas) share one plan object, and independent replica groups whose
structure is the same (every ``Shard`` coordinate of an HSDP mesh) are planned once and counted for each,
so thousands of ranks fit in one process. Header sizes of records are estimated (a record's data is taken
to end 512 bytes before the record does), which moves byte runs by a few hundred bytes, not the counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_storage.formats.dcp_native.torch_record import predicted_record
from dcp_storage.formats.slices import count_runs, slice_runs
from dcp_storage.inspection.summary import RECORD_TRAILER, even_split, synthetic_transformer
from dcp_storage.strategies.read_once_plan import ReadOnceConfig, plan_read_once
from dcp_storage.strategies.read_strategy import MetadataItems
from dcp_storage.transports.ranges import RangeRequest, plan_fetches

__all__ = ["STRATEGIES", "JobLayout", "LoadModel", "ModelConfig", "model_load", "synthetic_transformer"]

STRATEGIES = ("per_rank", "broadcasting", "read_once", "per_host")

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True)
class ModelConfig:
    """The loader and transport settings the counts follow (the library's defaults)."""

    probe_bytes: int = 4 * KiB
    small_item_bytes: int = 256 * KiB
    coalesce_gap: int = 256 * KiB
    max_request_bytes: int = 32 * MiB
    staging_bytes: int = 32 * MiB  # Broadcasting's read-ahead per chunk
    read_once: ReadOnceConfig = field(default_factory=ReadOnceConfig)
    # Per-load files fetched once by the coordinator: ``.metadata``, and the manifest ``.dcp_storage.json``
    # that a default (verified) load of a checkpoint this library wrote also reads.
    per_load_files: int = 2
    # Records whose layout their length gives away are not probed (``DcpLoaderConfig.guess_layouts``, on by
    # default on object stores): their headers come with their data.
    guess_layouts: bool = True


@dataclass(frozen=True)
class JobLayout:
    """``world`` ranks, ``gpus_per_host`` per host, on a ``(world // shard, shard)`` mesh with placements
    ``(Replicate, Shard(0))``: ``shard=1`` is DDP, ``shard=world`` is FSDP, anything between is HSDP."""

    world: int
    gpus_per_host: int = 8
    shard: int = 8

    def __post_init__(self) -> None:
        if self.world < 1 or self.shard < 1 or self.world % self.shard or self.gpus_per_host < 1:
            raise ValueError(f"JobLayout: world {self.world} must be a multiple of shard {self.shard}")

    @property
    def replicas(self) -> int:
        return self.world // self.shard

    def host(self, rank: int) -> str:
        return f"host{rank // self.gpus_per_host}"


@dataclass
class RankCounts:
    gets: int = 0
    heads: int = 0
    bytes: int = 0


@dataclass
class LoadModel:
    """Counts for one strategy: per-rank storage requests and bytes, metadata requests, exchange."""

    strategy: str
    per_rank: list[RankCounts]  # every rank planned; ``groups`` times as many ranks in the job
    groups: int
    metadata_gets: int
    exchanged_bytes: int = 0  # payload bytes sent between ranks, every group
    cross_host_bytes: int = 0
    rounds: int = 0

    @property
    def gets(self) -> int:
        return self.groups * sum(c.gets for c in self.per_rank) + self.metadata_gets

    @property
    def heads(self) -> int:
        return self.groups * sum(c.heads for c in self.per_rank)

    @property
    def bytes(self) -> int:
        return self.groups * sum(c.bytes for c in self.per_rank)

    @property
    def max_rank_bytes(self) -> int:
        return max(c.bytes for c in self.per_rank)

    @property
    def max_rank_requests(self) -> int:
        return max(c.gets + c.heads for c in self.per_rank)


def _plan_for_shard(metadata: Metadata, coordinate: int, shard: int) -> LoadPlan:
    """The load plan of a rank holding ``Shard(0)`` coordinate ``coordinate`` of ``shard`` of every tensor."""
    items: list[ReadItem] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            index, zero = MetadataIndex(fqn), torch.Size([0])
            items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))  # as DefaultLoadPlanner
            continue
        size = list(md.size)
        if not size:
            box = ChunkStorageMetadata(torch.Size([]), torch.Size([]))
        else:
            pieces = even_split(size[0], shard)
            if coordinate >= len(pieces):
                continue
            start, rows = pieces[coordinate]
            box = ChunkStorageMetadata(torch.Size([start, *[0] * (len(size) - 1)]), torch.Size([rows, *size[1:]]))
        items += create_read_items_for_chunk_list(fqn, md, [box])
    return LoadPlan(items)


class _Reads:
    """Turns read calls into requests, as one rank's loader and transport would."""

    def __init__(self, metadata: Metadata, config: ModelConfig) -> None:
        self.md = metadata.state_dict_metadata
        self.storage = metadata.storage_data
        self.config = config
        self.chunk_shapes: dict[MetadataIndex, list[int]] = {}

    def count(self, calls: Iterable[Sequence[ReadItem]], out: RankCounts, one_loader: bool = True) -> None:
        """``calls``: the item lists of successive ``load`` calls. ``one_loader``: all through one loader
        (one ``read_data``: a file's size is asked once), else a loader per call (``Broadcasting``'s chunks)."""
        sized: set[str] = set()
        for items in calls:
            if items:
                files = self._call(items, out)
                out.heads += len(files - sized) if one_loader else len(files)
                sized |= files

    def _fetch(self, requests: list[RangeRequest], out: RankCounts) -> None:
        for group in plan_fetches(requests, self.config.coalesce_gap, self.config.max_request_bytes):
            out.gets += 1
            out.bytes += group.end - group.start

    def _call(self, items: Sequence[ReadItem], out: RankCounts) -> set[str]:
        """One ``DcpItemLoader.load``: sizes; whole records and header probes (one round), every slice's runs;
        or, when every probed record's layout is guessed, all of it in one round."""
        cfg = self.config
        entries: dict[tuple[str, int, int], list[ReadItem]] = {}
        for item in items:
            info = self.storage[item.storage_index]
            entries.setdefault((info.relative_path, int(info.offset), int(info.length)), []).append(item)
        whole, probes, heads, runs = [], [], [], []
        for (path, offset, length), group in entries.items():
            first, info = group[0], self.storage[group[0].storage_index]
            small = length <= max(cfg.small_item_bytes, cfg.probe_bytes)
            if first.type == LoadItemType.BYTE_IO or small or getattr(info, "transform_descriptors", None):
                whole.append(RangeRequest(path, offset, offset + length))
                continue
            md = self.md[first.storage_index.fqn]
            shape, dtype = self._chunk_shape(md, first), md.properties.dtype  # type: ignore[union-attr]
            rec = predicted_record(dtype, tuple(shape), length) if cfg.guess_layouts else None
            if rec is not None:
                gap = max(0, cfg.probe_bytes - rec.data_start)  # as the loader: no more than the probe it replaces
                heads.append(RangeRequest(path, offset, offset + rec.data_start, max_gap=gap))
                runs += [r for i in group for r in self._runs(i, info, offset + rec.data_start)]
            else:
                probes.append(RangeRequest(path, offset, offset + min(cfg.probe_bytes, length)))
                base = offset + length - RECORD_TRAILER - math.prod(shape) * dtype.itemsize
                runs += [r for i in group for r in self._runs(i, info, base)]
        if heads and not probes:  # whole records merged across record overheads only, as the headers
            whole = [RangeRequest(r.path, r.start, r.end, max_gap=cfg.probe_bytes) for r in whole]
            self._fetch(whole + heads + runs, out)
        else:
            self._fetch(whole + probes, out)
            self._fetch(heads + runs, out)
        return {path for path, _o, _n in entries}

    def _runs(self, item: ReadItem, info: Any, base: int) -> list[RangeRequest]:
        """The byte runs of a slice whose tensor's data starts at ``base`` (``plan_slice_read``'s: a dense slice
        of many runs is read as its span)."""
        md = self.md[item.storage_index.fqn]
        shape = self._chunk_shape(md, item)
        itemsize = md.properties.dtype.itemsize
        offsets, lengths = [int(o) for o in item.storage_offsets], [int(n) for n in item.lengths]
        if math.prod(lengths) == 0:
            return []
        runs = count_runs(shape, offsets, lengths)
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        span = sum((n - 1) * st for n, st in zip(lengths, strides)) + 1
        if runs >= 64 and (span - math.prod(lengths)) * itemsize <= self.config.coalesce_gap * (runs - 1):
            first = sum(o * st for o, st in zip(offsets, strides))
            start = base + first * itemsize
            return [RangeRequest(info.relative_path, start, start + span * itemsize)]
        starts, run = slice_runs(shape, offsets, lengths, itemsize, base)
        return [RangeRequest(info.relative_path, s, s + run) for s in starts]

    def _chunk_shape(self, md: TensorStorageMetadata, item: ReadItem) -> list[int]:
        shape = self.chunk_shapes.get(item.storage_index)
        if shape is None:
            offset = list(item.storage_index.offset or [])
            for chunk in md.chunks:
                self.chunk_shapes[MetadataIndex(item.storage_index.fqn, chunk.offsets)] = list(chunk.sizes)
            shape = self.chunk_shapes.get(item.storage_index)
            if shape is None:
                raise KeyError(f"no chunk of {item.storage_index.fqn!r} at {offset}")
        return shape


def _nbytes(item: ReadItem, stored: MetadataItems) -> int:
    if item.type == LoadItemType.BYTE_IO:
        return 0
    return math.prod(int(n) for n in item.lengths) * stored.dtype(item).itemsize


def model_load(
    metadata: Metadata,
    layout: JobLayout,
    strategies: Sequence[str] = STRATEGIES,
    config: ModelConfig | None = None,
    enumerate_up_to: int = 64,
) -> dict[str, LoadModel]:
    """Counts per strategy (any of :data:`STRATEGIES`).

    Ranks holding one ``Shard`` coordinate form an independent replica group (they need the same bytes;
    other groups need other bytes). Up to ``enumerate_up_to`` coordinates every group is planned; beyond,
    coordinate 0's group is planned and counted for each (``LoadModel.groups``): exact when the tensors
    divide evenly, as the synthetic ones do.
    """
    config = config or ModelConfig()
    reads = _Reads(metadata, config)
    stored = MetadataItems(metadata)
    coordinates = list(range(layout.shard)) if layout.shard <= enumerate_up_to else [0]
    groups = layout.shard // len(coordinates)
    out: dict[str, LoadModel] = {}
    for name in strategies:
        out[name] = LoadModel(name, [], groups, metadata_gets=config.per_load_files)
    for coordinate in coordinates:
        plan = _plan_for_shard(metadata, coordinate, layout.shard)
        ranks = [replica * layout.shard + coordinate for replica in range(layout.replicas)]
        plans = [plan] * len(ranks)  # replicas need the same slices: one plan object
        group_bytes = sum(_nbytes(item, stored) for item in plan.items)
        for name in strategies:
            model = out[name]
            if name == "per_rank":
                counts = RankCounts()
                reads.count([plan.items], counts)
                model.per_rank += [counts] * len(ranks)
            elif name == "broadcasting":
                counts = RankCounts()
                _broadcasting(reads, plans, counts, config, stored, coordinate == 0)
                model.per_rank.append(counts)  # the coordinator; every other rank reads nothing
                model.per_rank += [RankCounts() for _ in ranks[1:]]
                sent = group_bytes * (len(ranks) * groups - (1 if coordinate == 0 else 0))
                model.exchanged_bytes += sent
                model.cross_host_bytes += sent  # an upper bound: most go to other hosts
            elif name in ("read_once", "per_host"):
                _read_once(model, reads, plans, ranks, layout, stored, config, name == "per_host")
            else:
                raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    if "broadcasting" in out and groups > 1:  # one coordinator serves every group: fold the copies into it
        model = out["broadcasting"]
        first = model.per_rank[0]
        extra = [c for i, c in enumerate(model.per_rank) if i and (c.gets or c.heads)]
        total = RankCounts(
            groups * (first.gets + sum(c.gets for c in extra)),
            groups * (first.heads + sum(c.heads for c in extra)),
            groups * (first.bytes + sum(c.bytes for c in extra)),
        )
        model.per_rank = [total] + [RankCounts() for _ in model.per_rank[1:]]
        model.groups = 1
    elif "broadcasting" in out:
        model = out["broadcasting"]
        busy = [c for c in model.per_rank if c.gets or c.heads]
        model.per_rank = [
            RankCounts(sum(c.gets for c in busy), sum(c.heads for c in busy), sum(c.bytes for c in busy))
        ] + [RankCounts() for _ in model.per_rank[1:]]
    return out


def _read_once(
    model: LoadModel,
    reads: _Reads,
    plans: list[LoadPlan],
    ranks: list[int],
    layout: JobLayout,
    stored: MetadataItems,
    config: ModelConfig,
    by_host: bool,
) -> None:
    hosts = [layout.host(rank) for rank in ranks] if by_host else None
    planned = plan_read_once(plans, stored, config.read_once, hosts)
    for i, plan in enumerate(planned):
        exchange = plan.storage_data
        # Destinations that hold their slices in place (CPU tensors of the stored dtype, or GPU ones under
        # NCCL): one read of the solo items and of every slice read for others.
        shared = [plan.items[j] for _n, part in sorted(exchange.rounds.items()) for j, _p, _t in part.reads]
        counts = RankCounts()
        reads.count([[plan.items[j] for j in exchange.solo] + shared], counts)
        model.per_rank.append(counts)
        mine = layout.host(ranks[i])
        for part in exchange.rounds.values():
            for j, _packed, targets in part.reads:
                n = _nbytes(plan.items[j], stored) * model.groups
                model.exchanged_bytes += n * len(targets)
                model.cross_host_bytes += n * sum(layout.host(ranks[t]) != mine for t, _x in targets)
    if planned:
        model.rounds = max(model.rounds, planned[0].storage_data.round_count)


def _broadcasting(
    reads: _Reads, plans: list[LoadPlan], out: RankCounts, config: ModelConfig, stored: MetadataItems, first: bool
) -> None:
    """The coordinator's reads for one replica group: every rank's items in storage order, chunked by the
    bytes held for other ranks (``staging_bytes``), one read call per chunk (as ``Broadcasting._serve``)."""
    jobs = [(rank, item) for rank, plan in enumerate(plans) for item in plan.items]
    jobs.sort(
        key=lambda j: (
            j[1].storage_index.fqn,
            tuple(j[1].storage_index.offset or ()),
            tuple(j[1].storage_offsets),
            j[0],
        )
    )
    folded: list[tuple[int, ReadItem, bool]] = []  # a slice several ranks need is read once (staged)
    last: tuple[Any, ...] | None = None
    for rank, item in jobs:
        key = (item.type, item.storage_index, tuple(item.storage_offsets), tuple(item.lengths))
        if folded and key == last:
            folded[-1] = (folded[-1][0], folded[-1][1], True)
        else:
            folded.append((rank, item, False))
            last = key
    calls: list[list[ReadItem]] = []
    chunk: list[ReadItem] = []
    held = 0
    for rank, item, shared in folded:
        size = _nbytes(item, stored) if (rank or not first or shared) else 0
        if chunk and held + size > config.staging_bytes:
            calls.append(chunk)
            chunk, held = [], 0
        chunk.append(item)
        held += size
    if chunk:
        calls.append(chunk)
    reads.count(calls, out, one_loader=False)
