#!/usr/bin/env python
"""Safetensors benchmark: ``dcp_storage.SafetensorsReader``/``SafetensorsWriter`` against torch's HF storage.

Usage::

    .venv/bin/python benchmarks/bench_safetensors.py [--size-gib 2] [--quick] [--repeats N] [--json out.json]

What it does (one run measures everything):

* Builds once (cached under ``$TMPDIR/dcp-storage-bench/`` keyed by size, seed and spec version) a seeded
  Hugging Face sharded checkpoint: several ``model-0000k-of-0000N.safetensors`` written with
  ``safetensors.torch.save_file`` plus ``model.safetensors.index.json``. The model is the transformer of
  ``harness.model_spec`` (fp32 embedding/head/norms/biases, bf16 attention and MLP matrices).
* Local reads (warm page cache; only ``dcp.load`` is timed, best of ``--repeats``, fresh rank processes):

  - ``local 1p full``: one process loads full plain tensors: ours vs torch's
    ``HuggingFaceStorageReader(dir)`` (default ``thread_count=1``, and ``thread_count=2`` as an extra row);
    raw limit: ``preadv`` of the same files from 1 thread.
  - ``local 2r S0``: 2 gloo ranks load ``Shard(0)`` DTensors; GB/s = bytes needed (both ranks) / slowest
    rank's seconds; raw limit: the same files from 2 threads.

* ``s3rver 2r S0``: the same files uploaded once to s3rver (npm, see ``NOTES-s3-throughput.md``), 2 ranks
  load ``Shard(0)`` DTensors from ``s3://``. Reported: GB/s, bytes read / bytes needed per rank (from
  ``reader.counters``, cross-checked with s3fs ``get_object`` calls), storage requests; the raw limit is
  concurrent plain ranged GETs (http.client, 16 MiB x 8) of the same objects from the same server, in the
  same run. torch's ``HuggingFaceStorageReader`` only reads local files (``safe_open`` on a path), so
  it has no s3 row.
* Writes, 2 ranks holding ``Shard(0)`` DTensors of the same model (FSDP2-like), to a local directory:

  - ours: ``SafetensorsWriter(dir, max_shard_size=<same as the input>)``: bytes written (sum of the ranks'
    ``writer.counters['bytes_written']``) / checkpoint size (sum of the output files), seconds.
  - torch: ``HuggingFaceStorageWriter(dir, save_distributed=True, enable_consolidation=True,
    fqn_to_index_mapping=<the input's>)``: every rank writes its shards to ``dir/sharded/``, then the
    coordinator's ``finish`` runs ``consolidate_safetensors_files`` into ``dir``. Bytes written = sum of
    every file's size under ``dir`` (intermediate sharded files + consolidated files + index; cross-checked
    with ``/proc/self/io`` ``wchar``); the consolidation's own seconds are reported too.
  - Every writer's output is checked against the seeded checksums (untimed).

Every load is checked against per-tensor (and per-row-half) checksums. Results: a table on stdout and
JSON (default ``benchmarks/results/safetensors.json``; ``--quick``: ``safetensors_quick.json``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (REPO, HERE):
    if _p not in sys.path:
        sys.path.insert(1, _p)

import harness as bdr
from harness import GB, GiB, MiB

SPEC_VERSION = 1  # bump when the checkpoint layout/generation changes (invalidates the cache)
BUCKET = "bench"
N_FILES_TARGET = 4  # the checkpoint is split into about this many shard files
INDEX_FILE = "model.safetensors.index.json"


# ====================================================================================== generation


def _tensor(idx: int, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + idx)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(bdr.torch_dtype(dtype))


def _row_halves(t: Any, world: int) -> list[int]:
    rows = t.shape[0] // world
    return [bdr.checksum(t[r * rows : (r + 1) * rows]) for r in range(world)]


def ensure_checkpoint(cache_root: str, size_gib: float, seed: int) -> dict[str, Any]:
    """The cached HF checkpoint for (size, seed, spec version): generate it if missing. Returns its info."""
    from safetensors.torch import save_file

    tag = f"st-{size_gib:g}gib-seed{seed}-v{SPEC_VERSION}"
    root = os.path.join(cache_root, tag)
    path = os.path.join(root, "hf")
    info_path = os.path.join(root, "info.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
        if all(os.path.getsize(os.path.join(path, n)) == s for n, s in info["file_sizes"].items()):
            info["generated_s"] = 0.0
            return info
    spec = bdr.model_spec(int(size_gib * GiB))
    total = bdr.spec_total_bytes(spec)
    largest = max(bdr.tensor_nbytes(s, d) for _, s, d in spec)
    max_shard = max(largest, -(-total // N_FILES_TARGET))
    # Greedy packing in spec order, as huggingface_hub's split_torch_state_dict_into_shards does.
    groups: list[list[int]] = [[]]
    acc = 0
    for i, (_, shape, dtype) in enumerate(spec):
        b = bdr.tensor_nbytes(shape, dtype)
        if groups[-1] and acc + b > max_shard:
            groups.append([])
            acc = 0
        groups[-1].append(i)
        acc += b
    n = len(groups)
    shutil.rmtree(root, ignore_errors=True)
    tmp = path + ".partial"
    os.makedirs(tmp)
    print(
        f"[gen] writing {total / GiB:.2f} GiB HF checkpoint ({len(spec)} tensors, {n} files) to {path} ...", flush=True
    )
    t0 = time.perf_counter()
    sums: dict[str, dict[str, Any]] = {}
    weight_map: dict[str, str] = {}
    for k, group in enumerate(groups, start=1):
        name = f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for i in group:
            tname, shape, dtype = spec[i]
            t = _tensor(i, shape, dtype, seed)
            sums[tname] = {"all": bdr.checksum(t), "rows2": _row_halves(t, 2)}
            tensors[tname] = t
            weight_map[tname] = name
        save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
        del tensors
        gc.collect()
    with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    os.rename(tmp, path)
    files = sorted(os.listdir(path))
    info = {
        "tag": tag,
        "path": path,
        "root": root,
        "size_gib": size_gib,
        "seed": seed,
        "spec": [[n_, list(s), d] for n_, s, d in spec],
        "sums": sums,
        "weight_map": weight_map,
        "max_shard_size": max_shard,
        "files": files,
        "file_sizes": {f_: os.path.getsize(os.path.join(path, f_)) for f_ in files},
        "tensor_bytes": total,
        "largest_tensor_bytes": largest,
    }
    with open(info_path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(info_path + ".tmp", info_path)
    info["generated_s"] = time.perf_counter() - t0
    print(f"[gen] done in {info['generated_s']:.1f}s", flush=True)
    return info


def data_files(info: dict[str, Any]) -> list[tuple[str, int]]:
    return [(n, s) for n, s in info["file_sizes"].items() if n.endswith(".safetensors")]


# ========================================================================================= workers


def _make_reader(kind: str, url: str, storage_options: dict[str, Any]) -> Any:
    if kind == "ours":
        from dcp_storage import SafetensorsReader

        return SafetensorsReader(url, storage_options)
    if kind == "ours-noverify":  # default verification's cost: the same reader with verify=False
        from dcp_storage import SafetensorsReader

        return SafetensorsReader(url, storage_options, verify=False)
    if kind == "ours-nobcast":  # diagnostic: every rank scans the headers itself (no metadata broadcast)
        from dcp_storage import SafetensorsReader

        return SafetensorsReader(url, storage_options, broadcast_metadata=False)
    if kind.startswith("ours-w"):  # diagnostic: ours with TransportConfig(max_workers=N)
        from dcp_storage import SafetensorsReader, TransportConfig

        return SafetensorsReader(url, storage_options, transport_config=TransportConfig(max_workers=int(kind[6:])))
    if kind.startswith("torch-hf"):
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        threads = int(kind.split("-t")[1]) if "-t" in kind else 1
        return HuggingFaceStorageReader(url, thread_count=threads)
    raise ValueError(kind)


def _expected(sums: dict[str, Any], name: str, layout: str, rank: int) -> int:
    return sums[name]["all"] if layout == "full" else sums[name]["rows2"][rank]


def _load_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One timed ``dcp.load`` on this rank (a fresh process). Returns timings and measurements."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    if world == 1:
        torch.set_num_threads(job.get("threads") or os.cpu_count() or 1)
    if job.get("profile") == "cprofile":
        import cProfile

        prof = cProfile.Profile()
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    s3count = None
    if job.get("s3"):
        s3count = bdr.S3Count()
        s3count.install()
    sd = bdr.destinations(spec, job["layout"], rank, world)
    needed = sum((v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size() for v in sd.values())
    reader = _make_reader(job["reader"], job["url"], job.get("storage_options") or {})
    phases: dict[str, float] = {}
    for method in ("read_metadata", "read_data"):  # per-phase seconds (both are synchronous in these readers)
        original = getattr(reader, method)

        def timed(*a: Any, _original: Any = original, _name: str = method, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                phases[_name] = phases.get(_name, 0.0) + time.perf_counter() - t

        setattr(reader, method, timed)
    gc.collect()
    spy = None
    if job.get("profile") == "py-spy":
        import subprocess

        spy_out = f"{job['profile_out']}.rank{rank}.txt"
        spy = subprocess.Popen(
            [
                job["pyspy"],
                "record",
                "--pid",
                str(os.getpid()),
                "--rate",
                "250",
                "--format",
                "raw",
                "--threads",
                "-o",
                spy_out,
                *(["--native"] if job.get("pyspy_native") else ["--nonblocking"]),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.5)  # let it attach
    base = bdr.proc_status()["VmRSS"]
    hwm_reset = bdr.reset_peak_rss()
    io0 = bdr.proc_io()
    if world > 1:
        dist.barrier()
    with bdr.CpuWindow(job.get("server_pid")) as cpu:
        if job.get("profile") == "cprofile":
            prof.enable()
        t0 = time.perf_counter()
        dcp.load(sd, storage_reader=reader, no_dist=(world == 1))
        elapsed = time.perf_counter() - t0
        if job.get("profile") == "cprofile":
            prof.disable()
    if spy is not None:
        import signal

        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(timeout=60)
        except Exception:  # noqa: BLE001
            spy.kill()
    io1 = bdr.proc_io()
    status = bdr.proc_status()
    peak = status["VmHWM"] if hwm_reset else bdr.ru_maxrss_bytes()
    bad = []
    for name, _, _ in spec:
        v = sd[name]
        local = v.to_local() if hasattr(v, "to_local") else v
        if bdr.checksum(local) != _expected(job["sums"], name, job["layout"], rank):
            bad.append(name)
    out: dict[str, Any] = {
        "rank": rank,
        "seconds": elapsed,
        "bytes_needed": needed,
        "peak_extra": peak - base,
        "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
        "syscr": io1.get("syscr", 0) - io0.get("syscr", 0),
        "verified": not bad,
        "bad": bad[:5],
        "phases": phases,
        **cpu.as_dict(),
    }
    counters = getattr(reader, "counters", None)
    if isinstance(counters, dict):
        out["counters"] = dict(counters)
    if s3count is not None:
        out["s3_gets"] = s3count.gets
        out["s3_get_bytes"] = s3count.get_bytes
        out["s3_other_calls"] = s3count.other
    if job.get("profile") == "cprofile":
        import io
        import pstats

        for sort in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(25)
            out[f"profile_{sort}"] = s.getvalue()
    return out


def _write_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Rank body: load this rank's Shard(0) rows of the model (untimed), then one timed ``dcp.save``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,))
    spec = {n: (tuple(s), d) for n, s, d in job["spec"]}
    by_file: dict[str, list[str]] = {}
    for name, file in job["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    sd: dict[str, Any] = {}
    for file, names in by_file.items():
        with safe_open(os.path.join(job["src"], file), framework="pt") as f:
            for name in names:
                shape, _ = spec[name]
                rows = shape[0] // world
                local = f.get_slice(name)[rank * rows : (rank + 1) * rows].contiguous().clone()
                sd[name] = DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=bdr.contig_stride(shape)
                )
    sd = {n: sd[n] for n, _, _ in job["spec"]}  # model order
    consolidate_s: list[float] = []
    if job["writer"] == "ours":
        from dcp_storage import SafetensorsWriter

        writer = SafetensorsWriter(job["out"], max_shard_size=job["max_shard_size"], overwrite=True)
    else:
        from torch.distributed.checkpoint import hf_storage

        original = hf_storage.consolidate_safetensors_files

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                consolidate_s.append(time.perf_counter() - t)

        hf_storage.consolidate_safetensors_files = timed  # type: ignore[assignment]
        index = {f: i for i, f in enumerate(sorted(by_file), start=1)}
        mapping = {n: index[f] for n, f in job["weight_map"].items()}
        writer = hf_storage.HuggingFaceStorageWriter(
            job["out"], fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
        )
    gc.collect()
    io0 = bdr.proc_io()
    dist.barrier()
    with bdr.CpuWindow() as cpu:
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer)
        elapsed = time.perf_counter() - t0
    io1 = bdr.proc_io()
    out = {
        "rank": rank,
        "seconds": elapsed,
        "wchar": io1.get("wchar", 0) - io0.get("wchar", 0),
        "write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
        "consolidate_s": sum(consolidate_s),
        **cpu.as_dict(),
    }
    if job["writer"] == "ours":
        out["counters"] = dict(writer.counters)
    return out


def verify_output(out_dir: str, info: dict[str, Any]) -> list[str]:
    """Names whose checksum in ``out_dir`` (read through its index) differs from the source, or are missing."""
    from safetensors import safe_open

    with open(os.path.join(out_dir, INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    bad = [n for n in info["sums"] if n not in weight_map]
    by_file: dict[str, list[str]] = {}
    for n, file in weight_map.items():
        by_file.setdefault(file, []).append(n)
    for file, names in by_file.items():
        with safe_open(os.path.join(out_dir, file), framework="pt") as f:
            for n in names:
                if n not in info["sums"] or bdr.checksum(f.get_tensor(n)) != info["sums"][n]["all"]:
                    bad.append(n)
    return bad


def _tree_bytes(root: str) -> tuple[int, int, dict[str, int]]:
    """(bytes of all files under root, bytes of the top-level files, {relative path: size})."""
    sizes = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            sizes[os.path.relpath(p, root)] = os.path.getsize(p)
    top = sum(s for p, s in sizes.items() if os.sep not in p)
    return sum(sizes.values()), top, sizes


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


def wait_for_other(pattern: str) -> None:
    """Wait (polling every 30 s) while another process whose command line contains ``pattern`` runs."""
    if not pattern:
        return
    import subprocess

    announced = False
    while True:
        out = subprocess.run(["pgrep", "-f", pattern], check=False, capture_output=True, text=True).stdout.split()
        others = [p for p in out if int(p) not in (os.getpid(), os.getppid())]
        if not others:
            return
        if not announced:
            print(f"  (waiting for {pattern} (pids {' '.join(others)}) to finish ...)", flush=True)
            announced = True
        time.sleep(30)


def find_pyspy(given: str | None) -> str | None:
    for cand in (given, shutil.which("py-spy"), "/tmp/pyspy/bin/py-spy"):
        if cand and os.path.exists(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def summarize_collapsed(text: str, top: int = 25) -> str:
    """Self and inclusive sample shares per function, and per thread, from py-spy ``--format raw`` output."""
    import collections

    self_c: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        if frames and frames[0].startswith(("thread", "process")):
            threads[frames[0]] += n
            frames = frames[1:]
        frames = [f.rsplit(":", 1)[0] if f.count(":") > 1 else f for f in frames]  # drop line numbers
        if frames:
            self_c[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        return "(no samples)"
    out = [f"{total} active samples"]
    out.append("threads: " + ", ".join(f"{t} {c / total:.0%}" for t, c in threads.most_common(8)))
    out.append("self (leaf) share:")
    out += [f"  {c / total:6.1%}  {f}" for f, c in self_c.most_common(top)]
    out.append("inclusive share:")
    out += [f"  {c / total:6.1%}  {f}" for f, c in incl.most_common(top)]
    return "\n".join(out)


# ======================================================================================= orchestration


class Bench:
    def __init__(self, args: argparse.Namespace, info: dict[str, Any]) -> None:
        self.args = args
        self.info = info
        self.spec = info["spec"]
        self.rows: list[dict[str, Any]] = []
        self.write_rows: list[dict[str, Any]] = []
        self.busy_before: list[float] = []
        self.server_pid: int | None = None
        self.s3_setup: dict[str, Any] | None = None
        self.profiles: dict[str, Any] = {}

    def _run(self, fn: Any, world: int, *a: Any, timeout: float) -> tuple[list[Any] | None, str | None]:
        from dcp_storage_testing.distributed import RankFailedError, RankTimeoutError, run_ranks

        wait_for_other(self.args.wait_for)
        if self.args.quiet_wait > 0:
            self.busy_before.append(bdr.wait_for_quiet(self.args.quiet_wait))
        try:
            return run_ranks(fn, world, *a, timeout=timeout), None
        except RankTimeoutError:
            return None, f"timeout after {timeout:.0f}s"
        except RankFailedError as exc:
            first = next(iter(exc.failures.values()))
            print(first, file=sys.stderr, flush=True)
            return None, "failed: " + first.strip().splitlines()[-1][:300]

    # ---- one run of each kind; cases interleave them round by round (see series)
    def _raw_once(self, fn: Any, *a: Any) -> tuple[dict[str, Any] | None, str | None]:
        res, error = self._run(fn, 1, *a, timeout=600)
        if res is None:
            return None, error
        return {"seconds": res[0]["seconds"], "ranks": res}, None

    def _load_job_dict(
        self, reader: str, url: str, layout: str, s3: bool, storage_options: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {
            "reader": reader,
            "url": url,
            "layout": layout,
            "spec": self.spec,
            "sums": self.info["sums"],
            "storage_options": storage_options or {},
            "s3": s3,
            "server_pid": self.server_pid if s3 else None,
        }

    def _load_once(self, job: dict[str, Any], world: int) -> tuple[dict[str, Any] | None, str | None]:
        res, error = self._run(_load_job, world, job, timeout=900)
        if res is None:
            return None, error
        out = {"seconds": max(r["seconds"] for r in res), "ranks": res}
        if not all(r["verified"] for r in res):
            out["wrong"] = "WRONG DATA: " + ", ".join(b for r in res for b in r["bad"])
        return out, None

    def series(self, case: str, entries: list[tuple[str, str, Any]], rounds: int) -> dict[str, dict[str, Any]]:
        """Run every entry once per round, interleaved (A B C A B C ...), so load changes on this shared
        machine hit every entry alike. ``entries``: (label, kind 'raw'|'load', thunk returning a run).
        Rows keep the best run (and the median of all runs)."""
        state: dict[str, dict[str, Any]] = {label: {"runs": [], "best": None, "error": None} for label, _, _ in entries}
        for _ in range(rounds):
            for label, _, thunk in entries:
                st = state[label]
                if st["error"]:
                    continue
                run, error = thunk()
                if run is None:
                    st["error"] = error
                    continue
                st["runs"].append(run["seconds"])
                if run.get("wrong"):
                    st["error"], st["best"] = run["wrong"], run
                    continue
                if st["best"] is None or run["seconds"] < st["best"]["seconds"]:
                    st["best"] = run
        rows = {}
        for label, kind, thunk in entries:
            st = state[label]
            row = (self._raw_row if kind == "raw" else self._load_row)(case, label, st, thunk)
            self._print(row)
            self.rows.append(row)
            rows[label] = row
        return rows

    def _raw_row(self, case: str, label: str, st: dict[str, Any], thunk: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"case": case, "reader": label, "kind": "raw", "runs_s": st["runs"], "error": st["error"]}
        if st["best"] is not None:
            best = st["best"]["ranks"][0]
            row.update(
                gbps=best["bytes"] / best["seconds"] / GB,
                seconds=best["seconds"],
                bytes=best["bytes"],
                median_gbps=best["bytes"] / _median(st["runs"]) / GB,
            )
            if "requests" in best:
                row["requests"] = best["requests"]
            row.update(bdr.cpu_summary([best], best["seconds"], best["bytes"]))
        return row

    def _load_row(self, case: str, label: str, st: dict[str, Any], thunk: Any) -> dict[str, Any]:
        job = thunk.job
        s3 = job["s3"]
        row: dict[str, Any] = {
            "case": case,
            "reader": job["reader"],
            "kind": "load",
            "layout": job["layout"],
            "world": thunk.world,
            "runs_s": st["runs"],
            "error": st["error"],
            "note": getattr(thunk, "note", ""),
        }
        if st["best"] is None:
            return row
        best = st["best"]["ranks"]
        t = max(r["seconds"] for r in best)
        needed = sum(r["bytes_needed"] for r in best)
        row.update(
            seconds=t,
            bytes_needed=needed,
            gbps=needed / t / GB,
            median_gbps=needed / _median(st["runs"]) / GB,
            peak_extra=max(r["peak_extra"] for r in best),
            per_rank=best,
            phases_max_rank={k: max(r["phases"].get(k, 0.0) for r in best) for k in ("read_metadata", "read_data")},
        )
        row["phases_max_rank"]["other"] = t - sum(row["phases_max_rank"].values())
        if all("counters" in r for r in best):
            per_rank_read = [r["counters"]["bytes_read"] for r in best]
            row["requests"] = sum(r["counters"]["requests"] for r in best)
            row["bytes_read_source"] = "reader.counters"
        elif s3:
            per_rank_read = [r["s3_get_bytes"] for r in best]
            row["requests"] = sum(r["s3_gets"] for r in best)
            row["bytes_read_source"] = "s3fs get_object ContentLength"
        else:
            # torch's HuggingFaceStorageReader reads through safetensors' mmap: no read syscalls to count.
            per_rank_read = None
            row["bytes_read_source"] = "not measured (torch-hf reads through mmap; rchar/syscr do not see it)"
        if per_rank_read is not None:
            row["bytes_read"] = sum(per_rank_read)
            row["read_ratio"] = row["bytes_read"] / needed
            row["read_ratio_per_rank"] = [b / r["bytes_needed"] for b, r in zip(per_rank_read, best)]
            row["read_ratio_max_rank"] = max(row["read_ratio_per_rank"])
        if s3 and all("s3_gets" in r for r in best):
            row["s3_gets"] = sum(r["s3_gets"] for r in best)
            row["s3_get_bytes_per_rank"] = [r["s3_get_bytes"] for r in best]
            row["s3_other_calls"] = sum(r["s3_other_calls"] for r in best)
        row.update(bdr.cpu_summary(best, t, needed))
        return row

    def raw_entry(self, label: str, fn: Any, *a: Any) -> tuple[str, str, Any]:
        return (label, "raw", lambda: self._raw_once(fn, *a))

    def load_entry(
        self,
        reader: str,
        url: str,
        layout: str,
        world: int,
        *,
        s3: bool = False,
        storage_options: dict[str, Any] | None = None,
        note: str = "",
    ) -> tuple[str, str, Any]:
        job = self._load_job_dict(reader, url, layout, s3, storage_options)

        def thunk() -> tuple[dict[str, Any] | None, str | None]:
            return self._load_once(job, world)

        thunk.job, thunk.world, thunk.note = job, world, note  # type: ignore[attr-defined]
        return (reader, "load", thunk)

    def profile_load(self, key: str, reader: str, url: str, layout: str, world: int, **kw: Any) -> None:
        """One extra load (not in the table) under py-spy (every thread, every rank) or else cProfile."""
        pyspy = find_pyspy(self.args.pyspy)
        out_base = os.path.join(self.info["root"], "profile-" + key.replace(" ", "_"))
        job = {
            "reader": reader,
            "url": url,
            "layout": layout,
            "spec": self.spec,
            "sums": self.info["sums"],
            "storage_options": kw.get("storage_options") or {},
            "s3": kw.get("s3", False),
            "server_pid": self.server_pid if kw.get("s3") else None,
            "profile": "py-spy" if pyspy else "cprofile",
            "pyspy": pyspy,
            "profile_out": out_base,
            "pyspy_native": self.args.pyspy_native,
        }
        res, error = self._run(_load_job, world, job, timeout=900)
        if res is None:
            self.profiles[key] = {"error": error}
            return
        prof: dict[str, Any] = {
            "tool": job["profile"],
            "seconds": [r["seconds"] for r in res],
            "cpu_summary": bdr.cpu_summary(res, max(r["seconds"] for r in res), sum(r["bytes_needed"] for r in res)),
        }
        if pyspy:
            for rank in range(world):
                try:
                    with open(f"{out_base}.rank{rank}.txt") as f:
                        prof[f"rank{rank}"] = summarize_collapsed(f.read())
                except OSError as exc:
                    prof[f"rank{rank}"] = f"no py-spy output: {exc}"
        else:
            prof["rank0"] = res[0].get("profile_tottime")
        self.profiles[key] = prof
        print(f"  [profile {key}] {job['profile']}: seconds {[round(r['seconds'], 2) for r in res]}", flush=True)

    def write(self, writer: str, out: str) -> dict[str, Any]:
        job = {
            "writer": writer,
            "out": out,
            "spec": self.spec,
            "weight_map": self.info["weight_map"],
            "src": self.info["path"],
            "max_shard_size": self.info["max_shard_size"],
        }
        best: list[dict[str, Any]] | None = None
        best_sizes: Any = None
        runs: list[float] = []
        error = None
        bad: list[str] = []
        for _ in range(self.args.write_repeats):
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            res, error = self._run(_write_job, 2, job, timeout=1800)
            if res is None:
                break
            t = max(r["seconds"] for r in res)
            runs.append(t)
            sizes = _tree_bytes(out)
            if best is None or t < max(r["seconds"] for r in best):
                best, best_sizes = res, sizes
        if best is not None:
            bad = verify_output(out, self.info)  # the last run's output (all runs write the same bytes)
        row: dict[str, Any] = {"writer": writer, "runs_s": runs, "error": error}
        if best is not None:
            total_files, top_files, sizes = best_sizes
            t = max(r["seconds"] for r in best)
            ckpt = top_files  # the consolidated checkpoint: top-level files (shards + index)
            if writer == "ours":
                written = sum(r["counters"]["bytes_written"] for r in best)
                source = "sum of writer.counters['bytes_written'] over ranks"
            else:
                written = total_files
                source = "sum of the sizes of every file written under the output dir (sharded/ + consolidated)"
            row.update(
                seconds=t,
                bytes_written=written,
                bytes_written_source=source,
                wchar=sum(r["wchar"] for r in best),
                checkpoint_bytes=ckpt,
                ratio=written / ckpt,
                wchar_ratio=sum(r["wchar"] for r in best) / ckpt,
                gbps=ckpt / t / GB,
                consolidate_s=max(r["consolidate_s"] for r in best),
                files=sizes,
                per_rank=best,
                verified=not bad,
                bad=bad[:5],
            )
            if bad:
                row["error"] = "WRONG DATA: " + ", ".join(bad[:5])
        shutil.rmtree(out, ignore_errors=True)
        self._print_write(row)
        self.write_rows.append(row)
        return row

    def _print(self, row: dict[str, Any]) -> None:
        if row.get("error") and not row.get("gbps"):
            print(f"  {row['case']:<22} {row['reader']:<26} ERROR {row['error']}", flush=True)
            return
        extra = ""
        if "read_ratio_max_rank" in row:
            extra = f"  read/needed(max rank) {row['read_ratio_max_rank']:.3f}  peak+{row['peak_extra'] / MiB:.0f}MiB"
        runs = " ".join(f"{s:.2f}" for s in row["runs_s"])
        print(
            f"  {row['case']:<22} {row['reader']:<26} {row['gbps']:.3f} GB/s (runs s: {runs}){extra}"
            f"  others' CPU {row.get('others_cpu_frac', 0):.0%}",
            flush=True,
        )

    def _print_write(self, row: dict[str, Any]) -> None:
        if "seconds" not in row:
            print(f"  write {row['writer']:<8} ERROR {row['error']}", flush=True)
            return
        runs = " ".join(f"{s:.2f}" for s in row["runs_s"])
        print(
            f"  write {row['writer']:<8} {row['seconds']:.2f}s (runs {runs})  written {row['bytes_written'] / GiB:.3f}"
            f" GiB / ckpt {row['checkpoint_bytes'] / GiB:.3f} GiB = {row['ratio']:.3f}x  verified={row['verified']}",
            flush=True,
        )

    # ---- cases
    def run_local(self) -> None:
        path = self.info["path"]
        files = [(os.path.join(path, n), s_) for n, s_ in data_files(self.info)]
        cases = self.args.cases
        rounds = self.args.local_rounds
        if "local1" in cases:
            print("[local, 1 process, full tensors]", flush=True)
            bdr.warm_files([p for p, _ in files])
            case = "local 1p full"
            got = self.series(
                case,
                [
                    self.raw_entry("raw readinto 1 thread", bdr.raw_local_job, files, 1),
                    *(
                        self.load_entry(r, path, "full", 1)
                        for r in ("ours", "ours-noverify", "torch-hf", "torch-hf-t2")
                    ),
                ],
                rounds,
            )
            self._profile_if_slower(case, got, path, "full", 1)
        if "local2" in cases:
            print("[local, 2 ranks, Shard(0)]", flush=True)
            bdr.warm_files([p for p, _ in files])
            case = "local 2r S0"
            got = self.series(
                case,
                [
                    self.raw_entry("raw readinto 2 threads", bdr.raw_local_job, files, 2),
                    *(self.load_entry(r, path, "shard0", 2) for r in ("ours", "ours-noverify", "torch-hf")),
                ],
                rounds,
            )
            self._profile_if_slower(case, got, path, "shard0", 2)

    def _profile_if_slower(self, case: str, got: dict[str, Any], path: str, layout: str, world: int) -> None:
        ours, ref = got["ours"].get("gbps"), got["torch-hf"].get("gbps")
        if self.args.profile_misses and ours and ref and (ours < ref or self.args.profile_always):
            self.profile_load(case + " ours", "ours", path, layout, world)
            self.profile_load(case + " torch-hf", "torch-hf", path, layout, world)

    def run_s3(self) -> None:
        with bdr.s3rver_holding(self.info) as (server, self.s3_setup):
            host, port = server.host, server.port
            self.server_pid = server.pid
            key_prefix = self.info["tag"]
            url = f"s3://{BUCKET}/{key_prefix}"
            so = server.storage_options()
            objects = [(f"/{BUCKET}/{key_prefix}/{n}", s) for n, s in data_files(self.info)]
            obj_files = [server.object_path(BUCKET, f"{key_prefix}/{n}") for n, _ in data_files(self.info)]
            print("[s3rver, 2 ranks, Shard(0)]", flush=True)
            bdr.warm_files(obj_files)
            case = "s3rver 2r S0"
            raw_label = f"raw ranged GET {bdr.RAW_PART // MiB}MiBx{bdr.RAW_CONCURRENCY}"
            got = self.series(
                case,
                [
                    self.raw_entry(
                        raw_label, bdr.raw_s3_job, host, port, objects, bdr.RAW_PART, bdr.RAW_CONCURRENCY, server.pid
                    ),
                    self.load_entry("ours", url, "shard0", 2, storage_options=so, s3=True),
                    self.load_entry("ours-noverify", url, "shard0", 2, storage_options=so, s3=True),
                    *(
                        self.load_entry(
                            f"ours-w{w}",
                            url,
                            "shard0",
                            2,
                            storage_options=so,
                            s3=True,
                            note=f"diagnostic: TransportConfig(max_workers={w}) per rank",
                        )
                        for w in self.args.s3_worker_variants
                    ),
                ],
                self.args.repeats,
            )
            row = got["ours"]
            if self.args.profile_misses and row.get("gbps"):
                raw = next(r for r in self.rows if r["case"] == case and r["kind"] == "raw")
                if raw.get("gbps") and (row["gbps"] < 0.7 * raw["gbps"] or self.args.profile_always):
                    self.profile_load("s3rver 2r S0 ours", "ours", url, "shard0", 2, storage_options=so, s3=True)

    def run_write(self) -> None:
        print("[write, 2 ranks, Shard(0) DTensors -> local HF checkpoint]", flush=True)
        base = os.path.join(self.info["root"], "write-out")
        for writer in ("ours", "torch-hf"):
            self.write(writer, os.path.join(base, writer))
        shutil.rmtree(base, ignore_errors=True)


# ============================================================================================ report


def finish_rows(rows: list[dict[str, Any]]) -> None:
    raw_of = {r["case"]: r["gbps"] for r in rows if r["kind"] == "raw" and r.get("gbps")}
    for r in rows:
        if r["kind"] != "load" or not r.get("gbps"):
            continue
        if r["case"] in raw_of:
            r["raw_gbps"] = raw_of[r["case"]]
            r["vs_raw"] = r["gbps"] / raw_of[r["case"]]
        ref = next((x for x in rows if x["case"] == r["case"] and x["reader"] == "torch-hf" and x.get("gbps")), None)
        if ref:
            r["vs_torch"] = r["gbps"] / ref["gbps"]


def format_read_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "case",
        "reader",
        "GB/s best (median)",
        "x torch-hf",
        "x raw",
        "read/needed (max rank)",
        "requests",
        "peak RSS +MiB/rank",
        "CPU s/GB client (server)",
        "s: metadata / read_data / rest (max rank)",
        "others' CPU",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r.get("error") and not r.get("gbps"):
            cells = [r["case"], r["reader"], "ERROR", "", "", "", "", "", "", "", "", r["error"]]
        else:
            cells = [
                r["case"],
                r["reader"],
                f"{r['gbps']:.3f} ({r['median_gbps']:.3f})",
                f"{r['vs_torch']:.2f}" if "vs_torch" in r else "-",
                f"{r['vs_raw']:.2f}" if "vs_raw" in r else "-",
                f"{r['read_ratio_max_rank']:.4f}" if "read_ratio_max_rank" in r else "-",
                str(r["requests"]) if "requests" in r else "-",
                f"{r['peak_extra'] / MiB:.0f}" if "peak_extra" in r else "-",
                (
                    f"{r['client_cpu_s_per_gb']:.2f}"
                    + (f" ({r['server_cpu_s_per_gb']:.2f})" if r["case"].startswith("s3") else "")
                )
                if "client_cpu_s_per_gb" in r
                else "-",
                " / ".join(f"{r['phases_max_rank'][k]:.3f}" for k in ("read_metadata", "read_data", "other"))
                if "phases_max_rank" in r
                else "-",
                f"{r['others_cpu_frac']:.0%}" if "others_cpu_frac" in r else "-",
                "; ".join(x for x in (r.get("note") or "", r.get("error") or "") if x),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_write_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "writer",
        "seconds",
        "GB/s (ckpt bytes/s)",
        "bytes written (GiB)",
        "checkpoint (GiB)",
        "written / checkpoint",
        "wchar / checkpoint",
        "of which consolidation s",
        "verified",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['writer']} | ERROR | | | | | | | {r.get('error')} |")
            continue
        label = (
            "ours: SafetensorsWriter"
            if r["writer"] == "ours"
            else "torch: HuggingFaceStorageWriter(save_distributed, enable_consolidation)"
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    f"{r['seconds']:.2f}",
                    f"{r['gbps']:.3f}",
                    f"{r['bytes_written'] / GiB:.3f}",
                    f"{r['checkpoint_bytes'] / GiB:.3f}",
                    f"{r['ratio']:.4f}",
                    f"{r['wchar_ratio']:.4f}",
                    f"{r['consolidate_s']:.2f}" if r["writer"] != "ours" else "-",
                    "yes" if r["verified"] else "NO " + ",".join(r["bad"]),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def evaluate_targets(rows: list[dict[str, Any]], write_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        out.append({"target": name, "met": ok, "detail": detail})

    def find(case: str, reader: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["case"] == case and r["reader"] == reader and r.get("gbps")), None)

    for case, label in (("local 1p full", "1 process"), ("local 2r S0", "2 ranks Shard(0)")):
        ours, ref = find(case, "ours"), find(case, "torch-hf")
        if ours and ref:
            add(
                f"local safetensors {label}: ours >= torch HuggingFaceStorageReader",
                ours["gbps"] >= ref["gbps"],
                f"best {ours['gbps']:.3f} vs {ref['gbps']:.3f} GB/s = {ours['gbps'] / ref['gbps']:.2f}x; median "
                f"{ours['median_gbps']:.3f} vs {ref['median_gbps']:.3f} = {ours['median_gbps'] / ref['median_gbps']:.2f}x"
                + (f" (ours {ours['vs_raw']:.2f}x raw readinto)" if "vs_raw" in ours else ""),
            )
    r = find("s3rver 2r S0", "ours")
    if r:
        add(
            "s3 resharding 2 ranks: bytes read <= 1.05x needed (max rank)",
            r["read_ratio_max_rank"] <= 1.05,
            f"{r['read_ratio_max_rank']:.4f}x (per rank "
            + ", ".join(f"{x:.4f}" for x in r["read_ratio_per_rank"])
            + f"); {r['requests']} requests",
        )
        if "vs_raw" in r:
            raw = next(x for x in rows if x["case"] == "s3rver 2r S0" and x["kind"] == "raw")
            add(
                "s3 resharding 2 ranks: >= 0.7x raw ranged-GET bandwidth",
                r["vs_raw"] >= 0.7,
                f"best {r['vs_raw']:.2f}x ({r['gbps']:.3f} vs {r['raw_gbps']:.3f} GB/s); median "
                f"{r['median_gbps'] / raw['median_gbps']:.2f}x",
            )
    w = next((x for x in write_rows if x["writer"] == "ours" and "ratio" in x), None)
    if w:
        add(
            "SafetensorsWriter bytes written <= 1.02x checkpoint",
            w["ratio"] <= 1.02 and w["verified"],
            f"{w['ratio']:.4f}x ({w['bytes_written']} / {w['checkpoint_bytes']} bytes), {w['seconds']:.2f}s",
        )
    t = next((x for x in write_rows if x["writer"] == "torch-hf" and "ratio" in x), None)
    if w and t:
        add(
            "(context) torch HF writer + consolidation",
            None,
            f"{t['ratio']:.3f}x written, {t['seconds']:.2f}s (consolidation {t['consolidate_s']:.2f}s); "
            f"ours {w['seconds']:.2f}s = {t['seconds'] / w['seconds']:.2f}x faster",
        )
    return out


# ============================================================================================== main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke test: 0.25 GiB, 1 repeat")
    p.add_argument("--repeats", type=int, default=None, help="s3 reads: best of N rounds (default 3, quick 1)")
    p.add_argument(
        "--local-rounds",
        type=int,
        default=None,
        help="local reads: best of N interleaved rounds (default 7, quick 1); they take well under a "
        "second each, so more rounds are cheap and steady the numbers on a shared machine",
    )
    p.add_argument(
        "--s3-worker-variants",
        default="4",
        help="comma list of max_workers values for extra, diagnostic s3 rows of ours ('' for none)",
    )
    p.add_argument(
        "--wait-for",
        default="bench_dcp_read",
        help="before each run, wait while a process whose command line contains this runs "
        "(polled every 30 s; '' disables)",
    )
    p.add_argument("--write-repeats", type=int, default=None, help="writes: best of N (default 2, quick 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None)
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "dcp-storage-bench"))
    p.add_argument("--cases", default="local1,local2,s3,write", help="comma list of local1,local2,s3,write")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="before each run, wait up to this many seconds for the machine to go idle (default 20; quick 0)",
    )
    p.add_argument(
        "--no-profile",
        dest="profile_misses",
        action="store_false",
        help="do not profile (one extra run under py-spy, else cProfile) a case that misses its bar",
    )
    p.add_argument("--profile-always", action="store_true", help="profile ours (and torch-hf locally) in every case")
    p.add_argument("--pyspy-native", action="store_true", help="py-spy --native (C frames too; pauses the process)")
    p.add_argument("--pyspy", default=None, help="py-spy binary (default: on PATH, or /tmp/pyspy/bin/py-spy)")
    args = p.parse_args(argv)
    if args.quick:
        args.size_gib = 0.25
        args.repeats = args.repeats or 1
        args.local_rounds = args.local_rounds or 1
        args.write_repeats = args.write_repeats or 1
        args.quiet_wait = 0.0 if args.quiet_wait is None else args.quiet_wait
    args.quiet_wait = 20.0 if args.quiet_wait is None else args.quiet_wait
    args.repeats = args.repeats or 3
    args.local_rounds = args.local_rounds or 7
    args.write_repeats = args.write_repeats or 2
    args.cases = set(args.cases.split(","))
    args.s3_worker_variants = [int(x) for x in args.s3_worker_variants.split(",") if x.strip()]
    if args.json is None:
        args.json = os.path.join(HERE, "results", "safetensors_quick.json" if args.quick else "safetensors.json")
    started = time.time()
    warnings.filterwarnings("ignore")
    # Rank processes (forkserver children) must import this module and the harness package by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (HERE, REPO, os.environ.get("PYTHONPATH")) if x)

    machine = bdr.machine_notes()
    import safetensors

    machine["versions"]["safetensors"] = safetensors.__version__
    bdr.print_machine(machine)
    info = ensure_checkpoint(args.cache_dir, args.size_gib, args.seed)
    bdr.print_checkpoint(info)
    bench = Bench(args, info)
    try:
        bench.run_local()
        if "s3" in args.cases:
            bench.run_s3()
        if "write" in args.cases:
            bench.run_write()
    except KeyboardInterrupt:
        print("interrupted; reporting what ran", flush=True)
    except Exception:  # noqa: BLE001 - report partial results
        traceback.print_exc()
    finish_rows(bench.rows)
    targets = evaluate_targets(bench.rows, bench.write_rows)
    read_table = format_read_table(bench.rows)
    write_table = format_write_table(bench.write_rows)
    print()
    print(read_table)
    print()
    print(write_table)
    print()
    for t in targets:
        mark = {True: "MET ", False: "MISS", None: "n/a "}[t["met"]]
        print(f"  [{mark}] {t['target']}: {t['detail']}")
    for key, prof in bench.profiles.items():
        print(f"\n[profile: {key}] {prof.get('tool')} seconds {prof.get('seconds')} {prof.get('cpu_summary')}")
        for rk in sorted(k for k in prof if k.startswith("rank")):
            print(f"--- {rk}\n{prof[rk]}")
        if prof.get("error"):
            print(prof["error"])
    result = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "command": " ".join(
            [
                os.path.relpath(sys.executable, REPO),
                os.path.relpath(__file__, REPO),
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
        "machine": machine,
        "loadavg_at_end": os.getloadavg(),
        "busy_before_runs": bench.busy_before,
        "checkpoint": {k: v for k, v in info.items() if k not in ("sums", "spec", "weight_map")}
        | {"n_tensors": len(info["spec"])},
        "s3_setup": bench.s3_setup,
        "definitions": {
            "GB": "1e9 bytes",
            "gbps": "reads: bytes needed (destination tensors, all ranks) / slowest rank's dcp.load seconds; raw "
            "rows: bytes read / s; writes: checkpoint bytes / slowest rank's dcp.save seconds",
            "read_ratio_max_rank": "max over ranks of bytes read / bytes needed by that rank (bytes_read_source)",
            "requests": "ours: reader.counters['requests'] (sum of ranks; includes header reads); torch local: "
            "read syscalls (syscr)",
            "peak_extra": "VmHWM (reset after allocating destinations) - VmRSS before dcp.load, max over ranks",
            "writes.ratio": "bytes written / checkpoint bytes (top-level output files incl. the index)",
            "others_cpu_frac": "share of the machine's CPU used by unrelated processes during the best run",
        },
        "rows": bench.rows,
        "write_rows": bench.write_rows,
        "targets": targets,
        "profiles": bench.profiles,
        "read_table_markdown": read_table,
        "write_table_markdown": write_table,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nJSON: {os.path.abspath(args.json)}  (total {time.time() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    # Run through the importable module name so worker functions pickle as bench_safetensors.<fn>.
    sys.path.insert(0, HERE)
    import bench_safetensors

    sys.exit(bench_safetensors.main())
