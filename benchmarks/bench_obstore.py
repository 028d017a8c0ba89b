#!/usr/bin/env python
"""Obstore transport vs the s3fs transport vs torch's FsspecReader, on the local s3rver S3 server.

Usage::

    .venv/bin/python benchmarks/bench_obstore.py [--size-gib 2] [--quick] [--json out.json]

Needs the ``dcp-storage-obstore`` plugin installed (``pip install -e plugins/dcp-storage-obstore``) and
``node``/``npm`` for s3rver (installed under ``benchmarks/.servers`` on first use).

Same checkpoint, server, timing and checks as ``bench_dcp_read.py`` (whose harness, ``harness/``, this script reuses):
a seeded ~2 GiB transformer-shaped DCP checkpoint saved by 2 ranks, uploaded once to s3rver, loaded by
one process into full tensors, ``dcp.load`` timed, best of ``--repeats``, each load in a fresh process,
every tensor verified by checksum. Rows, all in the same run:

* loads: ``dcp_storage.FsspecReader`` with the default s3fs transport; with ``{"transport": "obstore"}``
  at its defaults and at a few (workers, request size) settings; torch's ``FsspecReader``;
* raw limits of the same server, reading the same objects into pre-faulted buffers with 8 concurrent
  16 MiB ranges: plain ``http.client``, ``obstore.get_range`` threads, ``boto3`` ``get_object``
  threads, and s3fs ``cat_ranges``.

Every row records client and server (s3rver process) CPU seconds per GB; ``server cores`` is the share
of one core the server used during the run: s3rver is a single node process, so near 1.0 it is the
bottleneck, whatever the client does. GB/s is 1e9 bytes of destination tensors (loads) or bytes read
(raw rows) per second. JSON goes to ``benchmarks/results/obstore.json`` (``--quick``: ``obstore_quick.json``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (REPO, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import harness as base
from harness import GB, GiB, MiB

RAW_PART = 16 * MiB
RAW_CONCURRENCY = 8
CASE = "s3rver 1p full"
S3FS = "ours (s3fs transport)"

# ================================================================================= rank-side workers


def _make_reader(kind: str, url: str, storage_options: dict[str, Any]) -> Any:
    """``obstore[-wW-rR]``: our reader on the obstore transport (W workers, R MiB requests)."""
    if not kind.startswith("obstore"):
        return _ORIGINAL_MAKE_READER(kind, url, storage_options)
    from dcp_storage import FsspecReader, TransportConfig

    config = None
    if kind != "obstore":
        _, w, r = kind.split("-")
        config = TransportConfig(max_workers=int(w[1:]), max_request_bytes=int(r[1:]) * MiB)
    return FsspecReader(url, {**storage_options, "transport": "obstore"}, transport_config=config)


_ORIGINAL_MAKE_READER = base.make_reader
_ORIGINAL_LOAD_JOB = base.load_rank_job


def load_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """``harness.load_rank_job`` with readers of the obstore transport added."""
    base.make_reader = _make_reader
    return _ORIGINAL_LOAD_JOB(rank, world, job)


def raw_obstore_job(
    rank: int,
    world: int,
    endpoint: str,
    bucket: str,
    objects: list[tuple[str, int]],
    part: int,
    conc: int,
    server_pid: int | None,
) -> dict[str, Any]:
    """Raw limit: ``obstore.get_range`` from ``conc`` threads into pre-faulted buffers."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        bucket,
        config={"endpoint": endpoint, "access_key_id": "S3RVER", "secret_access_key": "S3RVER", "region": "us-east-1"},
        client_options={"allow_http": True, "timeout": "300s"},
        retry_config={"max_retries": 0},
    )

    def fetch(key: str, off: int, n: int, into: memoryview) -> None:
        into[:] = obstore.get_range(store, key, start=off, end=off + n)

    return base.raw_ranged_job(objects, part, conc, server_pid, lambda: contextlib.nullcontext(fetch))


