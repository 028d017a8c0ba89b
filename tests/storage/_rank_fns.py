"""Rank bodies for ``test_distributed.py``.

They run inside :func:`dcp_storage_testing.distributed.run_ranks` processes, so they must be module-level
functions of an importable module (the rank unpickles them by module and name). They do the checking
themselves and return plain, picklable reports (mismatching keys, byte counts) for the test to assert on,
so no tensors cross process boundaries except through ``torch.save`` files.
"""

from __future__ import annotations

from typing import Any

import torch

from dcp_storage_testing.compare import local_slice as _local_slice
from dcp_storage_testing.compare import same_bits as _same_bits

SEED = 4321
# Big enough that every weight matrix's saved half exceeds DcpLoaderConfig.small_item_bytes (read by
# header probe + ranged data), small enough to keep the file fast: ~18 MB of fp32.
SHAPE = {"vocab": 4096, "dim": 256, "hidden": 2048, "layers": 2}
MAX_READ_RATIO = 1.10  # bytes a rank reads / bytes of its local shards (local disk, 4 KiB gap)
MAX_READ_RATIO_REMOTE = 1.25  # object stores coalesce ranges up to 256 KiB apart


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------- save
def save_fsdp2(
    rank: int, world: int, targets: list[tuple[str, dict[str, Any]]], optim_dir: str, optim_full_path: str
) -> dict[str, Any]:
    """Save ``{"model": fsdp2.state_dict()}`` to every target, then an Adam checkpoint to ``optim_dir``.

    Rank 0 writes the full (unsharded) post-step model and optimizer state to ``optim_full_path``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    from dcp_storage.formats.dcp_native.writer import FsspecWriter
    from dcp_storage_testing.models import build_model, fsdp2_shard

    model = fsdp2_shard(build_model(SEED, **SHAPE))
    counters = []
    for url, options in targets:
        writer = FsspecWriter(url, options)
        dcp.save({"model": model.state_dict()}, storage_writer=writer)
        counters.append(writer.counters)

    # One seeded Adam step, then model + optimizer through get_state_dict.
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, SHAPE["vocab"], (2, 8), generator=gen)
    model(tokens).float().pow(2).mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=FsspecWriter(optim_dir))

    def full(v: Any) -> Any:
        return v.full_tensor() if isinstance(v, DTensor) else (v.clone() if isinstance(v, torch.Tensor) else v)

    full_model = {k: full(v) for k, v in msd.items()}
    full_state = {fqn: {k: full(v) for k, v in state.items()} for fqn, state in osd["state"].items()}
    if rank == 0:
        torch.save({"model": full_model, "state": full_state, "param_groups": osd["param_groups"]}, optim_full_path)
    dist.barrier()
    return {"counters": counters, "state_keys": sorted(full_state)}


# ---------------------------------------------------------------------------------------------- load
def _dtensor_state(reference: dict[str, torch.Tensor], mesh: Any, dim: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    for key, full in reference.items():
        d = min(dim, full.dim() - 1)
        sentinel = torch.full_like(full, float("nan"))  # a rank's missed write stays NaN
        out[key] = distribute_tensor(sentinel, mesh, [Shard(d)], src_data_rank=None)
    return out


def _check_dtensors(state: dict[str, Any], reference: dict[str, torch.Tensor]) -> tuple[list[str], int]:
    bad, needed = [], 0
    for key, full in reference.items():
        local = state[key].to_local()
        needed += _nbytes(local)
        if not _same_bits(local, _local_slice(full, state[key]).contiguous()):
            bad.append(key)
    return bad, needed


def load_resharded(
    rank: int, world: int, sources: list[tuple[str, dict[str, Any]]], gap0_local: str | None = None
) -> list[dict[str, Any]]:
    """Load each source into ``Shard(0)`` then ``Shard(1)`` DTensor state dicts; check every local shard.

    With ``gap0_local``, also a ``Shard(1)`` load from that local checkpoint with coalescing turned off,
    which must read no more than the rank's own bytes (plus headers).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_storage.formats.dcp_native.reader import FsspecReader
    from dcp_storage.transports import TransportConfig
    from dcp_storage_testing.models import reference_state_dict

    mesh = init_device_mesh("cpu", (world,))
    reference = reference_state_dict(SEED, **SHAPE)
    runs: list[tuple[str, str, dict[str, Any], int, TransportConfig | None]] = []
    for url, options in sources:
        runs += [(url, "Shard(0)", options, 0, None), (url, "Shard(1)", options, 1, None)]
    if gap0_local is not None:
        runs.append((gap0_local, "Shard(1) gap=0", {}, 1, TransportConfig(coalesce_gap=0)))
    reports = []
    for url, label, options, dim, config in runs:
        state = _dtensor_state(reference, mesh, dim)
        reader = FsspecReader(url, options, transport_config=config)
        dcp.load({"model": state}, storage_reader=reader)
        bad, needed = _check_dtensors(state, reference)
        reports.append({"url": url, "placement": label, "mismatched": bad, "needed": needed, **reader.counters})
    return reports


