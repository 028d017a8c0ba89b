#!/usr/bin/env python
"""``CheckpointManager``: how long an async save blocks the training loop, and what ``latest_step()`` and
``restore()`` cost with 1,000 stored steps on a local S3 server (moto).

Usage::

    .venv/bin/python benchmarks/bench_manager.py [--mib 256] [--repeats 5] [--steps 1000] [--json out.json]

Blocked time (one process, local disk, the same run, interleaved so that load hits every row alike):

* ``torch async_save``: ``dcp.async_save(state, storage_writer=FsspecWriter(...))`` with its default stager
  (THREAD mode), the seconds until it returns;
* ``manager save``: ``CheckpointManager(async_mode="thread").save(step, state)``, the seconds until it
  returns (the previous save waited for beforehand, as a training loop's next save would);
* ``memcpy``: ``copy_`` of every tensor of the state into preallocated buffers: the staging limit.

The first save of each kind allocates its buffers; the table shows the first and the median of the rest.

Requests (moto through a counting proxy: every HTTP request the client sends): ``--steps`` bare step
folders (a ``.metadata`` object each, which is all the manager looks at) plus two real saves; a fresh
manager's ``latest_step()``, ``all_steps()``, ``restore()``, and ``latest_step()`` without the index (the
listing fallback). JSON goes to ``benchmarks/results/manager.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import dcp_storage as ds  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1024 * 1024


def make_state(mib: int) -> dict[str, torch.Tensor]:
    """A transformer-shaped state of about ``mib`` MiB (fp32 matrices of 4 MiB, a few vectors)."""
    gen = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(1024, 1024, generator=gen) for i in range(max(1, mib // 4))}
    state["norm"] = torch.randn(1024, generator=gen)
    return state


def blocked_times(mib: int, repeats: int, tmp: str) -> dict[str, Any]:
    state = make_state(mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows: dict[str, list[float]] = {"torch async_save": [], "manager save": [], "memcpy": []}
    mgr = ds.CheckpointManager(os.path.join(tmp, "managed"), keep=ds.KeepPolicy(last=2), async_mode="thread")
    dst = None
    for i in range(repeats):
        t0 = time.perf_counter()
        future = dcp.async_save(state, storage_writer=ds.FsspecWriter(os.path.join(tmp, f"torch-{i}")))
        rows["torch async_save"].append(time.perf_counter() - t0)
        future.result()
        mgr.wait()  # the previous managed save: not part of the blocked time
        t0 = time.perf_counter()
        mgr.save(i + 1, state)
        rows["manager save"].append(time.perf_counter() - t0)
        mgr.wait()
        if dst is None:
            dst = {k: torch.empty_like(v) for k, v in state.items()}
            for t in dst.values():
                t.zero_()  # faulted in: the copy alone is timed
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        rows["memcpy"].append(time.perf_counter() - t0)
        for t in state.values():  # the training step
            t.mul_(0.999)
    mgr.close()
    out: dict[str, Any] = {"state_bytes": nbytes, "repeats": repeats, "rows": {}}
    for name, times in rows.items():
        later = times[1:] or times
        out["rows"][name] = {"first_s": times[0], "median_s": statistics.median(later), "all_s": times}
    torch_s = out["rows"]["torch async_save"]["median_s"]
    memcpy_s = out["rows"]["memcpy"]["median_s"]
    ours = out["rows"]["manager save"]
    out["ratio_to_torch"] = ours["median_s"] / torch_s
    out["ratio_to_torch_first"] = ours["first_s"] / out["rows"]["torch async_save"]["first_s"]
    out["ratio_to_memcpy"] = ours["median_s"] / memcpy_s
    return out


def request_counts(steps: int) -> dict[str, Any]:
    from dcp_storage.manager.folders import step_name
    from dcp_storage.manager.steps import INDEX_FILE
    from dcp_storage_testing.fault_proxy import FaultProxy
    from dcp_storage_testing.s3_server import MotoS3Server

    out: dict[str, Any] = {"steps": steps + 2}
    with MotoS3Server() as server, FaultProxy(server.endpoint_url) as proxy:
        bucket = server.create_bucket(server.unique_bucket_name("bench"))
        client = server.client()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(
                pool.map(
                    lambda s: client.put_object(Bucket=bucket, Key=f"run/{step_name(s)}/.metadata", Body=b""),
                    range(steps),
                )
            )
        url = f"s3://{bucket}/run"
        options = server.storage_options(
            client_kwargs={"endpoint_url": proxy.url}, skip_instance_cache=True, use_listings_cache=False
        )
        state = make_state(16)
        with ds.CheckpointManager(url, options, keep=ds.KeepPolicy(last=None)) as mgr:
            mgr.save(steps, state)
            mgr.save(steps + 1, state)

        def measured(name: str, fn: Any) -> Any:
            proxy.reset_counters()
            t0 = time.perf_counter()
            value = fn()
            out[name] = {"requests": proxy.counters().requests, "seconds": time.perf_counter() - t0}
            return value

        mgr = measured("start (recovery)", lambda: ds.CheckpointManager(url, options, keep=ds.KeepPolicy(last=None)))
        assert measured("latest_step", mgr.latest_step) == steps + 1
        assert len(measured("all_steps", mgr.all_steps)) == steps + 2
        target = {k: torch.empty_like(v) for k, v in state.items()}
        assert measured("restore", lambda: mgr.restore(target)) == steps + 1
        client.delete_object(Bucket=bucket, Key=f"run/{INDEX_FILE}")
        assert measured("latest_step without the index", mgr.latest_step) == steps + 1
        mgr.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="state size per rank (MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--json", default=os.path.join(HERE, "results", "manager.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        blocked = blocked_times(args.mib, args.repeats, tmp)
    print(f"\nasync save, blocked time ({blocked['state_bytes'] / MiB:.0f} MiB state, {args.repeats} saves each)")
    print(f"{'':<18} {'first s':>9} {'median s':>9}")
    for name, row in blocked["rows"].items():
        print(f"{name:<18} {row['first_s']:>9.3f} {row['median_s']:>9.3f}")
    print(
        f"manager / torch: {blocked['ratio_to_torch']:.2f}x (first save {blocked['ratio_to_torch_first']:.2f}x); "
        f"manager / memcpy: {blocked['ratio_to_memcpy']:.2f}x"
    )
    requests = request_counts(args.steps)
    print(f"\nrequests on moto with {requests['steps']} stored steps")
    print(f"{'':<32} {'requests':>9} {'seconds':>9}")
    for name, row in requests.items():
        if isinstance(row, dict):
            print(f"{name:<32} {row['requests']:>9} {row['seconds']:>9.3f}")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "blocked": blocked,
        "requests": requests,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
