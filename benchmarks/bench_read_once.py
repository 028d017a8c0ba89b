#!/usr/bin/env python
"""Wall time and bytes served of a replicated load from ``s3://``: ``per_rank`` against ``read_once``.

Usage::

    .venv/bin/python benchmarks/bench_read_once.py [--size-mib 256] [--ranks 4] [--repeats 3] [--layout ddp]

Starts moto on loopback with a counting :class:`~dcp_storage_testing.fault_proxy.FaultProxy` in front of
it, saves a seeded checkpoint of about ``--size-mib`` MiB (fp32 and bf16 matrices of 4-32 MiB, norms and
biases), and loads it on ``--ranks`` gloo ranks into DDP-replicated plain tensors (``--layout ddp``) or
HSDP DTensors on a ``(ranks // 2, 2)`` mesh (``--layout hsdp``), with each read strategy in turn. Reported
per strategy: ``dcp.load`` wall time (the slowest rank; best of ``--repeats``, each a fresh set of
processes), the bytes the server sent (counted by the proxy) against the checkpoint's size, and every rank
bit-exact. Results: a table on stdout and JSON (default ``benchmarks/results/read_once.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)

MiB = 1024 * 1024
SEED = 77


def state(size_mib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(SEED)
    out: dict[str, Any] = {}
    done, i = 0, 0
    while done < size_mib * MiB:
        rows = [1024, 2048, 4096, 2048][i % 4]
        dtype = torch.bfloat16 if i % 2 else torch.float32
        t = torch.randn(rows, 2048, generator=g).to(dtype)
        out[f"layers.{i}.weight"] = t
        out[f"layers.{i}.norm"] = torch.randn(2048, generator=g)
        done += t.numel() * t.element_size() + 2048 * 4
        i += 1
    return out


def rank_load(
    rank: int, world: int, url: str, options: dict[str, Any], strategy: str, layout: str, size_mib: int
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecReader
    from dcp_storage_testing.compare import local_slice, same_bits

    warnings.filterwarnings("ignore")
    ref = state(size_mib)
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world // 2, 2))
        dest = {k: distribute_tensor(torch.empty_like(v), mesh, [Replicate(), Shard(0)]) for k, v in ref.items()}
    else:
        dest = {k: torch.empty_like(v) for k, v in ref.items()}
    reader = FsspecReader(url, options, read_strategy=strategy)
    dist.barrier()
    start = time.perf_counter()
    dcp.load(dest, storage_reader=reader)
    seconds = time.perf_counter() - start
    bad = []
    for k, v in ref.items():
        got = dest[k]
        want = local_slice(v, got) if hasattr(got, "to_local") else v
        if not same_bits(got.to_local() if hasattr(got, "to_local") else got, want):
            bad.append(k)
    return {"seconds": seconds, "bad": bad, "bytes_read": reader.counters["bytes_read"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=("ddp", "hsdp"), default="ddp")
    parser.add_argument("--strategies", default="per_rank,read_once")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "read_once.json"))
    args = parser.parse_args()

    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter
    from dcp_storage_testing.distributed import run_ranks
    from dcp_storage_testing.fault_proxy import FaultProxy
    from dcp_storage_testing.s3_server import MotoS3Server

    warnings.filterwarnings("ignore")
    tmp = tempfile.mkdtemp(prefix="bench-read-once-")
    try:
        local = os.path.join(tmp, "ckpt")
        dcp.save(state(args.size_mib), storage_writer=FsspecWriter(local), no_dist=True)
        size = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local))
        with MotoS3Server() as moto, FaultProxy(moto.endpoint_url) as proxy:
            import fsspec

            direct = moto.storage_options(skip_instance_cache=True)
            location = moto.new_location("ckpt", skip_instance_cache=True)
            fs = fsspec.filesystem("s3", **direct)
            for name in os.listdir(local):
                fs.put_file(os.path.join(local, name), f"{location.url}/{name}")
            options = moto.storage_options(client_kwargs={"endpoint_url": proxy.url}, skip_instance_cache=True)
            results: dict[str, Any] = {}
            for strategy in args.strategies.split(","):
                runs = []
                for _ in range(args.repeats):
                    proxy.reset_counters()
                    per_rank = run_ranks(
                        rank_load, args.ranks, location.url, options, strategy, args.layout, args.size_mib, timeout=900
                    )
                    served = proxy.counters().body_bytes()
                    bad = [r["bad"] for r in per_rank if r["bad"]]
                    runs.append({"seconds": max(r["seconds"] for r in per_rank), "served": served, "bad": bad})
                best = min(runs, key=lambda r: r["seconds"])
                results[strategy] = {
                    "best_seconds": best["seconds"],
                    "runs": runs,
                    "served_ratio": best["served"] / size,
                }
                times = ", ".join(f"{r['seconds']:.2f}" for r in runs)
                print(
                    f"{strategy:>10}: {best['seconds']:.2f} s (runs: {times}), "
                    f"server sent {best['served'] / MiB:.1f} MiB = {best['served'] / size:.3f}x the checkpoint, "
                    f"{'bit-exact' if not any(r['bad'] for r in runs) else 'MISMATCH ' + str(best['bad'])}"
                )
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(
                {"size_bytes": size, "ranks": args.ranks, "layout": args.layout, "results": results}, fh, indent=1
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
