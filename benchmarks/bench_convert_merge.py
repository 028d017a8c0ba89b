#!/usr/bin/env python
"""Memory benchmark of ``convert`` and ``merge`` against torch's and accelerate's tools on the same input.

Usage::

    .venv/bin/python benchmarks/bench_convert_merge.py [--size-gib 2] [--quick] [--json out.json]

Input: the seeded transformer-shaped DCP checkpoint of ``bench_dcp_read.py`` (2 gloo ranks, torch's
``FileSystemWriter``, cached under ``$TMPDIR/dcp-storage-bench/``), locally and uploaded to s3rver (npm,
under ``benchmarks/.servers``). Every case runs in a fresh process; after its imports the process records
``VmRSS`` and resets the high-water mark (``/proc/self/clear_refs`` ``5``), runs the job, and reports
``VmHWM - VmRSS(before)``: the peak memory the job itself added. Cases:

* ``convert s3 dcp->safetensors``: ``dcp_storage.convert`` from ``s3://`` to HF safetensors on ``s3://``;
* ``convert local dcp->safetensors``: the same, local to local;
* ``dcp_to_torch_save``: torch's ``format_utils.dcp_to_torch_save`` and ours, local to local;
* ``merge``: ``accelerate.utils.merge_fsdp_weights`` and ``dcp_storage.merge_fsdp_weights`` (safetensors),
  local to local (accelerate reads local directories only).

The bar (issue 4): peak RSS of ``convert`` and ``merge`` at most 3x the largest tensor plus baseline.
Outputs are checked: every output tensor's checksum equals the source's. Results: a table and JSON
(default ``benchmarks/results/convert_merge.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (REPO, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import harness as base
from harness import MiB

# ============================================================================================ child


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _run_child(case: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run one case in this (fresh) process; return its figures."""
    import torch

    torch.set_num_threads(1)
    import dcp_storage

    if case.startswith("accelerate"):
        import accelerate.utils  # noqa: F401
    if case.startswith("torch"):
        import torch.distributed.checkpoint.format_utils
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    if case == "ours convert":
        result = dcp_storage.convert(
            args["src"], args["dst"], to="safetensors", storage_options=args.get("storage_options"), overwrite=True
        )
        output = result.output
    elif case == "ours dcp_to_torch_save":
        output = dcp_storage.conversion.dcp_to_torch_save(args["src"], args["dst"]).output
    elif case == "torch dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(args["src"], args["dst"])
        output = args["dst"]
    elif case == "ours merge":
        output = dcp_storage.merge_fsdp_weights(args["src"], args["dst"], safe_serialization=True).output
    elif case == "accelerate merge":
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(args["src"], args["dst"], safe_serialization=True)
        output = os.path.join(args["dst"], "model.safetensors")
    else:
        raise SystemExit(f"unknown case {case!r}")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_bytes": _status("VmHWM") - before, "baseline_rss": before, "output": output}


# ======================================================================================= checking


def _check(output: str, storage_options: dict[str, Any] | None, info: dict[str, Any]) -> int:
    """Every output tensor equals its source tensor: compare checksums with the generator's (one at a time)."""
    from dcp_storage.conversion.source import TensorSource

    expected = {name: sum(entry["all"] for entry in per_rank) for name, per_rank in info["sums"].items()}
    seen = 0
    with TensorSource.open(output, storage_options=storage_options) as source:
        for fqn in source.tensors:
            name = fqn.removeprefix("model.")
            if base.checksum(source.read_tensor(fqn)) != expected.get(name):
                raise SystemExit(f"{output}: tensor {fqn} differs from the source")
            seen += 1
    if seen != len(expected):
        raise SystemExit(f"{output}: {seen} tensors, expected {len(expected)}")
    return seen


# ======================================================================================= orchestration


