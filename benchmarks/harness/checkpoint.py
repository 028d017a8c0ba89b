"""The cached benchmark checkpoint: saved once by gloo ranks, its data files, page-cache preparation, destinations."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from .spec import (
    LOCAL_CHUNK,
    SPEC_VERSION,
    GiB,
    checksum,
    contig_stride,
    model_spec,
    spec_total_bytes,
    tensor_nbytes,
    torch_dtype,
)


def _save_rank(rank: int, world: int, path: str, spec: list, seed: int) -> dict[str, dict[str, Any]]:
    """Rank body: seeded Shard(0) chunks -> DTensors -> dcp.save with FileSystemWriter. Returns checksums."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    sums: dict[str, dict[str, Any]] = {}
    for idx, (name, shape, dtype) in enumerate(spec):
        rows = shape[0] // world
        local_shape = (rows, *shape[1:])
        g = torch.Generator().manual_seed(seed * 1_000_003 + idx * 64 + rank)
        local = torch.randn(local_shape, generator=g, dtype=torch.float32).to(torch_dtype(dtype))
        entry: dict[str, Any] = {"all": checksum(local)}
        if len(shape) == 2:
            half = shape[1] // world
            entry["cols"] = [checksum(local[:, c * half : (c + 1) * half]) for c in range(world)]
        sums[name] = entry
        sd[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=contig_stride(shape)
        )
    dcp.save(sd, storage_writer=FileSystemWriter(path))
    return sums


def ensure_checkpoint(cache_root: str, size_gib: float, seed: int) -> dict[str, Any]:
    """The cached checkpoint for (size, seed, spec version): generate it if missing. Returns its info."""
    from dcp_storage_testing.distributed import run_ranks

    tag = f"ckpt-{size_gib:g}gib-seed{seed}-v{SPEC_VERSION}"
    root = os.path.join(cache_root, tag)
    path = os.path.join(root, "dcp")
    info_path = os.path.join(root, "info.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
        if all(os.path.exists(os.path.join(path, name)) for name in info["files"]):
            info["generated_s"] = 0.0
            return info
    spec = model_spec(int(size_gib * GiB))
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    tmp = path + ".partial"
    print(
        f"[gen] writing {spec_total_bytes(spec) / GiB:.2f} GiB checkpoint ({len(spec)} tensors) to {path} ...",
        flush=True,
    )
    t0 = time.perf_counter()
    results = run_ranks(_save_rank, 2, tmp, spec, seed, timeout=1800)
    os.rename(tmp, path)
    files = sorted(os.listdir(path))
    info = {
        "tag": tag,
        "path": path,
        "root": root,
        "size_gib": size_gib,
        "seed": seed,
        "world_size": 2,
        "spec": [[n, list(s), d] for n, s, d in spec],
        "sums": {name: [results[r][name] for r in range(2)] for name, _, _ in spec},
        "files": files,
        "file_sizes": {name: os.path.getsize(os.path.join(path, name)) for name in files},
        "tensor_bytes": spec_total_bytes(spec),
        "largest_tensor_bytes": max(tensor_nbytes(s, d) for _, s, d in spec),
    }
    with open(info_path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(info_path + ".tmp", info_path)
    info["generated_s"] = time.perf_counter() - t0
    print(f"[gen] done in {info['generated_s']:.1f}s", flush=True)
    return info


def data_files(info: dict[str, Any]) -> list[tuple[str, int]]:
    return [(n, s) for n, s in info["file_sizes"].items() if n.endswith(".distcp")]


def warm_files(paths: list[str]) -> None:
    """Read every file once (untimed) so it is in the page cache."""
    buf = bytearray(LOCAL_CHUNK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


PAGE_CACHE_MODES = ("as-is", "large", "small")


def prepare_page_cache(paths: list[str], mode: str) -> dict[str, Any]:
    """Put ``paths`` in the page cache in a known state; returns what was done, for the JSON.

    The kernel caches a file in folios of 4 KiB up to 2 MiB, and which it gets decides how fast both the
    raw ``readinto`` limit and a memory-mapped copy run (measured here: 2-thread ``readinto`` 9.4 GB/s
    over 4 KiB folios, 14.8 GB/s over large ones, where a mapping is made of 2 MiB page-table entries).
    ``as-is`` only reads the files (pages already cached keep their folios: a just-written checkpoint);
    ``large`` drops them and reads them back sequentially, as readahead caches a file read from disk;
    ``small`` drops them and reads them back 4 KiB at a time with readahead off (``POSIX_FADV_RANDOM``),
    as a file written or read in small pieces is cached. Dropping uses ``POSIX_FADV_DONTNEED`` on the
    benchmark's own files.
    """
    before = _file_huge_pages()
    if mode != "as-is":
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if mode == "small":
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    page = bytearray(4096)
                    pos = 0
                    while n := os.preadv(fd, [page], pos):
                        pos += n
            finally:
                os.close(fd)
    warm_files(paths)  # "small": already cached, so this read changes no folio
    return {"mode": mode, "file_huge_pages_kib_before": before, "file_huge_pages_kib_after": _file_huge_pages()}


def _file_huge_pages() -> int | None:
    """``FileHugePages`` of ``/proc/meminfo`` (KiB of page cache held in 2 MiB folios), if the kernel says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("FileHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def destinations(spec: list, layout: str, rank: int, world: int) -> dict[str, Any]:
    import torch

    sd: dict[str, Any] = {}
    mesh = None
    if layout != "full":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    for name, shape, dtype in spec:
        shape = tuple(shape)
        if layout == "full":
            sd[name] = torch.empty(shape, dtype=torch_dtype(dtype)).zero_()
            continue
        from torch.distributed.tensor import DTensor, Shard

        dim = 1 if (layout == "shard1" and len(shape) == 2) else 0
        local_shape = list(shape)
        local_shape[dim] //= world
        local = torch.empty(local_shape, dtype=torch_dtype(dtype)).zero_()
        sd[name] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=contig_stride(shape)
        )
    return sd


def expected_checksum(sums: dict[str, list], name: str, shape: tuple[int, ...], layout: str, rank: int) -> int:
    chunks = sums[name]
    if layout == "full":
        return sum(c["all"] for c in chunks)
    if layout == "shard1" and len(shape) == 2:
        return sum(c["cols"][rank] for c in chunks)
    return chunks[rank]["all"]