def raw_boto3_job(
    rank: int,
    world: int,
    endpoint: str,
    bucket: str,
    objects: list[tuple[str, int]],
    part: int,
    conc: int,
    server_pid: int | None,
) -> dict[str, Any]:
    """Raw limit: boto3 ``get_object(Range=...)`` from ``conc`` threads, body read into pre-faulted buffers."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="S3RVER",
        aws_secret_access_key="S3RVER",
        config=Config(max_pool_connections=conc),
    )

    def fetch(key: str, off: int, n: int, into: memoryview) -> None:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + n - 1}")["Body"]
        base.read_exactly_into(body._raw_stream.readinto, into)  # urllib3 response: straight into the buffer

    return base.raw_ranged_job(objects, part, conc, server_pid, lambda: contextlib.nullcontext(fetch))


def raw_s3fs_cat_ranges_job(
    rank: int,
    world: int,
    storage_options: dict[str, Any],
    bucket: str,
    objects: list[tuple[str, int]],
    part: int,
    conc: int,
    server_pid: int | None,
) -> dict[str, Any]:
    """Plain s3fs: one ``cat_ranges`` call over all 16 MiB parts (``batch_size`` = ``conc``), then copied into
    pre-faulted buffers (the copy is what a reader would have to do with the returned ``bytes``)."""
    import s3fs

    fs = s3fs.S3FileSystem(**storage_options, skip_instance_cache=True)
    _keep, views = zip(*(base.touched(size) for _, size in objects))
    tasks = list(base.ranged_tasks(objects, part))
    paths = [f"{bucket}/{objects[i][0]}" for i, _, _ in tasks]
    starts = [off for _, off, _ in tasks]
    ends = [off + n for _, off, n in tasks]

    def work() -> None:
        for (i, off, n), data in zip(tasks, fs.cat_ranges(paths, starts, ends, batch_size=conc)):
            views[i][off : off + n] = data

    elapsed, cpu = base.run_threads(1, work, server_pid)
    return {"seconds": elapsed, "bytes": sum(s for _, s in objects), "requests": len(tasks), **cpu}


# ==================================================================================== orchestration


def _server_cores(row: dict[str, Any]) -> float | None:
    """Cores the server used on average during the best run: server CPU s/GB x GB/s."""
    if row.get("server_cpu_s_per_gb") is None or not row.get("gbps"):
        return None
    gb = (row.get("bytes_needed") or row.get("bytes") or 0) / GB
    return row["server_cpu_s_per_gb"] * gb / row["seconds"] if gb else None


QUIET = 0.15  # a run is "quiet" when other processes used less than this share of the machine's CPU


def _label(kind: str) -> str:
    if kind == "ours":
        return S3FS
    if kind == "obstore":
        return "ours (obstore transport, defaults)"
    _, w, r = kind.split("-")
    return f"ours (obstore, {w[1:]} workers, {r[1:]} MiB requests)"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per reader: its best run, plus medians and ratios to the s3fs transport within each round."""
    s3fs_by_round = {r["round"]: r for r in rows if r["reader"] == S3FS and "round" in r and r.get("gbps")}
    out: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        runs[r["reader"]].append(r)
    for reader, group in runs.items():
        good = [r for r in group if r.get("gbps")]
        best = dict(max(good, key=lambda r: r["gbps"]) if good else group[0])
        best["runs_s"] = [t for r in group for t in r.get("runs_s", [])]
        best.pop("per_rank", None)
        if good and "round" in group[0]:
            best["median_gbps"] = statistics.median(r["gbps"] for r in good)
            pairs = [(r, s3fs_by_round[r["round"]]) for r in good if r["round"] in s3fs_by_round]
            best["round_ratios"] = [a["gbps"] / b["gbps"] for a, b in pairs]
            best["round_others_cpu"] = [(a.get("others_cpu_frac"), b.get("others_cpu_frac")) for a, b in pairs]
            quiet = [a["gbps"] / b["gbps"] for a, b in pairs if max(a["others_cpu_frac"], b["others_cpu_frac"]) < QUIET]
            if best["round_ratios"]:
                best["median_ratio"] = statistics.median(best["round_ratios"])
            if quiet:
                best["quiet_ratio"] = statistics.median(quiet)
                best["quiet_rounds"] = len(quiet)
            best["server_cores_runs"] = [_server_cores(r) for r in good]
        best["server_cores"] = _server_cores(best)
        out[reader] = best
    return list(out.values())


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "reader",
        "best GB/s",
        "median GB/s",
        "x s3fs transport (median of rounds)",
        "x s3fs (quiet rounds)",
        "requests",
        "bytes read",
        "peak RSS +MiB",
        "client CPU s/GB",
        "server CPU s/GB",
        "server cores",
        "others' CPU",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if not r.get("gbps"):
            lines.append("| " + " | ".join([r["reader"], "ERROR " + (r.get("error") or ""), *[""] * 10]) + " |")
            continue
        cells = [
            r["reader"],
            f"{r['gbps']:.3f}",
            f"{r['median_gbps']:.3f}" if "median_gbps" in r else "-",
            f"{r['median_ratio']:.2f}" if "median_ratio" in r else "-",
            f"{r['quiet_ratio']:.2f} ({r['quiet_rounds']})" if "quiet_ratio" in r else "-",
            str(r.get("requests", "-")),
            f"{(r.get('bytes_read') or r.get('bytes') or 0) / GiB:.2f} GiB",
            f"{r['peak_extra'] / MiB:.0f}" if "peak_extra" in r else "-",
            f"{r['client_cpu_s_per_gb']:.2f}" if "client_cpu_s_per_gb" in r else "-",
            f"{r['server_cpu_s_per_gb']:.2f}" if "server_cpu_s_per_gb" in r else "-",
            f"{r['server_cores']:.2f}" if r.get("server_cores") is not None else "-",
            f"{r['others_cpu_frac']:.0%}" if "others_cpu_frac" in r else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 1 repeat, no tuning sweep")
    p.add_argument("--repeats", type=int, default=None, help="best of N (default 3, quick 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None)
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "dcp-storage-bench"))
    p.add_argument("--sweep", default="w8-r16,w16-r16,w8-r32,w4-r32", help="obstore settings: wW-rR (R in MiB)")
    p.add_argument("--rounds", type=int, default=None, help="paired rounds of every reader (default 4, quick 1)")
    p.add_argument("--torch-repeats", type=int, default=1)
    p.add_argument("--quiet-wait", type=float, default=None, help="wait up to N s for an idle machine (default 20)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_gib, args.sweep = 0.25, ""
        args.rounds = args.rounds or 1
        args.repeats = args.repeats or 1
        args.quiet_wait = 0.0 if args.quiet_wait is None else args.quiet_wait
    args.repeats = args.repeats or 3
    args.rounds = args.rounds or 4
    args.quiet_wait = 20.0 if args.quiet_wait is None else args.quiet_wait
    args.json = args.json or os.path.join(HERE, "results", "obstore_quick.json" if args.quick else "obstore.json")
    # What harness.Bench reads from its arguments:
    args.extra_repeats, args.slow_s = (0 if args.quick else 2), 30.0
    started = time.time()
    warnings.filterwarnings("ignore")
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (HERE, REPO, os.environ.get("PYTHONPATH")) if x)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    base.load_rank_job = load_job  # Bench.load runs this module's job (pickled by name: bench_obstore.load_job)

    machine = base.machine_notes()
    import obstore

    machine["versions"]["obstore"] = obstore.__version__
    print(f"machine: {machine['cpus']} CPUs, load {machine['loadavg_at_start']}", flush=True)
    info = base.ensure_checkpoint(args.cache_dir, args.size_gib, args.seed)
    print(f"checkpoint: {info['tensor_bytes'] / GiB:.2f} GiB in {len(info['spec'])} tensors", flush=True)
    bench = base.Bench(args, info)
    setup: dict[str, Any] = {}
    try:
        with base.s3rver_holding(info) as (srv, setup):
            bench.server_pid = srv.pid
            key_prefix = info["tag"]
            url, so = f"s3://{base.BUCKET}/{key_prefix}", srv.storage_options()
            names = [n for n, _ in base.data_files(info)]
            objects = [(f"{key_prefix}/{n}", s) for n, s in base.data_files(info)]
            http_objects = [(f"/{base.BUCKET}/{k}", s) for k, s in objects]
            base.warm_files([srv.object_path(base.BUCKET, f"{key_prefix}/{n}") for n in names])
            raw_args = (srv.endpoint_url, base.BUCKET, objects, RAW_PART, RAW_CONCURRENCY, srv.pid)
            label = f"{RAW_PART // MiB}MiBx{RAW_CONCURRENCY}"
            bench.raw(
                CASE,
                f"raw http.client {label}",
                base.raw_s3_job,
                srv.host,
                srv.port,
                http_objects,
                RAW_PART,
                RAW_CONCURRENCY,
                srv.pid,
            )
            bench.raw(CASE, f"raw obstore get_range {label}", raw_obstore_job, *raw_args)
            bench.raw(CASE, f"raw boto3 get_object {label}", raw_boto3_job, *raw_args)
            bench.raw(CASE, f"raw s3fs cat_ranges {label}", raw_s3fs_cat_ranges_job, so, *raw_args[1:])
            # Paired rounds: every reader once per round, in turn, so that the machine's drifting load
            # (other processes) hits all of them alike; ratios are taken within a round.
            kinds = ["ours", "obstore", *(f"obstore-{x}" for x in filter(None, args.sweep.split(",")))]
            args.extra_repeats = 0
            for round_ in range(args.rounds):
                for kind in kinds:
                    row = bench.load(CASE, kind, url, "full", 1, storage_options=so, s3=True, repeats=1)
                    row.update(reader=_label(kind), round=round_)
            bench.load(
                CASE,
                "torch-fsspec",
                url,
                "full",
                1,
                storage_options=so,
                s3=True,
                repeats=args.torch_repeats,
                timeout=900,
            )["reader"] = "torch FsspecReader"
    except KeyboardInterrupt:
        print("interrupted; reporting what ran", flush=True)
    except Exception:  # noqa: BLE001 - report partial results
        traceback.print_exc()
    rows = summarize(bench.rows)
    table = format_table(rows)
    print("\n" + table)
    verdict = _verdict(rows)
    print("\n" + verdict)
    result = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "command": " ".join(
            [os.path.relpath(sys.executable, REPO), os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]
        ),
        "args": vars(args),
        "machine": machine,
        "loadavg_at_end": os.getloadavg(),
        "s3_setup": setup,
        "checkpoint": {k: v for k, v in info.items() if k not in ("sums", "spec")},
        "rows": rows,
        "runs": [{k: v for k, v in r.items() if k != "per_rank"} for r in bench.rows],
        "table_markdown": table,
        "verdict": verdict,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nJSON: {os.path.abspath(args.json)}  (total {time.time() - started:.0f}s)")
    return 0


