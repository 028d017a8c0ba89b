"""The chunk exchange of a streamed safetensors save: every rank's chunks reach the coordinator, in order.

An object store cannot be written at offsets, so :class:`~dcp_storage.SafetensorsWriter` streams each file
front to back through one atomic upload on the coordinator (see :mod:`dcp_storage.formats.safetensors.reader`).
The other ranks hold the chunks; this module moves them, over the save's process group, on the group's
device (:class:`~.group.GroupView`: CPU for gloo, the current CUDA device for NCCL):

1. :func:`exchange_digests` (with checksums): every rank hashes its own chunks and the digests, a few
   bytes each, are all-gathered before any upload begins, so a failure on any rank is raised on every rank
   with nothing uploaded (each header, written first, carries every digest).
2. :func:`send_chunks` (every rank but the coordinator) sends each planned chunk as a status byte, then
   its bytes, in the plan's global order; :class:`ChunkSource` (the coordinator) takes chunks in that same
   order, its own resolved locally, the others received.

No rank waits for the process-group timeout when one fails: a sender that cannot produce a chunk announces
it (status ``FAILED``, no bytes) for it and every later one, and the coordinator, after any failure of its
own, :meth:`ChunkSource.drain`\\ s what is still due before it raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.safetensors.encode import as_memoryview
from dcp_storage.formats.safetensors.write_plan import ChunkWrite, PieceKey, RankWrites
from dcp_storage.integrity.checksums import checksum
from dcp_storage.strategies.collectives import RANK_FAILURES, GroupView

__all__ = ["ChunkBytes", "ChunkSource", "RemoteChunkError", "exchange_digests", "send_chunks"]

#: The bytes of one planned chunk on this rank, as a 1-d ``uint8`` tensor (raises if it cannot be made).
ChunkBytes = Callable[[ChunkWrite], torch.Tensor]
_STATUS_OK, _STATUS_FAILED = 1, 0


class RemoteChunkError(DcpStorageError):
    """Another rank announced that it could not produce a chunk (its own error says why)."""


def exchange_digests(
    view: GroupView, rw: RankWrites, chunk_bytes: ChunkBytes, algorithm: str, failure: BaseException | None
) -> dict[PieceKey, str]:
    """Hash this rank's chunks with ``algorithm``, then all-gather every rank's digests (or its failure).

    Collective over ``view.group``. ``failure``: an error this rank already met (it hashes nothing then).
    Raises this rank's own failure, else a :class:`~dcp_storage.errors.DcpStorageError` naming the first
    rank that failed, on every rank.
    """
    mine: dict[PieceKey, str] = {}
    if failure is None:
        try:
            for cw in rw.chunks.values():
                mine[(cw.fqn, cw.offsets)] = checksum(as_memoryview(chunk_bytes(cw).cpu()), algorithm)
        except RANK_FAILURES as exc:  # every rank must hear of it, then it is re-raised
            failure = exc
    payload: Any = ("error", f"{type(failure).__name__}: {failure}") if failure is not None else ("ok", mine)
    gathered = [payload]
    if rw.world > 1:  # the save's own world (one plan per rank), not the group's: no_dist saves plan alone
        gathered = [None] * rw.world
        dist.all_gather_object(gathered, payload, group=view.group)
    if failure is not None:
        raise failure
    out: dict[PieceKey, str] = {}
    for rank, (status, value) in enumerate(gathered):
        if status != "ok":
            raise DcpStorageError(f"rank {rank} could not hash its chunks, so nothing was uploaded: {value}")
        out.update(value)
    return out


def send_chunks(view: GroupView, rw: RankWrites, chunk_bytes: ChunkBytes, failure: BaseException | None) -> None:
    """Every rank but the coordinator: send each chunk of ``rw.sends`` (status, then bytes) in order.

    After a failure the remaining chunks are announced as failed instead of sent, so the coordinator stays
    in step and aborts its upload; the failure is raised once the exchange is over.
    """
    device, dst = view.device, rw.coordinator
    for index in rw.sends:
        payload = None
        if failure is None:
            try:
                payload = chunk_bytes(rw.chunks[index]).to(device)
            except RANK_FAILURES as exc:  # announced to the coordinator, then re-raised
                failure = exc
        status = _STATUS_OK if payload is not None else _STATUS_FAILED
        dist.send(torch.tensor([status], dtype=torch.uint8, device=device), group=view.group, group_dst=dst)
        if payload is not None:
            dist.send(payload, group=view.group, group_dst=dst)
    if failure is not None:
        raise failure


class ChunkSource:
    """The coordinator's side: chunks in schedule order, its own resolved by ``chunk_bytes``, others received."""

    def __init__(self, view: GroupView, rw: RankWrites, chunk_bytes: ChunkBytes) -> None:
        self.view = view
        self.rw = rw
        self.chunk_bytes = chunk_bytes
        self.order = [c for fs in rw.schedule or () for ts in fs.tensors for c in ts.chunks]
        self.pos = 0
        self.broken = False  # a collective failed: the group is unusable, do not drain

    def next(self, cw: ChunkWrite) -> torch.Tensor:
        """The bytes of ``cw`` (a CPU uint8 tensor); chunks must be asked for in schedule order."""
        if self.order[self.pos] is not cw:
            raise RuntimeError(f"chunk of {cw.fqn} asked out of schedule order")
        if cw.rank == self.rw.rank:
            self.pos += 1
            return self.chunk_bytes(cw).cpu()
        try:
            if not self._receive_status(cw):
                self.pos += 1
                raise RemoteChunkError(f"rank {cw.rank} could not produce its chunk of {cw.fqn!r} (see its error)")
            buf = torch.empty(cw.nbytes, dtype=torch.uint8, device=self.view.device)
            dist.recv(buf, group=self.view.group, group_src=cw.rank)
        except RemoteChunkError:
            raise
        except BaseException:
            self.broken = True
            raise
        self.pos += 1
        return buf.cpu()

    def drain(self, cause: BaseException) -> None:
        """After a failure: receive (and drop) every chunk still due, so senders do not block until timeout."""
        if self.broken:
            return
        try:
            for cw in self.order[self.pos :]:
                if cw.rank != self.rw.rank and self._receive_status(cw):
                    scratch = torch.empty(cw.nbytes, dtype=torch.uint8, device=self.view.device)
                    dist.recv(scratch, group=self.view.group, group_src=cw.rank)
        except Exception as exc:  # noqa: BLE001 - the original failure is what the caller raises
            cause.__context__ = exc
        finally:
            self.pos = len(self.order)

    def _receive_status(self, cw: ChunkWrite) -> bool:
        status = torch.empty(1, dtype=torch.uint8, device=self.view.device)
        dist.recv(status, group=self.view.group, group_src=cw.rank)
        return int(status.item()) == _STATUS_OK
