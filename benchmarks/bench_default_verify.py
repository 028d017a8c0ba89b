#!/usr/bin/env python
"""Cost of default verification: ``FsspecReader()`` (checked) against ``FsspecReader(verify=False)``.

Usage::

    .venv/bin/python benchmarks/bench_default_verify.py [--mib 256] [--repeats 5] [--no-s3] [--out FILE]

Saves one seeded checkpoint with ``FsspecWriter`` (fp32 ``[rows, 4096]`` matrices of about 16 MiB, so
each record has 16 block digests), then times single-process ``dcp.load`` calls into pre-allocated full
tensors (a whole-tensor read: every block of every record checked), verify on and off interleaved in the
same run, best and median of ``--repeats``: from warm local files, and from moto (S3, in-process server) unless
``--no-s3``. It also counts the extra bytes a 2-rank ``Shard(0)`` reshard reads for its covering blocks
(for 1, 2 and 4 MiB blocks, from the record's start or aligned to the elements), which is what picked the
block size and the alignment. Prints one JSON line per case (``--out`` also writes them to a JSON file), with
the process CPU time of each best load beside its wall time: on a busy machine (1-minute load average above
about 1.5 on 2 cores) wall times are guesses, CPU times less so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.integrity.blocks import BlockCover
from dcp_storage.integrity.checksums import block_size_for

warnings.simplefilter("ignore")


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    n = max(1, mib // 16)
    return {f"layer{i}.w": torch.randn(1024, 4096, generator=g) for i in range(n)}


RESULTS: list[dict[str, Any]] = []


def _emit(line: dict[str, Any]) -> None:
    RESULTS.append(line)
    print(json.dumps(line))


def _time(
    url: str, options: dict[str, Any] | None, state: dict[str, torch.Tensor], verify: bool | None
) -> tuple[float, float]:
    """Wall and process CPU seconds of one load into fresh, resident (zero-filled) tensors."""
    dest = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}
    t, cpu = time.perf_counter(), time.process_time()
    dcp.load(dest, storage_reader=FsspecReader(url, options, verify=verify), no_dist=True)
    return time.perf_counter() - t, time.process_time() - cpu


def _compare(name: str, url: str, options: dict[str, Any] | None, state: dict[str, torch.Tensor], repeats: int) -> None:
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    _time(url, options, state, None)  # warm: page cache, connections
    best = {None: (math.inf, math.inf), False: (math.inf, math.inf)}
    walls: dict[bool | None, list[float]] = {None: [], False: []}
    loads = []
    for _ in range(repeats):
        for v in (None, False):
            wall, cpu = _time(url, options, state, v)
            best[v] = (min(best[v][0], wall), min(best[v][1], cpu))
            walls[v].append(wall)
            loads.append(os.getloadavg()[0])
    (on, on_cpu), (off, off_cpu) = best[None], best[False]
    on_median, off_median = statistics.median(walls[None]), statistics.median(walls[False])
    _emit(
        {
            "case": name,
            "bytes": nbytes,
            "verified_s": round(on, 4),
            "unverified_s": round(off, 4),
            "verified_gbps": round(nbytes / on / 1e9, 2),
            "unverified_gbps": round(nbytes / off / 1e9, 2),
            "cost_pct": round(100 * (on / off - 1), 1),
            "verified_median_s": round(on_median, 4),
            "unverified_median_s": round(off_median, 4),
            "median_cost_pct": round(100 * (on_median / off_median - 1), 1),
            "verified_cpu_s": round(on_cpu, 4),
            "unverified_cpu_s": round(off_cpu, 4),
            "cpu_cost_pct": round(100 * (on_cpu / off_cpu - 1), 1),
            "load_average_1m": [round(min(loads), 2), round(max(loads), 2)],  # above ~1.5 on 2 cores: a guess
        }
    )


def _extra_bytes() -> None:
    """Bytes 2 ranks read for their covering blocks beyond their ``Shard(0)`` halves, per block size, with
    blocks from the record's start and with the first block ending where the elements start (ours)."""
    header, tail = 704, 463  # a torch.save record of one fp32 matrix: bytes before and after its elements
    for shape in ((1024, 4096), (1000, 4099)):
        data = shape[0] * shape[1] * 4
        for block in (block_size_for(data), 1 << 20, 2 << 20, 4 << 20):  # ours (1/64 of it), then fixed
            for first in (0, header):
                cover = BlockCover(0, header + data + tail, block, (), "xxh3_64", "", first)
                half = (shape[0] // 2) * shape[1] * 4
                extra = 0
                for lo, hi in ((header, header + half), (header + half, header + data)):
                    start, end = cover.covering(lo, hi)
                    extra += (end - start) - (hi - lo)
                line = {"case": "2 ranks Shard(0) extra bytes", "shape": list(shape), "block": block}
                line |= {"aligned_to_elements": bool(first), "extra_pct": round(100 * extra / data, 2)}
                _emit(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--out", help="also write the JSON lines, as a list, to this file")
    args = p.parse_args()
    try:
        _run(args)
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(RESULTS, f, indent=1)


def _run(args: argparse.Namespace) -> None:
    state = _state(args.mib)
    _extra_bytes()
    with tempfile.TemporaryDirectory() as root:
        dcp.save(state, storage_writer=FsspecWriter(root), no_dist=True)
        _compare("local warm, 1 process, full tensors", root, None, state, args.repeats)
    if args.no_s3:
        return
    from dcp_storage_testing.s3_server import MotoS3Server  # noqa: PLC0415 - test support, only for this case

    with MotoS3Server() as server:
        bucket = server.create_bucket("bench-verify")
        url, options = f"s3://{bucket}/ckpt", server.storage_options()
        dcp.save(state, storage_writer=FsspecWriter(url, options), no_dist=True)
        _compare("s3 (moto), 1 process, full tensors", url, options, state, args.repeats)


if __name__ == "__main__":
    main()
