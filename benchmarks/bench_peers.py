#!/usr/bin/env python
"""Side-by-side benchmark against the peers a user would pick instead: s3torchconnector, Run:ai Model Streamer.

Usage::

    .venv/bin/pip install -c .ci/constraints.txt '.[bench]'   # the peers (never needed by the package)
    .venv/bin/python benchmarks/bench_peers.py [--size-mib 256] [--reps 3] [--only s3-load,s3-save,local]

One run, one s3rver (npm, installed under ``benchmarks/.servers``), the same data for every contestant, a
fresh process per load or save (:func:`dcp_storage_testing.distributed.run_ranks`), the order of the
contestants rotated on every repetition so load on this shared machine hits them alike; rows report the
median (and best) of ``--reps``:

* ``s3-load``: a DCP checkpoint (2 ``Shard(0)`` files, saved by torch's ``FileSystemWriter``) and a Hugging
  Face safetensors checkpoint (4 shard files + index) of the same transformer-like model, uploaded once.
  DCP: ``dcp_storage.FsspecReader``, s3torchconnector's ``S3StorageReader`` (its default ``dcp_optimized``
  reader) and torch's ``FsspecReader``; safetensors: ``dcp_storage.SafetensorsReader`` and Run:ai's
  ``SafetensorsStreamer`` (every tensor copied into the same pre-allocated state dict). Each next to the raw
  limit: plain concurrent ranged GETs (16 MiB x 8 connections) of the same objects. 1 process (full
  tensors) and 2 ranks (``Shard(0)`` DTensors; Run:ai streams whole tensors, each rank copies its rows).
  Every load is checked against checksums (untimed).
* ``s3-save``: the same model to the same s3rver: ``FsspecWriter``, s3torchconnector's ``S3StorageWriter``
  (``thread_count`` 1 and 4), torch's ``FsspecWriter``; next to raw concurrent PUTs and a raw multipart
  upload (64 MiB parts x 8, unsigned ``http.client``, as ``bench_dcp_write.py``).
* ``local``: a DCP save to local disk by ``FsspecWriter`` and torch's ``FileSystemWriter(thread_count=2)``
  next to the disk's own limit: the same bytes, staged (untimed) in a page-aligned buffer, written with
  ``os.O_DIRECT`` and ``fsync``; the job checks the descriptor really has ``O_DIRECT`` and that the written
  file left (almost) no pages in the page cache (``mincore``).

Peak RSS: ``VmHWM`` reset after the destinations (or the state) are allocated, minus ``VmRSS`` before: the
extra memory a contestant needs, max over ranks. A missing peer skips its rows with a note. Results: a
table on stdout, JSON in ``benchmarks/results/peers-<date>.json`` and ``benchmarks/RESULTS-peers.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import bench_dcp_write as bw  # noqa: E402
import bench_safetensors as bst  # noqa: E402
import harness as base  # noqa: E402
from harness import GB, MiB  # noqa: E402
from peers_jobs import (  # noqa: E402
    BUCKET,
    REGION,
    WRITE_BUCKET,
    load_job,
    odirect_job,
    peer_missing,
    save_job,
)

PEERS = {"s3tc": "s3torchconnector", "runai": "runai_model_streamer"}


class Run:
    """Every contestant of one group, run ``reps`` times with the order rotated; rows hold the medians."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[dict[str, Any]] = []

    def group(self, case: str, entries: list[tuple[str, str, Any, int, dict[str, Any]]]) -> None:
        """``entries``: (label, kind raw|load|save, job function, world, job). Skips entries whose peer is missing."""
        from dcp_storage_testing.distributed import RankFailedError, RankTimeoutError, run_ranks

        print(f"[{case}]", flush=True)
        runs: dict[str, list[list[dict[str, Any]]]] = {e[0]: [] for e in entries}
        errors: dict[str, str] = {}
        for e in entries:
            missing = peer_missing(e[4].get("who", ""))
            if missing:
                errors[e[0]] = missing
        for rep in range(self.args.reps):
            k = rep % len(entries)
            for label, _kind, fn, world, job in entries[k:] + entries[:k]:
                if label in errors:
                    continue
                try:
                    run_job = {**job, "rep": rep, "run_id": uuid.uuid4().hex[:10]}
                    res = run_ranks(fn, world, run_job, timeout=self.args.timeout)
                except RankTimeoutError:
                    errors[label] = f"timeout after {self.args.timeout:.0f}s"
                    continue
                except RankFailedError as exc:
                    errors[label] = "failed: " + next(iter(exc.failures.values())).strip().splitlines()[-1][:300]
                    continue
                bad = [b for r in res for b in r.get("bad", [])]
                if bad:
                    errors[label] = "WRONG DATA: " + ", ".join(bad[:5])
                    continue
                runs[label].append(res)
        for label, kind, _fn, world, job in entries:
            row: dict[str, Any] = {
                "case": case,
                "who": label,
                "kind": kind,
                "world": world,
                "note": job.get("note", ""),
            }
            got = runs[label]
            if got:
                secs = [max(r["seconds"] for r in res) for res in got]
                nbytes = sum(r["bytes"] for r in got[0])
                row.update(
                    runs_s=secs,
                    bytes=nbytes,
                    gbps=nbytes / statistics.median(secs) / GB,
                    best_gbps=nbytes / min(secs) / GB,
                    peak_extra=max(max(r["peak_extra"] for r in res) for res in got),
                    per_rank_last=got[-1],
                )
                extras = [r.get("check") for r in got[-1] if r.get("check")]
                if extras:
                    row["check"] = extras
            if label in errors:
                row["error"] = errors[label]
            self.rows.append(row)
            _print_row(row)


