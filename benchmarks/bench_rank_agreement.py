#!/usr/bin/env python
"""What the agreement after ``finish_plan`` costs a 2-rank load (see ``dcp_storage/strategies/rank_agreement.py``).

Usage::

    .venv/bin/python benchmarks/bench_rank_agreement.py [--mib 64] [--repeats 15]

Two gloo ranks load a local DCP checkpoint of replicated plain tensors with ``read_once`` (every item
shared: the exchange runs), alternately with the guard in place and with it switched off in the ranks
(the guard's installer replaced by a no-op), and time a bare one-element ``all_reduce``, which is what the
guard adds when no rank fails. Prints medians (seconds) and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    rows = max(1, mib * (1 << 20) // (4 * 1024 * 8))
    return {f"w{i}": torch.randn(rows, 1024, generator=g) for i in range(8)} | {"norm": torch.randn(64, generator=g)}


def _rank(rank: int, world: int, path: str, repeats: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecReader, ReadStrategies
    from dcp_storage.strategies import read_strategy

    warnings.filterwarnings("ignore")
    meta = FsspecReader(path).read_metadata().state_dict_metadata
    like = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in meta.items()}
    guarded = read_strategy.guard_finish_plan
    out: dict[str, list[float]] = {"guarded": [], "unguarded": [], "all_reduce": []}
    for i in range(2 * repeats + 2):
        read_strategy.guard_finish_plan = guarded if i % 2 == 0 else (lambda *a, **k: False)
        dist.barrier()
        began = time.perf_counter()
        dcp.load(like, storage_reader=FsspecReader(path, read_strategy=ReadStrategies.read_once()))
        took = time.perf_counter() - began
        if i >= 2:  # the first two warm up
            out["guarded" if i % 2 == 0 else "unguarded"].append(took)
    read_strategy.guard_finish_plan = guarded
    flag = torch.zeros(1, dtype=torch.int64)
    for _ in range(200):
        began = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        out["all_reduce"].append(time.perf_counter() - began)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecWriter
    from dcp_storage_testing.distributed import run_ranks

    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(args.mib), storage_writer=FsspecWriter(root), no_dist=True)
        results = run_ranks(_rank, 2, root, args.repeats, timeout=600)
    for name in ("guarded", "unguarded", "all_reduce"):
        worst = [max(r[name][i] for r in results) for i in range(len(results[0][name]))]
        print(f"{name:>10}: median {statistics.median(worst) * 1e3:8.3f} ms over {len(worst)} (max over ranks)")
    g = statistics.median(max(r["guarded"][i] for r in results) for i in range(args.repeats))
    u = statistics.median(max(r["unguarded"][i] for r in results) for i in range(args.repeats))
    print(f"difference: {(g - u) * 1e3:+.2f} ms on a {u * 1e3:.0f} ms load ({args.mib} MiB, 2 gloo ranks, read_once)")


if __name__ == "__main__":
    main()
