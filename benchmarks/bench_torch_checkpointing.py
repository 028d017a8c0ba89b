#!/usr/bin/env python
"""torch_checkpointing's ``CheckpointManager`` on the ``dcp-storage-torch-checkpointing`` plugin: local disk
against torch_checkpointing's own ``LocalFileSystemStorage``, and ``s3://`` (moto) against the raw limit.

Usage::

    .venv/bin/python benchmarks/bench_torch_checkpointing.py [--size-mib 256] [--repeats 2] [--quick]

One process, a synchronous ``CheckpointManager`` (the staged directory and its commit by ``rename`` included),
a state dict of ``--size-mib`` of fp32 tensors (8 equal ones), saved then loaded back and compared
bit-exactly; best of ``--repeats``. Rows:

* local disk: ``LocalFileSystemStorage`` with its default ``O_DIRECT`` (fails on files whose size is not
  block-aligned: torch.save archives usually are not; reported as such), with ``use_direct_io=False``, and
  ``DcpStorageConfig(path)``; raw ``write``+``fsync`` and ``read`` of the same bytes;
* moto S3: ``DcpStorageConfig("s3://...")`` save and load; the commit alone (``rename`` of the staged
  directory: server-side copies, against the same copies streamed through the client); raw limits of the same
  server: ``boto3`` ``put_object`` and ``get_object`` of the same bytes, 8 threads.

GB/s is 1e9 bytes of tensors per second. JSON goes to ``benchmarks/results/torch_checkpointing.json``
(``--quick``: ``torch_checkpointing_quick.json``). Figures taken on a shared, loaded machine say so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch
from dcp_storage_torch_checkpointing import DcpStorageConfig, _unstable
from dcp_storage_torch_checkpointing import rename as tc_rename
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

from dcp_storage_testing.s3_server import MotoS3Server

MiB = 1 << 20


def state_of(size_mib: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    per = size_mib * MiB // 8 // 4
    return {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(8)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def manager(storage_config: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage_config))


def save_load(storage_config: Any, step: str, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Seconds to save ``state`` as ``step`` and to load it back (bit-exact), or the error."""
    mgr = manager(storage_config)
    try:
        began = time.perf_counter()
        mgr.save(step, {"model": state})
        saved = time.perf_counter() - began
        into = {k: torch.empty_like(v) for k, v in state.items()}
        began = time.perf_counter()
        out = mgr.load(step, into={"model": into})
        loaded = time.perf_counter() - began
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        mgr.close()
    exact = all(torch.equal(out["model"][k], v) for k, v in state.items())
    return {"save_s": saved, "load_s": loaded, "bit_exact": exact}


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[-1]
    return {
        "save_s": min(r["save_s"] for r in good),
        "load_s": min(r["load_s"] for r in good),
        "bit_exact": all(r["bit_exact"] for r in good),
    }


def raw_local(root: str, size: int, repeats: int) -> dict[str, Any]:
    data = os.urandom(size)
    path = os.path.join(root, "raw.bin")
    writes, reads = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        writes.append(time.perf_counter() - began)
        began = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(size)
            f.readinto(buf)
        reads.append(time.perf_counter() - began)
    os.remove(path)
    return {"save_s": min(writes), "load_s": min(reads)}


