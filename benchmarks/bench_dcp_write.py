#!/usr/bin/env python
"""Save benchmark: ``dcp_storage.FsspecWriter`` / ``SafetensorsWriter`` against torch's writers and raw I/O.

Usage::

    .venv/bin/python benchmarks/bench_dcp_write.py [--size-gib 2] [--quick] [--cases ...] [--json out.json]

What it does:

* Builds, in every rank process, the state dict of the read benchmark's transformer-shaped model
  (``harness.model_spec``: fp32 embedding/head/norms/biases, bf16 matrices) of about ``--size-gib``
  GiB: full tensors in one process, or ``Shard(0)`` DTensors on 2 gloo ranks (one torch thread each).
  Contents are a cheap seeded bit pattern (a save's cost does not depend on the values).
* Times the ``dcp.save`` call of each writer, best of ``--repeats``, each run in a fresh process (a fork of
  ``run_ranks``' forkserver) writing into a fresh directory or prefix that is removed afterwards; dirty
  pages of the previous run are flushed (``sync``) before the clock starts.
* Local writers: ours (``FsspecWriter``, default options), torch's ``FileSystemWriter`` (``thread_count``
  1 and 2), torch's ``FsspecWriter``, ``SafetensorsWriter``. Raw limit in the same run: each rank writes its
  tensors' bytes to one file with ``os.write`` straight from tensor memory, then ``fsync``.
* Object store (``--s3-server``, default moto; see ``RESULTS-dcp-write.md`` for why): ours, torch's
  ``FsspecWriter``, ``SafetensorsWriter``; raw limits: each rank's bytes as concurrent plain PUTs of
  ``--raw-part`` objects, and as one multipart upload with concurrent parts (unsigned ``http.client``).
* Async saves (local): ``dcp.async_save`` in THREAD and PROCESS mode with ours and torch's
  ``FileSystemWriter`` and the same (default) stager: the time ``async_save`` blocks the caller next to
  the time until the save is committed. PROCESS mode is warmed up by one small save first (torch spawns
  its checkpoint process on the first call).
* Peak RSS beyond the state dict: ``VmHWM`` reset after the state dict is built; reported is
  ``VmHWM - VmRSS(before save)``, max over ranks. Requests: ``writer.counters`` for ours, write syscalls
  (``/proc/self/io`` ``syscw``) for torch's local writers, s3fs calls for torch's ``FsspecWriter`` on S3.

GB/s is 1e9 tensor bytes per second of the slowest rank. Results: a table on stdout, JSON in
``benchmarks/results/`` (default ``dcp_write.json``); ``RESULTS-dcp-write.md`` holds the figures quoted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import http.client
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import harness as base
from harness import GB, GiB, MiB

BUCKET = "bench-write"
RAW_CHUNK = 64 * MiB  # os.write piece of the raw local limit
LOCAL_WRITERS = ("ours", "torch-fs-t1", "torch-fs-t2", "torch-fsspec", "safetensors")
S3_WRITERS = ("ours", "torch-fsspec", "safetensors")
TORCH_REF = {"local": ("torch-fs-t1", "torch-fs-t2"), "s3": ("torch-fsspec",)}

# ============================================================================================ state


def _fill(t: Any, seed: int) -> None:
    """A cheap, seeded, non-constant bit pattern (multiplicative hash of the index)."""
    import torch

    flat = t.view(-1).view(torch.uint8)
    words = flat[: flat.numel() // 8 * 8].view(torch.int64)
    torch.arange(seed << 32, (seed << 32) + words.numel(), out=words).mul_(0x9E3779B97F4A7C15 & 0x7FFFFFFFFFFFFFFF)
    flat[words.numel() * 8 :].fill_(seed & 0xFF)


def build_state(spec: list, rank: int, world: int, seed: int) -> dict[str, Any]:
    """Full tensors (``world == 1``) or ``Shard(0)`` DTensors holding this rank's rows."""
    import torch

    sd: dict[str, Any] = {}
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    for idx, (name, shape, dtype) in enumerate(spec):
        shape = tuple(shape)
        local_shape = (shape[0] // world, *shape[1:])
        local = torch.empty(local_shape, dtype=base.torch_dtype(dtype))
        _fill(local, seed * 1000 + idx * world + rank + 1)
        if mesh is None:
            sd[name] = local
        else:
            from torch.distributed.tensor import DTensor, Shard

            sd[name] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=base.contig_stride(shape)
            )
    return sd


