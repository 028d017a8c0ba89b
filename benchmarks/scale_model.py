#!/usr/bin/env python
"""Storage requests and bytes of a distributed load at 8 to 8,192 ranks, per read strategy, without a cluster.

Usage::

    .venv/bin/python benchmarks/scale_model.py [--worlds 8,1024,8192] [--layouts hsdp,fsdp,ddp]
        [--metadata path/to/.metadata] [--json benchmarks/results/scale_model.json]

The checkpoint is a real one's ``.metadata`` (``--metadata``) or a synthetic Llama-70B layout (bf16,
723 tensors, 141 GB) saved ``Shard(0)`` by 8 ranks. A job layout is a world size, 8 GPUs per host and a
``(replicate, shard)`` mesh with placements ``(Replicate, Shard(0))``:

* ``hsdp``: shard 8 (one host holds one replica), replicated across hosts;
* ``fsdp``: shard = world (nothing replicated);
* ``ddp``: shard 1 (every rank a full copy), of a Llama-3.2-1B layout (``--ddp-model``: ``1b``, ``8b`` or
  ``70b``): DDP is for models that fit a GPU. (``8b`` at 8,192 ranks needs more than this machine's memory:
  the coordinator's read-once plan grows with ranks x row blocks, about 16 million entries there.)

For each strategy - ``per_rank`` (every rank reads what it needs), ``broadcasting`` (rank 0 reads, sends
every rank its slices), ``read_once`` (shared slices read by one rank each, exchanged) and ``per_host``
(the same within each host) - :func:`dcp_storage.inspection.request_model.model_load` runs the library's
own planning for the ranks (torch's read-item planning, :func:`~dcp_storage.strategies.read_once_plan.plan_read_once`,
the loader's and transport's request grouping) and counts. The table gives, in total and for the busiest
rank: storage GETs and HEADs, bytes fetched from storage; metadata GETs; bytes ranks send each other
(and across hosts); the checkpoint prefix's request count and the rate at the modelled load time
against S3's ~5,500 GET/s per prefix.

Load time model (stated assumptions, not measurements): a rank fetches from storage at ``--rank-gbps``
(0.5 GB/s) and moves exchange bytes at ``--link-gbps`` (25 GB/s; NVLink inside a host is faster,
InfiniBand between hosts about this); the load takes the busiest rank's storage time plus the busiest
rank's receive time. A single prefix serves 5,500 GET/s; a load whose requests exceed 5,500 x its time
is throttled (503 SlowDown) or must spread over prefixes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)

PREFIX_LIMIT = 5500  # S3 GET/HEAD requests per second per prefix
GB = 1e9


def _metadata(args: argparse.Namespace, ddp: bool) -> Any:
    from dcp_storage.inspection.request_model import synthetic_transformer

    if args.metadata:
        from dcp_storage.formats.dcp_native.native import load_metadata

        with open(args.metadata, "rb") as fh:
            return load_metadata(fh.read(), args.metadata)
    if ddp and args.ddp_model == "8b":
        return synthetic_transformer(layers=32, hidden=4096, ffn=14336, vocab=128256, kv_heads=8, heads=32)
    if ddp and args.ddp_model == "1b":
        return synthetic_transformer(layers=16, hidden=2048, ffn=8192, vocab=128256, kv_heads=8, heads=32)
    return synthetic_transformer()


def _row(layout: str, world: int, name: str, m: Any, args: argparse.Namespace) -> dict[str, Any]:
    requests = m.gets + m.heads
    received = m.exchanged_bytes / max(1, world)  # average; the busiest rank receives about this (balanced)
    if name == "broadcasting":
        received = m.exchanged_bytes / max(1, world - 1)
    seconds = m.max_rank_bytes / (args.rank_gbps * GB) + received / (args.link_gbps * GB)
    if name == "broadcasting":  # the coordinator also sends everything
        seconds = m.max_rank_bytes / (args.rank_gbps * GB) + m.exchanged_bytes / (args.link_gbps * GB)
    return {
        "layout": layout,
        "world": world,
        "strategy": name,
        "gets": m.gets,
        "heads": m.heads,
        "metadata_gets": m.metadata_gets,
        "storage_bytes": m.bytes,
        "max_rank_bytes": m.max_rank_bytes,
        "max_rank_requests": m.max_rank_requests,
        "exchanged_bytes": m.exchanged_bytes,
        "cross_host_bytes": m.cross_host_bytes,
        "rounds": m.rounds,
        "prefix_requests": requests,
        "load_seconds": seconds,
        "prefix_rate": requests / seconds if seconds else 0.0,
        "prefix_seconds_at_limit": requests / PREFIX_LIMIT,
    }


def _fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,1024,8192")
    parser.add_argument("--layouts", default="hsdp,fsdp,ddp")
    parser.add_argument("--strategies", default="per_rank,broadcasting,read_once,per_host")
    parser.add_argument("--metadata", help="a real checkpoint's .metadata (default: synthetic Llama-70B)")
    parser.add_argument("--ddp-model", choices=("70b", "8b", "1b"), default="1b")
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--rank-gbps", type=float, default=0.5)
    parser.add_argument("--link-gbps", type=float, default=25.0)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "scale_model.json"))
    args = parser.parse_args()

    from dcp_storage.inspection.request_model import JobLayout, model_load

    rows = []
    for layout in args.layouts.split(","):
        md = _metadata(args, layout == "ddp")
        for world in (int(w) for w in args.worlds.split(",")):
            shard = {"hsdp": min(args.gpus_per_host, world), "fsdp": world, "ddp": 1}[layout]
            job = JobLayout(world, args.gpus_per_host, shard)
            t0 = time.perf_counter()
            # Every Shard coordinate planned up to 8; beyond, one coordinate, counted for each (symmetric).
            models = model_load(md, job, args.strategies.split(","), enumerate_up_to=8 if world <= 1024 else 1)
            took = time.perf_counter() - t0
            for name, m in models.items():
                rows.append(_row(layout, world, name, m, args))
            print(f"# {layout} at {world} ranks: modelled in {took:.1f} s", file=sys.stderr)

    head = (
        "| layout | ranks | strategy | GETs | HEADs | metadata GETs | storage bytes | busiest rank: bytes / requests "
        "| exchanged (cross-host) | prefix requests | rate at modelled time (s) | s at 5,500/s |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(
            f"| {r['layout']} | {r['world']:,} | {r['strategy']} | {r['gets']:,} | {r['heads']:,} | {r['metadata_gets']} "
            f"| {_fmt_bytes(r['storage_bytes'])} | {_fmt_bytes(r['max_rank_bytes'])} / {r['max_rank_requests']:,} "
            f"| {_fmt_bytes(r['exchanged_bytes'])} ({_fmt_bytes(r['cross_host_bytes'])}) | {r['prefix_requests']:,} "
            f"| {r['prefix_rate']:,.0f}/s ({r['load_seconds']:,.1f}) | {r['prefix_seconds_at_limit']:,.1f} |"
        )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"assumptions": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
