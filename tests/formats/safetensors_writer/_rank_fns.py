"""Rank bodies for ``test_distributed.py`` (module-level, so ``run_ranks`` can unpickle them by name).

They save and report plain, picklable facts (counters, error types); the test process reads the files
back with safetensors and compares them with references it rebuilds from the same seeds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

SEED = 2024
SHAPE = {"vocab": 1024, "dim": 128, "hidden": 512, "layers": 2}  # ~2.6 MB of fp32
MAX_SHARD = 1_000_000  # several files for the model above


def shard1_reference() -> dict[str, torch.Tensor]:
    """The model's weights (some in bf16), plus tensors that exercise uneven, empty and replicated shards."""
    from dcp_storage_testing.models import reference_state_dict

    ref = reference_state_dict(SEED, **SHAPE)
    for key in list(ref)[::3]:
        ref[key] = ref[key].to(torch.bfloat16)
    g = torch.Generator().manual_seed(SEED)
    ref["extra.uneven"] = torch.randn(6, 7, generator=g)  # Shard(1): 4 + 3 columns
    ref["extra.thin"] = torch.randn(5, 1, generator=g)  # Shard(1): rank 1's chunk is empty
    ref["extra.replicated"] = torch.randn(256, 256, generator=g)  # Replicate(): written once
    ref["extra.plain"] = torch.randn(300, generator=g)  # a plain tensor on every rank: written once
    ref["extra.scalar"] = torch.tensor(-3.5, dtype=torch.float64)
    return ref


def _shard1_state(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict[str, Any] = {}
    for key, full in shard1_reference().items():
        if key in ("extra.plain", "extra.scalar"):
            out[key] = full
        elif key == "extra.replicated":
            out[key] = distribute_tensor(full, mesh, [Replicate()], src_data_rank=None)
        else:
            out[key] = distribute_tensor(full, mesh, [Shard(min(1, full.dim() - 1))], src_data_rank=None)
    return out


def _shard0_state(reference: dict[str, torch.Tensor], mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in reference.items()}


class FailingPlanner(DefaultSavePlanner):
    """Raises on ``fail_rank`` when asked for ``fail_on``'s data, i.e. in the middle of ``write_data``."""

    def __init__(self, fail_rank: int, fail_on: str) -> None:
        super().__init__()
        self.fail_rank = fail_rank
        self.fail_on = fail_on

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == self.fail_rank and write_item.index.fqn == self.fail_on:
            raise RuntimeError(f"simulated crash on rank {self.fail_rank} while writing {self.fail_on}")
        return super().resolve_data(write_item)


def _save(state: dict[str, Any], url: str, options: dict[str, Any], **kwargs: Any) -> dict[str, int]:
    import torch.distributed.checkpoint as dcp

    from dcp_storage import SafetensorsWriter

    writer = SafetensorsWriter(url, options, **kwargs)
    dcp.save(state, storage_writer=writer)
    return writer.counters


def _expect_failure(
    state: dict[str, Any], url: str, options: dict[str, Any], planner: Any = None, **kwargs: Any
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_storage import SafetensorsWriter

    try:
        dcp.save(state, storage_writer=SafetensorsWriter(url, options, **kwargs), planner=planner)
    except CheckpointException as exc:
        return {
            "raised": True,
            "types": sorted({type(e).__name__ for e, _tb in exc.failures.values()}),
            "ranks": sorted(exc.failures),
            "message": str(exc)[:4000],
        }
    return {"raised": False}


def save_all(
    rank: int, world: int, root: str, s3: dict[str, tuple[str, dict[str, Any]]], llama_path: str | None
) -> dict[str, Any]:
    """Every 2-rank save of the module, local and S3, then the failure cases."""
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_storage_testing.models import build_model, fsdp2_shard

    mesh = init_device_mesh("cpu", (world,))
    fsdp2_sd = fsdp2_shard(build_model(SEED, **SHAPE)).state_dict()
    report: dict[str, Any] = {}
    report["fsdp2_local"] = _save(fsdp2_sd, f"{root}/fsdp2", {}, max_shard_size=MAX_SHARD)
    report["shard1_local"] = _save(_shard1_state(mesh), f"{root}/shard1", {})
    if llama_path is not None:  # each rank holds Shard(0) of every weight
        llama = _shard0_state(torch.load(llama_path, weights_only=True), mesh)
        report["llama_local"] = _save(llama, f"{root}/llama", {})
    url, opts = s3["fsdp2"]
    report["fsdp2_s3"] = _save(fsdp2_sd, url, opts, max_shard_size=MAX_SHARD)
    url, opts = s3["shard1"]
    report["shard1_s3"] = _save(_shard1_state(mesh), url, opts, max_shard_size=MAX_SHARD)

    report["refused_local"] = _expect_failure(_shard1_state(mesh), f"{root}/fsdp2", {}, max_shard_size=MAX_SHARD)
    report["overwritten_local"] = _save(fsdp2_sd, f"{root}/overwrite", {}, max_shard_size=MAX_SHARD)
    report["overwrite_local"] = _save(_shard1_state(mesh), f"{root}/overwrite", {}, overwrite=True)
    crash_key = "blocks.1.mlp_up.weight"
    report["crash_local"] = _expect_failure(
        _shard1_state(mesh), f"{root}/crash", {}, FailingPlanner(1, crash_key), max_shard_size=MAX_SHARD
    )
    url, opts = s3["crash_sender"]
    report["crash_s3_sender"] = _expect_failure(_shard1_state(mesh), url, opts, FailingPlanner(1, crash_key))
    url, opts = s3["crash_coordinator"]
    report["crash_s3_coordinator"] = _expect_failure(
        fsdp2_sd, url, opts, FailingPlanner(0, crash_key), max_shard_size=MAX_SHARD
    )
    return report