def _print_row(row: dict[str, Any]) -> None:
    if "gbps" not in row:
        print(f"  {row['who']:<34} SKIPPED/ERROR {row.get('error')}", flush=True)
        return
    runs = " ".join(f"{s:.2f}" for s in row["runs_s"])
    print(
        f"  {row['who']:<34} {row['gbps']:.3f} GB/s median (best {row['best_gbps']:.3f}; runs s: {runs})  "
        f"peak+{row['peak_extra'] / MiB:.0f}MiB" + (f"  ERROR {row['error']}" if row.get("error") else ""),
        flush=True,
    )


# ============================================================================================= cases


def s3_load(run: Run, server: Any, dcp_info: dict[str, Any], st_info: dict[str, Any], worlds: list[int]) -> None:
    env = _s3_env(server)
    so = server.storage_options()
    dcp_url = f"s3://{BUCKET}/{dcp_info['tag']}"
    st_url = f"s3://{BUCKET}/{st_info['tag']}"
    dcp_objects = [(f"/{BUCKET}/{dcp_info['tag']}/{n}", s) for n, s in base.data_files(dcp_info)]
    st_objects = [(f"/{BUCKET}/{st_info['tag']}/{n}", s) for n, s in bst.data_files(st_info)]
    for paths in (dcp_objects, st_objects):
        base.warm_files([server.object_path(BUCKET, p.split("/", 2)[2]) for p, _ in paths])
    raw_label = f"raw ranged GET {base.RAW_PART // MiB}MiBx{base.RAW_CONCURRENCY}"
    for fmt, info, url, objects, contestants in (
        ("DCP", dcp_info, dcp_url, dcp_objects, ("ours", "s3tc", "torch-fsspec")),
        ("safetensors", st_info, st_url, st_objects, ("ours-st", "runai")),
    ):
        for world in worlds:
            layout = "full" if world == 1 else "shard0"
            common = {
                "fmt": fmt,
                "url": url,
                "layout": layout,
                "spec": info["spec"],
                "sums": info["sums"],
                "so": so,
                "env": env,
                "files": [n for n, _ in (base.data_files(info) if fmt == "DCP" else bst.data_files(info))],
            }
            entries: list[tuple[str, str, Any, int, dict[str, Any]]] = []
            if world == 1:
                job = {"raw": (server.host, server.port, objects, base.RAW_PART, base.RAW_CONCURRENCY)}
                entries.append((raw_label, "raw", _raw_get_job, 1, job))
            for who in contestants:
                note = "each rank streams whole tensors, copies its rows" if who == "runai" and world > 1 else ""
                entries.append((_label(who), "load", load_job, world, {**common, "who": who, "note": note}))
            # The same load with the direct reads switched off (aiobotocore's path), to tell their share apart.
            ours = contestants[0]
            aio = {**common, "who": ours, "env": {**env, "DCP_STORAGE_S3_DIRECT": "0"}}
            entries.append((f"{_label(ours)}{AIO}", "load", load_job, world, aio))
            case = f"s3 load {fmt} {'1p' if world == 1 else f'{world}r S0'}"
            run.group(case, entries)