def raw_s3(server: MotoS3Server, url: str, size: int, repeats: int) -> dict[str, Any]:
    client = server.client()
    bucket, prefix = url.split("/", 3)[2], url.split("/", 3)[3]
    parts = 8
    blob = os.urandom(size // parts)

    def put(i: int) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/raw/{i}", Body=blob)

    def get(i: int) -> int:
        return len(client.get_object(Bucket=bucket, Key=f"{prefix}/raw/{i}")["Body"].read())

    puts, gets = [], []
    with ThreadPoolExecutor(parts) as pool:
        for _ in range(repeats):
            began = time.perf_counter()
            list(pool.map(put, range(parts)))
            puts.append(time.perf_counter() - began)
            began = time.perf_counter()
            assert sum(pool.map(get, range(parts))) == len(blob) * parts
            gets.append(time.perf_counter() - began)
    return {"save_s": min(puts), "load_s": min(gets)}


def commit_cost(url: str, options: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The staged-write commit alone: ``rename`` of a saved directory, by server-side copies and streamed."""
    storage = DcpStorageConfig(url, options).create_storage()
    mgr = manager(DcpStorageConfig(url, options))
    try:
        mgr.save("commit-src", {"model": state})
    finally:
        mgr.close()
    out: dict[str, Any] = {}
    began = time.perf_counter()
    storage.rename(Path("commit-src"), Path("commit-server"), is_directory=True)
    out["server_copy_s"] = time.perf_counter() - began
    transport, src = storage.locate(Path("commit-server"))
    _, dst = storage.locate(Path("commit-streamed"))
    files = _unstable.walk_files(transport, src)
    real = _unstable.filesystem
    _unstable.filesystem = lambda t: None  # the fallback a transport without server-side copy gets
    try:
        began = time.perf_counter()
        for rel in files:
            tc_rename.copy_object(transport, transport.join(src, rel), transport, transport.join(dst, rel))
        out["streamed_copy_s"] = time.perf_counter() - began
    finally:
        _unstable.filesystem = real
    out["files"] = len(files)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="64 MiB, one repeat")
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. 'under load')")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.repeats = 64, 1
    state = state_of(args.size_mib)
    size = nbytes(state)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-tc-", dir=os.environ.get("BENCH_DIR")) as tmp:
        configs = {
            "LocalFileSystemStorage (O_DIRECT, default)": lambda r: LocalFileSystemStorageConfig(),
            "LocalFileSystemStorage (use_direct_io=False)": lambda r: LocalFileSystemStorageConfig(use_direct_io=False),
            "DcpStorageConfig(local path)": lambda r: DcpStorageConfig(r),
        }
        for name, make in configs.items():
            runs = []
            for i in range(args.repeats):
                root = os.path.join(tmp, f"{len(rows)}-{i}")
                os.makedirs(root)
                step = os.path.join(root, "step-1") if name.startswith("Local") else "step-1"
                runs.append(save_load(make(root), step, state))
                shutil.rmtree(root)
            rows[f"local: {name}"] = best(runs)
        rows["local: raw write+fsync / read"] = raw_local(tmp, size, args.repeats)
    with MotoS3Server() as server:
        url, options = server.new_location("bench")
        runs = [save_load(DcpStorageConfig(url, options), f"step-{i}", state) for i in range(args.repeats)]
        rows["moto s3: DcpStorageConfig(s3://)"] = best(runs)
        rows["moto s3: raw boto3 put/get, 8 threads"] = raw_s3(server, url, size, args.repeats)
        commit = commit_cost(url, options, state)
    print(f"{size / MiB:.0f} MiB of tensors, best of {args.repeats}{' (' + args.note + ')' if args.note else ''}")
    print(f"{'row':58} {'save GB/s':>10} {'load GB/s':>10}  note")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:58} {'fails':>10} {'':>10}  {row['error'][:60]}")
            continue
        exact = "" if "bit_exact" not in row else ("bit-exact" if row["bit_exact"] else "MISMATCH")
        print(f"{name:58} {size / row['save_s'] / 1e9:10.3f} {size / row['load_s'] / 1e9:10.3f}  {exact}")
    print(
        f"moto s3 commit (rename of the staged directory, {commit['files']} files): server-side copy "
        f"{commit['server_copy_s']:.3f} s, streamed through the client {commit['streamed_copy_s']:.3f} s; "
        f"save total {rows['moto s3: DcpStorageConfig(s3://)']['save_s']:.3f} s"
    )
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "bytes": size,
        "repeats": args.repeats,
        "note": args.note,
        "rows": rows,
        "commit": commit,
    }
    name = "torch_checkpointing_quick.json" if args.quick else "torch_checkpointing.json"
    out = os.path.join(HERE, "results", name)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
