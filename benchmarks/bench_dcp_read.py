#!/usr/bin/env python
"""Read benchmark: ``dcp_storage.FsspecReader`` against torch's readers and raw I/O limits.

Usage::

    .venv/bin/python benchmarks/bench_dcp_read.py [--size-gib 2] [--quick] [--json out.json]

What it does:

* Builds (once, cached under ``$TMPDIR/dcp-storage-bench/`` keyed by size and seed) a seeded checkpoint of
  about ``--size-gib`` GiB shaped like a transformer (fp32 embedding/head/norms/biases, bf16 attention and
  MLP matrices), saved by 2 gloo ranks as ``Shard(0)`` DTensors with torch's own ``FileSystemWriter``.
* Times only the ``dcp.load`` call, best of ``--repeats``, each repeat in a fresh process (a fork of
  :func:`dcp_storage.testing.distributed.run_ranks`'s forkserver, torch preloaded) so peak-RSS numbers do
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
import collections
import contextlib
import datetime
import gc
import http.client
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
GB = 1e9
SPEC_VERSION = 1  # bump when the checkpoint layout/generation changes (invalidates the cache)
BUCKET = "bench"
RAW_PART = 16 * MiB
RAW_CONCURRENCY = 8
LOCAL_CHUNK = 64 * MiB

# ============================================================================================ spec


def model_spec(size_bytes: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Tensors of a transformer of about ``size_bytes``: (name, shape, dtype name)."""
    dim = 2048 if size_bytes >= 1 * GiB else 1024
    hidden = (int(2.75 * dim) + 255) // 256 * 256
    vocab = 16 * dim
    emb = [("embed.weight", (vocab, dim), "float32")]
    head = [("norm_f.weight", (dim,), "float32"), ("head.weight", (vocab, dim), "float32")]

    def layer(i: int) -> list[tuple[str, tuple[int, ...], str]]:
        p = f"layers.{i}."
        return [
            (p + "attn_norm.weight", (dim,), "float32"),
            (p + "attn_norm.bias", (dim,), "float32"),
            (p + "attn.qkv.weight", (3 * dim, dim), "bfloat16"),
            (p + "attn.qkv.bias", (3 * dim,), "float32"),
            (p + "attn.out.weight", (dim, dim), "bfloat16"),
            (p + "mlp_norm.weight", (dim,), "float32"),
            (p + "mlp.up.weight", (hidden, dim), "bfloat16"),
            (p + "mlp.up.bias", (hidden,), "float32"),
            (p + "mlp.down.weight", (dim, hidden), "bfloat16"),
            (p + "mlp.down.bias", (dim,), "float32"),
        ]

    fixed = _spec_bytes(emb + head)
    per_layer = _spec_bytes(layer(0))
    n_layers = max(1, round((size_bytes - fixed) / per_layer))
    spec = list(emb)
    for i in range(n_layers):
        spec += layer(i)
    return spec + head


_ITEMSIZE = {"float32": 4, "bfloat16": 2}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = _ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def _spec_bytes(spec: list[tuple[str, tuple[int, ...], str]]) -> int:
    return sum(_nbytes(shape, dt) for _, shape, dt in spec)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _checksum(t: Any) -> int:
    """Sum of the elements' bit patterns (int64): cheap and catches misplaced or missing bytes."""
    import torch

    t = t.contiguous()
    ints = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    return int(ints.sum(dtype=torch.int64).item())


# =========================================================================================== /proc


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * KiB
    return out


class _RssSampler(threading.Thread):
    """Samples RssAnon/RssFile every ``interval`` s: VmHWM is exact but cannot tell anonymous memory from
    file pages mapped by ``mmap`` (page cache, reclaimable), so the split of the peak is sampled."""

    def __init__(self, interval: float = 0.01) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.interval = interval
        self.stop_event = threading.Event()
        self.max_anon = 0
        self.max_file = 0

    def run(self) -> None:
        while True:
            st = _proc_status()
            self.max_anon = max(self.max_anon, st.get("RssAnon", 0))
            self.max_file = max(self.max_file, st.get("RssFile", 0))
            if self.stop_event.wait(self.interval):
                return

    def stop(self) -> None:
        self.stop_event.set()
        self.join()
        st = _proc_status()
        self.max_anon = max(self.max_anon, st.get("RssAnon", 0))
        self.max_file = max(self.max_file, st.get("RssFile", 0))


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_io() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, value = line.split(":", 1)
                out[key.strip()] = int(value)
    except OSError:
        pass
    return out


def _cpu_stat() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return (total - idle) / hz, total / hz


