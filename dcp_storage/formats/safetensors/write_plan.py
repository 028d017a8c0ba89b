"""Global planning of a Hugging Face safetensors save: which file holds each tensor, where, and who writes what.

Pure functions over DCP ``SavePlan``s; no I/O. The coordinator calls :func:`plan_save` with every rank's
plan and gets back the files (names, headers, sizes), the index, and for every rank the byte runs its
chunks occupy in those files.

Files. Tensors are taken in a deterministic order (the order of the ranks' state dicts: rank 0's keys
first, then keys only later ranks hold) and packed greedily into files of at most ``max_shard_size`` data
bytes, like ``huggingface_hub.split_torch_state_dict_into_shards``: a tensor that would tip the current
file over the limit starts a new file, and a tensor larger than the limit gets a file of its own. One file
is named ``{prefix}.safetensors`` and has no index; several are ``{prefix}-0000k-of-0000N.safetensors``
plus ``{prefix}.safetensors.index.json``. Inside each file tensors follow safetensors' own data order (see
:mod:`.encode`), without gaps.

Chunks. A rank holds a row-major box of a tensor (``chunk.offsets``/``chunk.sizes``). In the row-major full
tensor that box is a regular set of equally long byte runs (:class:`RunSet`): a ``Shard(0)`` chunk is one
run, a ``Shard(1)`` chunk of an ``R x C`` matrix is ``R`` runs. The chunk's own bytes, read in order, fill
those runs in order, so a rank can write its chunk in place without gathering anything.

Checksums. With a ``checksum_algorithm`` each header's ``__metadata__`` also carries the provenance and one
digest per written chunk (see :mod:`dcp_storage.integrity.safetensors_sums`), planned as zero-filled
placeholders of the digest's fixed width: :func:`fill_header` later puts the real digests in without
changing the header's length, so every planned offset stays valid.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ...errors import DcpStorageError, UnsupportedDtypeError
from ...integrity import safetensors_sums as sums
from ...integrity.checksums import checksum
from ...integrity.provenance import writer_descriptor
from .dtypes import safetensors_dtype
from .encode import HeaderEntry, encode_header, safetensors_order_key

__all__ = [
    "ChunkWrite",
    "FileSpec",
    "LocalOrder",
    "RankWrites",
    "RunSet",
    "SavePlanResult",
    "TensorSpec",
    "chunk_runs",
    "fill_header",
    "index_name",
    "pack_files",
    "parse_size",
    "plan_save",
    "single_name",
]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like ``"5GB"`` (10**9) or ``"500MiB"`` (2**20), as HF spells them."""
    if isinstance(size, bool):
        raise TypeError(f"max_shard_size must be an int or a size string, got {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = _SIZE_RE.match(size)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size {size!r} is not a size; use an int of bytes or e.g. '500MB', '5GB', '2GiB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"max_shard_size must be an int or a size string, got {type(size).__name__}")
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return value


def single_name(prefix: str) -> str:
    return f"{prefix}.safetensors"


def shard_name(prefix: str, k: int, n: int) -> str:
    return f"{prefix}-{k:05d}-of-{n:05d}.safetensors"


def index_name(prefix: str) -> str:
    return f"{prefix}.safetensors.index.json"


# ------------------------------------------------------------------------------------------- byte runs
@dataclass(frozen=True)
class RunSet:
    """Equally long byte runs at ``start + sum(i_d * strides[d])`` for every ``i_d < counts[d]``.

    Offsets are relative to the first byte of the full tensor, in row-major order; run ``j`` of the
    iteration holds bytes ``[j * length, (j + 1) * length)`` of the row-major chunk.
    """

    start: int
    length: int
    counts: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return math.prod(self.counts) if self.length else 0

    @property
    def nbytes(self) -> int:
        return self.count * self.length

    def offsets(self) -> Iterator[int]:
        if not self.length:
            return
        if not self.counts:
            yield self.start
            return
        for idx in product(*(range(c) for c in self.counts)):
            yield self.start + sum(i * s for i, s in zip(idx, self.strides))


def chunk_runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], itemsize: int) -> RunSet:
    """The byte runs the box ``offsets``/``sizes`` occupies in a row-major tensor of ``shape``."""
    ndim = len(shape)
    if len(offsets) != ndim or len(sizes) != ndim:
        raise ValueError(f"chunk offsets {tuple(offsets)} / sizes {tuple(sizes)} do not match shape {tuple(shape)}")
    for d in range(ndim):
        if offsets[d] < 0 or sizes[d] < 0 or offsets[d] + sizes[d] > shape[d]:
            raise ValueError(f"chunk offsets {tuple(offsets)} sizes {tuple(sizes)} exceed shape {tuple(shape)}")
    if math.prod(sizes) == 0:
        return RunSet(0, 0)
    elem_strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    start = sum(o * s for o, s in zip(offsets, elem_strides)) * itemsize
    # The run spans the innermost dims the box covers fully, plus the first dim (from inside) it does not.
    inner = ndim - 1
    while inner > 0 and sizes[inner] == shape[inner]:
        inner -= 1
    if ndim == 0:
        return RunSet(start, itemsize)
    length = sizes[inner] * elem_strides[inner] * itemsize
    lead = [(sizes[d], elem_strides[d] * itemsize) for d in range(inner) if sizes[d] != 1]
    return RunSet(start, length, tuple(c for c, _ in lead), tuple(s for _, s in lead))


