"""Rank bodies for ``test_rank_failures.py``: streamed saves in which one rank fails, and subgroup saves.

Module-level, so ``run_ranks`` can unpickle them by name. Each failure case is one ``dcp.save`` on every
rank, reported as whether it raised, the text, and the seconds it took; all cases of a run share one process
group, so a case that leaves the ranks out of step also breaks the ones after it.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

SEED = 11
FAIL_TEXT = "simulated failure"


def reference() -> dict[str, torch.Tensor]:
    """Full tensors: rank ``r`` of a ``world``-rank save holds row block ``r`` of each (see :func:`shards`)."""
    g = torch.Generator().manual_seed(SEED)
    return {
        "embed.weight": torch.randn(256, 128, generator=g),
        "layer.weight": torch.randn(128, 128, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(128, generator=g),
        "norm.weight": torch.randn(64, generator=g),
    }


def shards(mesh: Any) -> dict[str, Any]:
    """``Shard(0)`` DTensors of :func:`reference` on ``mesh``: every rank sends chunks to the coordinator."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in reference().items()}


class FailsAt(DefaultSavePlanner):
    """Raises on ``fail_rank`` (a global rank) in ``step``: ``finish_plan``, ``create_local_plan`` or
    ``resolve_data`` (the first tensor resolve: the hash with checksums on, the bytes sent without)."""

    def __init__(self, fail_rank: int, step: str) -> None:
        super().__init__()
        self.fail_rank, self.step = fail_rank, step

    def _maybe_fail(self, step: str) -> None:
        if step == self.step and dist.get_rank() == self.fail_rank:
            raise RuntimeError(f"{FAIL_TEXT} in {step} on rank {self.fail_rank}")

    def create_local_plan(self) -> Any:
        self._maybe_fail("create_local_plan")
        return super().create_local_plan()

    def finish_plan(self, new_plan: Any) -> Any:
        self._maybe_fail("finish_plan")
        return super().finish_plan(new_plan)

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type.name != "BYTE_IO":
            self._maybe_fail("resolve_data")
        return super().resolve_data(write_item)


def fail_each(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case: ``url``, ``options``, ``rank`` (which fails), ``step``, ``checksum_algorithm``. A good save to
    ``warm`` (``{"url", "options"}``) comes first, one to ``after`` last (the group is still in step)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_storage import SafetensorsWriter

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (world,))
    warm, after = cases["warm"], cases["after"]
    # A good save first: the S3 client's imports and connections are not timed (seconds on a loaded machine).
    dcp.save(shards(mesh), storage_writer=SafetensorsWriter(warm["url"], warm["options"]))
    out: dict[str, Any] = {}
    for name, case in cases.items():
        if name in ("warm", "after"):
            continue
        writer = SafetensorsWriter(case["url"], case["options"], checksum_algorithm=case["checksum_algorithm"])
        began = time.monotonic()
        try:
            dcp.save(shards(mesh), storage_writer=writer, planner=FailsAt(case["rank"], case["step"]))
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            out[name] = {"raised": True, "text": f"{type(exc).__name__}: {exc}"[:4000]}
        else:
            out[name] = {"raised": False, "text": ""}
        out[name]["seconds"] = time.monotonic() - began
    dcp.save(shards(mesh), storage_writer=SafetensorsWriter(after["url"], after["options"]))
    return out


def save_in_subgroup(rank: int, world: int, members: list[int], targets: list[tuple[str, dict[str, Any]]]) -> Any:
    """Ranks in ``members`` save ``Shard(0)`` DTensors over a mesh of that subgroup to every target (with
    ``process_group=`` the subgroup); the others take no part (they return at once)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh

    from dcp_storage import SafetensorsWriter

    warnings.filterwarnings("ignore")
    group = dist.new_group(members)  # collective over the default group: every rank calls it
    if rank not in members:
        return None
    mesh = DeviceMesh.from_group(group, "cpu")
    seconds = []
    for url, options in targets:
        began = time.monotonic()
        dcp.save(shards(mesh), storage_writer=SafetensorsWriter(url, options), process_group=group)
        seconds.append(time.monotonic() - began)
    return seconds
