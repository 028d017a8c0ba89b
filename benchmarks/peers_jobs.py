"""Rank bodies of ``bench_peers.py``: one timed load or save per fresh process, by us or by a peer.

The peers (s3torchconnector, Run:ai Model Streamer) are imported only here, inside the rank processes, and
only when their row runs: the package never imports them and the test suite never needs them. Their
endpoint settings travel in ``job["env"]`` and are set inside the rank, because the rank forkserver keeps
the environment it started with.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import importlib
import mmap
import os
import shutil
import time
import warnings
from typing import Any

import bench_dcp_write as bw
import bench_safetensors as bst
import harness as base

BUCKET = "bench"  # the uploaded checkpoints
WRITE_BUCKET = bw.BUCKET  # saves (bench_dcp_write's raw PUT job writes there too)
REGION = "us-east-1"
CHUNK = 64 * base.MiB
_PEER_MODULES = {
    "s3tc": ("s3torchconnector.dcp", "s3torchconnector[dcp]"),
    "runai": ("runai_model_streamer", "runai-model-streamer"),
}


def peer_missing(who: str) -> str:
    """Why ``who``'s peer cannot run here ("" when it can): the row is then skipped with this note."""
    for prefix, (module, dist) in _PEER_MODULES.items():
        if who.startswith(prefix):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                return f"skipped: {dist} is not installed ({exc}); pip install -c .ci/constraints.txt '.[bench]'"
    return ""


def _s3tc_client(fs: Any, env: dict[str, str]) -> Any:
    """Point an s3torchconnector ``S3FileSystem`` at the local server: its readers and writers take no endpoint,
    so the client they built is replaced by ``S3Client(region, endpoint=...)`` with path-style addressing."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    fs._client = S3Client(
        REGION, endpoint=env["AWS_ENDPOINT_URL"], s3client_config=S3ClientConfig(force_path_style=True)
    )


def _reader(who: str, url: str, so: dict[str, Any], env: dict[str, str]) -> Any:
    if who == "ours":
        from dcp_storage import FsspecReader

        return FsspecReader(url, so)
    if who == "ours-st":
        from dcp_storage import SafetensorsReader

        return SafetensorsReader(url, so)
    if who == "torch-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as TorchFsspecReader

        return TorchFsspecReader(url, **so)
    if who == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(REGION, url, s3client_config=S3ClientConfig(force_path_style=True))
        _s3tc_client(reader.fs, env)
        return reader
    raise ValueError(who)


def _writer(who: str, url: str, so: dict[str, Any], env: dict[str, str]) -> Any:
    if who == "ours-w":
        from dcp_storage import FsspecWriter

        return FsspecWriter(url, so, overwrite=True)
    if who.startswith("s3tc-w"):
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter

        cfg = S3ClientConfig(force_path_style=True)
        writer = S3StorageWriter(REGION, url, s3client_config=cfg, thread_count=int(who[6:]))
        _s3tc_client(writer.fs, env)
        return writer
    if who == "torch-fsspec-w":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as TorchFsspecWriter

        return TorchFsspecWriter(url, overwrite=True, **so)
    if who == "ours-st-w":
        from dcp_storage import SafetensorsWriter

        return SafetensorsWriter(url, overwrite=True)
    if who == "torch-hf-w":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        return HuggingFaceStorageWriter(url, thread_count=2)
    if who == "torch-fs-t2":
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(url, thread_count=2, overwrite=True)
    raise ValueError(who)


def _runai_load(job: dict[str, Any], sd: dict[str, Any], rank: int) -> None:
    """Run:ai's streamer over every file; each tensor (its rows, on a ``Shard(0)`` rank) copied into ``sd``."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files([f"{job['url']}/{name}" for name in job["files"]])
        for name, t in streamer.get_tensors():
            v = sd[name]
            local = v.to_local() if hasattr(v, "to_local") else v
            if job["layout"] == "full":
                local.copy_(t)
            else:
                rows = local.shape[0]
                local.copy_(t[rank * rows : (rank + 1) * rows])


