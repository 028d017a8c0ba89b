#!/usr/bin/env python
"""Benchmark: loading one ``torch.save`` file on N ranks, read by a coordinator and sent to the others.

Usage::

    .venv/bin/python benchmarks/bench_broadcast_torch_save.py [--size-gib 2] [--world 2] [--quick]
        [--repeats 1] [--no-verify] [--torch-dtensor-timeout 60] [--json out.json]

What it does:

* Builds (once, cached under ``$TMPDIR/dcp-storage-bench/`` keyed by size, seed and layout version) a seeded
  ``torch.save`` file of about ``--size-gib`` GiB shaped like a transformer: fp32 embedding, head and norms,
  bf16 attention and MLP matrices. ``--quick`` uses 0.25 GiB.
* Each case runs in fresh rank processes (forks of :func:`dcp_storage_testing.distributed.run_ranks`'s
  forkserver), so peak-RSS numbers do not mix. Destinations are allocated and touched before the clock
  starts; the page cache is warmed by an untimed read of the file before each case.
* Cases (``--world`` ranks, gloo on CPU, local file):

  - ``ours Shard(0)``: :class:`dcp_storage.BroadcastingTorchSaveReader` + torch's ``DynamicMetaLoadPlanner``
    into ``Shard(0)`` DTensors - the case this reader is for;
  - ``torch Shard(0)``: torch's ``BroadcastingTorchSaveReader`` + ``DynamicMetaLoadPlanner`` into the same
    DTensors. In torch 2.13 it does not complete (non-coordinators ``empty_like`` the DTensor and
    broadcast into it); it runs under ``--torch-dtensor-timeout`` and is reported as such;
  - ``torch full`` / ``ours full``: both readers into plain full tensors on every rank (the only mode
    torch's reader completes), for a like-for-like time and memory comparison;
  - ``gloo Shard(0)`` / ``gloo full``: gloo's own limit, the same run: the coordinator broadcasts the bytes
    one other rank receives in that case (its shard; every tensor) from a ready 64 MiB buffer, no file.
    The summary line gives ours as a fraction of it (gloo's seconds over ours).

* Reported per case: load seconds (slowest rank, from a barrier to ``dcp.load`` returning), coordinator
  peak RSS minus its baseline (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` in the rank process; the
  baseline is taken after the destinations are allocated and touched), the same for the other ranks (max),
  the largest tensor's bytes, and per rank bytes received / bytes of its own shards. Our reader counts
  received bytes in its delivery statistics; torch's reader broadcasts every full tensor, so a
  non-coordinator receives the sum of the full tensors of its plan (computed). Every completed load is
  checked bit for bit against the seeded generator (``--no-verify`` skips that).

Results: a table on stdout and JSON (default ``benchmarks/results/broadcast_torch_save[_quick].json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
SEED = 20240611
SPEC_VERSION = 1  # bump when the layout or generation changes (invalidates the cache)

Spec = list[tuple[str, tuple[int, ...], str]]


# ============================================================================================ spec
def model_spec(size_bytes: int) -> Spec:
    """(name, shape, dtype) of a transformer of about ``size_bytes``: fp32 embed/head/norms, bf16 matrices."""
    dim = 2048 if size_bytes >= 1 * GiB else 1024
    vocab = 16 * dim
    hidden = (int(2.75 * dim) + 255) // 256 * 256
    out: Spec = [("embed.weight", (vocab, dim), "float32")]

    def layer(i: int) -> Spec:
        p = f"layers.{i}."
        return [
            (p + "attn_norm.weight", (dim,), "float32"),
            (p + "attn.qkv.weight", (3 * dim, dim), "bfloat16"),
            (p + "attn.out.weight", (dim, dim), "bfloat16"),
            (p + "mlp_norm.weight", (dim,), "float32"),
            (p + "mlp.up.weight", (hidden, dim), "bfloat16"),
            (p + "mlp.down.weight", (dim, hidden), "bfloat16"),
        ]

    tail: Spec = [("norm_f.weight", (dim,), "float32"), ("head.weight", (vocab, dim), "float32")]
    fixed = spec_bytes(out + tail)
    per_layer = spec_bytes(layer(0))
    layers = max(1, round((size_bytes - fixed) / per_layer))
    for i in range(layers):
        out += layer(i)
    return out + tail


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def spec_bytes(spec: Spec) -> int:
    total = 0
    for _name, shape, dtype in spec:
        n = 1
        for s in shape:
            n *= s
        total += n * _itemsize(dtype)
    return total


def make_tensor(index: int, shape: tuple[int, ...], dtype: str) -> Any:
    """Tensor ``index`` of the spec, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(SEED * 1000 + index)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def ensure_file(size_bytes: int) -> tuple[str, Spec]:
    spec = model_spec(size_bytes)
    root = os.path.join(tempfile.gettempdir(), "dcp-storage-bench")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"torch_save_{spec_bytes(spec) // MiB}MiB_s{SEED}_v{SPEC_VERSION}.pt")
    if not os.path.exists(path):
        import torch

        print(f"generating {path} ({spec_bytes(spec) / GiB:.2f} GiB of tensors) ...", flush=True)
        state = {name: make_tensor(i, shape, dtype) for i, (name, shape, dtype) in enumerate(spec)}
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
        del state
    return path, spec


