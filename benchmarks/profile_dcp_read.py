#!/usr/bin/env python
"""Profile one ``dcp.load`` of the read benchmark's checkpoint: where does the time go?

Usage::

    .venv/bin/python benchmarks/profile_dcp_read.py --case local-reshard [--reader ours] [--size-gib 2]
        [--py-spy PATH/TO/py-spy] [--top 25]

Cases: ``local-full`` (1 process, full tensors), ``local-reshard`` (2 ranks, saved Shard(0) -> Shard(1)),
``s3-full`` and ``s3-reshard`` (same against s3rver; the benchmark must have uploaded the checkpoint once,
see ``bench_dcp_read.py``). Uses the cached checkpoint of ``bench_dcp_read.py`` (generated if missing).

Rank 0 is profiled with cProfile (its calling thread only) and, when ``--py-spy`` points at a py-spy
binary (``pip install --target /tmp/pyspy py-spy``), also sampled by py-spy across *all* its threads
(I/O worker threads, the fsspec event loop); the py-spy summary lists the top frames by self and by
inclusive samples.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CASES = {
    "local-full": ("full", 1, False),
    "local-reshard": ("shard1", 2, False),
    "s3-full": ("full", 1, True),
    "s3-reshard": ("shard1", 2, True),
}


def _job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import harness as b
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore")
    if world == 1:
        torch.set_num_threads(os.cpu_count() or 1)
    spec = [(n, tuple(s), d) for n, s, d in job["spec"]]
    sd = b.destinations(spec, job["layout"], rank, world)
    reader = b.make_reader(job["reader"], job["url"], job["storage_options"])
    spy = None
    if rank == 0 and job.get("py_spy"):
        spy = subprocess.Popen(
            [
                job["py_spy"],
                "record",
                "--pid",
                str(os.getpid()),
                "--format",
                "raw",
                "--rate",
                "250",
                "--nonblocking",
                "--threads",
                "-o",
                job["spy_out"],
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # let it attach
    if world > 1:
        dist.barrier()
    prof = cProfile.Profile() if rank == 0 else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    dcp.load(sd, storage_reader=reader, no_dist=(world == 1))
    if prof:
        prof.disable()
    elapsed = time.perf_counter() - t0
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
    out: dict[str, Any] = {"seconds": elapsed, "counters": getattr(reader, "counters", None)}
    if prof:
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(job["top"])
            out[key] = s.getvalue()
    return out


def summarize_spy(path: str, top: int) -> str:
    """Top frames of a py-spy raw (collapsed) profile, by self and by inclusive samples (all threads)."""
    self_c: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            threads[frames[0]] += n
            self_c[frames[-1]] += n
            for fr in set(frames[1:]):
                incl[fr] += n
    lines = [f"py-spy: {total} samples (all threads, idle excluded)", "", "by thread:"]
    lines += [f"  {n / total:6.1%}  {t}" for t, n in threads.most_common(10)]
    lines += ["", "self (leaf) frames:"]
    lines += [f"  {n / total:6.1%}  {fr}" for fr, n in self_c.most_common(top)]
    lines += ["", "inclusive frames:"]
    lines += [f"  {n / total:6.1%}  {fr}" for fr, n in incl.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=sorted(CASES), required=True)
    p.add_argument("--reader", default="ours", choices=["ours", "ours-gap0", "torch-fs", "torch-fsspec"])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "dcp-storage-bench"))
    p.add_argument("--py-spy", default=None, help="path to a py-spy binary (samples all threads of rank 0)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (HERE, REPO, os.environ.get("PYTHONPATH")) if x)
    import harness as b

    from dcp_storage_testing.distributed import run_ranks

    info = b.ensure_checkpoint(args.cache_dir, args.size_gib, args.seed)
    layout, world, s3 = CASES[args.case]
    url, so = info["path"], {}
    spy_out = os.path.join(tempfile.gettempdir(), f"dcp-read-profile-{os.getpid()}.txt")
    with contextlib.ExitStack() as stack:
        if s3:
            server, _setup = stack.enter_context(b.s3rver_holding(info))
            url, so = f"s3://{b.BUCKET}/{info['tag']}", server.storage_options()
            b.warm_files([server.object_path(b.BUCKET, f"{info['tag']}/{n}") for n, _ in b.data_files(info)])
        else:
            b.warm_files([os.path.join(info["path"], n) for n, _ in b.data_files(info)])
        job = {
            "reader": args.reader,
            "url": url,
            "storage_options": so,
            "layout": layout,
            "spec": info["spec"],
            "top": args.top,
            "py_spy": args.py_spy,
            "spy_out": spy_out,
        }
        res = run_ranks(_job, world, job, timeout=1200)
    needed = info["tensor_bytes"]
    t = max(r["seconds"] for r in res)
    print(f"{args.case} {args.reader}: {t:.2f}s  ({needed / t / 1e9:.3f} GB/s needed-bytes aggregate)")
    print("counters:", [r["counters"] for r in res])
    print("\n=== cProfile, rank 0 calling thread, by tottime ===\n" + res[0]["tottime"])
    print("\n=== cProfile, rank 0 calling thread, by cumulative ===\n" + res[0]["cumulative"])
    if args.py_spy and os.path.exists(spy_out):
        print("\n=== " + summarize_spy(spy_out, args.top))
        os.remove(spy_out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    import profile_dcp_read  # workers must pickle as profile_dcp_read._job, not __main__._job

    sys.exit(profile_dcp_read.main())
