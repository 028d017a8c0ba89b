"""Rank bodies for the plugin's multi-process tests: torch_checkpointing's ``CheckpointManager`` saving a
2-rank FSDP2 model through :class:`DcpStorageConfig` and loading it back, bit-exact, at any world size.

They live in the package, not in ``tests/``, because :func:`dcp_storage_testing.distributed.run_ranks`
unpickles a rank body by module name inside a forkserver whose ``sys.path`` was fixed when it started.
"""

from __future__ import annotations

from typing import Any

import torch

SEED = 23
SHAPE = {"vocab": 256, "dim": 64, "hidden": 128, "layers": 2}


def _gather_on_cpu() -> None:
    """torch_checkpointing 0.1.1 gathers its sharding metadata through CUDA tensors
    (``DefaultMetadataManager._all_gather_pickled_data`` calls ``.cuda()``), so a resharding save or load
    on gloo/CPU fails with "Torch not compiled with CUDA enabled" whatever the storage. These rank bodies run
    on CPU, so they swap in the same gather made with ``all_gather_object`` (the only change; nothing of the
    storage is patched)."""
    import torch.distributed as dist
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    def gather(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
        out: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    DefaultMetadataManager._all_gather_pickled_data = gather  # type: ignore[method-assign]


def _manager(root_url: str, storage_options: dict[str, Any], sync: bool) -> Any:
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder

    from dcp_storage_torch_checkpointing import DcpStorageConfig

    _gather_on_cpu()
    return CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DefaultResharder())},
            save=SyncCheckpointSaverConfig() if sync else AsyncCheckpointSaverConfig(),
            storage_config=DcpStorageConfig(root_url, storage_options),
        )
    )


def _model(zeros: bool) -> torch.nn.Module:
    from dcp_storage_testing.models import build_model, fsdp2_shard

    model = build_model(SEED, **SHAPE)
    if zeros:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return fsdp2_shard(model)


def save_fsdp2(rank: int, world: int, roots: list[tuple[str, dict[str, Any]]], step: str, sync: bool = True) -> None:
    """Save the reference model, FSDP2-sharded over ``world`` ranks, as checkpoint ``step`` under each root."""
    state = _model(zeros=False).state_dict()
    for root_url, storage_options in roots:
        mgr = _manager(root_url, storage_options, sync)
        try:
            future = mgr.save(step, {"model": state})
            if future is not None:
                future.result(timeout=120)
        finally:
            mgr.close()


def load_fsdp2(rank: int, world: int, roots: list[tuple[str, dict[str, Any]]], step: str) -> list[dict[str, Any]]:
    """Load ``step`` from each root into a zeroed FSDP2 model at this world size; compare every local shard
    with the reference bit-exactly. One report per root: the keys that differ, how many, the items loaded."""
    from dcp_storage_testing.compare import local_slice, same_bits
    from dcp_storage_testing.models import reference_state_dict

    reference = reference_state_dict(SEED, **SHAPE)
    reports = []
    for root_url, storage_options in roots:
        model = _model(zeros=True)
        mgr = _manager(root_url, storage_options, sync=True)
        try:
            loaded = mgr.load(step, into={"model": model.state_dict()})
        finally:
            mgr.close()
        state = model.state_dict()
        wrong = [k for k, v in state.items() if not same_bits(v.to_local(), local_slice(reference[k], v))]
        reports.append({"root": root_url, "wrong": wrong, "keys": len(state), "items": sorted(loaded)})
    return reports
