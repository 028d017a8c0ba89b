#!/usr/bin/env python
"""Planning a load, ``describe`` and ``inspect`` of a DCP checkpoint with very many small tensors.

Usage::

    .venv/bin/python benchmarks/bench_many_tensors.py [--tensors 1000000] [--profile PHASE] [--json out.json]

The checkpoint is built directly, as torch's ``FileSystemWriter`` lays it out: a ``.metadata`` (pickled
``Metadata``: one ``TensorStorageMetadata`` and one storage entry per tensor) and ``--files`` ``.distcp``
files whose sizes match the storage map (sparse: their bytes are never read here). It is cached under
``$TMPDIR/dcp-storage-bench/many-<N>-v2`` (``many-<N>-f<F>-v2`` for another number of files).
``--one-file-per-tensor`` writes one data file per tensor (a million files at a million tensors: the
per-file work of the metadata checks, the file table and the readers). Tensors are 16 fp32 elements each (64 bytes), 8 per "layer".

Phases, each in a fresh interpreter so time and peak memory (``VmHWM``) do not mix:

* ``plan``: what ``dcp.load`` does before reading data, on one process: ``FsspecReader.read_metadata``,
  ``set_up_planner``/``create_local_plan``/``create_global_plan``/``finish_plan`` of torch's
  ``DefaultLoadPlanner`` and the reader's ``set_up_storage_reader``/``prepare_*_plan``, into a state dict of
  matching tensors (built before the clock starts; its memory is reported apart);
* ``plan_ours``: the same with this library's drop-in planner (``RemappingLoadPlanner()``, which plans
  with the cyclic collector paused);
* ``plan_torch``: the same with torch's own ``FileSystemReader`` and ``DefaultLoadPlanner`` (no guard on
  the ``.metadata`` pickle: the reference);
* ``plan_read_once``: the read-once strategy's global planning for 4 DDP ranks (4 x N items);
* ``describe``: :func:`dcp_storage.describe`;
* ``inspect``: ``dcp-storage inspect`` (its table printed to /dev/null).

``--given-columns``: the phases start from a lazy ``Metadata`` over the checkpoint's columns
(:func:`~dcp_storage.formats.dcp_native.native.lazy_metadata`), built before the clock starts (from
a cache of the columns beside the checkpoint, ``many-<N>-v2.columns.pkl``): ``read_metadata`` (and
``describe``'s read of ``.metadata``) return it instead of decoding. What the planners and tools cost on
columns alone, whatever the decoder costs.

``--profile PHASE`` prints the top of a cProfile of that phase instead. Results: a table on stdout and
JSON (default ``benchmarks/results/many_tensors.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)

PER_TENSOR = 16  # fp32 elements
PHASES = ("plan", "plan_ours", "plan_torch", "plan_read_once", "describe", "inspect")


def build(n: int, files: int) -> str:
    """The cached checkpoint directory for ``n`` tensors (built on first use)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    tail = "" if files == 8 else f"-f{files}"  # the 8-file layout keeps its cache name
    root = os.path.join(tempfile.gettempdir(), "dcp-storage-bench", f"many-{n}{tail}-v2")
    if os.path.exists(os.path.join(root, ".metadata")):
        return root
    os.makedirs(root, exist_ok=True)
    record = 1024  # bytes per torch.save record of a 64-byte tensor, about what torch writes
    size = torch.Size([PER_TENSOR])
    props = TensorProperties(dtype=torch.float32)
    offset0 = torch.Size([0])
    state, storage = {}, {}
    ends = [0] * files
    for i in range(n):
        fqn = f"layers.{i // 8}.p{i % 8}.weight"
        state[fqn] = TensorStorageMetadata(props, size, [ChunkStorageMetadata(offset0, size)])
        f = i % files
        storage[MetadataIndex(fqn, offset0)] = _StorageInfo(f"__{f}_0.distcp", ends[f], record)
        ends[f] += record
    md = Metadata(state_dict_metadata=state, storage_data=storage)
    for f, end in enumerate(ends):
        with open(os.path.join(root, f"__{f}_0.distcp"), "wb") as fh:
            fh.write(b"PK\x03\x04")  # a zip record's start and a zip end record's, as format detection
            fh.truncate(end - 22)  # looks for (the bytes between are never read here)
            fh.seek(end - 22)
            fh.write(b"PK\x05\x06" + bytes(18))
    with open(os.path.join(root, ".metadata.tmp"), "wb") as fh:
        pickle.dump(md, fh)
    os.replace(os.path.join(root, ".metadata.tmp"), os.path.join(root, ".metadata"))
    return root


