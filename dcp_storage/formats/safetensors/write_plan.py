"""Global planning of a safetensors save (which file holds each tensor, where, who writes what) and checking its
checksums.

Global planning of a Hugging Face safetensors save: which file holds each tensor, where, and who writes what.

Pure functions over DCP ``SavePlan``s; no I/O. The coordinator calls :func:`plan_save` with every rank's
plan and gets back the files (names, headers, sizes), the index, and for every rank the byte runs its
chunks occupy in those files.

Files. Tensors are taken in a deterministic order (the order of the ranks' state dicts: rank 0's keys
first, then keys only later ranks hold) and packed into files by :mod:`.file_plan` (which also plans each
header and its digests). One file is named ``{prefix}.safetensors`` and has no index; several are
``{prefix}-0000k-of-0000N.safetensors`` plus ``{prefix}.safetensors.index.json`` (names from
:mod:`dcp_storage.formats.paths`).

Chunks. A rank holds a row-major box of a tensor (``chunk.offsets``/``chunk.sizes``). In the row-major full
tensor that box is a regular set of equally long byte runs (:class:`~dcp_storage.formats.slices.RunSet`,
from :func:`~dcp_storage.formats.slices.row_major_runs`): a ``Shard(0)`` chunk is one run, a ``Shard(1)``
chunk of an ``R x C`` matrix is ``R`` runs. The chunk's own bytes, read in order, fill those runs in
order, so a rank can write its chunk in place without gathering anything.

The names the converters and tests import from here (:func:`parse_size`, :func:`pack_files`,
:class:`TensorSpec`, :func:`chunk_runs`, the file names) are re-exported from their homes.

Checking safetensors files against the checksums their headers record, for ``verify`` (``--deep``).

Shallow: every file says whether it records checksums; those that do have their header digest and the
coverage of their tensors checked (two small reads per file). Deep: every recorded digest is compared,
reading each tensor's bytes in pieces of at most ``piece_bytes`` when its pieces are contiguous byte ranges
(a ``Shard(0)`` chunk, or a tensor written whole), or the tensor whole when a piece is strided (a
``Shard(1)`` chunk): memory stays near the largest such tensor. Every problem names URL, range and key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from dcp_storage.errors import DcpStorageError, NonTensorStateError, UnsupportedDtypeError
from dcp_storage.formats.paths import EXTRA_STATE_FILE, index_name, shard_name, single_name
from dcp_storage.formats.safetensors.checksums import FileSums, Piece
from dcp_storage.formats.safetensors.encode import (
    FileSpec,
    PieceKey,
    TensorSpec,
    file_spec,
    fill_header,
    pack_files,
    parse_size,
)
from dcp_storage.formats.safetensors.header import safetensors_dtype
from dcp_storage.formats.slices import RunSet
from dcp_storage.formats.slices import row_major_runs as chunk_runs
from dcp_storage.integrity.blocks import PIECE_BYTES, no_checksums_note
from dcp_storage.integrity.checksums import mismatch, new_hasher

__all__ = [
    "ChunkWrite",
    "FileSchedule",
    "FileSpec",
    "LocalOrder",
    "PieceKey",
    "RankWrites",
    "RunSet",
    "SavePlanResult",
    "TensorSpec",
    "check_file",
    "chunk_runs",
    "fill_header",
    "index_name",
    "local_order",
    "pack_files",
    "parse_size",
    "plan_save",
    "report_safetensors_checksums",
    "safetensors_provenance",
    "shard_name",
    "single_name",
]


# ------------------------------------------------------------------------------------------- per rank
@dataclass(frozen=True)
class LocalOrder:
    """``SavePlan.storage_data`` of a local plan: the rank's tensor keys in state-dict order (pre-dedup)."""

    fqns: tuple[str, ...]


def local_order(plan: SavePlan, *, allow_extra_state: bool) -> LocalOrder:
    """``plan``'s tensor keys in state-dict order, once its items are known to fit safetensors.

    Raises :class:`~dcp_storage.errors.UnsupportedDtypeError` naming every key whose dtype safetensors
    lacks, and, unless ``allow_extra_state``, :class:`~dcp_storage.errors.NonTensorStateError` naming every
    non-tensor entry.
    """
    bad_dtypes: dict[str, object] = {}
    byte_keys: list[str] = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            byte_keys.append(item.index.fqn)
        elif item.tensor_data is not None and safetensors_dtype(item.tensor_data.properties.dtype) is None:
            bad_dtypes[item.index.fqn] = item.tensor_data.properties.dtype
    if bad_dtypes:
        raise UnsupportedDtypeError(bad_dtypes)
    if byte_keys and not allow_extra_state:
        raise NonTensorStateError(
            byte_keys,
            fix=f"pass allow_extra_state=True to write them to {EXTRA_STATE_FILE} beside the weights, "
            "or leave them out of the state dict",
        )
    return LocalOrder(tuple(dict.fromkeys(i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO)))


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
    files = tuple(file_spec(name, group, metadata, checksum_algorithm, written) for name, group in zip(names, groups))
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