class _CpuWindow:
    """CPU seconds used, during a window, by this process, by the machine, and by one more process."""

    def __init__(self, other_pid: int | None = None) -> None:
        self.other_pid = other_pid

    def _other(self) -> float:
        if not self.other_pid:
            return 0.0
        try:
            import psutil

            t = psutil.Process(self.other_pid).cpu_times()
            return t.user + t.system
        except Exception:  # noqa: BLE001
            return 0.0

    def __enter__(self) -> Self:
        import resource

        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._sys = _cpu_stat()
        self._o = self._other()
        return self

    def __exit__(self, *exc: object) -> None:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        sys_now = _cpu_stat()
        self.self_cpu = (ru.ru_utime - self._ru.ru_utime) + (ru.ru_stime - self._ru.ru_stime)
        self.machine_busy = sys_now[0] - self._sys[0]
        self.server_cpu = self._other() - self._o

    def as_dict(self) -> dict[str, float]:
        return {"cpu_self": self.self_cpu, "cpu_machine": self.machine_busy, "cpu_server": self.server_cpu}


def wait_for_quiet(max_wait: float, threshold: float = 0.35) -> float:
    """Wait (up to ``max_wait`` s) until the machine (all cores) is mostly idle; returns the last busy share."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = _cpu_stat()
        time.sleep(0.5)
        b1, t1 = _cpu_stat()
        busy = (b1 - b0) / max(t1 - t0, 1e-9)
        if busy <= threshold or time.monotonic() >= deadline:
            return busy
        time.sleep(1.0)


def _touched(nbytes: int) -> Any:
    """A writable, already-faulted buffer (memoryview) of ``nbytes``; keep the returned tensor alive."""
    import torch

    t = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    t.fill_(1)
    return t, memoryview(t.numpy())[:nbytes]


# ====================================================================================== generation


def _save_rank(rank: int, world: int, path: str, spec: list, seed: int) -> dict[str, dict[str, Any]]:
    """Rank body: seeded Shard(0) chunks -> DTensors -> dcp.save with FileSystemWriter. Returns checksums."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    sums: dict[str, dict[str, Any]] = {}
    for idx, (name, shape, dtype) in enumerate(spec):
        rows = shape[0] // world
        local_shape = (rows, *shape[1:])
        g = torch.Generator().manual_seed(seed * 1_000_003 + idx * 64 + rank)
        local = torch.randn(local_shape, generator=g, dtype=torch.float32).to(_torch_dtype(dtype))
        entry: dict[str, Any] = {"all": _checksum(local)}
        if len(shape) == 2:
            half = shape[1] // world
            entry["cols"] = [_checksum(local[:, c * half : (c + 1) * half]) for c in range(world)]
        sums[name] = entry
        sd[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=_contig_stride(shape)
        )
    dcp.save(sd, storage_writer=FileSystemWriter(path))
    return sums


