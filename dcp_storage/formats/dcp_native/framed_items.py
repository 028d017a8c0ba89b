"""The saved records of a DCP checkpoint as byte frames: where each item's bytes lie, and matching them to reads.

One saved record of a DCP checkpoint, as the item loader and its in-place path address it.

Whether a decoded DCP record is the chunk the metadata says it is.

torch's ``FileSystemWriter`` saves each chunk as one record holding exactly that chunk, so the record's
shape is the chunk's ``sizes`` and its dtype the tensor's. A record that disagrees (a ``.metadata`` edited
or mixed with another save's records) would otherwise be narrowed to the slice asked for and loaded as
if nothing were wrong: torch's reader does so. The safetensors layouts check the same agreement when they
build the metadata (``formats/safetensors/metadata.py``).

Ranged reads of DCP items stored through a seekable transform (framed compression).

An item written through a :class:`~dcp_storage.formats.dcp_native.records.SeekableTransform` is a
``torch.save`` record cut into independently decodable frames plus an index. When a rank needs only part of
such a tensor (resharding), reading it whole would fetch and decode every frame; instead, three rounds of
I/O, each one :meth:`~dcp_storage.transports.Transport.read_ranges` call (sorted, coalesced,
concurrent) over all items of the plan:

1. **Index**: the item's tail (``tail_probe_bytes``), parsed into a :class:`FrameIndex`; a longer index
   costs one more round for the items that have one.
2. **Header**: the frames covering the record's first ``probe_bytes``: dtype, shape, strides and where the
   tensor's bytes start (:func:`parse_tensor_record`); the decoded frames are kept for round 3.
3. **Data**: for each read item, the frames covering the bounding byte range of its slice, each decoded by a
   job on the transport's workers as soon as it arrives, into one buffer aligned so that a strided view of
   it is the slice, which is then copied into the destination. Staging is batched to ``staging_bytes``.

Records the header parser cannot slice (tensor subclasses, ...) are decoded whole and loaded with
``torch.load(weights_only=True)``, as the whole-item path does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcp_storage.errors import CorruptCheckpointError, DcpStorageError, ShapeMismatchError
from dcp_storage.formats.columns import saved_chunk, stored_dtype
from dcp_storage.formats.dcp_native.records import Frame, FrameIndex, NeedMoreTail, SeekableTransform
from dcp_storage.formats.dcp_native.torch_record import (
    NeedMoreBytes,
    TensorRecord,
    UnsupportedRecord,
    load_tensor_record,
    parse_tensor_record,
)
from dcp_storage.transports import RangeRequest, Transport

__all__ = [
    "DecodesTooLarge",
    "FramedItem",
    "FramedItemLoader",
    "RecordEntry",
    "check_record_matches",
    "decode_whole",
    "framable_groups",
    "needs_whole_chunk",
    "record_bytes_bound",
    "saved_chunk",
    "stored_dtype",
]


@dataclass(frozen=True)
class RecordEntry:
    """One saved record: ``(relative_path, offset, length)`` from the metadata's ``_StorageInfo``."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


def check_record_matches(
    metadata: Metadata | None, index: Any, shape: tuple[int, ...], dtype: torch.dtype, where: str
) -> None:
    """Raise :class:`CorruptCheckpointError` unless the record at ``where`` holds the chunk ``index`` names."""
    chunk = saved_chunk(metadata, index)
    if chunk is None:
        return  # no metadata to compare with (the planner already refused unknown keys)
    want_dtype = stored_dtype(metadata, index.fqn)
    if tuple(shape) != tuple(chunk.sizes) or dtype != want_dtype:
        raise CorruptCheckpointError(
            f"{where}: the record holds {dtype} {list(shape)} but .metadata says chunk "
            f"{list(chunk.offsets)} of {index.fqn!r} is {want_dtype} {list(chunk.sizes)}; the metadata and the "
            "data files do not belong together (re-save the checkpoint, or restore its original .metadata)"
        )


# A torch.save record holds, besides the tensor's bytes, a few small zip entries (data.pkl, byteorder,
# version, serialization id), their headers and the 64-byte alignment padding: about 1.5 KB.
_RECORD_OVERHEAD = 64 * 1024


def record_bytes_bound(metadata: Metadata | None, item: ReadItem) -> int:
    """The most bytes the record of ``item``'s saved chunk can hold, from the metadata (0: it does not say)."""
    chunk = saved_chunk(metadata, item.storage_index)
    dtype = stored_dtype(metadata, item.storage_index.fqn)
    if chunk is None or dtype is None:
        return 0
    return math.prod(chunk.sizes) * dtype.itemsize + _RECORD_OVERHEAD


