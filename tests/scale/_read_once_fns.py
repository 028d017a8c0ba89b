"""Rank bodies for ``test_read_once.py``: loads whose ranks need the same stored bytes.

Module-level so that ranks import them by name. Each body loads one checkpoint into its state dict,
checks every tensor bit for bit against the reference (for DTensors, against the local shard), and
returns what it found plus this rank's own view of what it moved.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

SEED = 2024
MiB = 1024 * 1024


def reference(with_value: bool = True) -> dict[str, Any]:
    """About 7 MiB in tensors of every size class: one far above ``split_bytes`` (read in row blocks by
    all its replicas), medium ones, norms and biases below ``pack_below`` (packed), a bf16 and an int
    tensor, and a non-tensor value."""
    g = torch.Generator().manual_seed(SEED)
    state: dict[str, Any] = {
        "embed.weight": torch.randn(1024, 1024, generator=g),  # 4 MiB
        "layer0.weight": torch.randn(512, 512, generator=g),  # 1 MiB
        "layer1.weight": torch.randn(512, 512, generator=g).to(torch.bfloat16),
        "layer1.bias": torch.randn(512, generator=g),
        "norm.weight": torch.randn(256, generator=g),
        "head.weight": torch.randn(640, 512, generator=g),  # 1.25 MiB
        "positions": torch.randint(0, 1 << 30, (300, 100), generator=g, dtype=torch.int64),
    }
    if with_value:
        state["step"] = 1234
    return state


def _strategy(name: str | None) -> Any:
    """The strategy under test, with limits small enough that this checkpoint takes several rounds
    (``None``: none given, the reader chooses)."""
    if name is None:
        return None
    from dcp_storage import ReadStrategies
    from dcp_storage.strategies import DeliveryConfig

    config = DeliveryConfig(max_inflight_bytes=2 * MiB, staging_bytes=2 * MiB)
    if name == "read_once":
        return ReadStrategies.read_once(config, split_bytes=MiB, pack_below=16 * 1024)
    if name == "per_host":
        return ReadStrategies.per_host(None, config, split_bytes=MiB, pack_below=16 * 1024)
    return ReadStrategies.named(name)


def _reader(kind: str, url: str, options: dict[str, Any], read_strategy: Any) -> Any:
    from dcp_storage import FsspecReader, SafetensorsReader
    from dcp_storage.strategies import Broadcasting

    if kind == "broadcasting":
        return Broadcasting(FsspecReader(url, options))
    if kind == "safetensors":
        return SafetensorsReader(url, options, read_strategy=read_strategy)
    return FsspecReader(url, options, read_strategy=read_strategy)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _dest(layout: str, ref: dict[str, Any]) -> dict[str, Any]:
    """``ddp``: every rank a full copy; ``hsdp``: DTensors (Replicate, Shard(0)) on a 2x2 mesh; ``mixed``:
    HSDP weights, replicated plain norms and biases, the non-tensor value."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict[str, Any] = {}
    mesh = _mesh() if layout != "ddp" else None
    for key, value in ref.items():
        if not isinstance(value, torch.Tensor):
            out[key] = 0
            continue
        blank = torch.full_like(value, -1) if not value.is_floating_point() else torch.full_like(value, float("nan"))
        sharded = layout == "hsdp" or (layout == "mixed" and value.dim() == 2)
        out[key] = distribute_tensor(blank, mesh, [Replicate(), Shard(0)]) if sharded else blank
    return out


def load_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: ``kind`` (``dcp`` or ``safetensors``), ``layout`` (see :func:`_dest`), ``url``, ``options``,
    ``strategy`` (a name for :func:`strategy`) and optionally ``hosts`` (each rank's host key)."""
    return [load_one(rank, **case) for case in cases]


def load_one(
    rank: int,
    kind: str,
    layout: str,
    url: str,
    options: dict[str, Any],
    strategy: str | None,
    hosts: list[str] | None = None,
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from dcp_storage_testing.compare import local_slice, same_bits

    warnings.filterwarnings("ignore")
    if hosts is not None:
        os.environ["DCP_STORAGE_HOST_KEY"] = hosts[rank]
    ref = reference(with_value=kind != "safetensors")
    dest = _dest(layout, ref)
    reader = _reader(kind, url, options, _strategy(strategy))
    dcp.load(dest, storage_reader=reader)
    bad = []
    for key, value in ref.items():
        got = dest[key]
        if isinstance(got, DTensor):
            if not same_bits(got.to_local(), local_slice(value, got)):
                bad.append(key)
        elif isinstance(value, torch.Tensor):
            if not same_bits(got, value):
                bad.append(key)
        elif got != value:
            bad.append(key)
    counters = reader.reader.counters if hasattr(reader, "reader") else reader.counters
    return {"bad": bad, "counters": counters}


def fail_on_one_rank(rank: int, world: int, url: str, options: dict[str, Any]) -> str:
    """Rank 1's reads fail (its transport raises) in a DDP load: every rank must raise, none hang."""
    import torch.distributed.checkpoint as dcp

    from dcp_storage import FsspecReader
    from dcp_storage.errors import TransportError

    warnings.filterwarnings("ignore")
    reader = FsspecReader(url, options, read_strategy=_strategy("read_once"))
    if rank == 1:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise TransportError(f"{url}: injected failure on rank 1")

        reader.transport.read_ranges = broken  # type: ignore[method-assign]
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in reference().items()}
    try:
        dcp.load(dest, storage_reader=reader)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is one; its message is checked
        return f"{type(exc).__name__}: {exc}"
    return "loaded"