# ------------------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class TensorSpec:
    """A full tensor as the checkpoint stores it."""

    fqn: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


PieceKey = tuple[str, tuple[int, ...]]  # (fqn, chunk offsets): names one digest of a file


@dataclass(frozen=True)
class FileSpec:
    """One output file: its name, encoded header, tensors in data order and where each one begins.

    With checksums, ``header`` holds zero-filled digests; ``entries``, ``metadata`` (user metadata and
    provenance), ``pieces`` (each tensor's chunk boxes) and ``algorithm`` let :func:`fill_header` rebuild it.
    """

    name: str
    header: bytes
    tensors: tuple[str, ...]
    begins: Mapping[str, int]  # absolute file offset of each tensor's first byte
    size: int
    entries: tuple[HeaderEntry, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    pieces: Mapping[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = field(default_factory=dict)
    algorithm: str | None = None

    @property
    def piece_keys(self) -> list[PieceKey]:
        """Every digest this file's header needs (zero-size tensors need none: theirs is known)."""
        return [(fqn, offsets) for fqn, boxes in self.pieces.items() for offsets, _sizes in boxes]


def pack_files(specs: Sequence[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Greedy, order-preserving packing of tensors into groups of at most ``max_shard_size`` bytes."""
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_size = 0
    for spec in specs:
        n = spec.nbytes
        if current and current_size + n > max_shard_size:
            groups.append(current)
            current, current_size = [], 0
        current.append(spec)
        current_size += n
        if current_size > max_shard_size:  # a tensor larger than the limit: alone in its file
            groups.append(current)
            current, current_size = [], 0
    if current or not groups:
        groups.append(current)
    return groups


def _with_digests(spec: FileSpec, digests: Mapping[PieceKey, str] | None) -> dict[str, str]:
    """``spec``'s ``__metadata__``: user metadata, provenance, and the digests (zero-filled when ``None``)."""
    md = dict(spec.metadata)
    algorithm = spec.algorithm
    if algorithm is None:
        return md
    zero = sums.placeholder(algorithm)
    md[sums.ALGORITHM_KEY] = algorithm
    for e in spec.entries:
        boxes = spec.pieces.get(e.name, ())
        if not boxes:  # no bytes to write: the digest of nothing
            pieces = [sums.Piece((0,) * len(e.shape), e.shape, checksum(b"", algorithm))]
        else:
            pieces = [sums.Piece(o, s, zero if digests is None else digests[(e.name, o)]) for o, s in boxes]
        md[sums.CHECKSUM_PREFIX + e.name] = sums.encode_pieces(pieces, e.shape)
    md[sums.HEADER_KEY] = zero  # last, sealed by fill_header
    return md


def _file_spec(
    name: str,
    group: Sequence[TensorSpec],
    metadata: Mapping[str, str] | None,
    algorithm: str | None,
    boxes: Mapping[str, list[tuple[tuple[int, ...], tuple[int, ...]]]],
) -> FileSpec:
    ordered = sorted(group, key=lambda s: safetensors_order_key(s.fqn, s.dtype))
    entries, position = [], 0
    for s in ordered:
        entries.append(HeaderEntry(s.fqn, s.dtype, s.shape, position, position + s.nbytes))
        position += s.nbytes
    user = dict(metadata or {})
    if algorithm is not None:
        user[sums.WRITER_KEY] = writer_descriptor()
        user[sums.FORMAT_KEY] = "safetensors/1"
    pieces = {e.name: tuple(sorted(boxes.get(e.name, ()))) for e in entries}
    draft = FileSpec(name, b"", (), {}, 0, tuple(entries), user, pieces, algorithm)
    header = encode_header(entries, _with_digests(draft, None))
    begins = {e.name: len(header) + e.begin for e in entries}
    return FileSpec(
        name,
        header,
        tuple(e.name for e in entries),
        begins,
        len(header) + position,
        tuple(entries),
        user,
        pieces,
        algorithm,
    )


def fill_header(spec: FileSpec, digests: Mapping[PieceKey, str]) -> bytes:
    """``spec``'s header with the real digests and the sealed header digest; same length as planned."""
    if spec.algorithm is None:
        return spec.header
    missing = [f"{fqn!r} at {list(o)}" for fqn, o in spec.piece_keys if (fqn, o) not in digests]
    if missing:
        raise DcpStorageError(f"{spec.name}: no checksum arrived for the chunks {', '.join(missing[:5])}")
    header = encode_header(spec.entries, _with_digests(spec, digests))
    if len(header) != len(spec.header):
        raise DcpStorageError(
            f"{spec.name}: the header with checksums is {len(header)} bytes, planned {len(spec.header)} (a digest "
            "of the wrong width?)"
        )
    return sums.seal_header(header, spec.algorithm)


# ------------------------------------------------------------------------------------------- per rank
@dataclass(frozen=True)
class LocalOrder:
    """``SavePlan.storage_data`` of a local plan: the rank's tensor keys in state-dict order (pre-dedup)."""

    fqns: tuple[str, ...]


@dataclass(frozen=True)
class ChunkWrite:
    """One chunk a rank holds: the file it belongs to and the byte runs it fills there."""

    index: MetadataIndex
    rank: int
    fqn: str
    file: int
    begin: int  # absolute offset of the tensor in the file
    runs: RunSet
    offsets: tuple[int, ...] = ()  # the chunk's box, in elements (names its digest)
    sizes: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.runs.nbytes


@dataclass(frozen=True)
class TensorSchedule:
    """Stream mode, coordinator: one tensor of a file and the chunks that make it up, in run order."""

    fqn: str
    nbytes: int
    chunks: tuple[ChunkWrite, ...]


@dataclass(frozen=True)
class FileSchedule:
    name: str
    header: bytes
    tensors: tuple[TensorSchedule, ...]


@dataclass(frozen=True)
class RankWrites:
    """``SavePlan.storage_data`` of one rank's final plan: everything its ``write_data`` needs.

    ``mode`` ``"pwrite"``: write ``chunks`` in place into the temp files ``.{name}.{save_id}.tmp``.
    ``mode`` ``"stream"``: send ``sends`` (keys of ``chunks``), in order, to ``coordinator``; the coordinator
    (``schedule`` set) streams each file, tensor by tensor, receiving other ranks' chunks as it goes.
    """

    rank: int
    coordinator: int
    world: int
    mode: str
    save_id: str
    files: tuple[str, ...]
    chunks: Mapping[MetadataIndex, ChunkWrite] = field(default_factory=dict)
    sends: tuple[MetadataIndex, ...] = ()
    schedule: tuple[FileSchedule, ...] | None = None


@dataclass(frozen=True)
class SavePlanResult:
    files: tuple[FileSpec, ...]
    weight_map: dict[str, str]
    total_size: int
    byte_keys: tuple[str, ...]
    rank_writes: tuple[RankWrites, ...]

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    def index_json(self) -> bytes:
        """The HF index, formatted as ``save_pretrained`` writes it (sorted keys, 2-space indent)."""
        index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
        return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _ordered_fqns(plans: Sequence[SavePlan], tensor_fqns: set[str]) -> list[str]:
    seen: dict[str, None] = {}
    for plan in plans:
        if isinstance(plan.storage_data, LocalOrder):
            for fqn in plan.storage_data.fqns:
                if fqn in tensor_fqns:
                    seen.setdefault(fqn)
    for plan in plans:  # keys a rank's LocalOrder did not list (a planner that replaced storage_data)
        for item in plan.items:
            if item.index.fqn in tensor_fqns:
                seen.setdefault(item.index.fqn)
    return list(seen)


def _collect(plans: Sequence[SavePlan]) -> tuple[dict[str, TensorSpec], dict[str, list[tuple[int, Any]]], list[str]]:
    specs: dict[str, TensorSpec] = {}
    chunks: dict[str, list[tuple[int, Any]]] = {}
    byte_keys: list[str] = []
    seen_boxes: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                byte_keys.append(fqn)
                continue
            td = item.tensor_data
            if td is None:
                raise ValueError(f"{fqn}: write item of type {item.type} carries no tensor_data")
            torch_dtype = td.properties.dtype
            name = safetensors_dtype(torch_dtype)
            if name is None:
                raise UnsupportedDtypeError({fqn: torch_dtype})
            spec = TensorSpec(fqn, name, tuple(int(s) for s in td.size), torch_dtype.itemsize)
            prev = specs.setdefault(fqn, spec)
            if prev != spec:
                raise ValueError(
                    f"{fqn}: ranks disagree about the tensor ({prev.dtype} {list(prev.shape)} vs "
                    f"{spec.dtype} {list(spec.shape)} on rank {rank})"
                )
            box = (fqn, tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
            if box in seen_boxes:  # replicated and not deduplicated by the planner: one writer is enough
                continue
            seen_boxes.add(box)
            chunks.setdefault(fqn, []).append((rank, item.index, box[1], box[2]))
    for fqn, spec in specs.items():
        covered = sum(math.prod(sizes) for _r, _i, _o, sizes in chunks.get(fqn, []))
        if covered != math.prod(spec.shape):
            raise ValueError(
                f"{fqn}: the ranks' chunks hold {covered} of {math.prod(spec.shape)} elements of shape "
                f"{list(spec.shape)}; a safetensors file needs every element exactly once (overlapping or "
                "missing shards)"
            )
    return specs, chunks, byte_keys


def plan_save(
    plans: Sequence[SavePlan],
    *,
    max_shard_size: int,
    prefix: str,
    metadata: Mapping[str, str] | None,
    coordinator: int,
    mode: str,
    save_id: str,
    checksum_algorithm: str | None = None,
) -> SavePlanResult:
    """Plan files, offsets and each rank's writes from every rank's (deduplicated) ``SavePlan``.

    ``checksum_algorithm``: plan each header with zero-filled digests of every chunk (see :func:`fill_header`).
    """
    if mode not in ("pwrite", "stream"):
        raise ValueError(f"unknown write mode {mode!r}")
    specs, chunks, byte_keys = _collect(plans)
    order = _ordered_fqns(plans, set(specs))
    groups = pack_files([specs[f] for f in order], max_shard_size)
    n = len(groups)
    names = [single_name(prefix)] if n == 1 else [shard_name(prefix, k + 1, n) for k in range(n)]
    written: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for fqn, boxes in chunks.items():
        for _rank, _index, offsets, sizes in boxes:
            if math.prod(sizes) and specs[fqn].itemsize:
                written.setdefault(fqn, []).append((offsets, sizes))
    files = tuple(_file_spec(name, group, metadata, checksum_algorithm, written) for name, group in zip(names, groups))
    where: dict[str, int] = {}
    for i, f in enumerate(files):
        for fqn in f.tensors:
            where[fqn] = i

    per_rank: list[dict[MetadataIndex, ChunkWrite]] = [{} for _ in plans]
    by_fqn: dict[str, list[ChunkWrite]] = {}
    for fqn, boxes in chunks.items():
        spec, fi = specs[fqn], where[fqn]
        for rank, index, offsets, sizes in boxes:
            runs = chunk_runs(spec.shape, offsets, sizes, spec.itemsize)
            if runs.nbytes == 0:
                continue
            cw = ChunkWrite(index, rank, fqn, fi, files[fi].begins[fqn], runs, offsets, sizes)
            per_rank[rank][index] = cw
            by_fqn.setdefault(fqn, []).append(cw)
    for cws in by_fqn.values():
        cws.sort(key=lambda c: (c.runs.start, c.rank))

    schedule = None
    sends: list[list[MetadataIndex]] = [[] for _ in plans]
    if mode == "stream":
        file_schedules = []
        for f in files:
            tensors = []
            for fqn in f.tensors:
                cws = tuple(by_fqn.get(fqn, ()))
                for c in cws:
                    sends[c.rank].append(c.index)
                tensors.append(TensorSchedule(fqn, specs[fqn].nbytes, cws))
            file_schedules.append(FileSchedule(f.name, f.header, tuple(tensors)))
        schedule = tuple(file_schedules)

    names_t = tuple(f.name for f in files)
    rank_writes = tuple(
        RankWrites(
            rank=r,
            coordinator=coordinator,
            world=len(plans),
            mode=mode,
            save_id=save_id,
            files=names_t,
            chunks=per_rank[r],
            sends=tuple(sends[r]),
            schedule=schedule if r == coordinator else None,
        )
        for r in range(len(plans))
    )
    weight_map = {fqn: files[where[fqn]].name for fqn in order}
    total_size = sum(specs[f].nbytes for f in order)
    return SavePlanResult(files, weight_map, total_size, tuple(dict.fromkeys(byte_keys)), rank_writes)