def framable_groups(
    items: Sequence[ReadItem], entries: dict[int, RecordEntry], metadata: Metadata | None, small_item_bytes: int
) -> dict[RecordEntry, list[ReadItem]]:
    """The tensor items of records stored through one transform and larger than ``small_item_bytes``, by record,
    where no item needs the whole chunk (those, and small records, keep the whole-item path)."""
    groups: dict[RecordEntry, list[ReadItem]] = {}
    for item in items:
        entry = entries[id(item)]
        if len(entry.transforms) == 1 and entry.length > small_item_bytes and item.type != LoadItemType.BYTE_IO:
            groups.setdefault(entry, []).append(item)
    return {e: group for e, group in groups.items() if not any(needs_whole_chunk(i, metadata) for i in group)}


class DecodesTooLarge(ValueError):
    """A whole item's frame index claims more decoded bytes than the caller allows (nothing was allocated)."""


def needs_whole_chunk(item: ReadItem, metadata: Metadata | None) -> bool:
    """Whether ``item`` reads its whole saved chunk (then the whole-item path is cheaper); ``False`` when
    the metadata cannot tell."""
    if metadata is None:
        return False
    if stored_dtype(metadata, item.storage_index.fqn) is None:  # a value (or no such key)
        return True
    chunk = saved_chunk(metadata, item.storage_index)
    if chunk is None:
        return False
    return all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == tuple(chunk.sizes)


@dataclass(eq=False)
class FramedItem:
    """One stored item read by frames: ``[offset, offset + length)`` of ``path``, decoded by ``transform``."""

    path: str
    offset: int
    length: int
    transform: SeekableTransform
    where: str  # "file [start, end)" for errors
    key: str  # the item's fqn, for errors
    index: FrameIndex | None = None
    record: TensorRecord | None = None
    whole: torch.Tensor | None = None  # records we cannot slice, loaded whole
    decoded: dict[int, memoryview] = field(default_factory=dict)  # frames kept from the header round

    def name(self) -> str:
        return f"{self.where} (item {self.key!r})"


@dataclass
class _RawRead:
    """Raw bytes ``[lo, hi)`` of an item; they land in ``buffer`` at byte ``shift + (lo - span_start)``,
    ``shift`` chosen so that position is a multiple of ``align`` (the element size: views need it)."""

    item: FramedItem
    lo: int
    hi: int
    align: int = 1
    key: ReadItem | None = None  # the read item the bytes are for
    frames: list[Frame] = field(default_factory=list, init=False)
    shift: int = field(default=0, init=False)
    buffer: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        assert self.item.index is not None
        self.frames = self.item.index.covering(self.lo, self.hi)
        self.shift = (-(self.lo - self.span_start)) % self.align

    @property
    def span_start(self) -> int:
        return self.frames[0].raw_start if self.frames else self.lo

    @property
    def nbytes(self) -> int:
        """Size of the buffer this read needs."""
        span = self.frames[-1].raw_end - self.frames[0].raw_start if self.frames else 0
        return span + self.shift + (-(span + self.shift)) % self.align

    def allocate(self) -> memoryview:
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8)
        return _bytes_of(self.buffer)

    def frame_view(self, frame: Frame) -> memoryview:
        assert self.buffer is not None
        start = self.shift + frame.raw_start - self.span_start
        return _bytes_of(self.buffer)[start : start + frame.raw_length]

    def bytes_view(self) -> memoryview:
        """The raw bytes ``[lo, hi)`` (after the fetch)."""
        assert self.buffer is not None
        start = self.shift + self.lo - self.span_start
        return _bytes_of(self.buffer)[start : start + self.hi - self.lo]

    def as_tensor(self, rec: TensorRecord, lengths: tuple[int, ...]) -> torch.Tensor:
        """The slice as a strided view of the buffer (``lo`` is its first element)."""
        assert self.buffer is not None
        elem0 = (self.shift + self.lo - self.span_start) // rec.itemsize
        return self.buffer.view(rec.dtype).as_strided(lengths, rec.stride, elem0)


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    return memoryview(buffer.numpy()).cast("B")


def _batches(reads: Sequence[_RawRead], budget: int) -> list[list[_RawRead]]:
    """Consecutive groups whose buffers add up to at most ``budget`` bytes (a larger read goes alone)."""
    out: list[list[_RawRead]] = []
    held = budget + 1
    for read in reads:
        if held + read.nbytes > budget:
            out.append([])
            held = 0
        out[-1].append(read)
        held += read.nbytes
    return out


