"""Integrity costs: checksum algorithm speed, and what ``FsspecReader(verify=True)`` adds to a load.

    .venv/bin/python benchmarks/bench_integrity.py [--size-mib 256] [--repeats 3] [--no-s3]

1. Each checksum algorithm over a 64 MiB buffer (best of 5, one core): GB/s.
2. A checkpoint of ``--size-mib`` MiB (8 fp32 tensors, one process) saved with ``FsspecWriter`` to a local
   directory and to S3 (moto on 127.0.0.1; moto serves whole objects, so S3 figures are moto-bound), then
   loaded with ``verify=False`` and ``verify=True``, alternating, best of ``--repeats``: seconds and the
   relative cost. Prints a table; writes ``benchmarks/results/integrity.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage.errors import DcpStorageError
from dcp_storage.integrity.checksums import ALGORITHMS, new_hasher

RESULTS = Path(__file__).parent / "results" / "integrity.json"


def bench_algorithms(nbytes: int = 64 << 20) -> dict[str, float | None]:
    buf = memoryview(os.urandom(nbytes))
    out: dict[str, float | None] = {}
    for name in ALGORITHMS:
        try:
            new_hasher(name)
        except DcpStorageError:
            out[name] = None  # its package is not installed
            continue
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            h = new_hasher(name)
            h.update(buf)
            h.hexdigest()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    return out


def _state(size_mib: int) -> dict[str, torch.Tensor]:
    n = 8
    per = size_mib * (1 << 20) // 4 // n
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn(per // 1024, 1024, generator=g) for i in range(n)}


def _load_time(url: str, options: dict[str, Any], sd: dict[str, torch.Tensor], verify: bool) -> float:
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    t0 = time.perf_counter()
    dcp.load(dest, storage_reader=FsspecReader(url, options, verify=verify), no_dist=True)
    elapsed = time.perf_counter() - t0
    for k, v in sd.items():
        if not torch.equal(dest[k], v):
            raise RuntimeError(f"{url}: {k} differs after load")
    return elapsed


def bench_verify(
    name: str, url: str, options: dict[str, Any], sd: dict[str, torch.Tensor], repeats: int
) -> dict[str, Any]:
    dcp.save(sd, storage_writer=FsspecWriter(url, options, overwrite=True), no_dist=True)
    plain, checked = [], []
    _load_time(url, options, sd, False)  # warm-up (page cache, connections)
    for _ in range(repeats):
        plain.append(_load_time(url, options, sd, False))
        checked.append(_load_time(url, options, sd, True))
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    best_plain, best_checked = min(plain), min(checked)
    return {
        "storage": name,
        "bytes": nbytes,
        "load_s": plain,
        "verify_s": checked,
        "load_gbps": nbytes / best_plain / 1e9,
        "verify_gbps": nbytes / best_checked / 1e9,
        "cost_pct": 100.0 * (best_checked - best_plain) / best_plain,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)

    algos = bench_algorithms()
    print("checksum algorithm      GB/s (64 MiB buffer, one core)")
    for name, gbps in algos.items():
        print(f"  {name:<20} {'not installed' if gbps is None else f'{gbps:6.2f}'}")

    sd = _state(args.size_mib)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(bench_verify("local", os.path.join(tmp, "ckpt"), {}, sd, args.repeats))
    if not args.no_s3:
        from dcp_storage_testing.s3_server import MotoS3Server

        with MotoS3Server() as server:
            loc = server.new_location("integrity", skip_instance_cache=True, use_listings_cache=False)
            rows.append(bench_verify("s3 (moto)", loc.url, loc.storage_options, sd, args.repeats))
    print(f"\nload of {args.size_mib} MiB, best of {args.repeats}: verify=False vs verify=True")
    print(f"  {'storage':<10} {'load s':>8} {'verify s':>9} {'load GB/s':>10} {'verify GB/s':>12} {'cost':>7}")
    for r in rows:
        print(
            f"  {r['storage']:<10} {min(r['load_s']):8.3f} {min(r['verify_s']):9.3f} {r['load_gbps']:10.2f} "
            f"{r['verify_gbps']:12.2f} {r['cost_pct']:6.1f}%"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
                "size_mib": args.size_mib,
                "algorithms_gbps": algos,
                "verify": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