def load_full(rank: int, world: int, sources: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """World size 1: load into plain full tensors."""
    import torch.distributed.checkpoint as dcp

    from dcp_storage.formats.dcp_native.reader import FsspecReader
    from dcp_storage_testing.models import reference_state_dict

    reference = reference_state_dict(SEED, **SHAPE)
    reports = []
    for url, options in sources:
        state = {k: torch.full_like(v, float("nan")) for k, v in reference.items()}
        reader = FsspecReader(url, options)
        dcp.load({"model": state}, storage_reader=reader)
        bad = [k for k, v in reference.items() if not _same_bits(state[k], v)]
        needed = sum(_nbytes(v) for v in reference.values())
        reports.append({"url": url, "mismatched": bad, "needed": needed, "keys": sorted(state), **reader.counters})
    return reports


def load_optimizer(rank: int, world: int, optim_dir: str, optim_full_path: str) -> dict[str, Any]:
    """Build model + Adam at this world size, step once, load the saved state, compare with the saved full values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    from dcp_storage.formats.dcp_native.reader import FsspecReader
    from dcp_storage_testing.models import build_model, fsdp2_shard

    saved = torch.load(optim_full_path, weights_only=True)
    model = fsdp2_shard(build_model(SEED + 1, **SHAPE))  # different weights
    optim = torch.optim.Adam(model.parameters(), lr=5e-3)  # different lr
    gen = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, SHAPE["vocab"], (3, 5), generator=gen)
    model(tokens).float().pow(2).mean().backward()
    optim.step()  # creates state to load into
    optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    dcp.load({"model": msd, "optim": osd}, storage_reader=FsspecReader(optim_dir))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)

    msd2, osd2 = get_state_dict(model, optim)

    def full(v: Any) -> Any:
        return v.full_tensor() if isinstance(v, DTensor) else v

    bad: list[str] = []
    for key, value in saved["model"].items():
        if not _same_bits(full(msd2[key]), value):
            bad.append(f"model:{key}")
    compared = 0
    for fqn, state in saved["state"].items():
        for name, value in state.items():
            got = full(osd2["state"][fqn][name])
            compared += 1
            if isinstance(value, torch.Tensor):
                if not isinstance(got, torch.Tensor) or not _same_bits(got, value):
                    bad.append(f"optim:{fqn}.{name}")
            elif got != value:
                bad.append(f"optim:{fqn}.{name}")
    lrs = sorted({g["lr"] for g in osd2["param_groups"]})
    return {"mismatched": bad, "compared": compared, "lrs": lrs, "state_keys": sorted(osd2["state"])}


def load_world3(
    rank: int,
    world: int,
    sources: list[tuple[str, dict[str, Any]]],
    gap0_local: str,
    optim_dir: str,
    optim_full_path: str,
) -> dict[str, Any]:
    """Everything checked at world size 3, in one spawn: resharded loads, then the optimizer round trip."""
    return {
        "reshard": load_resharded(rank, world, sources, gap0_local),
        "optim": load_optimizer(rank, world, optim_dir, optim_full_path),
    }
