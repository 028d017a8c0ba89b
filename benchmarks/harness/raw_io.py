"""Raw I/O limits to compare against: ``readinto`` of local files, concurrent ranged GETs, the s3rver server."""

from __future__ import annotations

import collections
import contextlib
import http.client
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .measure import CpuWindow, touched
from .report import cmd_version
from .spec import BUCKET, HERE, LOCAL_CHUNK, GiB, MiB


def raw_local_job(rank: int, world: int, files: list[tuple[str, int]], threads: int) -> dict[str, Any]:
    """Raw limit: ``preadv`` of ``files`` into touched buffers from ``threads`` threads (contiguous shares)."""
    keep, views = [], []
    for _, size in files:
        t, mv = touched(size)
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
    with CpuWindow() as cpu:
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
    with CpuWindow(server_pid) as cpu:
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
    _keep, views = zip(*(touched(size) for _, size in objects))
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


def raw_s3_job(
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


@contextlib.contextmanager
def s3rver_holding(info: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
    """s3rver serving the cached checkpoint ``info`` as ``s3://BUCKET/<info["tag"]>``, for every script here.

    Installs s3rver under ``benchmarks/.servers`` if needed, keeps its objects in the checkpoint's cache
    directory (``s3rver-data``), and uploads only files missing there (uploads are slow). Yields the server
    and the set-up figures (install and upload seconds, bytes uploaded).
    """
    from dcp_storage_testing.s3rver import S3RVER_VERSION, S3rverServer, ensure_installed

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
            "server": f"s3rver {S3RVER_VERSION} (npm), node " + cmd_version(["node", "--version"]),
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
