"""Rank bodies for ``test_reader.py`` (module-level, importable by rank processes).

They check bit-exactness in place and return plain reports, so tensors cross process boundaries only
through ``torch.save`` files.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dcp_storage_testing.compare import same_bits

from ._build import torch_reference


def _dtensors(reference: dict[str, torch.Tensor], mesh: Any, dim: int, sentinel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict[str, Any] = {}
    for key, full in reference.items():
        if sentinel:  # a byte pattern no checkpoint holds: a missed write shows
            nbytes = full.numel() * full.element_size()
            full = torch.full((nbytes,), 0xA5, dtype=torch.uint8).view(full.dtype).reshape(full.shape)
        if full.dim() == 0:
            out[key] = full.clone()  # 0-dim: a plain (replicated) tensor
        else:
            out[key] = distribute_tensor(full, mesh, [Shard(min(dim, full.dim() - 1))], src_data_rank=None)
    return out


def save_distributed(rank: int, world: int, hf_dir: str, fsw_dir: str) -> None:
    """torch's ``HuggingFaceStorageWriter(save_distributed=True)`` and ``FileSystemWriter(SAFETENSORS)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state = _dtensors(torch_reference(), mesh, 0, sentinel=False)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(hf_dir, save_distributed=True))
    writer = FileSystemWriter(fsw_dir, serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({**state, "step": 7}, storage_writer=writer)


def _local(full: torch.Tensor, value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(what this rank holds, what it should hold)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(value, DTensor):
        return value, full
    shape, offset = compute_local_shape_and_global_offset(full.shape, value.device_mesh, value.placements)
    expected = full
    for dim, (off, length) in enumerate(zip(offset, shape)):
        expected = expected.narrow(dim, off, length)
    return value.to_local(), expected


def load_everything(
    rank: int,
    world: int,
    sources: list[dict[str, Any]],
    refs_path: str,
    counted: tuple[str, dict[str, Any]],
    broken: tuple[str, dict[str, Any]],
) -> dict[str, Any]:
    """Load every source into Shard(0) and Shard(1) DTensor state dicts; count a metadata read; fail one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_storage import SafetensorsReader
    from dcp_storage.errors import DcpStorageError
    from dcp_storage.transports import FsspecTransport, TransportConfig

    mesh = init_device_mesh("cpu", (world,))
    refs = torch.load(refs_path, weights_only=True)
    # One transport per backend, shared by the readers (an s3fs client per load costs more than the load);
    # local loads without coalescing read exactly the rank's bytes (checked by the test).
    transports: dict[str, FsspecTransport] = {}
    loads = []
    for src in sources:
        reference = refs[src["name"]]
        backend = src["url"].split("://")[0] if "://" in src["url"] else "local"
        if backend not in transports:
            config = TransportConfig(coalesce_gap=0) if backend == "local" else None
            transports[backend] = FsspecTransport.from_url(src["url"], src["options"], config)[0]
        transport = transports[backend]
        for dim in (0, 1):
            state = _dtensors(reference, mesh, dim, sentinel=True)
            if src["step"]:
                state["step"] = 0
            before = transport.counters.snapshot()
            started = time.perf_counter()
            dcp.load(state, storage_reader=SafetensorsReader(src["url"], transport=transport))
            seconds = time.perf_counter() - started
            after = transport.counters.snapshot()
            bad, needed = [], 0
            for key, full in reference.items():
                got, expected = _local(full, state[key])
                needed += got.numel() * got.element_size()
                if not same_bits(got, expected.contiguous()):
                    bad.append(key)
            if src["step"] and state["step"] != 7:
                bad.append("step")
            delta = {k: after[k] - before[k] for k in after}
            loads.append(
                {
                    "name": src["name"],
                    "url": src["url"],
                    "dim": dim,
                    "bad": bad,
                    "needed": needed,
                    "seconds": seconds,
                    **delta,
                }
            )

    reader = SafetensorsReader(counted[0], counted[1])
    reader.read_metadata()
    counters = reader.counters

    try:
        SafetensorsReader(broken[0], broken[1]).read_metadata()
        error = None
    except DcpStorageError as exc:
        error = (type(exc).__name__, str(exc))
    return {"loads": loads, "metadata_counters": counters, "error": error}