class FramedItemLoader:
    """Reads slices of framed items for one load plan (see the module docstring); not thread-safe.

    ``keep_bytes``: decoded header frames kept for the data round, at most this many bytes in all.
    """

    def __init__(self, transport: Transport, probe_bytes: int = 4096, staging_bytes: int = 256 << 20) -> None:
        self.transport = transport
        self.probe_bytes = probe_bytes
        self.staging_bytes = staging_bytes
        self.keep_bytes = staging_bytes // 4
        self._kept = 0

    def load(
        self,
        jobs: Sequence[tuple[ReadItem, FramedItem]],
        destination: Callable[[ReadItem], torch.Tensor],
        commit: Callable[[ReadItem, torch.Tensor], None],
        metadata: Metadata | None = None,
    ) -> None:
        """Bring each ``(read_item, framed_item)`` slice into ``destination(read_item)``, then ``commit`` it.

        With ``metadata``, each record must hold the chunk it names (dtype and shape), as on the other read
        paths (:mod:`.record_match`); checked once its header is parsed, before any slice is copied.
        """
        items = list({id(f): f for _, f in jobs}.values())
        self._read_indexes(items)
        self._read_headers(items)
        for read_item, f in jobs:
            held = f.whole if f.whole is not None else f.record
            if held is not None:
                check_record_matches(metadata, read_item.storage_index, tuple(held.shape), held.dtype, f.name())
        pending = {id(f): 0 for f in items}
        for _, f in jobs:
            pending[id(f)] += 1

        def done(read_item: ReadItem, f: FramedItem, dest: torch.Tensor) -> None:
            commit(read_item, dest)
            pending[id(f)] -= 1
            if pending[id(f)] == 0:  # its kept header frames and whole tensor are no longer needed
                f.decoded.clear()
                f.whole = None

        reads: list[_RawRead] = []
        for read_item, f in jobs:
            raw = self._slice_read(read_item, f)
            if raw is not None:
                reads.append(raw)
                continue
            dest = destination(read_item)
            if f.whole is not None:
                src = f.whole
                for dim, (off, n) in enumerate(zip(read_item.storage_offsets, read_item.lengths)):
                    src = src.narrow(dim, off, n)
                dest.copy_(src)
            done(read_item, f, dest)
        for batch in _batches(reads, self.staging_bytes):
            self._fetch(batch)
            for raw in batch:
                assert raw.key is not None and raw.item.record is not None
                dest = destination(raw.key)
                dest.copy_(raw.as_tensor(raw.item.record, tuple(raw.key.lengths)))
                raw.buffer = None
                done(raw.key, raw.item, dest)

    # ---------------------------------------------------------------------------------------- rounds
    def _read_indexes(self, items: list[FramedItem]) -> None:
        want = {id(f): min(f.length, max(1, f.transform.tail_probe_bytes(f.length))) for f in items}
        todo = list(items)
        while todo:
            reqs = [RangeRequest(f.path, f.offset + f.length - want[id(f)], f.offset + f.length) for f in todo]
            again = []
            for f, tail in zip(todo, self.transport.read_ranges(reqs)):
                try:
                    f.index = f.transform.read_frame_index(tail, f.length)  # type: ignore[arg-type]
                except NeedMoreTail as more:
                    if more.needed <= want[id(f)] or more.needed > f.length:
                        raise CorruptCheckpointError(
                            f"{f.name()}: the frame index claims {more.needed} bytes of a {f.length}-byte item"
                        ) from None
                    want[id(f)] = more.needed
                    again.append(f)
                except (ValueError, TypeError) as exc:
                    raise CorruptCheckpointError(f"{f.name()}: damaged frame index ({exc})") from exc
                else:
                    if f.index.stored_size > f.length:
                        raise CorruptCheckpointError(
                            f"{f.name()}: frames end at byte {f.index.stored_size} of a {f.length}-byte item"
                        )
            todo = again

    def _read_headers(self, items: list[FramedItem]) -> None:
        """Parse each record's header from its first frames; keep those frames (within ``keep_bytes``)."""
        want = {id(f): min(self.probe_bytes, _raw_size(f)) for f in items}
        todo = list(items)
        while todo:
            again = []
            for batch in _batches([_RawRead(f, 0, want[id(f)]) for f in todo], self.staging_bytes):
                self._fetch(batch)
                for r in batch:
                    f, size = r.item, _raw_size(r.item)
                    self._keep(r)
                    try:
                        f.record = parse_tensor_record(r.bytes_view(), size, f.name())
                    except NeedMoreBytes as more:
                        if r.hi >= size:
                            raise CorruptCheckpointError(f"{f.name()}: torch.save record is incomplete") from None
                        want[id(f)] = min(size, max(more.needed, 2 * r.hi))
                        again.append(f)
                    except UnsupportedRecord:
                        if r.hi < size:
                            want[id(f)] = size
                            again.append(f)
                        else:
                            f.whole = self._load_whole(f, r)
                    r.buffer = None
            todo = again

    def _keep(self, read: _RawRead) -> None:
        for frame in read.frames:
            if frame.index not in read.item.decoded and self._kept + frame.raw_length <= self.keep_bytes:
                read.item.decoded[frame.index] = memoryview(bytes(read.frame_view(frame)))
                self._kept += frame.raw_length

    def _load_whole(self, f: FramedItem, read: _RawRead) -> torch.Tensor:
        tensor = load_tensor_record(bytes(read.bytes_view()), f.name())
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"{f.name()}: record holds a {type(tensor).__name__}, not a tensor")
        return tensor

    def _slice_read(self, read_item: ReadItem, f: FramedItem) -> _RawRead | None:
        """The raw byte range of the slice ``read_item`` needs (``None``: nothing to fetch)."""
        if f.whole is not None:
            return None
        rec = f.record
        assert rec is not None
        offsets, lengths = tuple(read_item.storage_offsets), tuple(read_item.lengths)
        if len(offsets) != len(rec.shape) or any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, rec.shape)):
            raise ShapeMismatchError(
                f"{f.name()}: slice offsets {list(offsets)} lengths {list(lengths)} do not fit the stored shape "
                f"{list(rec.shape)}"
            )
        if math.prod(lengths) == 0:
            return None
        first = rec.storage_offset + sum(o * st for o, st in zip(offsets, rec.stride))
        last = first + sum((n - 1) * st for n, st in zip(lengths, rec.stride))
        size = rec.itemsize
        return _RawRead(f, rec.data_start + first * size, rec.data_start + (last + 1) * size, size, key=read_item)

    # ---------------------------------------------------------------------------------------- frames
    def _fetch(self, reads: list[_RawRead]) -> None:
        """Allocate each read's buffer, fetch its frames and decode them.

        Each frame is decoded by its own job on the transport's workers, submitted as soon as its bytes
        arrive: decoding overlaps the remaining I/O and uses every worker, even when coalescing turned many
        frames into one request (whose segments complete together, in one thread).
        """
        pool = self.transport.executor()
        jobs: list[Future[None]] = []
        requests = []
        for read in reads:
            read.allocate()
            f = read.item
            for frame in read.frames:
                target = read.frame_view(frame)
                kept = f.decoded.get(frame.index)
                if kept is not None:
                    target[:] = kept
                    continue
                decode = _decoder(f, frame, target)

                def submit(data: memoryview, decode: Callable[[memoryview], None] = decode) -> None:
                    jobs.append(pool.submit(decode, data))  # list.append is atomic

                start, end = f.offset + frame.stored_start, f.offset + frame.stored_end
                requests.append(RangeRequest(f.path, start, end, on_complete=submit))
        try:
            if requests:
                self.transport.read_ranges(requests)
        finally:
            wait(jobs)  # no job may still write into a buffer once we return or raise
        for job in jobs:
            job.result()


