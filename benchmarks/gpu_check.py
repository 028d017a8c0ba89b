"""GPU destinations under NCCL: every reader and strategy loads into CUDA tensors bit-exactly.

Run on a machine with one or more NVIDIA GPUs (takes well under 5 minutes)::

    .venv/bin/python benchmarks/gpu_check.py [--ranks N]

Each rank owns one GPU (``N`` defaults to the GPU count, at most 4; with one GPU it runs one rank, which
still exercises NCCL and CUDA destinations). Checks, each loading into CUDA DTensors (``Shard(0)`` and
``Shard(1)``) and comparing with the seeded reference on the GPU:

1. ``FsspecReader`` on a DCP checkpoint saved from CUDA DTensors with ``FsspecWriter``;
2. ``SafetensorsReader`` on a ``SafetensorsWriter`` output saved from CUDA DTensors;
3. ``BroadcastingTorchSaveReader`` + ``DynamicMetaLoadPlanner`` on a ``torch.save`` file;
4. ``Broadcasting(FsspecReader(...))``: only the coordinator touches storage, slices travel over NCCL.

Prints one line per check and exits non-zero on any failure. No network beyond the GPUs of this host.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch

SHAPES = {"embed": (1024, 256), "w1": (512, 384), "w2": (384, 512), "norm": (256,), "head": (1000, 256)}


def _reference(dtype_half: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ref = {k: torch.randn(shape, generator=gen) for k, shape in SHAPES.items()}
    if dtype_half:
        ref["w2"] = ref["w2"].to(torch.bfloat16)
    return ref


def _device() -> str:
    return "cuda" if os.environ.get("DCP_STORAGE_RUN_RANKS_BACKEND") == "nccl" else "cpu"


def _dtensors(ref: dict[str, torch.Tensor], dim: int, fill: float | None = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(_device(), (torch.distributed.get_world_size(),))
    out = {}
    for key, value in ref.items():
        d = min(dim, value.dim() - 1)
        src = (value if fill is None else torch.full_like(value, fill)).to(_device())
        out[key] = distribute_tensor(src, mesh, [Shard(d)])
    return out


def _verify(name: str, loaded: dict[str, Any], ref: dict[str, torch.Tensor]) -> list[str]:
    bad = []
    for key, value in loaded.items():
        if value.device.type != _device():
            bad.append(f"{name}: {key} landed on {value.device}")
            continue
        full = value.full_tensor()
        if not torch.equal(full.cpu(), ref[key]):
            bad.append(f"{name}: {key} differs")
    return bad


def _rank(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import dcp_storage as ds

    ref = _reference()
    problems: list[str] = []
    started = time.perf_counter()
    # 1 + 4: DCP native from CUDA DTensors, loaded directly and through the broadcasting strategy.
    dcp.save(_dtensors(ref, 0), storage_writer=ds.FsspecWriter(f"{root}/dcp", overwrite=True))
    for dim in (0, 1):
        dest = _dtensors(ref, dim, fill=0.0)
        dcp.load(dest, storage_reader=ds.FsspecReader(f"{root}/dcp"))
        problems += _verify(f"FsspecReader Shard({dim})", dest, ref)
        dest = _dtensors(ref, dim, fill=0.0)
        dcp.load(dest, storage_reader=ds.Broadcasting(ds.FsspecReader(f"{root}/dcp")))
        problems += _verify(f"Broadcasting(FsspecReader) Shard({dim})", dest, ref)
    # 2: safetensors written from CUDA DTensors, read back into CUDA DTensors.
    dcp.save(_dtensors(ref, 0), storage_writer=ds.SafetensorsWriter(f"{root}/st", overwrite=True))
    for dim in (0, 1):
        dest = _dtensors(ref, dim, fill=0.0)
        dcp.load(dest, storage_reader=ds.SafetensorsReader(f"{root}/st"))
        problems += _verify(f"SafetensorsReader Shard({dim})", dest, ref)
    # 3: a torch.save file through the broadcasting reader.
    if rank == 0:
        torch.save(ref, f"{root}/model.pt")
    dist.barrier()
    for dim in (0, 1):
        dest = _dtensors(ref, dim, fill=0.0)
        dcp.load(
            dest,
            storage_reader=ds.BroadcastingTorchSaveReader(),
            planner=ds.DynamicMetaLoadPlanner(),
            checkpoint_id=f"{root}/model.pt",
        )
        problems += _verify(f"BroadcastingTorchSaveReader Shard({dim})", dest, ref)
    if rank == 0:
        print(f"rank 0 finished all checks in {time.perf_counter() - started:.1f}s", flush=True)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=0, help="ranks (one GPU each); default: GPU count, max 4")
    parser.add_argument("--cpu", action="store_true", help="dry run of the same checks with gloo on CPU")
    args = parser.parse_args()
    if args.cpu:
        ranks = args.ranks or 2
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (use --cpu for a dry run)", file=sys.stderr)
        return 2
    else:
        ranks = args.ranks or min(4, torch.cuda.device_count())
        os.environ["DCP_STORAGE_RUN_RANKS_BACKEND"] = "nccl"
    from dcp_storage_testing.distributed import run_ranks

    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_rank, ranks, root, timeout=280)
    problems = sorted({p for rank_problems in results for p in rank_problems})
    for line in problems:
        print("FAIL", line)
    print(
        f"gpu_check: {ranks} {'gloo' if args.cpu else 'NCCL'} rank(s): "
        + ("all checks passed" if not problems else f"{len(problems)} failures")
    )
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
