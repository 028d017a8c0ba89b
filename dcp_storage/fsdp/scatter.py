"""Rank 0 holds a full state dict; every rank receives only the blocks its local shards store.

Steps (every rank of the default process group takes each one, in this order):

1. describe: each rank lists its entries (:class:`~.local_shards.LocalShards`), or the error that stopped
   it, and ``gather_object`` sends them to rank 0;
2. status: rank 0 checks every rank's description against the full state dict (keys, shapes, dtypes) and
   :func:`~dcp_storage.strategies.share_object` broadcasts the verdict, so a bad state dict fails on every
   rank before any tensor moves;
3. transfer: rank 0 walks the keys, copies its own blocks in place, and sends every other rank each of its
   blocks, cast to the destination dtype, point to point with the slice-delivery protocol
   (:mod:`dcp_storage.strategies.slice_delivery`: a header, then the raw elements, over the group's device,
   with bounded in-flight bytes); receivers ``recv`` straight into their local shard. A failure on rank 0
   mid-transfer reaches every receiver (the protocol's error message);
4. agree: ``all_gather_object`` of each rank's outcome, so a failure anywhere raises everywhere.

Each rank receives exactly the bytes of its blocks (plus a 24-byte header per block); replicated values
(unsharded buffers, ``Replicate`` placements) go to every rank that holds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcp_storage._torch import sharded_tensor_class
from dcp_storage.errors import DcpStorageError, ShapeMismatchError
from dcp_storage.fsdp.local_shards import Entry, FullStateDictKeysError, LocalShards, clean_key
from dcp_storage.planners.column_plan import DtypePolicy
from dcp_storage.planners.key_map import DtypeMismatchError, ValueTypeMismatchError, format_keys
from dcp_storage.strategies.collectives import RANK_FAILURES, GroupView, decode_error, encode_error, share_object
from dcp_storage.strategies.slice_delivery import (
    DeliveryConfig,
    DeliveryStats,
    canonical_order,
    receive_items,
    sending,
)

__all__ = ["agree", "scatter_full_state_dict"]

COORDINATOR = 0


def scatter_full_state_dict(
    full_sd: Mapping[str, Any] | None,
    describe: Any,
    view: GroupView,
    stats: DeliveryStats,
    config: DeliveryConfig,
    dtype_policy: DtypePolicy,
) -> LocalShards:
    """Fill this rank's local shards (``describe()`` builds them) from rank 0's ``full_sd``.

    ``describe`` is called here, inside the error protocol, so that a rank that cannot describe its
    model still takes part in every collective and the others raise its error instead of waiting.
    """
    local: LocalShards | None = None
    local_error: BaseException | None = None
    try:
        local = describe()
        report: tuple[str, Any] = ("ok", local.entries)
    except RANK_FAILURES as exc:  # reported to rank 0, raised on every rank
        local_error = exc
        report = ("error", encode_error(exc, view.rank))

    reports = _gather(report, view)
    pairs: dict[str, str] = {}

    def verdict() -> None:
        assert reports is not None  # the coordinator's branch: gather filled it
        pairs.update(_check(full_sd, reports, dtype_policy))

    try:
        share_object(verdict, group=view.group, src_rank=COORDINATOR)
    except Exception:
        if local_error is not None:
            raise local_error from None  # this rank's own error, with its traceback
        raise
    assert local is not None  # no error was shared, so this rank described its model

    failure: BaseException | None = None
    try:
        if view.rank == COORDINATOR:
            assert full_sd is not None and reports is not None
            _send(full_sd, pairs, [entries for _kind, entries in reports], local, view, stats, config)
        else:
            _receive(local, view, stats)
    except RANK_FAILURES as exc:  # every rank must learn of it
        failure = exc
    agree(failure, view)
    return local


def _gather(report: tuple[str, Any], view: GroupView) -> list[tuple[str, Any]] | None:
    if not view.distributed or view.world == 1:
        return [report]
    import torch.distributed as dist

    out: list[Any] | None = [None] * view.world if view.rank == COORDINATOR else None
    dist.gather_object(report, out, group=view.group, group_dst=COORDINATOR)
    return out


def _check(
    full_sd: Mapping[str, Any] | None, reports: list[tuple[str, Any]], dtype_policy: DtypePolicy
) -> dict[str, str]:
    """Rank 0: raise if any rank failed or the full state dict does not fit; else model key -> full key."""
    for rank, (kind, body) in enumerate(reports):
        if kind == "error":
            raise decode_error(body)
    entries: dict[str, Entry] = reports[COORDINATOR][1]
    for rank, (_kind, other) in enumerate(reports):
        differs = [
            k
            for k in entries.keys() | other.keys()
            if k not in entries
            or k not in other
            or (entries[k].shape, entries[k].dtype) != (other[k].shape, other[k].dtype)
        ]
        if differs:
            raise DcpStorageError(
                f"load_full_state_dict: rank {rank}'s model differs from rank {COORDINATOR}'s at "
                f"{format_keys(sorted(differs))} (keys, shapes or dtypes); every rank must build the same model"
            )
    if not isinstance(full_sd, Mapping) or not full_sd:
        if full_sd is None:
            got = "None"
        else:
            got = f"{'an empty' if isinstance(full_sd, Mapping) else 'a'} {type(full_sd).__name__}"
        raise DcpStorageError(
            f"load_full_state_dict: rank {COORDINATOR} must pass the full state dict (a mapping of tensors) or a "
            f"checkpoint URL, got {got}; other ranks may pass None"
        )
    full_by_clean: dict[str, str] = {}
    for key in full_sd:
        if not isinstance(key, str):
            raise ValueTypeMismatchError(f"load_full_state_dict: full state dict keys must be str, got {key!r}")
        cleaned = clean_key(key)
        if cleaned in full_by_clean:
            raise DcpStorageError(
                f"load_full_state_dict: full state dict keys {full_by_clean[cleaned]!r} and {key!r} name the same "
                "tensor once wrapper segments are dropped"
            )
        full_by_clean[cleaned] = key
    model_by_clean = {clean_key(k): k for k in entries}
    missing = [k for c, k in model_by_clean.items() if c not in full_by_clean]
    unexpected = [k for c, k in full_by_clean.items() if c not in model_by_clean]
    if missing or unexpected:
        raise FullStateDictKeysError(missing, unexpected)
    pairs = {model_by_clean[c]: full_by_clean[c] for c in model_by_clean}
    not_tensors, shapes, dtypes = [], [], []
    for key, full_key in pairs.items():
        value, entry = full_sd[full_key], entries[key]
        if not isinstance(value, torch.Tensor) or _is_distributed(value) or value.is_meta:
            what = "on the meta device" if isinstance(value, torch.Tensor) and value.is_meta else type(value).__name__
            not_tensors.append(f"{full_key!r} ({what})")
        elif tuple(value.shape) != entry.shape:
            shapes.append(f"{full_key!r}: {list(value.shape)} in the full state dict, {list(entry.shape)} in the model")
        elif not dtype_policy.allows(value.dtype, entry.dtype):
            dtypes.append(f"{full_key!r}: {value.dtype} -> {entry.dtype}")
    if not_tensors:
        raise ValueTypeMismatchError(
            "load_full_state_dict: the full state dict must hold plain, materialised tensors (not DTensors, "
            f"ShardedTensors or meta tensors); it holds {', '.join(not_tensors[:10])}"
        )
    if shapes:
        more = f"; ... and {len(shapes) - 10} more" if len(shapes) > 10 else ""
        raise ShapeMismatchError("load_full_state_dict: shape mismatch: " + "; ".join(shapes[:10]) + more)
    if dtypes:
        raise DtypeMismatchError(
            f"load_full_state_dict: {dtype_policy!r} refuses {'; '.join(dtypes[:10])}; pass another dtype_policy "
            "or convert the state dict"
        )
    return pairs


def _is_distributed(value: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, (DTensor, sharded_tensor_class()))


def _items(entries: Mapping[str, Entry]) -> list[ReadItem]:
    """The delivery protocol's items for one rank's blocks (built identically on sender and receiver)."""
    items = []
    for key, entry in entries.items():
        for chunk in entry.chunks:
            zeros = torch.Size([0] * len(chunk.offsets))
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(key, torch.Size(chunk.offsets)),
                    dest_offsets=zeros,
                    storage_index=MetadataIndex(key, torch.Size(chunk.offsets)),
                    storage_offsets=zeros,
                    lengths=torch.Size(chunk.sizes),
                )
            )
    return canonical_order(items)


class _Destinations:
    """What ``receive_items`` calls on its "planner": the local tensor behind each block."""

    def __init__(self, local: LocalShards) -> None:
        self.local = local

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.local.tensors[(item.dest_index.fqn, tuple(int(o) for o in item.dest_index.offset))]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # received in place (or copied in by receive_items)

    def load_bytes(self, item: ReadItem, value: Any) -> None:
        raise DcpStorageError(f"load_full_state_dict: unexpected non-tensor message for {item.dest_index.fqn!r}")


@torch.no_grad()
def _receive(local: LocalShards, view: GroupView, stats: DeliveryStats) -> None:
    items = _items(local.entries)
    receive_items(
        items, _Destinations(local), view, COORDINATOR, lambda item: local.entries[item.dest_index.fqn].dtype, stats
    )


@torch.no_grad()
def _send(
    full_sd: Mapping[str, Any],
    pairs: dict[str, str],
    per_rank: list[dict[str, Entry]],
    local: LocalShards,
    view: GroupView,
    stats: DeliveryStats,
    config: DeliveryConfig,
) -> None:
    numbering = [
        {(it.dest_index.fqn, tuple(int(o) for o in it.dest_index.offset)): i for i, it in enumerate(_items(e))}
        for e in per_rank
    ]
    with sending(view, {r: len(n) for r, n in enumerate(numbering)}, stats, config) as sender:
        for key, full_key in pairs.items():
            source: torch.Tensor = full_sd[full_key].detach()
            dtype = per_rank[COORDINATOR][key].dtype
            for rank, entries in enumerate(per_rank):
                for chunk in entries[key].chunks:
                    block = source[chunk.region()]
                    if rank == view.rank:
                        dest = local.tensors[(key, chunk.offsets)]
                        dest.copy_(block)
                        stats.bytes_local += dest.numel() * dest.element_size()
                    else:
                        payload = block.to(dtype=dtype).contiguous()
                        sender.send_tensor(rank, numbering[rank][(key, chunk.offsets)], payload)


def agree(failure: BaseException | None, view: GroupView) -> None:
    """Collective: raise on every rank if ``failure`` is set on any (this rank's own error first)."""
    if view.distributed and view.world > 1:
        import torch.distributed as dist

        mine = None if failure is None else encode_error(failure, view.rank)
        outcomes: list[Any] = [None] * view.world
        dist.all_gather_object(outcomes, mine, group=view.group)
    else:
        outcomes = [None]
    if failure is not None:
        raise failure
    for outcome in outcomes:
        if outcome is not None:
            raise decode_error(outcome)
