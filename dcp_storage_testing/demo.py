"""The main job, end to end on an embedded S3 server: save with FSDP2 at 2 ranks, load at 3, verify.

Everything runs on this machine: a moto S3 server on 127.0.0.1 (free port), real gloo process groups,
FSDP2 ``fully_shard`` on CPU. The report gives bytes, seconds, GB/s and storage requests per phase.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from dcp_storage import FsspecReader, FsspecWriter
from dcp_storage_testing.distributed import run_ranks
from dcp_storage_testing.models import build_model, fsdp2_shard, reference_state_dict
from dcp_storage_testing.s3_server import MotoS3Server

__all__ = ["DemoConfig", "format_report", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    seed: int = 1234
    save_ranks: int = 2
    load_ranks: int = 3
    dim: int = 512
    hidden: int = 2048
    layers: int = 4
    vocab: int = 8192

    def __post_init__(self) -> None:
        if self.save_ranks < 1 or self.load_ranks < 1:
            raise ValueError("rank counts must be >= 1")

    @property
    def shape(self) -> dict[str, int]:
        return {"dim": self.dim, "hidden": self.hidden, "layers": self.layers, "vocab": self.vocab}


def _save_rank(rank: int, world: int, url: str, options: dict[str, Any], cfg: DemoConfig) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    model = fsdp2_shard(build_model(cfg.seed, **cfg.shape))
    writer = FsspecWriter(url, options, overwrite=True)
    dist.barrier()
    start = time.perf_counter()
    dcp.save({"model": model.state_dict()}, storage_writer=writer)
    dist.barrier()
    return {"seconds": time.perf_counter() - start, **writer.counters}


def _load_rank(rank: int, world: int, url: str, options: dict[str, Any], cfg: DemoConfig) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    model = fsdp2_shard(build_model(cfg.seed + 1, **cfg.shape))  # different weights: the load must replace them
    state = {"model": model.state_dict()}
    reader = FsspecReader(url, options)
    dist.barrier()
    start = time.perf_counter()
    dcp.load(state, storage_reader=reader)
    dist.barrier()
    seconds = time.perf_counter() - start
    expected = reference_state_dict(cfg.seed, **cfg.shape)
    mismatched = []
    needed = 0
    for key, value in model.state_dict().items():
        local = value.to_local()
        needed += local.numel() * local.element_size()
        if not torch.equal(value.full_tensor(), expected[key]):
            mismatched.append(key)
    return {
        "seconds": seconds,
        "needed_bytes": needed,
        "mismatched": mismatched,
        "tensors": len(expected),
        **reader.counters,
    }


def run_demo(cfg: DemoConfig | None = None) -> dict[str, Any]:
    """Run the whole job and return the per-rank figures."""

    cfg = cfg or DemoConfig()
    with MotoS3Server() as server:
        location = server.new_location("demo")
        saved = run_ranks(_save_rank, cfg.save_ranks, location.url, location.storage_options, cfg, timeout=600)
        loaded = run_ranks(_load_rank, cfg.load_ranks, location.url, location.storage_options, cfg, timeout=600)
    return {"config": cfg, "url": location.url, "save": saved, "load": loaded}


def format_report(result: dict[str, Any]) -> str:
    cfg: DemoConfig = result["config"]
    lines = [f"checkpoint: {result['url']} (embedded moto S3 server on 127.0.0.1)"]
    for phase, ranks_key in (("save", "save"), ("load", "load")):
        rows = result[ranks_key]
        nbytes = sum(r["bytes_written" if phase == "save" else "bytes_read"] for r in rows)
        seconds = max(r["seconds"] for r in rows)
        requests = sum(r["requests"] for r in rows)
        world = cfg.save_ranks if phase == "save" else cfg.load_ranks
        lines.append(
            f"{phase:>4}: {world} ranks  {nbytes / 1e6:9.1f} MB  {seconds:6.2f} s  {nbytes / seconds / 1e9:6.3f} GB/s  "
            f"{requests:5d} requests  {sum(r['retries'] for r in rows)} retries"
        )
    load = result["load"]
    needed = sum(r["needed_bytes"] for r in load)
    read = sum(r["bytes_read"] for r in load)
    bad = sorted({k for r in load for k in r["mismatched"]})
    lines.append(
        f"resharded {cfg.save_ranks} -> {cfg.load_ranks} ranks: read {read / max(needed, 1):.3f}x the bytes the ranks needed"
    )
    lines.append(
        f"verify: {load[0]['tensors']} tensors, "
        + ("all bit-exact on every rank" if not bad else f"MISMATCH in {len(bad)}: {', '.join(bad[:5])}")
    )
    return "\n".join(lines)
