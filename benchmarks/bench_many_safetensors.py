#!/usr/bin/env python
"""``describe`` and ``dcp.load`` of one safetensors file whose header lists very many small tensors.

Usage::

    .venv/bin/python benchmarks/bench_many_safetensors.py [--tensors 1050000] [--phases describe,load,load_ours]
        [--json out.json]

The file is written directly (header JSON, then a sparse data section): ``--tensors`` fp32 tensors of 16
elements (64 bytes), 8 per "layer", in header order, with a ``__metadata__`` of ``{"format": "pt"}``. At
1,050,000 tensors the header is just under the 100 MiB header cap. It is cached under
``$TMPDIR/dcp-storage-bench/many-st-<N>.safetensors`` (the content is fixed by ``N``: nothing random).

Phases, each in a fresh interpreter so time and peak memory (``VmHWM`` growth) do not mix:

* ``describe``: :func:`dcp_storage.describe` of the file;
* ``load``: ``dcp.load(sd, storage_reader=SafetensorsReader(path), no_dist=True)`` into a state dict of
  matching empty tensors (built before the clock starts; its memory is not counted) with torch's
  ``DefaultLoadPlanner``;
* ``load_ours``: the same with ``planner=dcp_storage.planners.RemappingLoadPlanner()``;
* ``plan_ours``: planning alone, as ``bench_many_tensors.py``'s phase of that name: ``read_metadata``, then
  ``RemappingLoadPlanner``'s ``set_up_planner``/``create_local_plan``/``create_global_plan``/``finish_plan``
  and the reader's ``set_up_storage_reader``/``prepare_*_plan`` (what ``dcp.load`` runs before
  ``read_data``, without its own two ``Stateful`` checks per key).

Results: a table on stdout and JSON (default ``benchmarks/results/many_safetensors.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PHASES = ("describe", "plan_ours", "load", "load_ours")
PER_TENSOR = 64  # bytes: 16 fp32 elements


NAMES = {  # name of tensor i: HF-like (1,050,000 fill the 100 MiB header cap), or short (1,400,000 do)
    "long": "model.layers.{layer}.block.{slot}.weight",
    "short": "{layer}.{slot}",
}


def _name(i: int, form: str = "long") -> str:
    return NAMES[form].format(layer=i // 8, slot=i % 8)


def build(n: int, form: str = "long") -> str:
    """The cached file of ``n`` tensors named in ``form`` (written on first use)."""
    root = os.path.join(os.environ.get("TMPDIR", tempfile.gettempdir()), "dcp-storage-bench")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"many-st-{n}.safetensors" if form == "long" else f"many-st-{n}-{form}.safetensors")
    if os.path.exists(path):
        return path
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for i in range(n):
        header[_name(i, form)] = {"dtype": "F32", "shape": [16], "data_offsets": [i * PER_TENSOR, (i + 1) * PER_TENSOR]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + n * PER_TENSOR)
    os.replace(tmp, path)
    return path


_CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
import torch.distributed.checkpoint as dcp
import dcp_storage as ds
from dcp_storage.planners import RemappingLoadPlanner
path, phase, n, pattern = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def hwm():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
if phase != "describe":
    sd = {pattern.format(layer=i // 8, slot=i % 8): torch.empty(16) for i in range(n)}
base = hwm()
t, cpu = time.perf_counter(), time.process_time()
if phase == "describe":
    info = ds.describe(path)
    assert len(info.tensors) == n, len(info.tensors)
elif phase == "plan_ours":
    reader, planner = ds.SafetensorsReader(path), RemappingLoadPlanner()
    md = reader.read_metadata()
    planner.set_up_planner(sd, md, True)
    reader.set_up_storage_reader(md, True)
    local = reader.prepare_local_plan(planner.create_local_plan())
    plans = reader.prepare_global_plan(planner.create_global_plan([local]))
    planner.finish_plan(plans[0])
    assert len(plans[0].items) == n, len(plans[0].items)
else:
    planner = RemappingLoadPlanner() if phase == "load_ours" else None
    dcp.load(sd, storage_reader=ds.SafetensorsReader(path), planner=planner, no_dist=True)
seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
print(json.dumps({"phase": phase, "seconds": seconds, "cpu_seconds": cpu, "peak_extra_bytes": hwm() - base}))
"""


def run_phase(path: str, phase: str, n: int, form: str = "long") -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-c", _CHILD, path, phase, str(n), NAMES[form]]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=1_050_000)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--names", choices=sorted(NAMES), default="long", help="tensor names (see NAMES)")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "many_safetensors.json"))
    args = parser.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)} (known: {', '.join(PHASES)})")
    path = build(args.tensors, args.names)
    load = os.getloadavg()[0]
    rows = [run_phase(path, phase, args.tensors, args.names) for phase in phases]
    print(f"{args.tensors} tensors, header {os.path.getsize(path) - args.tensors * PER_TENSOR - 8} bytes")
    print(f"{'phase':<12} {'seconds':>9} {'CPU s':>9} {'peak +MiB':>10}")
    for row in rows:
        print(
            f"{row['phase']:<12} {row['seconds']:>9.2f} {row['cpu_seconds']:>9.2f} "
            f"{row['peak_extra_bytes'] / 2**20:>10.0f}"
        )
    end_load = os.getloadavg()[0]
    result = {
        "tensors": args.tensors,
        "names": args.names,
        "load_average_at_start": load,
        "load_average_at_end": end_load,
        "under_load": max(load, end_load) >= 1,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