def s3_save(run: Run, server: Any, spec: list, worlds: list[int]) -> None:
    env = _s3_env(server)
    so = server.storage_options()
    for world in worlds:
        raw = {"host": server.host, "port": server.port, "part": 64 * MiB, "concurrency": 8, "spec": spec}
        entries: list[tuple[str, str, Any, int, dict[str, Any]]] = [
            ("raw PUT 64MiB x8", "raw", _raw_put_job, world, {**raw, "multipart": False}),
            ("raw multipart 64MiB x8", "raw", _raw_put_job, world, {**raw, "multipart": True}),
        ]
        for who in ("ours-w", "s3tc-w1", "s3tc-w4", "torch-fsspec-w"):
            job = {"who": who, "spec": spec, "so": so, "env": env, "s3": True, "bucket": WRITE_BUCKET}
            entries.append((_label(who), "save", save_job, world, job))
        # s3rver ignores If-None-Match, so the save's lock is written, then read back after a settle time
        # (1 s by default: see dcp_storage.formats.commit_holder); a store that honours it (S3, moto) has none.
        # This row shows the same save with the settle time set to 0, to tell the lock's cost from the data's.
        quick = {**env, "DCP_STORAGE_LOCK_SETTLE_MS": "0"}
        job = {"who": "ours-w", "spec": spec, "so": so, "env": quick, "s3": True, "bucket": WRITE_BUCKET}
        entries.append((NO_SETTLE, "save", save_job, world, job))
        run.group(f"s3 save DCP {'1p' if world == 1 else f'{world}r'}", entries)


def local_save(run: Run, spec: list, root: str, worlds: list[int]) -> None:
    for world in worlds:
        common = {"spec": spec, "root": root}
        entries: list[tuple[str, str, Any, int, dict[str, Any]]] = [
            ("raw O_DIRECT write+fsync", "raw", odirect_job, world, common),
        ]
        for who in ("ours-w", "torch-fs-t2"):
            entries.append((_label(who), "save", save_job, world, {**common, "who": who, "s3": False}))
        run.group(f"local save DCP {'1p' if world == 1 else f'{world}r'}", entries)
    for world in worlds:
        # The same state saved as HF safetensors: the bar compares it with the disk's limit for the same bytes
        # and with torch's best writer, FileSystemWriter t2 (its HuggingFaceStorageWriter writes per-rank files
        # that need a second consolidation pass at 2 ranks, so it runs at 1 process only).
        common = {"spec": spec, "root": root}
        entries = [("raw O_DIRECT write+fsync", "raw", odirect_job, world, common)]
        for who in ("ours-st-w", "torch-fs-t2") + (("torch-hf-w",) if world == 1 else ()):
            entries.append((_label(who), "save", save_job, world, {**common, "who": who, "s3": False}))
        run.group(f"local save safetensors {'1p' if world == 1 else f'{world}r'}", entries)


def _raw_get_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    host, port, objects, part, conc = job["raw"]
    out = base.raw_s3_job(rank, world, host, port, [tuple(o) for o in objects], part, conc)
    return {"seconds": out["seconds"], "bytes": out["bytes"], "peak_extra": 0}


def _raw_put_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    prefix = f"raw-{job['run_id']}"
    out = bw._raw_s3_job(rank, world, {**job, "prefix": prefix, "seed": 7})
    return {"seconds": out["seconds"], "bytes": out["bytes"], "peak_extra": out["peak_extra"]}


def _label(who: str) -> str:
    return {
        "ours": "dcp_storage FsspecReader",
        "s3tc": "s3torchconnector S3StorageReader",
        "torch-fsspec": "torch FsspecReader",
        "ours-st": "dcp_storage SafetensorsReader",
        "runai": "Run:ai SafetensorsStreamer",
        "ours-w": "dcp_storage FsspecWriter",
        "s3tc-w1": "s3torchconnector S3StorageWriter t1",
        "s3tc-w4": "s3torchconnector S3StorageWriter t4",
        "torch-fsspec-w": "torch FsspecWriter",
        "torch-fs-t2": "torch FileSystemWriter t2",
        "ours-st-w": "dcp_storage SafetensorsWriter",
        "torch-hf-w": "torch HuggingFaceStorageWriter t2",
    }[who]


def _s3_env(server: Any) -> dict[str, str]:
    """What the peers read from the environment (set inside each rank: the forkserver keeps its own env)."""
    key, secret = server.storage_options()["key"], server.storage_options()["secret"]
    return {
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": server.endpoint_url,
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        "NO_PROXY": "127.0.0.1,localhost",
    }


# ============================================================================================ report