def _local_tensors(sd: dict[str, Any]) -> list[Any]:
    return [v.to_local() if hasattr(v, "to_local") else v for v in sd.values()]


def _bytes_of(t: Any) -> memoryview:
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ========================================================================================== writers


def make_writer(kind: str, url: str, so: dict[str, Any]) -> Any:
    import torch.distributed.checkpoint as dcp

    if kind == "ours":
        from dcp_storage import FsspecWriter

        return FsspecWriter(url, so, overwrite=True)
    if kind == "safetensors":
        from dcp_storage import SafetensorsWriter

        return SafetensorsWriter(url, so, overwrite=True)
    if kind.startswith("torch-fs-t"):
        return dcp.FileSystemWriter(url, thread_count=int(kind[-1]), overwrite=True)
    if kind == "torch-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as TorchFsspecWriter

        return TorchFsspecWriter(url, overwrite=True, **so)
    raise ValueError(kind)


class _S3Calls:
    """Counts s3fs ``_call_s3`` requests in this process (torch's FsspecWriter has no counters)."""

    def __init__(self) -> None:
        import s3fs

        self.calls = 0
        original = s3fs.S3FileSystem._call_s3
        counter = self

        async def counting(fs: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
            counter.calls += 1
            return await original(fs, method, *args, **kwargs)

        s3fs.S3FileSystem._call_s3 = counting  # type: ignore[method-assign]


@contextlib.contextmanager
def measured(job: dict[str, Any], world: int) -> Any:
    """Reset the peak-RSS mark, sync the ranks, time the body; fills the yielded dict."""
    import torch.distributed as dist

    gc.collect()
    os.sync()  # the previous run's dirty pages must not be written back on this run's clock
    out: dict[str, Any] = {}
    before = base.proc_status()["VmRSS"]
    hwm = base.reset_peak_rss()
    io0 = base.proc_io()
    if world > 1:
        dist.barrier()
    with base.CpuWindow(job.get("server_pid")) as cpu:
        t0 = time.perf_counter()
        yield out
        out.setdefault("seconds", time.perf_counter() - t0)
    io1 = base.proc_io()
    peak = base.proc_status()["VmHWM"] if hwm else base.ru_maxrss_bytes()
    out.update(
        peak_extra=peak - before,
        syscw=io1.get("syscw", 0) - io0.get("syscw", 0),
        wchar=io1.get("wchar", 0) - io0.get("wchar", 0),
        **cpu.as_dict(),
    )


def _save_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One timed ``dcp.save`` (or ``async_save``) on this rank, in a fresh process."""
    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    s3calls = _S3Calls() if job["writer"] == "torch-fsspec" and job["url"].startswith("s3://") else None
    sd = build_state(spec, rank, world, job["seed"])
    nbytes = sum(t.numel() * t.element_size() for t in _local_tensors(sd))
    largest = max(t.numel() * t.element_size() for t in _local_tensors(sd))
    url, so = job["url"], job.get("storage_options") or {}
    mode = job.get("async")
    if mode == "PROCESS":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        _async_save({"warm": torch.zeros(4)}, make_writer(job["writer"], url + "-warmup", so), mode, world)
    writer = make_writer(job["writer"], url, so)
    with measured(job, world) as out:
        if mode:
            out.update(_async_save(sd, writer, mode, world))
        else:
            dcp.save(sd, storage_writer=writer, no_dist=(world == 1))
    counters = getattr(writer, "counters", None)
    if isinstance(counters, dict) and not mode:
        out["requests"] = counters["requests"]
    elif s3calls is not None:
        out["requests"] = s3calls.calls
    elif not url.startswith("s3://"):
        out["requests"] = out["syscw"]
    out.update(rank=rank, bytes=nbytes, largest_tensor=largest)
    if mode == "PROCESS":
        from torch.distributed.checkpoint import _async_process_executor as executor

        process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
        del process
    return out


def _async_save(sd: dict[str, Any], writer: Any, mode: str, world: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    t0 = time.perf_counter()
    future = dcp.async_save(
        sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType[mode], no_dist=(world == 1)
    )
    blocked = time.perf_counter() - t0
    future.result()
    return {"blocked_s": blocked, "seconds": time.perf_counter() - t0}


# ============================================================================================== raw


def _raw_local_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Raw limit: this rank's tensor bytes into one file, ``os.write`` from tensor memory, then ``fsync``."""
    import torch

    torch.set_num_threads(1)
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    tensors = _local_tensors(build_state(spec, rank, world, job["seed"]))
    os.makedirs(job["url"], exist_ok=True)
    path = os.path.join(job["url"], f"raw-{rank}")
    writes = 0
    with measured(job, world) as out:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors:
                view = _bytes_of(t)
                pos = 0
                while pos < view.nbytes:
                    pos += os.write(fd, view[pos : pos + RAW_CHUNK])
                    writes += 1
            os.fsync(fd)
        finally:
            os.close(fd)
    out.update(rank=rank, bytes=sum(t.numel() * t.element_size() for t in tensors), requests=writes)
    return out


def _http(host: str, port: int, method: str, path: str, body: Any = b"") -> tuple[int, bytes, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request(method, path, body=body, headers={"Content-Length": str(memoryview(body).nbytes)})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp
    finally:
        conn.close()


def _raw_s3_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Raw limit: this rank's bytes as concurrent plain PUTs of ``part`` bytes each (``multipart=False``), or as
    one multipart upload whose parts go up concurrently; unsigned ``http.client``, no checksums."""
    import torch

    torch.set_num_threads(1)
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    tensors = _local_tensors(build_state(spec, rank, world, job["seed"]))
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])  # contiguous: parts of any size
    view = memoryview(flat.numpy())
    host, port, part = job["host"], job["port"], job["part"]
    key = f"/{BUCKET}/{job['prefix']}/raw-{rank}"
    tasks = collections.deque(enumerate(range(0, view.nbytes, part), 1))
    etags: dict[int, str] = {}

    def put(query: str, number: int, offset: int) -> None:
        status, body, resp = _http(host, port, "PUT", key + query, view[offset : offset + part])
        if status != 200:
            raise OSError(f"PUT {key}{query} -> {status} {body[:200]!r}")
        etags[number] = resp.getheader("ETag")

    with measured(job, world) as out:
        upload = ""
        if job["multipart"]:
            status, body, _ = _http(host, port, "POST", key + "?uploads")
            upload = re.search(rb"<UploadId>([^<]+)</UploadId>", body).group(1).decode()  # type: ignore[union-attr]

        def work() -> None:
            while True:
                try:
                    number, offset = tasks.popleft()
                except IndexError:
                    return
                query = f"?partNumber={number}&uploadId={upload}" if upload else f"-{number}"
                put(query, number, offset)

        base.run_threads(job["concurrency"], work, None)
        if upload:
            parts = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{etags[n]}</ETag></Part>" for n in sorted(etags))
            xml = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
            status, body, _ = _http(host, port, "POST", f"{key}?uploadId={upload}", xml)
            if status != 200 or b"<Error>" in body:
                raise OSError(f"complete {key} -> {status} {body[:200]!r}")
    out.update(rank=rank, bytes=view.nbytes, requests=len(etags) + (2 if upload else 0))
    return out


# ======================================================================================= orchestration


class Bench:
    def __init__(self, args: argparse.Namespace, spec: list) -> None:
        self.args = args
        self.spec = spec
        self.rows: list[dict[str, Any]] = []
        self.busy_before: list[float] = []
        self.server: Any = None

    def _run_once(self, fn: Callable[..., Any], world: int, job: dict[str, Any]) -> tuple[list | None, str | None]:
        from dcp_storage_testing.distributed import RankFailedError, RankTimeoutError, run_ranks

        if self.args.quiet_wait > 0:
            self.busy_before.append(base.wait_for_quiet(self.args.quiet_wait))
        try:
            return run_ranks(fn, world, job, timeout=self.args.timeout), None
        except RankTimeoutError:
            return None, f"timeout after {self.args.timeout:.0f}s"
        except RankFailedError as exc:
            return None, "failed: " + next(iter(exc.failures.values())).strip().splitlines()[-1][:300]

    def case(self, case: str, label: str, fn: Callable[..., Any], world: int, job: dict[str, Any]) -> dict[str, Any]:
        """Best of ``--repeats`` runs of ``fn`` on ``world`` ranks; each run gets a fresh target, removed after."""
        best: list[dict[str, Any]] | None = None
        runs: list[float] = []
        error = None
        repeats = (self.args.s3_repeats or self.args.repeats) if job.get("s3") else self.args.repeats
        for _ in range(repeats):
            run_job = {**job, "spec": self.spec, "seed": self.args.seed}
            run_job.update(self._fresh_target(job))
            res, error = self._run_once(fn, world, run_job)
            self._remove_target(run_job)
            if res is None:
                break
            t = max(r["seconds"] for r in res)
            runs.append(t)
            if best is None or t < max(r["seconds"] for r in best):
                best = res
        row: dict[str, Any] = {"case": case, "writer": label, "world": world, "runs_s": runs, "error": error}
        if best is not None:
            t = max(r["seconds"] for r in best)
            nbytes = sum(r["bytes"] for r in best)
            row.update(seconds=t, bytes=nbytes, gbps=nbytes / t / GB, per_rank=best)
            row["peak_extra"] = max(r["peak_extra"] for r in best)
            row["largest_tensor"] = max(r.get("largest_tensor", 0) for r in best)
            if all("requests" in r for r in best):
                row["requests"] = sum(r["requests"] for r in best)
            if all("blocked_s" in r for r in best):
                row["blocked_s"] = max(r["blocked_s"] for r in best)
            row.update(base.cpu_summary(best, t, nbytes))
        self._print(row)
        self.rows.append(row)
        return row

    def _chosen(self, writers: tuple[str, ...]) -> list[str]:
        wanted = self.args.writers.split(",") if self.args.writers else writers
        return [w for w in writers if w in wanted]

    def _fresh_target(self, job: dict[str, Any]) -> dict[str, Any]:
        name = f"run-{uuid.uuid4().hex[:8]}"
        if job.get("s3"):
            return {"prefix": name, "url": f"s3://{BUCKET}/{name}"}
        return {"url": os.path.join(self.args.dir, name)}

    def _remove_target(self, job: dict[str, Any]) -> None:
        if job.get("s3"):
            with contextlib.suppress(Exception):
                import fsspec

                fs = fsspec.filesystem("s3", **self.server.storage_options(skip_instance_cache=True))
                fs.rm(f"{BUCKET}/{job['prefix']}", recursive=True)
                fs.rm(f"{BUCKET}/{job['prefix']}-warmup", recursive=True)
            return
        for path in (job["url"], job["url"] + "-warmup"):
            shutil.rmtree(path, ignore_errors=True)

    def _print(self, row: dict[str, Any]) -> None:
        if row.get("error") and not row.get("gbps"):
            print(f"  {row['case']:<16} {row['writer']:<26} ERROR {row['error']}", flush=True)
            return
        runs = " ".join(f"{s:.2f}" for s in row["runs_s"])
        extra = f"  blocked {row['blocked_s']:.2f}s" if "blocked_s" in row else ""
        print(
            f"  {row['case']:<16} {row['writer']:<26} {row['gbps']:.3f} GB/s (runs s: {runs}){extra}  "
            f"peak+{row['peak_extra'] / MiB:.0f}MiB  requests {row.get('requests', '-')}  "
            f"others' CPU {row.get('others_cpu_frac', 0):.0%}",
            flush=True,
        )

    # ---- cases
    def run_local(self) -> None:
        os.makedirs(self.args.dir, exist_ok=True)
        for world, key in ((1, "local1"), (2, "local2")):
            if key not in self.args.cases:
                continue
            case = f"local {world}p" if world == 1 else f"local {world}r"
            print(f"[{case}]", flush=True)
            self.case(case, "raw write+fsync", _raw_local_job, world, {})
            for writer in self._chosen(LOCAL_WRITERS):
                self.case(case, writer, _save_job, world, {"writer": writer})
        if "async" in self.args.cases:
            for world in (1, 2):
                case = f"local {world}{'p' if world == 1 else 'r'} async"
                print(f"[{case}]", flush=True)
                for mode in ("THREAD", "PROCESS"):
                    for writer in ("ours", "torch-fs-t2"):
                        self.case(case, f"{writer} {mode}", _save_job, world, {"writer": writer, "async": mode})

    def run_s3(self) -> None:
        with self._s3_server() as server:
            self.server = server
            so = server.storage_options()
            host, port = "127.0.0.1", server.port
            for world, key in ((1, "s3-1"), (2, "s3-2")):
                if key not in self.args.cases:
                    continue
                case = f"s3 {world}p" if world == 1 else f"s3 {world}r"
                print(f"[{case}, {self.s3_name}]", flush=True)
                raw = {"s3": True, "host": host, "port": port, "part": self.args.raw_part, "server_pid": server.pid}
                mib = self.args.raw_part // MiB
                self.case(
                    case,
                    f"raw PUT {mib}MiB x{self.args.raw_concurrency}",
                    _raw_s3_job,
                    world,
                    {**raw, "multipart": False, "concurrency": self.args.raw_concurrency},
                )
                self.case(
                    case,
                    f"raw multipart {mib}MiB x{self.args.raw_concurrency}",
                    _raw_s3_job,
                    world,
                    {**raw, "multipart": True, "concurrency": self.args.raw_concurrency},
                )
                for writer in self._chosen(S3_WRITERS):
                    job = {"s3": True, "writer": writer, "storage_options": so, "server_pid": server.pid}
                    self.case(case, writer, _save_job, world, job)

    @contextlib.contextmanager
    def _s3_server(self) -> Any:
        """The S3 server, behind a :class:`~dcp_storage_testing.fault_proxy.LinkModel` proxy with ``--s3-link``."""
        with self._s3_emulator() as server:
            if not self.args.s3_link:
                yield server
                return
            from dcp_storage_testing.fault_proxy import FaultProxy, LinkModel

            link = LinkModel.parse(self.args.s3_link)
            with FaultProxy(server.endpoint_url, link=link) as proxy:
                self.s3_name += f" behind a link of {link.describe()}"
                yield _Linked(server, proxy)

    @contextlib.contextmanager
    def _s3_emulator(self) -> Any:
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        os.environ["NO_PROXY"] = "127.0.0.1,localhost"
        if self.args.s3_server == "moto":
            import moto

            from dcp_storage_testing.s3_server import MotoS3Server

            self.s3_name = f"moto {moto.__version__}"
            with MotoS3Server() as server:
                server.create_bucket(BUCKET)
                server.host = "127.0.0.1"  # type: ignore[attr-defined]
                yield server
            return
        from dcp_storage_testing.s3rver import S3RVER_VERSION, S3rverServer, ensure_installed

        prefix = os.path.join(HERE, ".servers")
        ensure_installed(prefix)
        self.s3_name = f"s3rver {S3RVER_VERSION}"
        with S3rverServer(prefix, buckets=(BUCKET,)) as server:
            yield server


class _Linked:
    """An S3 server as its clients see it through a link-model proxy: the proxy's port and endpoint."""

    def __init__(self, server: Any, proxy: Any) -> None:
        self._server = server
        self.port = proxy.port
        self.endpoint_url = proxy.url
        self.pid = server.pid

    def storage_options(self) -> dict[str, Any]:
        options = self._server.storage_options()
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": self.endpoint_url}
        return options


# ============================================================================================ report


def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Ratio columns: to the case's raw limit (for S3, the multipart one) and to torch's best writer."""
    by_case: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        by_case[r["case"]].append(r)
    for case, group in by_case.items():
        raws = [r for r in group if r["writer"].startswith("raw") and r.get("gbps")]
        limit = next((r for r in raws if "multipart" in r["writer"] or "fsync" in r["writer"]), None)
        put = next((r for r in raws if r["writer"].startswith("raw PUT")), None)
        refs = [
            r for r in group if r["writer"] in TORCH_REF["s3" if case.startswith("s3") else "local"] and r.get("gbps")
        ]
        torch_best = max(refs, key=lambda r: r["gbps"], default=None)
        for r in group:
            if r["writer"].startswith("raw") or not r.get("gbps"):
                continue
            if limit:
                r["vs_raw"] = r["gbps"] / limit["gbps"]
            if put:
                r["vs_raw_put"] = r["gbps"] / put["gbps"]
            if torch_best:
                r["vs_torch"] = r["gbps"] / torch_best["gbps"]
                r["torch_ref"] = torch_best["writer"]


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "case",
        "writer",
        "GB/s",
        "x raw",
        "x torch best",
        "requests",
        "peak RSS +MiB/rank",
        "blocked s / total s",
        "client CPU s/GB",
        "others' CPU",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if not r.get("gbps"):
            lines.append(
                "| "
                + " | ".join([r["case"], r["writer"], "ERROR", "", "", "", "", "", "", r.get("error") or ""])
                + " |"
            )
            continue
        raw = f"{r['vs_raw']:.2f}" if "vs_raw" in r else "-"
        if "vs_raw_put" in r:
            raw += f" (PUT {r['vs_raw_put']:.2f})"
        cells = [
            r["case"],
            r["writer"],
            f"{r['gbps']:.3f}",
            raw,
            f"{r['vs_torch']:.2f}" if "vs_torch" in r else "-",
            str(r.get("requests", "-")),
            f"{r['peak_extra'] / MiB:.0f}",
            f"{r['blocked_s']:.2f} / {r['seconds']:.2f}" if "blocked_s" in r else "-",
            f"{r.get('client_cpu_s_per_gb', 0):.2f}",
            f"{r.get('others_cpu_frac', 0):.0%}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def evaluate_bar(rows: list[dict[str, Any]], inflight: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def find(case: str, writer: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["case"] == case and r["writer"] == writer and r.get("gbps")), None)

    def bar(target: str, met: bool, detail: str) -> None:
        out.append({"target": target, "met": met, "detail": detail})

    for case in ("local 1p", "local 2r"):
        r = find(case, "ours")
        if r and "vs_raw" in r:
            bar(f"{case} >= 0.9x raw write+fsync", r["vs_raw"] >= 0.9, f"{r['vs_raw']:.2f}x ({r['gbps']:.3f} GB/s)")
        if r and "vs_torch" in r:
            bar(
                f"{case} >= 1.1x torch's best FileSystemWriter",
                r["vs_torch"] >= 1.1,
                f"{r['vs_torch']:.2f}x ({r['torch_ref']})",
            )
    for case in ("s3 1p", "s3 2r"):
        r = find(case, "ours")
        if r and "vs_raw" in r:
            bar(
                f"{case} >= 0.7x raw concurrent multipart",
                r["vs_raw"] >= 0.7,
                f"{r['vs_raw']:.2f}x ({r['gbps']:.3f} GB/s; x raw PUT {r.get('vs_raw_put', 0):.2f})",
            )
        if r and "vs_torch" in r:
            bar(f"{case} >= 3x torch's FsspecWriter", r["vs_torch"] >= 3.0, f"{r['vs_torch']:.2f}x")
    worst = max(
        (r for r in rows if r["writer"] == "ours" and "peak_extra" in r), key=lambda r: r["peak_extra"], default=None
    )
    if worst:
        limit = 2 * worst["largest_tensor"] + inflight
        out.append(
            {
                "target": "peak RSS beyond the state dict <= 2x largest tensor + in-flight bytes",
                "met": worst["peak_extra"] <= limit,
                "detail": f"worst {worst['peak_extra'] / MiB:.0f} MiB ({worst['case']}) vs {limit / MiB:.0f} MiB",
            }
        )
    for case in ("local 1p async", "local 2r async"):
        for mode in ("THREAD", "PROCESS"):
            ours, ref = find(case, f"ours {mode}"), find(case, f"torch-fs-t2 {mode}")
            if ours and ref and "blocked_s" in ours and "blocked_s" in ref:
                ratio = ours["blocked_s"] / ref["blocked_s"]
                out.append(
                    {
                        "target": f"{case} {mode}: blocked <= 1.2x torch FileSystemWriter",
                        "met": ratio <= 1.2,
                        "detail": f"{ours['blocked_s']:.2f}s vs {ref['blocked_s']:.2f}s ({ratio:.2f}x)",
                    }
                )
    return out


# ============================================================================================== main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="model size (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke test: 0.25 GiB, 1 repeat, no quiet wait")
    p.add_argument("--repeats", type=int, default=None, help="best of N (default 3, quick 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--cases", default="local1,local2,async,s3-1,s3-2", help="comma list of local1,local2,async,s3-1,s3-2"
    )
    p.add_argument("--s3-server", choices=("moto", "s3rver"), default="moto")
    p.add_argument(
        "--s3-link",
        default=None,
        metavar="MBPS[,LATENCY_MS]",
        help="put a proxy in front of the S3 server that caps each connection at MBPS (1e6 bytes/s) and delays "
        "each response by LATENCY_MS, as a real store's single stream is capped (see RESULTS-dcp-write.md)",
    )
    p.add_argument("--writers", default=None, help="comma list: only these writers (and the raw limits)")
    p.add_argument("--s3-repeats", type=int, default=None, help="best of N for the S3 cases (default: --repeats)")
    p.add_argument("--raw-part", type=int, default=64 * MiB, help="raw S3 limit: bytes per PUT / part")
    p.add_argument("--raw-concurrency", type=int, default=4, help="raw S3 limit: requests in flight per rank")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "dcp-storage-bench-write"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--quiet-wait", type=float, default=None, help="wait up to N s for an idle machine (default 10)")
    p.add_argument(
        "--json", default=None, help="default benchmarks/results/dcp_write.json (quick: dcp_write_quick.json)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.size_gib = 0.25
        args.repeats = args.repeats or 1
        args.quiet_wait = 0.0 if args.quiet_wait is None else args.quiet_wait
    args.repeats = args.repeats or 3
    args.quiet_wait = 10.0 if args.quiet_wait is None else args.quiet_wait
    args.cases = set(args.cases.split(","))
    args.json = args.json or os.path.join(HERE, "results", "dcp_write_quick.json" if args.quick else "dcp_write.json")
    started = time.time()
    warnings.filterwarnings("ignore")
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (HERE, REPO, os.environ.get("PYTHONPATH")) if x)

    machine = base.machine_notes()
    base.print_machine(machine)
    spec = base.model_spec(int(args.size_gib * GiB))
    largest = max(base.tensor_nbytes(tuple(s), d) for _, s, d in spec)
    print(
        f"model: {base.spec_total_bytes(spec) / GiB:.2f} GiB in {len(spec)} tensors, largest {largest / MiB:.0f} MiB",
        flush=True,
    )
    bench = Bench(args, [[n, list(s), d] for n, s, d in spec])
    try:
        bench.run_local()
        if args.cases & {"s3-1", "s3-2"}:
            bench.run_s3()
    except KeyboardInterrupt:
        print("interrupted; reporting what ran", flush=True)
    except Exception:  # noqa: BLE001 - report partial results
        traceback.print_exc()
    from dcp_storage.transports import TransportConfig

    finish_rows(bench.rows)
    inflight = TransportConfig().max_inflight_bytes
    bar = evaluate_bar(bench.rows, inflight)
    table = format_table(bench.rows)
    print("\n" + table + "\n")
    for t in bar:
        print(f"  [{'MET ' if t['met'] else 'MISS'}] {t['target']}: {t['detail']}")
    result = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_s": time.time() - started,
        "command": " ".join(["python", os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
        "machine": machine,
        "loadavg_at_end": os.getloadavg(),
        "busy_before_runs": bench.busy_before,
        "code_at_end": base.code_version(),
        "model": {"bytes": base.spec_total_bytes(spec), "tensors": len(spec), "largest_tensor_bytes": largest},
        "s3_server": getattr(bench, "s3_name", None),
        "definitions": {
            "gbps": "tensor bytes (all ranks) / seconds of the slowest rank (dcp.save, or async_save until committed)",
            "vs_raw": "local: to raw write+fsync; s3: to raw concurrent multipart (vs_raw_put: to raw concurrent PUTs)",
            "vs_torch": "to torch's best writer of the case (local: FileSystemWriter thread_count 1 or 2; s3: FsspecWriter)",
            "peak_extra": "VmHWM (reset after the state dict is built) - VmRSS before the save, max over ranks",
            "blocked_s": "seconds async_save blocked the caller (staging, and for PROCESS mode sending the request)",
        },
        "rows": bench.rows,
        "bar": bar,
        "table_markdown": table,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nJSON: {os.path.abspath(args.json)}  (total {time.time() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    # Run through the importable module name so rank functions pickle as bench_dcp_write.<fn>.
    import bench_dcp_write

    sys.exit(bench_dcp_write.main())
