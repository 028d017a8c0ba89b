"""Raw local I/O of a safetensors save (``pwrite`` mode): temp files, chunks written in place, headers, commit.

Local filesystems (shared by all ranks, as for torch's ``FileSystemWriter``) take positioned writes, so
every byte is written once, by the rank that holds it, with nothing sent between ranks:

1. :func:`create_temp_files` (coordinator, ``prepare_global_plan``): each planned file is created at its
   full size under a hidden temp name (:func:`~dcp_storage.formats.paths.temp_name`), its header written
   now, or, with checksums, in step 3 once the chunk digests are known.
2. :func:`pwrite_chunks` (every rank, ``write_data``): each rank ``pwrite``\\ s its own chunks at their final
   offsets (a ``Shard(0)`` chunk is one run, a ``Shard(1)`` chunk one run per row), hashing each chunk in
   the same pass, and ``fsync``\\ s.
3. :func:`fill_headers` then :func:`commit_files` (coordinator, ``finish``): each header gets every
   digest, in the space the temp file reserved for it, and is ``fsync``\\ ed; only then are the files renamed
   into place and the directory ``fsync``\\ ed, so a committed file always carries its digests.

Paths are local paths; the transport only counts requests and bytes (and removes temp files on failure).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_storage.errors import CheckpointExistsError
from dcp_storage.formats.paths import temp_name
from dcp_storage.formats.safetensors.encode import as_memoryview, pwrite_all
from dcp_storage.formats.safetensors.write_plan import ChunkWrite, PieceKey, RankWrites, SavePlanResult, fill_header
from dcp_storage.integrity.checksums import checksum
from dcp_storage.transports import Transport
from dcp_storage.transports.local_io import fsync_dir

__all__ = ["commit_files", "create_temp_files", "fill_headers", "pwrite_chunks", "temp_path"]


def temp_path(transport: Transport, root: str, name: str, save_id: str) -> str:
    """Where file ``name`` of save ``save_id`` is written until :func:`commit_files` renames it."""
    return transport.join(root, temp_name(name, save_id))


def create_temp_files(transport: Transport, root: str, planned: SavePlanResult, save_id: str) -> None:
    """Create every planned file at its full size (its header too, when it carries no digests)."""
    created: list[str] = []
    try:
        for f in planned.files:
            tmp = temp_path(transport, root, f.name, save_id)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            created.append(tmp)
            try:
                os.ftruncate(fd, f.size)
                if f.algorithm is None:  # with checksums the header is written once, in finish
                    pwrite_all(fd, memoryview(f.header), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            if f.algorithm is None:
                transport.counters.add(requests=1, bytes_written=len(f.header))
    except BaseException:
        for tmp in created:
            transport.remove(tmp)
        raise


def _open_temp(transport: Transport, path: str) -> int:
    """The temp file this save created in ``prepare_global_plan``, opened for writing."""
    try:
        return os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        raise CheckpointExistsError(
            f"{transport.url(path)}: this save's temp file is gone: another save (overwrite=True) took this "
            "location over and removed it while this one was writing; this save was not committed. Save again "
            "with overwrite=True to replace that save's checkpoint, or save to another path"
        ) from None


def pwrite_chunks(
    transport: Transport,
    root: str,
    rw: RankWrites,
    indexes: Iterable[MetadataIndex],
    chunk_bytes: Callable[[ChunkWrite], torch.Tensor],
    algorithm: str | None,
) -> dict[MetadataIndex, str]:
    """Write this rank's chunks (those of ``indexes`` that ``rw`` plans) in place; ``fsync`` every file.

    Returns each chunk's digest under ``algorithm`` (hashed from the bytes written; none when ``None``).
    """
    fds: dict[int, int] = {}
    digests: dict[MetadataIndex, str] = {}
    try:
        for index in indexes:
            cw = rw.chunks.get(index)
            if cw is None:
                continue
            src = as_memoryview(chunk_bytes(cw).cpu())
            if algorithm is not None:
                digests[index] = checksum(src, algorithm)
            fd = fds.get(cw.file)
            if fd is None:
                fd = fds[cw.file] = _open_temp(transport, temp_path(transport, root, rw.files[cw.file], rw.save_id))
            n, length = 0, cw.runs.length
            for j, offset in enumerate(cw.runs.offsets()):
                pwrite_all(fd, src[j * length : (j + 1) * length], cw.begin + offset)
                n += 1
            transport.counters.add(requests=n, bytes_written=cw.nbytes)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return digests


def fill_headers(
    transport: Transport, root: str, planned: SavePlanResult, save_id: str, digests: Mapping[PieceKey, str]
) -> None:
    """Put every chunk's digest into its temp file's header (same length as planned), then ``fsync``."""
    for f in planned.files:
        header = fill_header(f, digests)
        fd = _open_temp(transport, temp_path(transport, root, f.name, save_id))
        try:
            pwrite_all(fd, memoryview(header), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        transport.counters.add(requests=1, bytes_written=len(header))


def commit_files(transport: Transport, root: str, planned: SavePlanResult, save_id: str) -> None:
    """Rename every temp file into place, then ``fsync`` the directory."""
    for f in planned.files:
        os.replace(temp_path(transport, root, f.name, save_id), transport.join(root, f.name))
        transport.counters.add(requests=1)
    fsync_dir(root)
