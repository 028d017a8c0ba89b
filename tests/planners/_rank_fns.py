"""Rank bodies for the planners' multi-process tests (module-level so ``run_ranks`` can pickle them).

Each checks bit-exactness in place against values every rank rebuilds from the seed, and returns a
small report; assertions live in the tests.
"""

from __future__ import annotations

from typing import Any

import torch

from dcp_storage_testing.compare import same_bits

SEED = 23
SHAPE = {"vocab": 64, "dim": 32, "hidden": 48, "layers": 2}
SAVED_DTYPE = torch.bfloat16


def saved_state_dict() -> dict[str, Any]:
    """What the test process saves: a DDP-named bf16 model under "model", plus a non-tensor."""
    from dcp_storage_testing.models import reference_state_dict

    ref = reference_state_dict(SEED, **SHAPE)
    return {"model": {"module." + k: v.to(SAVED_DTYPE) for k, v in ref.items()} | {"module.note": "bf16 run"}}


def fsdp2_load_remapped_cast(rank: int, world: int, paths: dict[str, str]) -> dict[str, Any]:
    """Load each checkpoint into a fresh fp32 FSDP2 model through a scoped prefix map; check every value.

    Then a strict load without the map, which must fail on every rank with our error (it crosses
    processes inside DCP's ``CheckpointException``, so it must pickle).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.tensor import DTensor

    from dcp_storage import FsspecReader
    from dcp_storage.planners import KeyMap, RemappingLoadPlanner
    from dcp_storage_testing.models import build_model, fsdp2_shard, reference_state_dict

    expected = {k: v.to(SAVED_DTYPE).to(torch.float32) for k, v in reference_state_dict(SEED, **SHAPE).items()}
    readers = {"torch": FileSystemReader, "ours": FsspecReader}
    reports = []
    for name, path in paths.items():
        model = fsdp2_shard(build_model(SEED + 1, **SHAPE))
        sd: dict[str, Any] = {"model": model.state_dict() | {"note": None}}
        planner = RemappingLoadPlanner(KeyMap.within("model.", KeyMap.add_prefix("module.")))
        dcp.load(sd, storage_reader=readers[name](path), planner=planner)
        after = model.state_dict()  # the parameters themselves, not just the dict we passed
        kinds = sorted({type(v).__name__ for v in after.values()})
        bad = [k for k, want in expected.items() if not same_bits(after[k].full_tensor(), want)]
        local_shapes = {k: tuple(v.to_local().shape) for k, v in after.items() if isinstance(v, DTensor)}
        assert planner.result is not None
        reports.append(
            {
                "reader": name,
                "rank": rank,
                "kinds": kinds,
                "mismatched": bad,
                "note": sd["model"]["note"],
                "casts": len(planner.result.casts),
                "renamed": len(planner.result.renamed),
                "missing": planner.result.missing_keys,
                "unexpected": planner.result.unexpected_keys,
                "head_local_shape": local_shapes.get("head.weight"),
            }
        )

    from torch.distributed.checkpoint.api import CheckpointException

    failures: dict[int, str] = {}
    try:
        dcp.load(
            {"model": model.state_dict()}, storage_reader=FsspecReader(paths["ours"]), planner=RemappingLoadPlanner()
        )
    except CheckpointException as exc:
        failures = {r: f"{type(e).__name__}: {e}" for r, (e, _tb) in exc.failures.items()}
    return {"loads": reports, "strict_failures": failures}


def dynamic_meta_parity(rank: int, world: int, plain_path: str, ddp_path: str) -> dict[str, Any]:
    """torch's BroadcastingTorchSaveReader with torch's DynamicMetaLoadPlanner and with ours."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import BroadcastingTorchSaveReader
    from torch.distributed.checkpoint.format_utils import DynamicMetaLoadPlanner as TorchDynamicMeta

    from dcp_storage import DynamicMetaLoadPlanner, KeyMap
    from dcp_storage_testing.models import reference_state_dict

    ref = reference_state_dict(SEED, **SHAPE)  # plain_path holds ref in bf16

    def blank() -> dict[str, Any]:
        return {"model": {k: torch.full_like(v, float("nan")) for k, v in ref.items()}}

    theirs, ours = blank(), blank()
    dcp.load(theirs, storage_reader=BroadcastingTorchSaveReader(), planner=TorchDynamicMeta(), checkpoint_id=plain_path)
    planner = DynamicMetaLoadPlanner()
    dcp.load(ours, storage_reader=BroadcastingTorchSaveReader(), planner=planner, checkpoint_id=plain_path)
    expected = {k: v.to(SAVED_DTYPE).to(torch.float32) for k, v in ref.items()}
    mapped = blank()
    mapped_planner = DynamicMetaLoadPlanner(key_map=KeyMap.within("model.", KeyMap.add_prefix("module.")))
    dcp.load(mapped, storage_reader=BroadcastingTorchSaveReader(), planner=mapped_planner, checkpoint_id=ddp_path)
    return {
        "ours_vs_theirs": [k for k in ref if not same_bits(ours["model"][k], theirs["model"][k])],
        "theirs_vs_expected": [k for k in ref if not same_bits(theirs["model"][k], expected[k])],
        "mapped_vs_expected": [k for k in ref if not same_bits(mapped["model"][k], expected[k])],
        "missing": planner.result.missing_keys if planner.result else None,
        "mapped_renamed": len(mapped_planner.result.renamed) if mapped_planner.result else None,
    }