def load_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One timed load on this rank (a fresh process): destinations allocated first, checked after (untimed)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    os.environ.update(job["env"])
    if world == 1:
        torch.set_num_threads(os.cpu_count() or 1)
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    sd = base.destinations(spec, job["layout"], rank, world)
    nbytes = sum((v.to_local() if hasattr(v, "to_local") else v).nbytes for v in sd.values())
    reader = None if job["who"] == "runai" else _reader(job["who"], job["url"], job["so"], job["env"])
    gc.collect()
    before = base.proc_status()["VmRSS"]
    hwm = base.reset_peak_rss()
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    if reader is None:
        _runai_load(job, sd, rank)
    else:
        dcp.load(sd, storage_reader=reader, no_dist=(world == 1))
    seconds = time.perf_counter() - t0
    peak = base.proc_status()["VmHWM"] if hwm else base.ru_maxrss_bytes()
    bad = []
    for name, shape, _ in spec:
        v = sd[name]
        got = base.checksum(v.to_local() if hasattr(v, "to_local") else v)
        if job["fmt"] == "DCP":
            want = base.expected_checksum(job["sums"], name, shape, job["layout"], rank)
        else:
            want = bst._expected(job["sums"], name, job["layout"], rank)
        if got != want:
            bad.append(name)
    return {"seconds": seconds, "bytes": nbytes, "peak_extra": peak - before, "bad": bad[:5]}


def _target(job: dict[str, Any]) -> str:
    name = f"{job['who']}-{job['run_id']}"
    return f"s3://{job['bucket']}/{name}" if job["s3"] else os.path.join(job["root"], name)


def save_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One timed ``dcp.save`` of this rank's state (``Shard(0)`` DTensors at 2 ranks) to a fresh target."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    os.environ.update(job.get("env") or {})
    torch.set_num_threads(1)
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    sd = bw.build_state(spec, rank, world, 7)
    nbytes = sum(t.nbytes for t in bw._local_tensors(sd))
    url = _target(job)
    writer = _writer(job["who"], url, job.get("so") or {}, job.get("env") or {})
    with bw.measured(job, world) as out:
        dcp.save(sd, storage_writer=writer, no_dist=(world == 1))
    if world > 1:
        dist.barrier()
    if rank == 0:
        _remove(url, job)
    return {"seconds": out["seconds"], "bytes": nbytes, "peak_extra": out["peak_extra"]}


def _remove(url: str, job: dict[str, Any]) -> None:
    if not job["s3"]:
        shutil.rmtree(url, ignore_errors=True)
        return
    with contextlib.suppress(Exception):
        import fsspec

        fs = fsspec.filesystem("s3", **job["so"], skip_instance_cache=True)
        if not fs.exists(url + "/.metadata"):
            print(f"warning: {job['who']} left no .metadata at {url}", flush=True)
        fs.rm(url, recursive=True)


def _resident_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file), by ``mincore`` over a read-only mapping."""
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    n = -(-size // page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        vec = ctypes.create_string_buffer(n)
        try:
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw), n


def odirect_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """The disk's limit for this rank's bytes: staged (untimed) in a page-aligned buffer, then ``O_DIRECT`` writes
    of 64 MiB and ``fsync``, timed. Checks the flag is really on and the file left the page cache empty."""
    import torch

    torch.set_num_threads(1)
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    tensors = bw._local_tensors(bw.build_state(spec, rank, world, 7))
    nbytes = sum(t.nbytes for t in tensors)
    padded = -(-nbytes // 4096) * 4096
    buf = mmap.mmap(-1, padded)  # anonymous: page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    pos = 0
    for t in tensors:
        view[pos : pos + t.nbytes] = bw._bytes_of(t)
        pos += t.nbytes
    del tensors
    folder = os.path.join(job["root"], f"odirect-{job['run_id']}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"raw-{rank}")
    with bw.measured(job, world) as out:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            flag_on = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
            written = 0
            while written < padded:
                written += os.write(fd, view[written : written + CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)
    resident, pages = _resident_pages(path)
    view.release()
    buf.close()
    os.remove(path)  # this rank's file only: another rank may still be checking its own in the same folder
    with contextlib.suppress(OSError):
        os.rmdir(folder)  # the last rank out removes the folder
    check = f"O_DIRECT flag {'on' if flag_on else 'OFF'}, {resident}/{pages} pages in the page cache after the write"
    if not flag_on or resident > pages // 100:
        return {"seconds": out["seconds"], "bytes": nbytes, "peak_extra": 0, "bad": ["not O_DIRECT: " + check]}
    return {"seconds": out["seconds"], "bytes": nbytes, "peak_extra": out["peak_extra"], "check": check}
