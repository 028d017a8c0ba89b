"""The coordinator's read-once planning and the strategy choice, in one process (no ranks, no storage)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from dcp_storage import FsspecReader, ReadStrategies
from dcp_storage.strategies import DeliveryConfig
from dcp_storage.strategies.read_once_plan import ExchangePlan, ReadOnceConfig, plan_read_once

MiB = 1024 * 1024


class _Stored:
    def dtype(self, item: ReadItem) -> torch.dtype:
        return torch.float32

    def splittable(self, item: ReadItem) -> bool:
        return True


def _item(fqn: str, rows: int, cols: int = 256, kind: LoadItemType = LoadItemType.TENSOR) -> ReadItem:
    zero = torch.Size([0, 0])
    index = MetadataIndex(fqn, zero)
    return ReadItem(kind, index, zero, index, zero, torch.Size([rows, cols]))


def _ddp(world: int) -> list[LoadPlan]:
    items = [_item(f"w{i}", rows) for i, rows in enumerate([4096, 1024, 256, 64, 8, 1])]  # 4 MiB down to 1 KiB
    items.append(
        ReadItem(
            LoadItemType.BYTE_IO,
            MetadataIndex("step"),
            torch.Size([0]),
            MetadataIndex("step"),
            torch.Size([0]),
            torch.Size([0]),
        )
    )
    return [LoadPlan(list(items)) for _ in range(world)]


def _bytes(item: ReadItem) -> int:
    return math.prod(item.lengths) * 4 if item.type == LoadItemType.TENSOR else 0


def _reads(planned: list[LoadPlan]) -> dict[tuple[Any, ...], list[int]]:
    """Stored slice (with its row block) -> the ranks that read it from storage."""
    out: dict[tuple[Any, ...], list[int]] = {}
    for rank, plan in enumerate(planned):
        exchange: ExchangePlan = plan.storage_data
        for part in exchange.rounds.values():
            for index, _packed, _to in part.reads:
                item = plan.items[index]
                out.setdefault((item.storage_index.fqn, tuple(item.storage_offsets), tuple(item.lengths)), []).append(
                    rank
                )
    return out


def test_ddp_each_slice_is_read_by_one_rank_balanced_and_sent_to_all_others() -> None:
    config = ReadOnceConfig(DeliveryConfig(2 * MiB, 2 * MiB), split_bytes=MiB, pack_below=16 * 1024)
    planned = plan_read_once(_ddp(4), _Stored(), config)
    readers = _reads(planned)
    assert all(len(ranks) == 1 for ranks in readers.values()), readers
    # Row blocks tile every tensor exactly, and each reader sends its block to the three others.
    for fqn, rows in [("w0", 4096), ("w1", 1024)]:
        blocks = sorted((off[0], n[0]) for (name, off, n) in readers if name == fqn)
        assert blocks[0][0] == 0 and sum(n for _o, n in blocks) == rows
        assert all(a + n == b for (a, n), (b, _m) in itertools.pairwise(blocks))
    loads = [0] * 4
    for (_fqn, _off, lengths), (rank,) in readers.items():
        loads[rank] += math.prod(lengths) * 4
    assert max(loads) - min(loads) <= MiB, loads  # within one block (blocks are at least 1 MiB)
    for rank, plan in enumerate(planned):
        exchange = plan.storage_data
        assert exchange.items == len(plan.items)
        assert [plan.items[i].type for i in exchange.solo] == [LoadItemType.BYTE_IO]  # values: every rank reads
        for part in exchange.rounds.values():
            for _index, _packed, targets in part.reads:
                assert sorted(r for r, _i in targets) == [r for r in range(4) if r != rank]
    # Per round, no rank receives more than the budget (a single larger slice alone).
    for number in range(planned[0].storage_data.round_count):
        for plan in planned:
            part = plan.storage_data.rounds.get(number)
            if part is not None and len(part.receives) > 1:
                got = sum(_bytes(plan.items[i]) for _src, i, _p in part.receives)
                assert got <= 2 * MiB, (number, got)


def test_slices_only_one_rank_needs_are_solo_and_nothing_moves() -> None:
    plans = [LoadPlan([_item(f"shard{rank}", 1024)]) for rank in range(4)]  # FSDP: disjoint slices
    planned = plan_read_once(plans, _Stored(), ReadOnceConfig())
    for plan in planned:
        assert plan.storage_data.solo == [0] and plan.storage_data.round_count == 0


def test_per_host_never_crosses_hosts() -> None:
    config = ReadOnceConfig(DeliveryConfig(2 * MiB, 2 * MiB), split_bytes=MiB)
    hosts = ["a", "a", "b", "b"]
    planned = plan_read_once(_ddp(4), _Stored(), config, hosts)
    readers = _reads(planned)
    for plan_rank, plan in enumerate(planned):
        for part in plan.storage_data.rounds.values():
            for _index, _packed, targets in part.reads:
                assert {hosts[r] for r, _i in targets} == {hosts[plan_rank]}
    # Every tensor is read once per host.
    per_fqn: dict[str, set[str]] = {}
    for (fqn, _off, _n), ranks in readers.items():
        per_fqn.setdefault(fqn, set()).update(hosts[r] for r in ranks)
    assert all(found == {"a", "b"} for found in per_fqn.values()), per_fqn


def test_strategy_choice_argument_option_and_storage_kind(tmp_path: Any) -> None:
    assert FsspecReader(str(tmp_path)).read_strategy.name == "per_rank"  # local files
    assert FsspecReader("memory://x", {"read_strategy": "read_once"}).read_strategy.name == "read_once"
    reader = FsspecReader("memory://x", {"read_strategy": "read_once"}, read_strategy="per_host")
    assert reader.read_strategy.name == "per_host"  # the argument wins
    assert "read_strategy" not in reader.storage_options  # never handed to the filesystem
    with pytest.raises(ValueError, match="unknown read strategy 'twice'"):
        FsspecReader(str(tmp_path), read_strategy="twice")
    with pytest.raises(TypeError, match="ReadStrategy or its name"):
        FsspecReader(str(tmp_path), read_strategy=3)  # type: ignore[arg-type]
    assert ReadStrategies.named("read_once").name == "read_once"


def test_object_stores_default_to_read_once(moto_server: Any) -> None:
    from dcp_storage import describe
    from dcp_storage.transports import open_transport

    url, options = moto_server.new_location("ckpt", skip_instance_cache=True)
    assert FsspecReader(url, options).read_strategy.name == "read_once"
    # Any entry point given a reader's options opens the store (the option is not the filesystem's).
    transport, _path = open_transport(url, {**options, "read_strategy": "per_rank"})
    assert transport.is_local is False
    with pytest.raises(Exception) as info:  # an empty bucket: not found, not an option error
        describe(url, {**options, "read_strategy": "per_rank"})
    assert "read_strategy" not in str(info.value)