def warm_page_cache(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass


# ============================================================================================ rank body
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB  # Linux: KiB


def bench_rank(rank: int, world: int, impl: str, target: str, path: str, spec: Spec, verify: bool) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import BroadcastingTorchSaveReader as TorchReader
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from dcp_storage import BroadcastingTorchSaveReader

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {}
    for name, shape, dtype in spec:
        if target == "Shard(0)":
            empty = torch.empty(shape, dtype=getattr(torch, dtype))  # never touched: no resident pages
            state[name] = distribute_tensor(empty, mesh, [Shard(0)], src_data_rank=None)
            state[name].to_local().zero_()
        else:
            state[name] = torch.zeros(shape, dtype=getattr(torch, dtype))
    local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()}
    shard_bytes = sum(t.numel() * t.element_size() for t in local.values())
    full_bytes = spec_bytes(spec)
    reader = BroadcastingTorchSaveReader() if impl == "ours" else TorchReader()
    gc.collect()
    dist.barrier()
    base_max, base_rss = _maxrss_bytes(), _rss_bytes()
    start = time.perf_counter()
    dcp.load(state, storage_reader=reader, planner=DynamicMetaLoadPlanner(), checkpoint_id=path)
    seconds = time.perf_counter() - start
    peak = _maxrss_bytes()
    if impl == "ours":
        received = reader.stats["bytes_received"]
        bytes_read = reader.stats["storage"]["bytes_read"]
    else:
        received = 0 if rank == 0 else full_bytes  # one broadcast of every full tensor
        bytes_read = os.path.getsize(path) if rank == 0 else 0
    mismatched: list[str] = []
    if verify:
        for i, (name, shape, dtype) in enumerate(spec):
            full = make_tensor(i, shape, dtype)
            got = state[name]
            if isinstance(got, DTensor):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                lshape, offset = compute_local_shape_and_global_offset(full.shape, got.device_mesh, got.placements)
                expected = full.narrow(0, offset[0], lshape[0])
                got = got.to_local()
            else:
                expected = full
            # Compare bits, not values (NaN != NaN): both sides as raw bytes of a contiguous copy.
            if not torch.equal(got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)):
                mismatched.append(name)
    return {
        "rank": rank,
        "seconds": seconds,
        "baseline_maxrss": base_max,
        "baseline_rss": base_rss,
        "peak_maxrss": peak,
        "peak_minus_baseline": max(0, peak - base_max),
        "received": received,
        "shard_bytes": shard_bytes,
        "bytes_read": bytes_read,
        "mismatched": mismatched if verify else None,
    }


def gloo_rank(rank: int, world: int, target: str, spec: Spec) -> dict[str, Any]:
    """gloo's own limit for the bytes a non-coordinator of the load receives: the coordinator broadcasts that
    many bytes (its shard for ``Shard(0)``, every tensor for ``full``) from a ready buffer, 64 MiB at a time."""
    import torch
    import torch.distributed as dist

    full = spec_bytes(spec)
    nbytes = full if target == "full" else full // world
    buf = torch.empty(64 * MiB, dtype=torch.uint8)
    if rank == 0:
        buf.random_(0, 256, generator=torch.Generator().manual_seed(SEED))
    dist.barrier()
    start = time.perf_counter()
    for at in range(0, nbytes, buf.numel()):
        dist.broadcast(buf[: min(buf.numel(), nbytes - at)], src=0)
    seconds = time.perf_counter() - start
    return {"rank": rank, "seconds": seconds, "received": 0 if rank == 0 else nbytes, "shard_bytes": nbytes}


# ============================================================================================ driver
def run_gloo(target: str, spec: Spec, world: int, timeout: float) -> dict[str, Any]:
    from dcp_storage_testing.distributed import run_ranks

    start = time.monotonic()
    ranks = run_ranks(gloo_rank, world, target, spec, timeout=timeout)
    return {
        "case": f"gloo {target}",
        "status": "ok (broadcast of the bytes a rank receives, no file)",
        "seconds": max(r["seconds"] for r in ranks),
        "coordinator_peak_minus_baseline": 0,
        "others_peak_minus_baseline": 0,
        "received_over_shard": [r["received"] / r["shard_bytes"] for r in ranks],
        "coordinator_bytes_read": 0,
        "ranks": ranks,
        "wall": time.monotonic() - start,
    }