NO_SETTLE = "dcp_storage FsspecWriter, lock settle 0"
AIO = ", aiobotocore reads"  # DCP_STORAGE_S3_DIRECT=0
OURS = {
    "dcp_storage FsspecReader",
    "dcp_storage SafetensorsReader",
    "dcp_storage FsspecWriter",
    NO_SETTLE,
    "dcp_storage FsspecReader" + AIO,
    "dcp_storage SafetensorsReader" + AIO,
    "dcp_storage SafetensorsWriter",
}


def finish(rows: list[dict[str, Any]]) -> None:
    """Ratio columns: to the case's raw limit (S3 saves: multipart; 2-rank loads: the 1-process GET limit) and,
    for our rows, to every other contestant of the case."""
    raw_of: dict[str, float] = {}
    for r in rows:
        if r["kind"] == "raw" and r.get("gbps"):
            key = " ".join(r["case"].split(" ")[:3])  # "s3 load DCP", "s3 save DCP", "local save DCP"
            if r["case"].startswith("s3 save") and "multipart" not in r["who"]:
                raw_of.setdefault(r["case"] + "/put", r["gbps"])
                continue
            raw_of[r["case"]] = r["gbps"]
            raw_of.setdefault(key, r["gbps"])
    for r in rows:
        if r["kind"] == "raw" or not r.get("gbps"):
            continue
        limit = raw_of.get(r["case"]) or raw_of.get(" ".join(r["case"].split(" ")[:3]))
        if limit:
            r["vs_raw"] = r["gbps"] / limit
        if r["case"] + "/put" in raw_of:
            r["vs_raw_put"] = r["gbps"] / raw_of[r["case"] + "/put"]
        if r["who"] in OURS:
            r["vs_peers"] = {
                o["who"]: r["gbps"] / o["gbps"]
                for o in rows
                if o["case"] == r["case"] and o["kind"] != "raw" and o["who"] not in OURS and o.get("gbps")
            }