def run_case(case: str, args: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", case, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        return {"case": case, "error": (proc.stderr or proc.stdout)[-2000:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"case": case, **out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="0.25 GiB input")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-s3", action="store_true", help="skip the s3rver case")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "convert_merge.json"))
    parser.add_argument("--child", nargs=2, metavar=("CASE", "ARGS"), help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        print(json.dumps(_run_child(opts.child[0], json.loads(opts.child[1]))))
        return 0
    size = 0.25 if opts.quick else opts.size_gib
    cache = os.path.join(tempfile.gettempdir(), "dcp-storage-bench")
    info = base.ensure_checkpoint(cache, size, opts.seed)
    largest = info["largest_tensor_bytes"]
    src = info["path"]
    work = tempfile.mkdtemp(prefix="bench-convert-", dir=cache)
    rows: list[dict[str, Any]] = []
    try:
        for case, dst in [
            ("ours convert", os.path.join(work, "ours_st")),
            ("torch dcp_to_torch_save", os.path.join(work, "torch.pt")),
            ("ours dcp_to_torch_save", os.path.join(work, "ours.pt")),
            ("accelerate merge", os.path.join(work, "acc_merged")),
            ("ours merge", os.path.join(work, "ours_merged")),
        ]:
            print(f"[{case}] local ...", flush=True)
            row = run_case(case, {"src": src, "dst": dst})
            row["store"] = "local"
            rows.append(row)
            if "output" in row:
                row["tensors_checked"] = _check(row["output"], None, info)
            if os.path.isdir(dst):
                shutil.rmtree(dst)
            elif os.path.exists(dst):
                os.remove(dst)
        if not opts.no_s3:
            rows.append(_s3_case(info))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    limit = 3 * largest
    for r in rows:
        if "peak_bytes" in r:
            r["peak_vs_largest"] = r["peak_bytes"] / largest
            r["within_bar"] = r["peak_bytes"] <= limit
    ratios = _ratios(rows)
    table = format_table(rows, largest, ratios)
    print(table)
    payload = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "input": {"tag": info["tag"], "tensor_bytes": info["tensor_bytes"], "largest_tensor_bytes": largest},
        "rows": rows,
        "ratios": ratios,
        "bar": "peak RSS <= 3x largest tensor (beyond baseline)",
    }
    os.makedirs(os.path.dirname(opts.json), exist_ok=True)
    with open(opts.json, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {opts.json}")
    return 0 if all(r.get("within_bar", True) or not r["case"].startswith("ours") for r in rows) else 1


def _s3_case(info: dict[str, Any]) -> dict[str, Any]:
    with base.s3rver_holding(info) as (server, _setup):
        key_prefix = info["tag"]
        so = server.storage_options()
        src = f"s3://{base.BUCKET}/{key_prefix}"
        dst = f"s3://{base.BUCKET}/convert-out-{os.getpid()}"
        print("[ours convert] s3 -> s3 ...", flush=True)
        row = run_case("ours convert", {"src": src, "dst": dst, "storage_options": so})
        row["store"] = "s3rver"
        if "output" in row:
            row["tensors_checked"] = _check(row["output"], so, info)
        import fsspec

        fsspec.filesystem("s3", **so).rm(dst, recursive=True)
    return row


def _ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    def peak(case: str, store: str = "local") -> float | None:
        r = next((r for r in rows if r["case"] == case and r.get("store") == store and "peak_bytes" in r), None)
        return r["peak_bytes"] if r else None

    out: dict[str, float] = {}
    for ours, theirs, name in [
        ("ours dcp_to_torch_save", "torch dcp_to_torch_save", "dcp_to_torch_save peak: torch / ours"),
        ("ours merge", "accelerate merge", "merge peak: accelerate / ours"),
        (
            "ours convert",
            "torch dcp_to_torch_save",
            "convert->safetensors peak vs torch dcp_to_torch_save: torch / ours",
        ),
    ]:
        a, b = peak(ours), peak(theirs)
        if a and b:
            out[name] = b / a
    return out


def format_table(rows: list[dict[str, Any]], largest: int, ratios: dict[str, float]) -> str:
    lines = [f"largest tensor {largest / MiB:.0f} MiB; bar: peak <= 3x = {3 * largest / MiB:.0f} MiB", ""]
    lines.append(f"{'case':<26} {'store':<8} {'seconds':>8} {'peak MiB':>9} {'x largest':>9} {'bar':>4}")
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<26} {r.get('store', ''):<8} ERROR {r['error'].splitlines()[-1][:80]}")
            continue
        lines.append(
            f"{r['case']:<26} {r['store']:<8} {r['seconds']:>8.1f} {r['peak_bytes'] / MiB:>9.0f} "
            f"{r['peak_vs_largest']:>9.2f} {'ok' if r['within_bar'] else 'MISS':>4}"
        )
    lines.append("")
    lines += [f"{k}: {v:.2f}x" for k, v in ratios.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
