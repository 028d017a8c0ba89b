#!/usr/bin/env python
"""Benchmark: what zip CRC32 and layout checks cost on load (the numbers behind "opt-in with verify=True").

Usage::

    .venv/bin/python benchmarks/bench_zip_checks.py [--tensor-mib 512] [--records 4000] [--repeats 7] [--json out.json]

Cases, one process, local files, warm page cache, each repeat alternating the two settings:

* ``torch.save`` whole tensors: a seeded file of fp32 tensors of 64 MiB (``--tensor-mib`` in all) loaded
  into full tensors by :class:`dcp_storage.BroadcastingTorchSaveReader` with ``verify=False`` and
  ``verify=True`` (the zip CRC32 of every tensor read whole);
* DCP records read whole: a checkpoint of ``--records`` fp32 tensors of 64 KiB saved by torch's own
  ``FileSystemWriter`` (no manifest), loaded by :class:`dcp_storage.FsspecReader` with ``verify=False`` and
  ``verify=True`` (every record read whole gets its zip layout and CRC32s checked);
* per record: :func:`~dcp_storage.formats.torch_save.zip_layout.check_zip_bytes` with and without CRCs.

Reported: CPU seconds (``time.process_time``, all threads; median) and wall seconds (best and median).
CPU time is the steadier figure on a shared machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)

MiB = 1 << 20


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def compare(name: str, run: Callable[[bool], None], repeats: int) -> dict[str, Any]:
    run(False)  # warm the page cache and the imports
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for rep in range(repeats):
        for checked in (False, True) if rep % 2 else (True, False):
            times[checked].append(timed(lambda c=checked: run(c)))
    out: dict[str, Any] = {"case": name}
    for checked, label in ((False, "off"), (True, "on")):
        cpu = statistics.median(c for c, _ in times[checked])
        walls = [w for _, w in times[checked]]
        out[label] = {"cpu_median": cpu, "wall_best": min(walls), "wall_median": statistics.median(walls)}
    out["cpu_cost"] = out["on"]["cpu_median"] / out["off"]["cpu_median"] - 1
    out["wall_cost"] = out["on"]["wall_best"] / out["off"]["wall_best"] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-mib", type=int, default=512)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from dcp_storage import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner, FsspecReader
    from dcp_storage.formats.torch_save.zip_layout import check_zip_bytes

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(20240611)
    root = tempfile.mkdtemp(prefix="bench-zip-checks-")
    big = {f"t{i}": torch.randn(16 * MiB, generator=g) for i in range(max(1, args.tensor_mib // 64))}
    pt = os.path.join(root, "model.pt")
    torch.save(big, pt)
    small = {f"s{i}": torch.randn(16384, generator=g) for i in range(args.records)}
    ckpt = os.path.join(root, "dcp")
    dcp.save(small, storage_writer=FileSystemWriter(ckpt), no_dist=True)

    def load_pt(verify: bool) -> None:
        dest = {k: torch.empty_like(v) for k, v in big.items()}
        reader = BroadcastingTorchSaveReader(pt, verify=verify)
        dcp.load(dest, storage_reader=reader, planner=DynamicMetaLoadPlanner(), no_dist=True)

    def load_dcp(verify: bool) -> None:
        dest = {k: torch.empty_like(v) for k, v in small.items()}
        dcp.load(dest, storage_reader=FsspecReader(ckpt, verify=verify), no_dist=True)

    results = [
        compare(f"torch.save {sum(t.nbytes for t in big.values()) // MiB} MiB, whole tensors", load_pt, args.repeats),
        compare(f"DCP {args.records} records of 64 KiB, read whole", load_dcp, args.repeats),
    ]
    buf = io.BytesIO()
    torch.save(small["s0"], buf)
    record = memoryview(buf.getvalue())
    per_record = {}
    for crc in (False, True):
        start, n = time.process_time(), 4000
        for _ in range(n):
            check_zip_bytes(record, "bench", crc=crc)
        per_record["layout+crc" if crc else "layout"] = (time.process_time() - start) / n

    print(f"{'case':<44} {'cpu off':>8} {'cpu on':>8} {'cpu +':>7} {'wall off':>9} {'wall on':>8} {'wall +':>7}")
    for r in results:
        print(
            f"{r['case']:<44} {r['off']['cpu_median']:8.3f} {r['on']['cpu_median']:8.3f} {100 * r['cpu_cost']:+6.1f}% "
            f"{r['off']['wall_best']:9.3f} {r['on']['wall_best']:8.3f} {100 * r['wall_cost']:+6.1f}%"
        )
    for what, seconds in per_record.items():
        print(f"check_zip_bytes per 64 KiB record, {what}: {seconds * 1e6:.0f} us of CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "per_record_seconds": per_record, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
