"""The coordinator's uploads of a streamed safetensors save (``stream`` mode: object stores).

Objects cannot be written at offsets, so the coordinator writes each file in order through one atomic
upload (single PUT or multipart upload), tensor by tensor, taking chunks from a
:class:`~dcp_storage.strategies.chunk_exchange.ChunkSource` (its own, and the other ranks' as they
arrive). ``Shard(0)`` chunks are written straight through; other shardings are assembled one tensor at a
time, so the coordinator's memory is bounded by the largest tensor. Files are committed one by one (the
index, written last by the writer's ``finish``, commits the checkpoint). On any failure the current upload
is aborted and the source drained, so no other rank waits for the process-group timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.safetensors.encode import as_memoryview
from dcp_storage.formats.safetensors.write_plan import PieceKey, RankWrites, SavePlanResult, TensorSchedule, fill_header
from dcp_storage.strategies.chunk_exchange import ChunkSource
from dcp_storage.transports import Transport

__all__ = ["stream_files"]


def stream_files(
    transport: Transport,
    root: str,
    rw: RankWrites,
    planned: SavePlanResult | None,
    source: ChunkSource,
    failure: BaseException | None,
    digests: Mapping[PieceKey, str] | None = None,
) -> None:
    """Upload every file of ``rw.schedule`` (headers with ``digests``, when given); raises ``failure`` first."""
    if rw.schedule is None:
        raise DcpStorageError("stream-mode plan for the coordinator carries no schedule")
    try:
        if failure is not None:
            raise failure
        specs = {f.name: f for f in planned.files} if planned is not None else {}
        for fs in rw.schedule:
            header = fs.header if digests is None else fill_header(specs[fs.name], digests)
            with transport.open_atomic(transport.join(root, fs.name)) as out:
                out.write(header)
                for ts in fs.tensors:
                    _write_tensor(out, ts, source)
    except BaseException as exc:
        source.drain(exc)  # let the other ranks finish sending, so none waits for the timeout
        raise


def _write_tensor(out: Any, ts: TensorSchedule, source: ChunkSource) -> None:
    """Write one tensor's bytes: chunk by chunk if they are consecutive single runs, else assembled first."""
    if ts.nbytes == 0:
        return
    position, straight = 0, True
    for c in ts.chunks:
        if c.runs.count != 1 or c.runs.start != position:
            straight = False
            break
        position += c.runs.length
    if straight and position == ts.nbytes:
        for c in ts.chunks:
            out.write(as_memoryview(source.next(c)))
        return
    full = torch.empty(ts.nbytes, dtype=torch.uint8)
    for c in ts.chunks:
        data = source.next(c)
        r = c.runs
        # The runs are a strided view of the full tensor's bytes; the chunk's bytes fill it in order.
        dest = full.as_strided((*r.counts, r.length), (*r.strides, 1), r.start)
        dest.copy_(data.view(*r.counts, r.length))
    out.write(as_memoryview(full))
