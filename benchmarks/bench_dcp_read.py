#!/usr/bin/env python
"""Read benchmark: ``dcp_storage.FsspecReader`` against torch's readers and raw I/O limits.

Usage::

    .venv/bin/python benchmarks/bench_dcp_read.py [--size-gib 2] [--quick] [--json out.json]

What it does:

* Builds (once, cached under ``$TMPDIR/dcp-storage-bench/`` keyed by size and seed) a seeded checkpoint of
  about ``--size-gib`` GiB shaped like a transformer (fp32 embedding/head/norms/biases, bf16 attention and
  MLP matrices), saved by 2 gloo ranks as ``Shard(0)`` DTensors with torch's own ``FileSystemWriter``.
* Times only the ``dcp.load`` call, best of ``--repeats``, each repeat in a fresh process (a fork of
  :func:`dcp_storage_testing.distributed.run_ranks`'s forkserver, torch preloaded) so peak-RSS numbers do
  not mix. Destinations are pre-allocated and touched before the clock starts; the page cache is warmed
  by an untimed read of the files before each case, optionally after dropping them to put them in a
  known folio state (``--page-cache large|small``: see :func:`prepare_page_cache`). Every load is checked against per-chunk checksums.
* Cases: local single process into full tensors; local 2 ranks resharding ``Shard(0)`` -> ``Shard(1)``
  (and ``Shard(0)`` -> ``Shard(0)``); s3rver (npm, installed under ``benchmarks/.servers``) single process
  and 2 ranks. Raw limits: ``readinto`` (1 and 2 threads) of the same file bytes; plain concurrent
  ranged GETs (http.client, 16 MiB parts, 8 concurrent) against the same server.
* Peak RSS beyond destinations: ``VmHWM`` is reset (``/proc/self/clear_refs`` ``5``) after the
  destinations are allocated; reported is ``VmHWM - VmRSS(before load)`` (max over ranks).

GB/s is 1e9 bytes per second of bytes *needed* (the destination tensors' bytes); raw limits use the bytes
they read. Results: a table on stdout and JSON (default ``benchmarks/results/dcp_read.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

from harness import (
    HERE,
    PAGE_CACHE_MODES,
    REPO,
    Bench,
    MiB,
    code_version,
    ensure_checkpoint,
    finish_rows,
    format_table,
    machine_notes,
    print_checkpoint,
    print_machine,
)


def evaluate_targets(rows: list[dict[str, Any]], info: dict[str, Any]) -> list[dict[str, Any]]:
    def find(case: str, reader: str, note_empty: bool = True) -> dict[str, Any] | None:
        for r in rows:
            if r["case"] == case and r["reader"] == reader and r.get("gbps") and (not note_empty or not r.get("note")):
                return r
        return None

    rss_limit = 2 * info["largest_tensor_bytes"] + 256 * MiB
    out = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        out.append({"target": name, "met": ok, "detail": detail})

    r = find("local 1p full", "ours")
    if r and "vs_raw" in r:
        add("local 1p >= 0.7x raw readinto", r["vs_raw"] >= 0.7, f"{r['vs_raw']:.2f}x ({r['gbps']:.3f} GB/s)")
    r = find("local 2r S0->S1", "ours")
    if r and "vs_raw" in r:
        add("local 2r reshard >= 0.7x 2-thread readinto", r["vs_raw"] >= 0.7, f"{r['vs_raw']:.2f}x")
        add(
            "local 2r reshard bytes read <= 1.05x needed",
            r["read_ratio_max_rank"] <= 1.05,
            f"{r['read_ratio']:.3f}x (max rank {r['read_ratio_max_rank']:.3f}x)",
        )
    r2 = find("local 2r S0->S1", "ours-gap0")
    if r2 and "vs_raw" in r2:
        add("(ours-gap0) local 2r reshard >= 0.7x 2-thread readinto", r2["vs_raw"] >= 0.7, f"{r2['vs_raw']:.2f}x")
        add(
            "(ours-gap0) local 2r reshard bytes read <= 1.05x needed",
            r2["read_ratio_max_rank"] <= 1.05,
            f"{r2['read_ratio']:.3f}x",
        )
    r = find("s3rver 1p full", "ours")
    if r and "vs_raw" in r:
        add("s3rver 1p >= 0.7x raw ranged GET", r["vs_raw"] >= 0.7, f"{r['vs_raw']:.2f}x ({r['gbps']:.3f} GB/s)")
    if r:
        t = find("s3rver 1p full", "torch-fsspec", note_empty=False)
        same = next(
            (
                x
                for x in rows
                if x["case"] == "s3rver 1p full"
                and x["reader"] == "ours"
                and x.get("gbps")
                and "same subset" in (x.get("note") or "")
            ),
            None,
        )
        if t:
            ours_r = same or r
            detail = f"{ours_r['gbps'] / t['gbps']:.1f}x" + (f" on the same {t['note']}" if same else "")
            if same:
                detail += f"; ours on the whole checkpoint vs torch on the subset: {r['gbps'] / t['gbps']:.1f}x"
            add("s3rver 1p >= 5x torch FsspecReader", ours_r["gbps"] / t["gbps"] >= 5, detail)
    for label, reader in (("", "ours"), ("(ours-gap0) ", "ours-gap0")):
        worst = max(
            (x for x in rows if x["reader"] == reader and "peak_extra" in x),
            key=lambda x: x["peak_extra"],
            default=None,
        )
        if worst:
            detail = f"worst {worst['peak_extra'] / MiB:.0f} MiB ({worst['case']}) vs limit {rss_limit / MiB:.0f} MiB"
            if worst.get("peak_file_extra", 0) > 32 * MiB:
                detail += (
                    f"; of which anonymous memory {max(worst['peak_anon_extra'], 0) / MiB:.0f} MiB, the "
                    "rest checkpoint pages mapped with mmap (page cache, reclaimable)"
                )
                worst_anon = max(
                    (x for x in rows if x["reader"] == reader and "peak_anon_extra" in x),
                    key=lambda x: x["peak_anon_extra"],
                )
                detail += f"; worst anonymous peak {worst_anon['peak_anon_extra'] / MiB:.0f} MiB ({worst_anon['case']})"
            add(
                label + "peak RSS/rank beyond destinations <= 2x largest tensor + 256 MiB",
                worst["peak_extra"] <= rss_limit,
                detail,
            )
    r = find("s3rver 2r S0->S1", "ours")
    if r and "vs_raw" in r:
        add(
            "(no target) s3rver 2r reshard vs raw ranged GET",
            None,
            f"{r['vs_raw']:.2f}x, bytes read {r['read_ratio']:.2f}x needed",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke test: 0.25 GiB, 1 repeat")
    p.add_argument("--repeats", type=int, default=None, help="best of N (default 3, quick 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=os.path.join(HERE, "results", "dcp_read.json"))
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "dcp-storage-bench"))
    p.add_argument("--cases", default="local1,local2,s3-1,s3-2", help="comma list of local1,local2,s3-1,s3-2")
    p.add_argument(
        "--torch-s3-subset-gib",
        type=float,
        default=0.0,
        help="if > 0, torch's FsspecReader on s3 loads only a prefix of the state dict of at most this "
        "many GiB (it is slow; ours then also runs on the same subset); default 0: everything",
    )
    p.add_argument("--torch-s3-timeout", type=float, default=300.0)
    p.add_argument("--torch-s3-repeats", type=int, default=None, help="default: min(repeats, 2)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="before each run, wait up to this many seconds for the machine to go idle (default 20; quick 0)",
    )
    p.add_argument(
        "--extra-repeats",
        type=int,
        default=None,
        help="up to this many more runs while the best run so far was disturbed by other processes "
        "(>15%% of the CPU); default 3, quick 0",
    )
    p.add_argument("--slow-s", type=float, default=10.0, help="a load slower than this gets only 2 repeats")
    p.add_argument(
        "--page-cache",
        choices=PAGE_CACHE_MODES,
        default="as-is",
        help="state of the page cache for the local cases: as-is (read once), large (drop, read back "
        "sequentially: large folios), small (drop, read back 4 KiB at a time: 4 KiB folios); see "
        "prepare_page_cache",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.size_gib = 0.25
        args.repeats = args.repeats or 1
        args.quiet_wait = 0.0 if args.quiet_wait is None else args.quiet_wait
    args.quiet_wait = 20.0 if args.quiet_wait is None else args.quiet_wait
    args.extra_repeats = (0 if args.quick else 3) if args.extra_repeats is None else args.extra_repeats
    args.repeats = args.repeats or 3
    args.torch_s3_repeats = args.torch_s3_repeats or min(args.repeats, 2)
    args.cases = set(args.cases.split(","))
    started = time.time()
    warnings.filterwarnings("ignore")
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (HERE, REPO, os.environ.get("PYTHONPATH")) if x)

    machine = machine_notes()
    print_machine(machine)
    info = ensure_checkpoint(args.cache_dir, args.size_gib, args.seed)
    print_checkpoint(info)
    bench = Bench(args, info)
    bench.s3_setup = None  # type: ignore[attr-defined]
    try:
        bench.run_local()
        if args.cases & {"s3-1", "s3-2"}:
            bench.run_s3()
    except KeyboardInterrupt:
        print("interrupted; reporting what ran", flush=True)
    except Exception:  # noqa: BLE001 - report partial results
        traceback.print_exc()
    finish_rows(bench.rows)
    targets = evaluate_targets(bench.rows, info)
    table = format_table(bench.rows)
    print()
    print(table)
    print()
    for t in targets:
        mark = {True: "MET ", False: "MISS", None: "n/a "}[t["met"]]
        print(f"  [{mark}] {t['target']}: {t['detail']}")
    result = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "command": " ".join(
            [os.path.relpath(sys.executable, REPO), os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]
        ),
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
        "machine": machine,
        "loadavg_at_end": os.getloadavg(),
        "busy_before_runs": bench.busy_before,
        "code_at_end": code_version(),
        "checkpoint": {k: v for k, v in info.items() if k not in ("sums", "spec")} | {"n_tensors": len(info["spec"])},
        "s3_setup": bench.s3_setup,  # type: ignore[attr-defined]
        "page_cache": bench.page_cache,
        "definitions": {
            "GB": "1e9 bytes",
            "gbps": "bytes needed (destination tensors, all ranks) / max rank dcp.load seconds; raw rows: bytes read / s",
            "peak_extra": "VmHWM (reset after allocating destinations) - VmRSS before dcp.load, max over ranks",
            "peak_anon_extra": "sampled (10 ms) peak RssAnon - RssAnon before dcp.load: the table shows it as "
            "'(anon N)' when file-backed pages (mmap of the checkpoint files) make up more than 32 MiB of the peak",
            "requests": "ours: reader.counters['requests'] (sum of ranks); torch local: read syscalls (syscr); "
            "torch s3: s3fs get_object calls",
            "read_ratio": "bytes read / bytes needed (sum of ranks); see bytes_read_source per row",
            "others_cpu_frac": "share of the machine's CPU (all cores) used by unrelated processes during the "
            "best run: /proc/stat busy - benchmark processes - s3rver; high values mean the number is noisy",
            "client_cpu_s_per_gb": "CPU seconds of the reading process(es) per GB needed (all threads)",
        },
        "rows": bench.rows,
        "targets": targets,
        "table_markdown": table,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nJSON: {os.path.abspath(args.json)}  (total {time.time() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