def given_columns(root: str) -> object:
    """The checkpoint's ``MetadataColumns``, from a cache beside it (built from the ``.metadata`` once)."""
    import gc

    from dcp_storage.formats.columns import columns_from_metadata

    cache = root + ".columns.pkl"
    if os.path.exists(cache):
        with open(cache, "rb") as fh:
            return pickle.load(fh)
    gc.disable()
    with open(os.path.join(root, ".metadata"), "rb") as fh:
        md = pickle.load(fh)  # our own benchmark file: torch's plain unpickler is fine here
    cols = columns_from_metadata(md)
    del md
    gc.enable()
    with open(cache + ".tmp", "wb") as fh:
        pickle.dump(cols, fh, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(cache + ".tmp", cache)
    return cols


def _give_metadata(md: object) -> None:
    """Make ``FsspecReader.read_metadata`` and ``describe``'s ``.metadata`` read return ``md``."""
    from dcp_storage.formats.dcp_native import reader as fsspec_reader
    from dcp_storage.formats.dcp_native import spec as dcp_describe

    dcp_describe.read_metadata_file = lambda transport, path: md  # type: ignore[assignment]
    fsspec_reader.FsspecReader._read_per_load_files = lambda self: (md, ())  # type: ignore[assignment]


def _peak_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def phase(name: str, root: str, n: int, columns: bool = False) -> dict[str, float]:
    """Run one phase here; returns seconds and MiB (peak beyond what was there before the clock)."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from dcp_storage import FsspecReader, describe

    extra: dict[str, float] = {}
    setup: dict[str, object] = {}
    if columns:
        import gc

        from dcp_storage.formats.dcp_native.native import lazy_metadata

        _give_metadata(lazy_metadata(given_columns(root)))  # type: ignore[arg-type]
        gc.collect()
    if name.startswith("plan"):
        before = _rss_kib()
        block = torch.zeros(n, PER_TENSOR)  # one allocation; the state dict holds views of its rows
        setup["sd"] = {f"layers.{i // 8}.p{i % 8}.weight": block[i] for i in range(n)}
        extra["state_dict_mib"] = (_rss_kib() - before) / 1024
    if name == "plan_read_once":
        reader = FsspecReader(root)
        md = reader.read_metadata()
        planner = DefaultLoadPlanner()
        planner.set_up_planner(setup["sd"], md, True)
        setup["plans"] = [planner.create_local_plan() for _ in range(4)]
        setup["md"] = md
        del planner
    _reset_peak()
    base = _rss_kib()
    start, cpu = time.perf_counter(), time.process_time()
    if name in ("plan", "plan_ours", "plan_torch"):
        if name == "plan_torch":
            from torch.distributed.checkpoint import FileSystemReader

            reader = FileSystemReader(root)
        else:
            reader = FsspecReader(root)
        md = reader.read_metadata()
        if name == "plan_ours":
            from dcp_storage.planners import RemappingLoadPlanner

            planner = RemappingLoadPlanner()
        else:
            planner = DefaultLoadPlanner()
        planner.set_up_planner(setup["sd"], md, True)
        reader.set_up_storage_reader(md, True)
        local = reader.prepare_local_plan(planner.create_local_plan())
        plans = reader.prepare_global_plan(planner.create_global_plan([local]))
        planner.finish_plan(plans[0])
        extra["items"] = len(plans[0].items)
    elif name == "plan_read_once":
        from dcp_storage.strategies.read_once_plan import ReadOnceConfig, plan_read_once
        from dcp_storage.strategies.read_strategy import MetadataItems

        out = plan_read_once(setup["plans"], MetadataItems(setup["md"]), ReadOnceConfig())  # type: ignore[arg-type]
        extra["rounds"] = out[0].storage_data.round_count
    elif name == "describe":
        info = describe(root)
        extra["tensors"] = len(info.tensors)
    elif name == "inspect":
        from dcp_storage.cli import main

        with open(os.devnull, "w") as sink:
            stdout, sys.stdout = sys.stdout, sink
            try:
                main(["inspect", root])
            finally:
                sys.stdout = stdout
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_mib": (_peak_kib() - base) / 1024,
        "rss_before_mib": base / 1024,
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=8, help="data files the tensors are spread over")
    parser.add_argument(
        "--one-file-per-tensor", action="store_true", help="one data file per tensor (--files = --tensors)"
    )
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--profile", choices=PHASES)
    parser.add_argument(
        "--given-columns", action="store_true", help="start from lazy metadata over cached columns (no decode)"
    )
    parser.add_argument("--json", default=os.path.join(HERE, "results", "many_tensors.json"))
    parser.add_argument("--_phase", help=argparse.SUPPRESS)
    parser.add_argument("--_root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._phase:
        print(json.dumps(phase(args._phase, args._root, args.tensors, args.given_columns)))
        return
    if args.one_file_per_tensor:
        args.files = args.tensors
    t0 = time.perf_counter()
    root = build(args.tensors, args.files)
    if args.given_columns:
        given_columns(root)  # cached before the phases (building it takes a while)
    print(f"checkpoint: {root} ({args.tensors} tensors; built or found in {time.perf_counter() - t0:.1f} s)")
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(phase, args.profile, root, args.tensors, args.given_columns)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)
        return
    results = {}
    load_start = os.getloadavg()[0]
    for name in args.phases.split(","):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--tensors",
            str(args.tensors),
            "--_phase",
            name,
            "--_root",
            root,
        ] + (["--given-columns"] if args.given_columns else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-3000:]}")
            continue
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[name]
        print(
            f"{name:>15}: {r['seconds']:7.2f} s ({r['cpu_seconds']:.2f} s CPU), peak +{r['peak_mib']:7.1f} MiB (process before: {r['rss_before_mib']:.0f} MiB)"
            + "".join(
                f", {k}={v:.0f}"
                for k, v in r.items()
                if k not in ("seconds", "cpu_seconds", "peak_mib", "rss_before_mib")
            )
        )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(
            {
                "tensors": args.tensors,
                "files": args.files,
                "given_columns": args.given_columns,
                "load_average": [load_start, os.getloadavg()[0]],
                "phases": results,
            },
            fh,
            indent=1,
        )


if __name__ == "__main__":
    main()