def _raw_size(f: FramedItem) -> int:
    assert f.index is not None
    return f.index.raw_size


def _decoder(f: FramedItem, frame: Frame, target: memoryview) -> Callable[[memoryview], None]:
    def decode(data: memoryview) -> None:
        try:
            f.transform.decode_frame(frame, data, target)
        except DcpStorageError:
            raise
        except Exception as exc:  # decoders raise their own types; chained, never swallowed
            raise CorruptCheckpointError(
                f"{f.name()}: frame {frame.index} (stored bytes [{frame.stored_start}, {frame.stored_end}) of the "
                f"item) does not decode ({type(exc).__name__}: {exc})"
            ) from exc

    return decode


def decode_whole(
    transform: SeekableTransform, stored: memoryview, executor: Executor | None = None, limit: int | None = None
) -> bytearray:
    """All original bytes of a whole stored item, its frames decoded concurrently on ``executor``.

    Raises ``ValueError`` (from the transform) for bytes that do not decode, :class:`DecodesTooLarge` when the
    index claims more than ``limit`` decoded bytes (before anything is allocated); callers name the item.
    """
    stored = memoryview(stored).cast("B")
    try:
        index = transform.read_frame_index(stored, len(stored))
    except NeedMoreTail as more:
        raise ValueError(f"the frame index claims {more.needed} bytes of a {len(stored)}-byte item") from None
    if limit is not None and index.raw_size > limit:
        raise DecodesTooLarge(index.raw_size)
    out = bytearray(index.raw_size)
    view = memoryview(out)
    frames = [f for f in index.frames if f.raw_length]
    if executor is None or len(frames) < 2:
        for f in frames:
            transform.decode_frame(f, stored[f.stored_start : f.stored_end], view[f.raw_start : f.raw_end])
        return out
    jobs = [
        executor.submit(transform.decode_frame, f, stored[f.stored_start : f.stored_end], view[f.raw_start : f.raw_end])
        for f in frames
    ]
    try:
        for job in jobs:
            job.result()
    finally:
        for job in jobs:
            job.cancel()
        wait(jobs)  # no worker may still write into ``out`` once we return or raise
    return out