def table(rows: list[dict[str, Any]]) -> str:
    head = ["case", "contestant", "GB/s (median)", "best", "x raw", "ours x each peer", "peak RSS +MiB/rank", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if "gbps" not in r:
            lines.append(f"| {r['case']} | {r['who']} | - | - | - | - | - | {r.get('error', '')} |")
            continue
        vs_raw = f"{r['vs_raw']:.2f}" if "vs_raw" in r else "-"
        if "vs_raw_put" in r:
            vs_raw += f" (PUT {r['vs_raw_put']:.2f})"
        peers = ", ".join(f"{v:.2f}x {k}" for k, v in r.get("vs_peers", {}).items()) or "-"
        peak = f"{r['peak_extra'] / MiB:.0f}" if r["kind"] != "raw" or r["peak_extra"] else "-"
        note = "; ".join(x for x in (r.get("note", ""), r.get("error", "")) if x)
        cells = [r["case"], r["who"], f"{r['gbps']:.3f}", f"{r['best_gbps']:.3f}", vs_raw, peers, peak, note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in (
        "torch",
        "s3torchconnector",
        "s3torchconnectorclient",
        "runai-model-streamer",
        "runai-model-streamer-s3",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def write_markdown(path: str, result: dict[str, Any]) -> None:
    a = result["args"]
    text = f"""# Side by side with the peers (`benchmarks/bench_peers.py`)

**Under load**: measured on a shared 2-core machine while other work ran (load average
{result["machine"]["loadavg_at_start"][0]:.1f} at the start, {result["loadavg_at_end"][0]:.1f} at the end); the
ratios (one run, same server, same data, order rotated per repetition) say more than the absolute GB/s.

Command: `{result["command"]}` (a model of {result["model"]["bytes"] / MiB:.0f} MiB in {result["model"]["tensors"]}
tensors, medians of {a["reps"]}, a fresh process per load or save; {result["wall_s"]:.0f} s). Server: s3rver {result["s3rver"]} on loopback. Versions: {result["versions"]}.
Commit {result["machine"]["code"]["commit"]}. JSON: `{os.path.relpath(result["json"], REPO)}`.

{result["table_markdown"]}

- x raw: to the raw limit of the same bytes on the same server or disk: loads, plain ranged GETs of the same
  objects (16 MiB x 8 connections; the 2-rank rows use the 1-process limit, the server's); S3 saves, a raw
  multipart upload (and plain PUTs in brackets), 64 MiB x 8; local saves, `O_DIRECT` writes from an aligned
  buffer plus `fsync` (checked: descriptor flags, page-cache residency after the write: {result["odirect_check"]}).
- peak RSS: `VmHWM` beyond the allocated destinations (or the state being saved), max over ranks.
- Run:ai at 2 ranks streams whole tensors (it cannot read a row range), so each rank fetches the whole model.
- s3rver's multipart upload is slow and noisy (it concatenates parts and hashes them on its one core), so
  the S3 save rows are also given against plain concurrent PUTs (in brackets), the tighter limit.
- The local `O_DIRECT` limit is one thread writing 64 MiB at a time (queue depth 1): at this size and load
  buffered writers plus `fsync` can beat it (x raw above 1), so it is a floor of the disk's limit, not its
  ceiling; a deeper queue (threads or `io_uring`) is the next limit to measure.
"""
    with open(path, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=128, help="model size (default 128, the smallest model: 147 MiB)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, order rotated each time (default 3)")
    p.add_argument("--only", default="s3-load,s3-save,local", help="comma list of s3-load,s3-save,local")
    p.add_argument("--worlds", default="1,2", help="process counts (default 1,2)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=300.0, help="per run")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "dcp-storage-bench"))
    p.add_argument("--json", default=None, help="default benchmarks/results/peers-<date>.json")
    p.add_argument("--markdown", default=os.path.join(HERE, "RESULTS-peers.md"))
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    worlds = [int(w) for w in args.worlds.split(",")]
    started = time.time()
    args.json = args.json or os.path.join(HERE, "results", f"peers-{datetime.date.today().isoformat()}.json")
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (HERE, REPO, os.environ.get("PYTHONPATH")) if x)
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    for mod, dist in PEERS.items():
        if peer_missing(mod):
            print(
                f"note: {dist} is not installed: its rows are skipped (pip install -c .ci/constraints.txt '.[bench]')"
            )
    machine = base.machine_notes()
    base.print_machine(machine)
    size_gib = args.size_mib / 1024
    dcp_info = base.ensure_checkpoint(args.cache_dir, size_gib, args.seed)
    st_info = bst.ensure_checkpoint(args.cache_dir, size_gib, args.seed)
    base.print_checkpoint(dcp_info)
    run = Run(args)
    s3rver_version = None
    try:
        if only & {"s3-load", "s3-save"}:
            from dcp_storage_testing.s3rver import S3RVER_VERSION, S3rverServer, ensure_installed

            s3rver_version = S3RVER_VERSION
            prefix = os.path.join(HERE, ".servers")
            ensure_installed(prefix)
            data_dir = os.path.join(args.cache_dir, "peers-s3rver-data")
            with S3rverServer(prefix, data_dir=data_dir, buckets=(BUCKET, WRITE_BUCKET)) as server:
                for info in (dcp_info, st_info):
                    for name in info["files"]:
                        key, local = f"/{BUCKET}/{info['tag']}/{name}", os.path.join(info["path"], name)
                        if base._head_size(server.host, server.port, key) != os.path.getsize(local):
                            base._put_file(server.host, server.port, key, local)
                if "s3-load" in only:
                    s3_load(run, server, dcp_info, st_info, worlds)
                if "s3-save" in only:
                    s3_save(run, server, dcp_info["spec"], worlds)
        if "local" in only:
            root = os.path.join(args.cache_dir, "peers-local-write")
            local_save(run, dcp_info["spec"], root, worlds)
    except KeyboardInterrupt:
        print("interrupted; reporting what ran", flush=True)
    except Exception:  # noqa: BLE001 - report what ran
        traceback.print_exc()
    finish(run.rows)
    md = table(run.rows)
    print("\n" + md)
    checks = [c for r in run.rows if r.get("check") for c in r["check"]]
    result = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "command": " ".join(["python", os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        "args": vars(args),
        "machine": machine,
        "loadavg_at_end": os.getloadavg(),
        "versions": versions(),
        "s3rver": s3rver_version,
        "json": args.json,
        "odirect_check": checks[0] if checks else "not run",
        "model": {"tensors": len(dcp_info["spec"]), "bytes": dcp_info["tensor_bytes"]},
        "definitions": {
            "gbps": "bytes (destination tensors, or tensors saved, all ranks) / median over reps of the slowest rank's seconds",
            "peak_extra": "VmHWM (reset after allocating) - VmRSS before the timed call, max over ranks and reps",
        },
        "rows": run.rows,
        "table_markdown": md,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    write_markdown(args.markdown, result)
    print(f"\nJSON: {args.json}; {args.markdown}  (total {time.time() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