def _contiguous_range(piece: Piece, shape: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """``[begin, end)`` of the piece inside its tensor's bytes, when it is one run; else ``None``."""
    runs = chunk_runs(shape, piece.offsets, piece.sizes, itemsize)
    if runs.count > 1:
        return None
    return (runs.start, runs.start + runs.nbytes)


def check_file(
    transport: Any, path: str, *, deep: bool, piece_bytes: int = PIECE_BYTES
) -> tuple[FileSums | None, list[str], int]:
    """The file's checksums, the problems found and how many digests were compared."""
    try:
        sums, header = FileSums.read(transport, path)
    except DcpStorageError as exc:
        return None, [str(exc)], 0
    if not sums.present:
        return sums, [], 0
    problems = [p for p in (sums.header_problem(),) if p]
    problems += sums.coverage_problems(header.tensors)
    if problems or not deep:
        return sums, problems, 0
    compared = 0
    for name, entry in header.tensors.items():
        shape, itemsize = entry.shape, entry.dtype.itemsize
        base = header.data_start + entry.begin
        span = f"bytes [{base}, {base + entry.nbytes})"
        pieces = sums.pieces(name, shape)
        if isinstance(pieces, str):  # reported by coverage_problems
            continue
        ranges = [_contiguous_range(p, shape, itemsize) for p in pieces]
        if all(r is not None for r in ranges):
            for piece, r in zip(pieces, ranges):
                lo, hi = r  # type: ignore[misc]
                hasher = new_hasher(sums.algorithm or "")
                for at in range(base + lo, base + hi, piece_bytes):
                    hasher.update(transport.read_range(path, at, min(at + piece_bytes, base + hi)))
                compared += 1
                got = hasher.hexdigest()
                if got != piece.digest:
                    problems.append(
                        f"{sums.url} bytes [{base + lo}, {base + hi}) (holding {piece.describe(name)}): "
                        f"{mismatch(sums.algorithm, piece.digest)}: the stored "
                        "bytes changed after they were written"
                    )
            continue
        raw = bytes(transport.read_range(path, base, base + entry.nbytes))
        full = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        problem = sums.check_tensor(name, shape, itemsize, full, span)
        compared += len(pieces)
        if problem:
            problems.append(problem)
    return sums, problems, compared


def _mismatch_key(problem: str) -> str:
    """What tells two reports of one checksum mismatch apart: the chunk and the digest, not the byte span read."""
    at = problem.find("(holding ")
    return problem[at:] if at >= 0 else problem


def report_safetensors_checksums(report: Any, transport: Any, paths: list[str], *, deep: bool) -> None:
    """Add the checksum findings of the safetensors files ``paths`` to a ``VerifyReport``."""
    with_sums, without, compared, writers, algorithms = 0, 0, 0, set(), set()
    for path in paths:
        sums, problems, n = check_file(transport, path, deep=deep)
        # once: the deep read of the tensor may have reported the same chunk's mismatch, over its own byte span
        seen = {_mismatch_key(q) for q in report.problems}
        report.problems.extend(p for p in problems if _mismatch_key(p) not in seen)
        compared += n
        if sums is None:
            continue
        if sums.present:
            with_sums += 1
            writers.add(sums.writer or "unknown writer")
            algorithms.add(sums.algorithm or "unknown algorithm")
        else:
            without += 1
    if with_sums == 0:
        if not deep:
            report.notes.append(
                no_checksums_note(
                    "not dcp-storage's SafetensorsWriter: safetensors files written by others carry no checksum"
                )
            )
        return
    written_by = ", ".join(sorted(writers))
    if deep:
        report.checked["checksum_records"] = compared
        report.notes.append(
            f"{', '.join(sorted(algorithms))} checksums of {compared} tensor pieces in {with_sums} files checked "
            f"(written by {written_by})" + (f"; {without} files record none" if without else "")
        )
    elif not report.deep:
        report.notes.append(
            f"header checksums of {with_sums} files checked ({', '.join(sorted(algorithms))} checksums of the "
            "tensor data: pass --deep)" + (f"; {without} files record none" if without else "")
        )


def safetensors_provenance(
    transport: Any, paths: list[str], known: Mapping[str, FileSums] | None = None
) -> dict[str, Any]:
    """Provenance for ``inspect`` from the headers of ``paths``: format, writer, checksums (empty if none).

    ``known``: path -> the checksums of a header the caller already read and parsed (not read again)."""
    writers, formats, algorithms, records, without = set(), set(), set(), 0, 0
    for path in paths:
        sums = (known or {}).get(path)
        try:
            if sums is None:
                sums, _header = FileSums.read(transport, path)
        except DcpStorageError as exc:
            return {"error": str(exc)}
        if not sums.present and sums.writer is None:
            without += 1
            continue
        writers.add(sums.writer or "unknown")
        formats.add(sums.format or "safetensors")
        if sums.algorithm:
            algorithms.add(sums.algorithm)
        records += sum(1 if not v.startswith("[") else v.count('"') // 2 for v in sums.values.values())
    if not writers:
        return {}
    out: dict[str, Any] = {
        "format": ", ".join(sorted(formats)),
        "writer": ", ".join(sorted(writers)),
        "extensions": [],
        "checksums": ", ".join(sorted(algorithms)) or None,
        "checksummed_records": records,
    }
    if without:
        out["files_without_provenance"] = without
    return out
