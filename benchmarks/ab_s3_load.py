#!/usr/bin/env python
"""A/B of ``FsspecReader`` loads from s3rver between source trees (commits), on one server and one checkpoint.

Usage::

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/ab_s3_load.py --trees /tmp/before,. [--rounds 4] [--loads 3] [--json out.json]

Why a separate script: ``bench_dcp_read.py`` run once per tree also compares each tree's own harness, a
fresh s3rver and a fresh page cache per run, and its best-of-N figures moved by 20-40% between runs of the
same tree on this 2-core machine. Here every tree loads the same objects from the same server, in
alternating rounds, each round a fresh interpreter (``PYTHONPATH`` = the tree) doing ``--loads`` loads of
the benchmark checkpoint (``bench_dcp_read.py``'s cached one, full tensors, one process): the first load
is cold (client set-up included, as in the read benchmark), the others warm. Only the reader's code differs.
Prints cold and warm best and median per tree, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness.checkpoint import ensure_checkpoint  # noqa: E402 - benchmarks/ is not a package
from harness.raw_io import s3rver_holding  # noqa: E402

_CHILD = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(os.cpu_count() or 1)
import torch.distributed.checkpoint as dcp
from dcp_storage import FsspecReader
options, spec, loads, url = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
dest = {name: torch.empty(tuple(shape), dtype=dtypes[d]).zero_() for name, shape, d in spec}
times = []
for _ in range(loads):
    reader = FsspecReader(url, options)
    start = time.perf_counter()
    dcp.load(dest, storage_reader=reader, no_dist=True)
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="comma list of source trees (each holds dcp_storage/)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--loads", type=int, default=3, help="loads per interpreter (the first is cold)")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "dcp-storage-bench"))
    p.add_argument("--json")
    args = p.parse_args(argv)
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    info = ensure_checkpoint(args.cache_dir, args.size_gib, args.seed)
    runs: dict[str, dict[str, list[float]]] = {t: {"cold": [], "warm": []} for t in trees}
    with s3rver_holding(info) as (server, _):
        options = server.storage_options()
        url = f"s3://bench/{info['tag']}"
        for r in range(args.rounds):
            for tree in trees:
                cmd = [
                    sys.executable,
                    "-c",
                    _CHILD,
                    json.dumps(options),
                    json.dumps(info["spec"]),
                    str(args.loads),
                    url,
                ]
                out = subprocess.run(
                    cmd, env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True, cwd=tree, check=False
                )
                if out.returncode:
                    print(out.stderr[-3000:], file=sys.stderr)
                    return 1
                times = json.loads(out.stdout.strip().splitlines()[-1])
                runs[tree]["cold"].append(times[0])
                runs[tree]["warm"].extend(times[1:])
                print(f"round {r} {tree}: " + " ".join(f"{x:.3f}" for x in times), flush=True)
    summary = {}
    print("\n| tree | cold best s | cold median s | warm best s | warm median s | n |\n|---|---|---|---|---|---|")
    for tree, got in runs.items():
        row = {k: (min(v), statistics.median(v)) for k, v in got.items() if v}
        summary[tree] = {"runs": got, **{f"{k}_best": b for k, (b, _) in row.items()}}
        cells = " | ".join(f"{row[k][0]:.3f} | {row[k][1]:.3f}" if k in row else "- | -" for k in ("cold", "warm"))
        print(f"| {tree} | {cells} | {len(got['cold'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint": info["tag"], "trees": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