def _contig_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def ensure_checkpoint(cache_root: str, size_gib: float, seed: int) -> dict[str, Any]:
    """The cached checkpoint for (size, seed, spec version): generate it if missing. Returns its info."""
    from dcp_storage.testing.distributed import run_ranks

    tag = f"ckpt-{size_gib:g}gib-seed{seed}-v{SPEC_VERSION}"
    root = os.path.join(cache_root, tag)
    path = os.path.join(root, "dcp")
    info_path = os.path.join(root, "info.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
        if all(os.path.exists(os.path.join(path, name)) for name in info["files"]):
            info["generated_s"] = 0.0
            return info
    spec = model_spec(int(size_gib * GiB))
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    tmp = path + ".partial"
    print(f"[gen] writing {_spec_bytes(spec) / GiB:.2f} GiB checkpoint ({len(spec)} tensors) to {path} ...", flush=True)
    t0 = time.perf_counter()
    results = run_ranks(_save_rank, 2, tmp, spec, seed, timeout=1800)
    os.rename(tmp, path)
    files = sorted(os.listdir(path))
    info = {
        "tag": tag,
        "path": path,
        "root": root,
        "size_gib": size_gib,
        "seed": seed,
        "world_size": 2,
        "spec": [[n, list(s), d] for n, s, d in spec],
        "sums": {name: [results[r][name] for r in range(2)] for name, _, _ in spec},
        "files": files,
        "file_sizes": {name: os.path.getsize(os.path.join(path, name)) for name in files},
        "tensor_bytes": _spec_bytes(spec),
        "largest_tensor_bytes": max(_nbytes(s, d) for _, s, d in spec),
    }
    with open(info_path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(info_path + ".tmp", info_path)
    info["generated_s"] = time.perf_counter() - t0
    print(f"[gen] done in {info['generated_s']:.1f}s", flush=True)
    return info


def data_files(info: dict[str, Any]) -> list[tuple[str, int]]:
    return [(n, s) for n, s in info["file_sizes"].items() if n.endswith(".distcp")]


def warm_files(paths: list[str]) -> None:
    """Read every file once (untimed) so it is in the page cache."""
    buf = bytearray(LOCAL_CHUNK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


PAGE_CACHE_MODES = ("as-is", "large", "small")


def prepare_page_cache(paths: list[str], mode: str) -> dict[str, Any]:
    """Put ``paths`` in the page cache in a known state; returns what was done, for the JSON.

    The kernel caches a file in folios of 4 KiB up to 2 MiB, and which it gets decides how fast both the
    raw ``readinto`` limit and a memory-mapped copy run (measured here: 2-thread ``readinto`` 9.4 GB/s
    over 4 KiB folios, 14.8 GB/s over large ones, where a mapping is made of 2 MiB page-table entries).
    ``as-is`` only reads the files (pages already cached keep their folios: a just-written checkpoint);
    ``large`` drops them and reads them back sequentially, as readahead caches a file read from disk;
    ``small`` drops them and reads them back 4 KiB at a time with readahead off (``POSIX_FADV_RANDOM``),
    as a file written or read in small pieces is cached. Dropping uses ``POSIX_FADV_DONTNEED`` on the
    benchmark's own files.
    """
    before = _file_huge_pages()
    if mode != "as-is":
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if mode == "small":
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    page = bytearray(4096)
                    pos = 0
                    while n := os.preadv(fd, [page], pos):
                        pos += n
            finally:
                os.close(fd)
    warm_files(paths)  # "small": already cached, so this read changes no folio
    return {"mode": mode, "file_huge_pages_kib_before": before, "file_huge_pages_kib_after": _file_huge_pages()}


def _file_huge_pages() -> int | None:
    """``FileHugePages`` of ``/proc/meminfo`` (KiB of page cache held in 2 MiB folios), if the kernel says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("FileHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# ========================================================================================= workers


def _destinations(spec: list, layout: str, rank: int, world: int) -> dict[str, Any]:
    import torch

    sd: dict[str, Any] = {}
    mesh = None
    if layout != "full":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    for name, shape, dtype in spec:
        shape = tuple(shape)
        if layout == "full":
            sd[name] = torch.empty(shape, dtype=_torch_dtype(dtype)).zero_()
            continue
        from torch.distributed.tensor import DTensor, Shard

        dim = 1 if (layout == "shard1" and len(shape) == 2) else 0
        local_shape = list(shape)
        local_shape[dim] //= world
        local = torch.empty(local_shape, dtype=_torch_dtype(dtype)).zero_()
        sd[name] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=_contig_stride(shape)
        )
    return sd


def _expected(sums: dict[str, list], name: str, shape: tuple[int, ...], layout: str, rank: int) -> int:
    chunks = sums[name]
    if layout == "full":
        return sum(c["all"] for c in chunks)
    if layout == "shard1" and len(shape) == 2:
        return sum(c["cols"][rank] for c in chunks)
    return chunks[rank]["all"]


def _make_reader(kind: str, url: str, storage_options: dict[str, Any]) -> Any:
    if kind == "ours":
        from dcp_storage import FsspecReader

        return FsspecReader(url, storage_options)
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


class _S3Count:
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


def _load_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
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
        s3count = _S3Count()
        s3count.install()
    sd = _destinations(spec, job["layout"], rank, world)
    needed = sum((v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size() for v in sd.values())
    reader = _make_reader(job["reader"], job["url"], job.get("storage_options") or {})
    gc.collect()
    base_status = _proc_status()
    base = base_status["VmRSS"]
    hwm_reset = _reset_peak_rss()
    io0 = _proc_io()
    sampler = _RssSampler()
    sampler.start()
    if world > 1:
        dist.barrier()
    with _CpuWindow(job.get("server_pid")) as cpu:
        t0 = time.perf_counter()
        dcp.load(sd, storage_reader=reader, no_dist=(world == 1))
        elapsed = time.perf_counter() - t0
    sampler.stop()
    io1 = _proc_io()
    status = _proc_status()
    peak = status["VmHWM"] if hwm_reset else _ru_maxrss()
    # Verify (untimed).
    bad = []
    for name, shape, _ in spec:
        v = sd[name]
        local = v.to_local() if hasattr(v, "to_local") else v
        if _checksum(local) != _expected(job["sums"], name, shape, job["layout"], rank):
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


def _ru_maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB


def _raw_local_job(rank: int, world: int, files: list[tuple[str, int]], threads: int) -> dict[str, Any]:
    """Raw limit: ``preadv`` of ``files`` into touched buffers from ``threads`` threads (contiguous shares)."""
    keep, views = [], []
    for _, size in files:
        t, mv = _touched(size)
        keep.append(t)
        views.append(mv)
    total = sum(s for _, s in files)
    # Pieces (file index, offset, length) of LOCAL_CHUNK, split into `threads` contiguous shares.
    pieces = [(i, off, min(LOCAL_CHUNK, s - off)) for i, (_, s) in enumerate(files) for off in range(0, s, LOCAL_CHUNK)]
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    acc = 0
    for p in pieces:
        shares[min(threads - 1, acc * threads // total)].append(p)
        acc += p[2]
    fds = [os.open(p, os.O_RDONLY) for p, _ in files]
    errors: list[BaseException] = []

    def run(share: list[tuple[int, int, int]]) -> None:
        try:
            for i, off, n in share:
                mv = views[i][off : off + n]
                pos = 0
                while pos < n:
                    got = os.preadv(fds[i], [mv[pos:]], off + pos)
                    if got <= 0:
                        raise OSError(f"short read of {files[i][0]}")
                    pos += got
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ths = [threading.Thread(target=run, args=(s,)) for s in shares]
    with _CpuWindow() as cpu:
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        elapsed = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    if errors:
        raise errors[0]
    return {"seconds": elapsed, "bytes": total, **cpu.as_dict()}


def ranged_tasks(objects: list[tuple[str, int]], part: int) -> collections.deque:
    """``(object index, offset, length)`` of every ``part``-sized range of ``objects``, as a shared work queue."""
    return collections.deque(
        (i, off, min(part, size - off)) for i, (_, size) in enumerate(objects) for off in range(0, size, part)
    )


def run_threads(n: int, fn: Any, server_pid: int | None) -> tuple[float, dict[str, Any]]:
    """Run ``fn`` in ``n`` threads at once; seconds until all ended, and the CPU used (client and server)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    with _CpuWindow(server_pid) as cpu:
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed, cpu.as_dict()


def raw_ranged_job(
    objects: list[tuple[str, int]],
    part: int,
    concurrency: int,
    server_pid: int | None,
    reader: Callable[[], contextlib.AbstractContextManager[Callable[[str, int, int, memoryview], None]]],
) -> dict[str, Any]:
    """Raw limit: every ``part``-sized range of ``objects``, fetched by ``concurrency`` threads into touched buffers.

    ``reader()`` is entered once per thread and yields ``fetch(key, offset, length, into)``, which must fill
    ``into`` (a per-thread client: a connection, a store). Returns seconds, bytes, requests and CPU.
    """
    _keep, views = zip(*(_touched(size) for _, size in objects))
    tasks = ranged_tasks(objects, part)
    n_tasks = len(tasks)

    def work() -> None:
        with reader() as fetch:
            while True:
                try:
                    i, off, n = tasks.popleft()
                except IndexError:
                    return
                fetch(objects[i][0], off, n, views[i][off : off + n])

    elapsed, cpu = run_threads(concurrency, work, server_pid)
    return {"seconds": elapsed, "bytes": sum(s for _, s in objects), "requests": n_tasks, **cpu}


def read_exactly_into(readinto: Callable[[memoryview], int | None], into: memoryview) -> None:
    """Fill ``into`` from a response body's ``readinto``; ``OSError`` if the body ends early."""
    pos = 0
    while pos < len(into):
        got = readinto(into[pos:])
        if not got:
            raise OSError("short body")
        pos += got


def _raw_s3_job(
    rank: int,
    world: int,
    host: str,
    port: int,
    objects: list[tuple[str, int]],
    part: int,
    concurrency: int,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """Raw limit: concurrent plain ranged GETs (http.client, unsigned) into touched buffers."""

    @contextlib.contextmanager
    def connection() -> Iterator[Callable[[str, int, int, memoryview], None]]:
        conn = http.client.HTTPConnection(host, port, timeout=120)

        def fetch(key: str, off: int, n: int, into: memoryview) -> None:
            conn.request("GET", key, headers={"Range": f"bytes={off}-{off + n - 1}"})
            resp = conn.getresponse()
            if resp.status != 206:
                raise OSError(f"GET {key} -> {resp.status} {resp.read(300)!r}")
            read_exactly_into(resp.readinto, into)
            resp.read()

        try:
            yield fetch
        finally:
            conn.close()

    return raw_ranged_job(objects, part, concurrency, server_pid, connection)


# ====================================================================================== s3 helpers


@contextlib.contextmanager
def s3rver_holding(info: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
    """s3rver serving the cached checkpoint ``info`` as ``s3://BUCKET/<info["tag"]>``, for every script here.

    Installs s3rver under ``benchmarks/.servers`` if needed, keeps its objects in the checkpoint's cache
    directory (``s3rver-data``), and uploads only files missing there (uploads are slow). Yields the server
    and the set-up figures (install and upload seconds, bytes uploaded).
    """
    from dcp_storage.testing.s3rver import S3RVER_VERSION, S3rverServer, ensure_installed

    prefix = os.path.join(HERE, ".servers")
    t0 = time.perf_counter()
    ensure_installed(prefix)
    install_s = time.perf_counter() - t0
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    with S3rverServer(prefix, data_dir=os.path.join(info["root"], "s3rver-data"), buckets=(BUCKET,)) as server:
        t0 = time.perf_counter()
        uploaded = 0
        for name in info["files"]:
            key_path = f"/{BUCKET}/{info['tag']}/{name}"
            local = os.path.join(info["path"], name)
            if _head_size(server.host, server.port, key_path) != os.path.getsize(local):
                _put_file(server.host, server.port, key_path, local)
                uploaded += os.path.getsize(local)
        setup = {
            "server": f"s3rver {S3RVER_VERSION} (npm), node " + _cmd_version(["node", "--version"]),
            "install_s": install_s,
            "uploaded_bytes": uploaded,
            "upload_s": time.perf_counter() - t0,
        }
        print(
            f"[s3rver on {server.host}:{server.port}; uploaded {uploaded / GiB:.2f} GiB in {setup['upload_s']:.1f}s]",
            flush=True,
        )
        yield server, setup


def _put_file(host: str, port: int, key_path: str, file_path: str) -> None:
    size = os.path.getsize(file_path)
    conn = http.client.HTTPConnection(host, port, timeout=600, blocksize=1 * MiB)
    try:
        with open(file_path, "rb") as f:
            conn.request("PUT", key_path, body=f, headers={"Content-Length": str(size)})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise OSError(f"PUT {key_path} -> {resp.status} {body[:300]!r}")
    finally:
        conn.close()


def _head_size(host: str, port: int, key_path: str) -> int | None:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("HEAD", key_path)
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            return None
        return int(resp.getheader("Content-Length", "-1"))
    finally:
        conn.close()


# ======================================================================================= orchestration


def _cpu_summary(ranks: list[dict[str, Any]], seconds: float, nbytes: int) -> dict[str, float]:
    """Client/server CPU per GB and the share of the machine other processes took during the run."""
    ncpu = os.cpu_count() or 1
    client = sum(r["cpu_self"] for r in ranks)
    server = ranks[0]["cpu_server"]
    others = max(0.0, ranks[0]["cpu_machine"] - client - server)
    return {
        "client_cpu_s_per_gb": client / (nbytes / GB),
        "server_cpu_s_per_gb": server / (nbytes / GB),
        "others_cpu_frac": min(1.0, others / max(seconds * ncpu, 1e-9)),
    }


class Bench:
    def __init__(self, args: argparse.Namespace, info: dict[str, Any]) -> None:
        self.args = args
        self.info = info
        self.spec = info["spec"]
        self.rows: list[dict[str, Any]] = []
        self.busy_before: list[float] = []
        self.server_pid: int | None = None
        self.page_cache: dict[str, dict[str, Any]] = {}

    # ---- running
    def _run(self, fn: Any, world: int, *a: Any, timeout: float) -> tuple[list[Any] | None, str | None]:
        from dcp_storage.testing.distributed import RankFailedError, RankTimeoutError, run_ranks

        if self.args.quiet_wait > 0:
            self.busy_before.append(wait_for_quiet(self.args.quiet_wait))
        try:
            return run_ranks(fn, world, *a, timeout=timeout), None
        except RankTimeoutError:
            return None, f"timeout after {timeout:.0f}s"
        except RankFailedError as exc:
            first = next(iter(exc.failures.values()))
            return None, "failed: " + first.strip().splitlines()[-1][:300]

    def _noisy(self, ranks: list[dict[str, Any]], seconds: float, nbytes: int) -> bool:
        """Whether unrelated processes took a noticeable share of the CPU during the best run so far."""
        return _cpu_summary(ranks, seconds, nbytes)["others_cpu_frac"] > 0.15

    def raw(self, case: str, label: str, fn: Any, *a: Any, timeout: float = 600) -> dict[str, Any]:
        best: dict[str, Any] | None = None
        runs = []
        error = None
        for i in range(self.args.repeats + self.args.extra_repeats):
            if i >= self.args.repeats and not self._noisy([best], best["seconds"], best["bytes"]):
                break
            res, error = self._run(fn, 1, *a, timeout=timeout)
            if res is None:
                break
            r = res[0]
            runs.append(r["seconds"])
            if best is None or r["seconds"] < best["seconds"]:
                best = r
        row = {"case": case, "reader": label, "kind": "raw", "runs_s": runs, "error": error}
        if best is not None:
            row.update(gbps=best["bytes"] / best["seconds"] / GB, seconds=best["seconds"], bytes=best["bytes"])
            if "requests" in best:
                row["requests"] = best["requests"]
            row.update(_cpu_summary([best], best["seconds"], best["bytes"]))
        self._print_progress(row)
        self.rows.append(row)
        return row

    def load(
        self,
        case: str,
        reader: str,
        url: str,
        layout: str,
        world: int,
        *,
        storage_options: dict[str, Any] | None = None,
        s3: bool = False,
        spec: list | None = None,
        timeout: float = 600,
        repeats: int | None = None,
        note: str = "",
    ) -> dict[str, Any]:
        job = {
            "reader": reader,
            "url": url,
            "layout": layout,
            "spec": spec or self.spec,
            "sums": self.info["sums"],
            "storage_options": storage_options or {},
            "s3": s3,
            "server_pid": self.server_pid if s3 else None,
        }
        best: list[dict[str, Any]] | None = None
        runs: list[float] = []
        error = None
        n = repeats or self.args.repeats
        for i in range(n + self.args.extra_repeats):
            if i >= 2 and runs and min(runs) > self.args.slow_s:
                break  # slow case: best of 2 is enough
            if i >= n and (
                best is None
                or not self._noisy(best, max(r["seconds"] for r in best), sum(r["bytes_needed"] for r in best))
            ):
                break
            res, error = self._run(_load_job, world, job, timeout=timeout)
            if res is None:
                break
            t = max(r["seconds"] for r in res)
            runs.append(t)
            if not all(r["verified"] for r in res):
                error = "WRONG DATA: " + ", ".join(b for r in res for b in r["bad"])
                best = res
                break
            if best is None or t < max(r["seconds"] for r in best):
                best = res
        row: dict[str, Any] = {
            "case": case,
            "reader": reader,
            "kind": "load",
            "layout": layout,
            "world": world,
            "runs_s": runs,
            "error": error,
            "note": note,
        }
        if best is not None:
            t = max(r["seconds"] for r in best)
            needed = sum(r["bytes_needed"] for r in best)
            row.update(
                seconds=t,
                bytes_needed=needed,
                gbps=needed / t / GB,
                peak_extra=max(r["peak_extra"] for r in best),
                peak_anon_extra=max(r["peak_anon_extra"] for r in best),
                peak_file_extra=max(r["peak_file_extra"] for r in best),
                per_rank=best,
            )
            if all("counters" in r for r in best):
                row["requests"] = sum(r["counters"]["requests"] for r in best)
                row["bytes_read"] = sum(r["counters"]["bytes_read"] for r in best)
                row["bytes_read_source"] = "reader.counters"
            elif s3:
                row["requests"] = sum(r["s3_gets"] for r in best)
                row["bytes_read"] = sum(r["s3_get_bytes"] for r in best)
                row["bytes_read_source"] = "s3fs get_object calls/ContentLength"
            else:
                row["requests"] = sum(r["syscr"] for r in best)
                row["bytes_read"] = sum(r["rchar"] for r in best)
                row["bytes_read_source"] = "/proc/self/io syscr/rchar"
            row.update(_cpu_summary(best, t, needed))
            row["read_ratio"] = row["bytes_read"] / needed
            row["read_ratio_max_rank"] = max(
                (r["counters"]["bytes_read"] if "counters" in r else (r.get("s3_get_bytes") if s3 else r["rchar"]))
                / r["bytes_needed"]
                for r in best
            )
        self._print_progress(row)
        self.rows.append(row)
        return row

    def _print_progress(self, row: dict[str, Any]) -> None:
        if row.get("error"):
            print(f"  {row['case']:<28} {row['reader']:<24} ERROR {row['error']}", flush=True)
            return
        extra = ""
        if "peak_extra" in row:
            extra = f"  peak+{row['peak_extra'] / MiB:.0f}MiB  read/needed {row.get('read_ratio', 0):.3f}"
        runs = " ".join(f"{s:.2f}" for s in row["runs_s"])
        extra += f"  others' CPU {row.get('others_cpu_frac', 0):.0%}"
        print(f"  {row['case']:<28} {row['reader']:<24} {row['gbps']:.3f} GB/s  (runs s: {runs}){extra}", flush=True)

    # ---- cases
    def run_local(self) -> None:
        path = self.info["path"]
        files = [(os.path.join(path, n), s) for n, s in data_files(self.info)]
        cases = self.args.cases
        if "local1" in cases:
            print("[local, 1 process, full tensors]", flush=True)
            self.page_cache["local1"] = prepare_page_cache([p for p, _ in files], self.args.page_cache)
            case = "local 1p full"
            self.raw(case, "raw readinto 1 thread", _raw_local_job, files, 1)
            for reader in ("ours", "torch-fs", "torch-fsspec"):
                self.load(case, reader, path, "full", 1)
        if "local2" in cases:
            print("[local, 2 ranks]", flush=True)
            self.page_cache["local2"] = prepare_page_cache([p for p, _ in files], self.args.page_cache)
            case = "local 2r S0->S1"
            self.raw(case, "raw readinto 2 threads", _raw_local_job, files, 2)
            # ours-gap0: coalescing off (TransportConfig(coalesce_gap=0)), i.e. only the needed bytes
            for reader in ("ours", "torch-fs") if self.args.quick else ("ours", "ours-gap0", "torch-fs"):
                self.load(case, reader, path, "shard1", 2)
            case = "local 2r S0->S0"
            for reader in ("ours", "torch-fs"):
                self.load(case, reader, path, "shard0", 2)

    def run_s3(self) -> None:
        with s3rver_holding(self.info) as (server, self.s3_setup):
            host, port = server.host, server.port
            self.server_pid = server.pid
            key_prefix = self.info["tag"]
            url = f"s3://{BUCKET}/{key_prefix}"
            so = server.storage_options()
            objects = [(f"/{BUCKET}/{key_prefix}/{n}", s) for n, s in data_files(self.info)]
            obj_files = [server.object_path(BUCKET, f"{key_prefix}/{n}") for n, _ in data_files(self.info)]
            cases = self.args.cases
            # torch's FsspecReader gets a subset when the checkpoint is big (it is slow).
            subset, subset_bytes = self._subset(self.args.torch_s3_subset_gib * GiB)
            full_bytes = _spec_bytes([(n, tuple(s), d) for n, s, d in self.spec])
            subset_note = "" if subset is None else f"subset {subset_bytes / GiB:.2f} of {full_bytes / GiB:.2f} GiB"
            if "s3-1" in cases:
                print("[s3rver, 1 process, full tensors]", flush=True)
                warm_files(obj_files)
                case = "s3rver 1p full"
                self.raw(
                    case,
                    f"raw ranged GET {RAW_PART // MiB}MiBx{RAW_CONCURRENCY}",
                    _raw_s3_job,
                    host,
                    port,
                    objects,
                    RAW_PART,
                    RAW_CONCURRENCY,
                    server.pid,
                )
                self._s3_readers(case, url, "full", 1, so, subset, subset_note)
            if "s3-2" in cases:
                print("[s3rver, 2 ranks, S0->S1]", flush=True)
                warm_files(obj_files)
                case = "s3rver 2r S0->S1"
                self._s3_readers(case, url, "shard1", 2, so, subset, subset_note)

    def _s3_readers(
        self, case: str, url: str, layout: str, world: int, so: dict[str, Any], subset: list | None, subset_note: str
    ) -> None:
        """Ours on everything, ours again on torch's subset (when it has one), then torch's ``FsspecReader``."""
        self.load(case, "ours", url, layout, world, storage_options=so, s3=True)
        if subset is not None:
            note = subset_note + " (same subset as torch-fsspec)"
            self.load(case, "ours", url, layout, world, storage_options=so, s3=True, spec=subset, note=note)
        self.load(
            case,
            "torch-fsspec",
            url,
            layout,
            world,
            storage_options=so,
            s3=True,
            spec=subset,
            timeout=self.args.torch_s3_timeout,
            repeats=self.args.torch_s3_repeats,
            note=subset_note,
        )

    def _subset(self, cap: float) -> tuple[list | None, int]:
        total = _spec_bytes([(n, tuple(s), d) for n, s, d in self.spec])
        if cap <= 0 or total <= cap:
            return None, total
        out, acc = [], 0
        for n, s, d in self.spec:  # a prefix: the embedding and the first layers
            b = _nbytes(tuple(s), d)
            if acc + b > cap:
                break
            out.append([n, s, d])
            acc += b
        return out, acc


def _cmd_version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def code_version() -> dict[str, Any]:
    """The commit benchmarked, and which files of the package differ from it (work in progress)."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(
                ["git", "-C", REPO, *a], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except Exception:  # noqa: BLE001
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "dcp_storage").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "dirty_package_files": dirty}


def machine_notes() -> dict[str, Any]:
    import fsspec
    import torch

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * KiB
    versions = {"python": platform.python_version(), "torch": torch.__version__, "fsspec": fsspec.__version__}
    for mod in ("s3fs", "aiobotocore", "aiohttp", "psutil"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = None
    return {
        "code": code_version(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "mem_gib": round(mem / GiB, 1),
        "kernel": platform.release(),
        "loadavg_at_start": os.getloadavg(),
        "versions": versions,
        "node": _cmd_version(["node", "--version"]),
    }


def print_machine(machine: dict[str, Any]) -> None:
    print(
        f"machine: {machine['cpus']} CPUs ({machine['cpu_model']}), {machine['mem_gib']} GiB, "
        f"load {machine['loadavg_at_start']}",
        flush=True,
    )


def print_checkpoint(info: dict[str, Any]) -> None:
    print(
        f"checkpoint: {info['path']}  {info['tensor_bytes'] / GiB:.2f} GiB in {len(info['spec'])} tensors, "
        f"largest {info['largest_tensor_bytes'] / MiB:.0f} MiB; files {info['file_sizes']}",
        flush=True,
    )


# ============================================================================================ report

TORCH_REF = {"local": "torch-fs", "s3rver": "torch-fsspec"}


def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Add ratio columns (to torch's reader of the same case and to the raw limit of the case group)."""
    by_case: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        by_case[r["case"]].append(r)
    raw_of: dict[str, float] = {}
    for r in rows:
        if r["kind"] == "raw" and r.get("gbps"):
            group = r["case"].split(" ")[0] + " " + r["case"].split(" ")[1]  # "local 1p", "local 2r", "s3rver 1p"
            raw_of[group] = r["gbps"]
    # s3 2-rank shares the server-bound ranged-GET limit of the single-process case.
    if "s3rver 1p" in raw_of:
        raw_of.setdefault("s3rver 2r", raw_of["s3rver 1p"])
    for r in rows:
        if r["kind"] != "load" or not r.get("gbps"):
            continue
        group = " ".join(r["case"].split(" ")[:2])
        if group in raw_of:
            r["vs_raw"] = r["gbps"] / raw_of[group]
            r["raw_gbps"] = raw_of[group]
        ref_name = TORCH_REF[r["case"].split(" ")[0]]
        refs = [x for x in by_case[r["case"]] if x["reader"] == ref_name and x.get("gbps")]
        if refs:
            r["vs_torch"] = r["gbps"] / refs[0]["gbps"]
            r["torch_ref"] = ref_name + (" (" + refs[0]["note"] + ")" if refs[0].get("note") else "")


def _fmt_peak(r: dict[str, Any]) -> str:
    if "peak_extra" not in r:
        return "-"
    text = f"{r['peak_extra'] / MiB:.0f}"
    if r.get("peak_file_extra", 0) > 32 * MiB:  # mmap'd file pages (page cache) are part of it
        text += f" (anon {max(r['peak_anon_extra'], 0) / MiB:.0f})"
    return text


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "case",
        "reader",
        "GB/s",
        "x torch",
        "x raw",
        "peak RSS +MiB/rank",
        "requests",
        "read/needed",
        "others' CPU",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r.get("error") and not r.get("gbps"):
            cells = [r["case"], r["reader"], "ERROR", "", "", "", "", "", "", r["error"]]
        else:
            cells = [
                r["case"],
                r["reader"],
                f"{r['gbps']:.3f}",
                f"{r['vs_torch']:.2f}" if "vs_torch" in r else "-",
                f"{r['vs_raw']:.2f}" if "vs_raw" in r else "-",
                _fmt_peak(r),
                str(r["requests"]) if "requests" in r else "-",
                f"{r['read_ratio']:.3f}" if "read_ratio" in r else "-",
                f"{r['others_cpu_frac']:.0%}" if "others_cpu_frac" in r else "-",
                "; ".join(x for x in (r.get("note") or "", r.get("error") or "") if x),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


# ============================================================================================== main


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
    # Run through the importable module name so worker functions pickle as bench_dcp_read.<fn>.
    sys.path.insert(0, HERE)
    import bench_dcp_read

    sys.exit(bench_dcp_read.main())