def _verdict(rows: list[dict[str, Any]]) -> str:
    by = {r["reader"]: r for r in rows if r.get("gbps")}
    s3fs = by.get(S3FS)
    obs = [r for name, r in by.items() if name.startswith("ours (obstore") and "median_ratio" in r]
    if not s3fs or not obs:
        return "verdict: incomplete run"
    best = max(obs, key=lambda r: r["median_ratio"])
    ratios = ", ".join(f"{x:.2f}" for x in best["round_ratios"])
    met = "MET" if best["median_ratio"] >= 1.5 else "MISSED"
    lines = [
        (
            f"bar (obstore >= 1.5x the s3fs transport, same run): {met}: {best['reader']} median "
            f"{best['median_ratio']:.2f}x over {len(best['round_ratios'])} paired rounds (each: {ratios})"
        ),
    ]
    if "quiet_ratio" in best:
        lines.append(f"  in rounds where other processes took < {QUIET:.0%} of the CPU: {best['quiet_ratio']:.2f}x")
    else:
        lines.append(f"  no round was quiet (other processes took >= {QUIET:.0%} of the CPU): not conclusive")
    if len(best["round_ratios"]) < 3:
        lines.append("  fewer than 3 rounds: a smoke test, not a measurement")
    raw = max((r for name, r in by.items() if name.startswith("raw")), key=lambda r: r["gbps"], default=None)
    if raw:
        need = 1.5 * s3fs["median_gbps"]
        lines.append(
            f"fastest raw client on this server: {raw['reader']} {raw['gbps']:.3f} GB/s; 1.5x the s3fs transport's "
            f"median ({s3fs['median_gbps']:.3f} GB/s) is {need:.3f} GB/s = {need / raw['gbps']:.2f}x that"
        )
    cores = [c for r in by.values() for c in (r.get("server_cores_runs") or [r.get("server_cores")]) if c]
    if cores:
        lines.append(f"s3rver (a single node process) used {min(cores):.2f}-{max(cores):.2f} cores in the runs")
    return "\n".join(lines)


if __name__ == "__main__":
    # Run through the importable module name so worker functions pickle as bench_obstore.<fn>.
    import bench_obstore

    sys.exit(bench_obstore.main())
