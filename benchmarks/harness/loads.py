"""One timed ``dcp.load`` per rank process: the reader under test, request counting, checks against checksums."""

from __future__ import annotations

import gc
import os
import time
import warnings
from typing import Any

from .checkpoint import destinations, expected_checksum
from .measure import CpuWindow, RssSampler, proc_io, proc_status, reset_peak_rss, ru_maxrss_bytes
from .spec import checksum


def make_reader(kind: str, url: str, storage_options: dict[str, Any]) -> Any:
    if kind == "ours":
        from dcp_storage import FsspecReader

        return FsspecReader(url, storage_options)
    if kind == "ours-noverify":  # default verification's cost: the same reader with verify=False
        from dcp_storage import FsspecReader

        return FsspecReader(url, storage_options, verify=False)
    if kind == "ours-gap0":
        from dcp_storage import FsspecReader, TransportConfig

        return FsspecReader(url, storage_options, transport_config=TransportConfig(coalesce_gap=0))
    if kind == "torch-fs":
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(url)
    if kind == "torch-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as TorchFsspecReader

        return TorchFsspecReader(url, **storage_options)
    raise ValueError(kind)


class S3Count:
    """Counts s3fs ``_call_s3`` requests (and get_object bytes) in this process."""

    def __init__(self) -> None:
        self.gets = 0
        self.get_bytes = 0
        self.other = 0

    def install(self) -> None:
        import s3fs

        original = s3fs.S3FileSystem._call_s3
        counter = self

        async def counting(fs: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
            out = await original(fs, method, *args, **kwargs)
            if method == "get_object":
                counter.gets += 1
                counter.get_bytes += int(out.get("ContentLength", 0) or 0)
            else:
                counter.other += 1
            return out

        s3fs.S3FileSystem._call_s3 = counting  # type: ignore[method-assign]


def load_rank_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """One timed ``dcp.load`` on this rank (a fresh process). Returns timings and measurements."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    if world == 1:
        torch.set_num_threads(job.get("threads") or os.cpu_count() or 1)
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    s3count = None
    if job.get("s3"):
        s3count = S3Count()
        s3count.install()
    sd = destinations(spec, job["layout"], rank, world)
    needed = sum((v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size() for v in sd.values())
    reader = make_reader(job["reader"], job["url"], job.get("storage_options") or {})
    gc.collect()
    base_status = proc_status()
    base = base_status["VmRSS"]
    hwm_reset = reset_peak_rss()
    io0 = proc_io()
    sampler = RssSampler()
    sampler.start()
    if world > 1:
        dist.barrier()
    with CpuWindow(job.get("server_pid")) as cpu:
        t0 = time.perf_counter()
        dcp.load(sd, storage_reader=reader, no_dist=(world == 1))
        elapsed = time.perf_counter() - t0
    sampler.stop()
    io1 = proc_io()
    status = proc_status()
    peak = status["VmHWM"] if hwm_reset else ru_maxrss_bytes()
    # Verify (untimed).
    bad = []
    for name, shape, _ in spec:
        v = sd[name]
        local = v.to_local() if hasattr(v, "to_local") else v
        if checksum(local) != expected_checksum(job["sums"], name, shape, job["layout"], rank):
            bad.append(name)
    out: dict[str, Any] = {
        "rank": rank,
        "seconds": elapsed,
        "bytes_needed": needed,
        "rss_before": base,
        "peak_rss": peak,
        "peak_extra": peak - base,
        "peak_anon_extra": sampler.max_anon - base_status.get("RssAnon", 0),
        "peak_file_extra": sampler.max_file - base_status.get("RssFile", 0),
        "hwm_reset": hwm_reset,
        "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
        "syscr": io1.get("syscr", 0) - io0.get("syscr", 0),
        "verified": not bad,
        "bad": bad[:5],
        **cpu.as_dict(),
    }
    counters = getattr(reader, "counters", None)
    if isinstance(counters, dict):
        out["counters"] = dict(counters)
    if s3count is not None:
        out["s3_gets"] = s3count.gets
        out["s3_get_bytes"] = s3count.get_bytes
        out["s3_other_calls"] = s3count.other
    return out
