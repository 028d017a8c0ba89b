"""How FsspecWriter lays a save out: files per rank on disks and object stores, the in-memory objects sent
by one PUT, and local writeback started while writing (the fsync at commit stays)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

from dcp_storage import FsspecReader, FsspecWriter, TransportConfig, verify
from dcp_storage.formats.writing import MemoryFile, estimated_bytes, group_items, write_order
from dcp_storage.transports import local
from dcp_storage_testing.compare import same_bits

MiB = 1024 * 1024


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    sd = {f"small{i}": torch.randn(3 * MiB // 4, generator=g) for i in range(6)}  # 3 MiB each
    sd["big"] = torch.randn(3 * MiB, generator=g)  # 12 MiB: more than a 5 MiB part
    return sd


def _items(sd: dict[str, Any]) -> list[Any]:
    return list(create_default_local_save_plan(sd, True).items)


def test_a_file_s_small_records_are_spread_among_its_large_ones() -> None:
    """Each few small records' CPU sits beside a large record's disk time; no run of small ones at the end."""

    big = 1024 * 1024 // 4  # float32 elements of one SMALL_RECORD
    sizes = {"a": 3 * big, "b": 2 * big, "c": big, "x1": 5, "x2": 900, "x3": 7, "x4": 30, "x5": 64, "x6": 9, "x7": 2}
    sd: dict[str, Any] = {name: torch.zeros(n) for name, n in sizes.items()}
    sd["extra"] = io.BytesIO(b"step 7")
    items = _items(sd)
    ordered = [i.index.fqn for i in write_order(items)]
    assert sorted(ordered) == sorted(i.index.fqn for i in items)  # each item once
    assert ordered[0] == "extra"  # byte items first, as torch writes them
    assert ordered[1:] == ["a", "x2", "x5", "b", "x4", "x6", "c", "x3", "x1", "x7"]
    assert [i.index.fqn for i in write_order(_items({"s": torch.zeros(3), "t": torch.zeros(9)}))] == ["t", "s"]
    assert write_order([]) == []


def test_grouping_disk_and_object_store() -> None:
    items = _items(_state())
    local = group_items(items, local=True, thread_count=2, single_file_per_rank=True, object_bytes=5 * MiB)
    assert len(local) == 2 and sorted(len(g) for g in local) == [2, 5]  # torch's split: by size, largest first
    remote = group_items(items, local=False, thread_count=2, single_file_per_rank=True, object_bytes=5 * MiB)
    assert len(remote) == -(-estimated_bytes(items) // (5 * MiB)) == 7
    assert sorted(len(g) for g in remote) == [1] * 7  # the 12 MiB item alone; 3 MiB items one per object
    tiny = _items({"a": torch.zeros(4), "b": torch.zeros(4)})
    assert len(group_items(tiny, local=False, thread_count=2, single_file_per_rank=True, object_bytes=5 * MiB)) == 2
    per_item = group_items(items, local=False, thread_count=2, single_file_per_rank=False, object_bytes=5 * MiB)
    assert len(per_item) == len(items)


def test_memory_file_grows_when_short_and_trims() -> None:
    f = MemoryFile(4)
    assert f.write(b"abc") == 3 and f.write(memoryview(b"defgh")) == 5 and f.tell() == 8
    assert f.write(torch.arange(2, dtype=torch.int16).numpy()) == 4  # typed buffers count bytes
    assert bytes(f.close_buffer()) == b"abcdefgh" + bytes([0, 0, 1, 0])


def test_object_store_objects_are_single_puts_within_a_part(s3_url: Any, moto_server: Any) -> None:
    url, options = s3_url
    sd = _state()
    config = TransportConfig(part_size=5 * MiB, max_inflight_bytes=16 * MiB)
    writer = FsspecWriter(url, options, transport_config=config)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    bucket, prefix = url.split("/")[2], url.split("/", 3)[3]
    client = moto_server.client()
    objects = {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]}
    data = {k: v for k, v in objects.items() if k.endswith(".distcp")}
    assert len(data) == 7 and sum(v > 5 * MiB for v in data.values()) == 1, data  # one multipart object
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=FsspecReader(url, options), no_dist=True)
    assert all(same_bits(out[k], v) for k, v in sd.items())
    assert verify(url, storage_options=options, deep=True).ok


def test_local_writeback_starts_while_writing_and_fsync_stays(tmp_path: Path, monkeypatch: Any) -> None:
    """Where the file system refuses ``O_DIRECT``: each staged buffer's writeback is started as it is
    written, and the commit still ``fsync``s."""
    from dcp_storage.transports.local import LocalWriter

    monkeypatch.setattr(LocalWriter, "_set_direct", lambda self, on: False)
    monkeypatch.setattr(local, "start_writeback", lambda fd, off, n: every.append((fd, off, n)))
    every: list[tuple[int, int, int]] = []
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    sd = {"w": torch.randn(20 * MiB)}  # 80 MiB in one file
    dcp.save(sd, storage_writer=FsspecWriter(tmp_path / "c", thread_count=1), no_dist=True)
    calls = [(off, n) for _, off, n in every]
    calls = calls[: next((i for i in range(1, len(calls)) if calls[i][0] == 0), len(calls))]  # the data file's
    assert len(calls) >= 9 and calls[0][0] == 0, calls  # buffer by buffer, not once at the end
    assert all(b[0] == a[0] + a[1] for a, b in zip(calls, calls[1:])), calls  # consecutive ranges
    assert max(n for _, n in calls) <= LocalWriter.STAGE_BYTES
    assert sum(n for _, n in calls) == os.path.getsize(tmp_path / "c" / "__0_0.distcp")
    assert synced  # the commit's fsync is still made
    out = {"w": torch.zeros(20 * MiB)}
    dcp.load(out, storage_reader=FsspecReader(tmp_path / "c"), no_dist=True)
    assert same_bits(out["w"], sd["w"])
