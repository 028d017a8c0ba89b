"""A 2-rank FSDP2 load with a key map and a dtype cast, through torch's reader and ours.

The checkpoint is saved once, in this process, from a DDP-named bf16 state dict (one chunk per tensor);
each rank loads its ``Shard(0)`` slices into a freshly built fp32 FSDP2 model.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_storage import FsspecWriter
from dcp_storage_testing.distributed import run_ranks

from . import _rank_fns as R

WORLD = 2


def test_fsdp2_load_with_key_map_and_cast(tmp_path: Path) -> None:
    saved = R.saved_state_dict()
    paths = {"torch": str(tmp_path / "torch"), "ours": str(tmp_path / "ours")}
    dcp.save(saved, storage_writer=FileSystemWriter(paths["torch"]))
    dcp.save(saved, storage_writer=FsspecWriter(paths["ours"]))
    n_tensors = len(saved["model"]) - 1

    results = run_ranks(R.fsdp2_load_remapped_cast, WORLD, paths, timeout=120)
    for rank, result in enumerate(results):
        reports = result["loads"]
        assert [r["reader"] for r in reports] == ["torch", "ours"]
        for rep in reports:
            where = f"rank {rank} reader {rep['reader']}"
            assert rep["kinds"] == ["DTensor"], where
            assert rep["mismatched"] == [], f"{where}: {rep['mismatched']}"
            assert rep["note"] == "bf16 run", where
            assert rep["casts"] == n_tensors and rep["renamed"] == n_tensors + 1, where
            assert rep["missing"] == [] and rep["unexpected"] == [], where
            assert rep["head_local_shape"] == (R.SHAPE["vocab"] // WORLD, R.SHAPE["dim"]), where
        # The strict load's error reached every rank, with every rank's IncompatibleKeysError inside.
        failures = result["strict_failures"]
        assert sorted(failures) == list(range(WORLD)), f"rank {rank}: {failures}"
        for text in failures.values():
            assert text.startswith("IncompatibleKeysError:") and "'model.module." in text
            assert "KeyMap.within('model.', KeyMap.add_prefix('module.'))" in text