def run_case(impl: str, target: str, path: str, spec: Spec, world: int, verify: bool, timeout: float) -> dict[str, Any]:
    from dcp_storage_testing.distributed import RankFailedError, RankTimeoutError, run_ranks

    warm_page_cache(path)
    label = f"{impl} {target}"
    start = time.monotonic()
    try:
        ranks = run_ranks(bench_rank, world, impl, target, path, spec, verify, timeout=timeout)
    except RankTimeoutError as exc:
        return {
            "case": label,
            "status": f"did not finish within {timeout:.0f}s (ranks {exc.unfinished})",
            "wall": time.monotonic() - start,
        }
    except RankFailedError as exc:
        first = exc.failures[exc.rank].strip().splitlines()[-1]
        return {"case": label, "status": f"failed on rank {exc.rank}: {first}", "wall": time.monotonic() - start}
    ok = all(not r["mismatched"] for r in ranks) if verify else None
    return {
        "case": label,
        "status": "ok" if ok or ok is None else "WRONG DATA",
        "verified": ok,
        "seconds": max(r["seconds"] for r in ranks),
        "coordinator_peak_minus_baseline": ranks[0]["peak_minus_baseline"],
        "others_peak_minus_baseline": max((r["peak_minus_baseline"] for r in ranks[1:]), default=0),
        "received_over_shard": [r["received"] / r["shard_bytes"] for r in ranks],
        "coordinator_bytes_read": ranks[0]["bytes_read"],
        "ranks": ranks,
        "wall": time.monotonic() - start,
    }


def print_table(results: list[dict[str, Any]], ckpt_bytes: int, largest: int) -> None:
    print(f"\ncheckpoint: {ckpt_bytes / GiB:.2f} GiB of tensors, largest tensor {largest / MiB:.0f} MiB")
    head = f"{'case':<18} {'seconds':>8} {'GB/s':>6} {'coord RSS+':>11} {'others RSS+':>12} {'recv/shard, ranks 1..':>22}  status"
    print(head)
    print("-" * len(head))
    for r in results:
        if "seconds" not in r:
            print(f"{r['case']:<18} {'-':>8} {'-':>6} {'-':>11} {'-':>12} {'-':>22}  {r['status']}")
            continue
        ratios = " ".join(f"{x:.2f}" for x in r["received_over_shard"][1:])  # the coordinator receives nothing
        print(
            f"{r['case']:<18} {r['seconds']:8.2f} {ckpt_bytes / r['seconds'] / 1e9:6.2f} "
            f"{r['coordinator_peak_minus_baseline'] / MiB:9.0f}Mi {r['others_peak_minus_baseline'] / MiB:10.0f}Mi "
            f"{ratios:>22}  {r['status']}"
        )
    print("RSS+: peak RSS (ru_maxrss) minus the baseline taken after allocating destinations.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="0.25 GiB; torch's DTensor case times out after 20 s")
    parser.add_argument("--repeats", type=int, default=None, help="best of N (fresh processes each); default 1")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--torch-dtensor-timeout", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per case")
    parser.add_argument(
        "--cases",
        default="ours:Shard(0),gloo:Shard(0),torch:Shard(0),torch:full,ours:full,gloo:full",
        help="comma-separated impl:target pairs to run (impl: ours, torch, or gloo: its broadcast limit)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    size = int((0.25 if args.quick else args.size_gib) * GiB)
    repeats = max(1, args.repeats or 1)
    hang_timeout = min(args.torch_dtensor_timeout, 20.0) if args.quick else args.torch_dtensor_timeout
    path, spec = ensure_file(size)
    ckpt_bytes = spec_bytes(spec)
    largest = max(spec_bytes([s]) for s in spec)
    cases = []
    for pair in args.cases.split(","):
        impl, target = pair.strip().split(":")
        hangs = impl == "torch" and target != "full"
        cases.append((impl, target, hang_timeout if hangs else args.timeout))
    results = []
    for impl, target, timeout in cases:
        best: dict[str, Any] | None = None
        for _ in range(repeats if timeout == args.timeout else 1):
            try:
                if impl == "gloo":
                    res = run_gloo(target, spec, args.world, timeout)
                else:
                    res = run_case(impl, target, path, spec, args.world, not args.no_verify, timeout)
            except Exception:  # noqa: BLE001 - report and go on with the other cases
                res = {"case": f"{impl} {target}", "status": "error: " + traceback.format_exc().splitlines()[-1]}
            if best is None or ("seconds" in res and res["seconds"] < best.get("seconds", float("inf"))):
                best = res
        assert best is not None
        print(
            f"  {best['case']}: {best['status']}" + (f", {best['seconds']:.2f}s" if "seconds" in best else ""),
            flush=True,
        )
        results.append(best)
    print_table(results, ckpt_bytes, largest)
    by_case = {r["case"]: r for r in results if "seconds" in r}
    for target in ("Shard(0)", "full"):
        ours, limit = by_case.get(f"ours {target}"), by_case.get(f"gloo {target}")
        if ours and limit:
            print(f"ours {target}: {limit['seconds'] / ours['seconds']:.2f}x gloo's broadcast of the same bytes")
    out = args.json or os.path.join(HERE, "results", f"broadcast_torch_save{'_quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    import torch

    with open(out, "w") as f:
        json.dump(
            {
                "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "host": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                },
                "file": path,
                "file_bytes": os.path.getsize(path),
                "tensor_bytes": ckpt_bytes,
                "largest_tensor_bytes": largest,
                "world": args.world,
                "repeats": repeats,
                "results": results,
            },
            f,
            indent=2,
        )
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
