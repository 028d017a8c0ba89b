"""FSDP2 at 2 ranks saves through ``ZstdSeekable``; 3 ranks load it resharded, bit-exactly, by ranges.

Real gloo processes (``run_ranks``); the rank bodies live in :mod:`dcp_storage_zstd.testing`. One spawn
saves a bf16 and an fp32 checkpoint, one spawn loads each twice: frame-granular ranged reads (the default)
and every item read whole (the baseline), so the saving in bytes is measured, not assumed.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from dcp_storage_testing.distributed import run_ranks

from dcp_storage_zstd.testing import run_all

SEED = 97
SHAPE = {"vocab": 4096, "dim": 256, "hidden": 1024, "layers": 2}  # ~10 MB fp32, ~5 MB bf16
FRAME = 64 * 1024
DTYPES = ("bfloat16", "float32")
TIMEOUT_S = 180.0
WHOLE = 1 << 40  # small_item_bytes that makes the reader fetch every item whole
RANGED = 32 * 1024  # ... and one that reads by frames every item above 32 KiB (the toy model's are small)


def test_fsdp2_save_at_2_load_resharded_at_3(tmp_path: Path) -> None:
    paths = {dtype: str(tmp_path / dtype) for dtype in DTYPES}
    saves = [("save_fsdp2", (paths[d], SEED, SHAPE, d, "zstd-seekable", {"frame_bytes": FRAME})) for d in DTYPES]
    run_ranks(run_all, 2, saves, timeout=TIMEOUT_S)
    loads = [("load_resharded", (paths[d], SEED, SHAPE, d, limit)) for d in DTYPES for limit in (RANGED, WHOLE)]
    results = run_ranks(run_all, 3, loads, timeout=TIMEOUT_S)

    for i, (name, (path, *_rest, limit)) in enumerate(loads):
        for rank, per_rank in enumerate(results):
            assert per_rank[i]["mismatched"] == [], f"{path} (small_item_bytes={limit}) rank {rank}"
    for n, dtype in enumerate(DTYPES):
        ckpt = Path(paths[dtype])
        metadata = pickle.loads((ckpt / ".metadata").read_bytes())
        assert {tuple(s.transform_descriptors) for s in metadata.storage_data.values()} == {("stream.zstd_seekable/1",)}
        stored = sum(s.length for s in metadata.storage_data.values())
        ranged = sum(per_rank[2 * n]["bytes_read"] for per_rank in results)
        whole = sum(per_rank[2 * n + 1]["bytes_read"] for per_rank in results)
        # Whole items: each rank fetches every saved half it overlaps (the middle rank both), about 2x the
        # checkpoint. By frames: about 1x plus, per item, a header frame and a seek table.
        assert whole > 1.8 * stored, (dtype, whole, stored)
        assert ranged < 0.7 * whole, (dtype, ranged, whole, stored)
    timings = {name: [round(r["seconds"], 2) for per_rank in results for r in per_rank] for name, _ in loads}
    print(timings)
