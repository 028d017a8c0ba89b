"""Structural checks of a decoded DCP ``Metadata``, so that a hostile ``.metadata`` fails where it is read.

The allow-list unpickler guarantees that only DCP's classes, dtypes and plain containers come out of a
``.metadata`` file; it says nothing about their values. A hostile (or damaged) file can still hold a
storage entry naming ``../../x`` or ``s3://another-bucket/...``, a negative or 2**63 offset, a dtype that
is a string, a shape whose byte count overflows, a chunk outside its tensor, or a tensor chunk with no
storage entry. Unchecked, each of these surfaces later as an ``OverflowError``, ``TypeError`` or
``RuntimeError`` inside torch's planner or our readers, naming no file, or as elements silently left
unloaded. :func:`metadata_problems` lists every such problem; ``load_metadata`` raises them together as
one :class:`~dcp_storage.errors.CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from dcp_storage._torch import StorageInfo
from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.formats.paths import BROADCAST_BYTES, MAX_BYTES, MAX_DIM, MAX_NDIM, check_relative
from dcp_storage.formats.reading import tiling_problem

__all__ = ["check_metadata", "metadata_problems"]

_MAX_LISTED = 5
_PROPERTY_TYPES = (
    ("layout", torch.layout),
    ("memory_format", torch.memory_format),
    ("requires_grad", bool),
    ("pin_memory", bool),
)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dims(value: Any) -> list[int] | None:
    """``value`` as a list of int64 dimensions (a ``torch.Size``, list or tuple), else ``None``."""
    if type(value) is torch.Size:  # ints only (fast path): the count, the sign and int64's range to check
        if not value:
            return []
        return list(value) if len(value) <= MAX_NDIM and min(value) >= 0 and max(value) <= MAX_DIM else None
    if not isinstance(value, (torch.Size, list, tuple)) or len(value) > MAX_NDIM:
        return None
    if not all(_int(v) and 0 <= v <= MAX_DIM for v in value):
        return None
    return [int(v) for v in value]


def _tensor_problems(
    fqn: str, item: TensorStorageMetadata, storage: dict[Any, Any], described: dict[tuple[str, tuple[int, ...]], int]
) -> list[str]:
    """What is wrong with tensor ``fqn``; records each sound chunk's bytes in ``described`` (for :func:`_repeats`)."""
    props = getattr(item, "properties", None)
    dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return [f"tensor {fqn!r} has dtype {dtype!r}, not a torch dtype"]
    odd = [name for name, kind in _PROPERTY_TYPES if not isinstance(getattr(props, name, None), kind)]
    if odd:
        return [f"tensor {fqn!r} has malformed properties ({', '.join(odd)})"]
    problems: list[str] = []
    raw_size = getattr(item, "size", None)
    size = _dims(raw_size)
    if size is None:
        if isinstance(raw_size, (torch.Size, list, tuple)) and len(raw_size) > MAX_NDIM:
            return [f"tensor {fqn!r} has a size of {len(raw_size)} dimensions (at most {MAX_NDIM})"]
        return [f"tensor {fqn!r} has size {raw_size!r}, not a list of non-negative integers"]
    if math.prod(size) * dtype.itemsize > MAX_BYTES:
        return [f"tensor {fqn!r} of shape {size} ({dtype}) would need more than 2**63 - 1 bytes"]
    chunks = getattr(item, "chunks", None)
    if not isinstance(chunks, list):
        return [f"tensor {fqn!r} has no chunk list"]
    boxes: list[tuple[list[int], list[int]]] = []
    itemsize = dtype.itemsize
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            problems.append(f"tensor {fqn!r} has a chunk of type {type(chunk).__name__}")
            continue
        offsets, sizes = _dims(chunk.offsets), _dims(chunk.sizes)
        if (
            offsets is None
            or sizes is None
            or len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + n > s for o, n, s in zip(offsets, sizes, size))
        ):
            problems.append(f"tensor {fqn!r} chunk at {chunk.offsets!r} of size {chunk.sizes!r} lies outside {size}")
            continue
        boxes.append((offsets, sizes))
        described[(fqn, tuple(offsets))] = math.prod(sizes) * itemsize
        if MetadataIndex(fqn, offsets) not in storage:  # its __init__ makes the torch.Size
            problems.append(f"tensor {fqn!r} chunk at {offsets} has no storage entry")
    tiling = None if problems else tiling_problem(size, boxes)
    if tiling is not None:
        problems.append(f"tensor {fqn!r}: {tiling}")
    return problems


def _relative_problem(rel: Any, what: str, seen: dict[str, str | None]) -> str | None:
    """:func:`check_relative`'s complaint about ``rel``, once per distinct path (a checkpoint names a few
    data files from millions of entries)."""
    if isinstance(rel, str) and rel in seen:
        problem = seen[rel]
        return None if problem is None else f"{what}: {problem}"
    try:
        check_relative(rel, what)
    except CorruptCheckpointError as exc:
        if isinstance(rel, str):
            seen[rel] = str(exc).removeprefix(f"{what}: ")
        return str(exc)
    if isinstance(rel, str):
        seen[rel] = None
    return None


def _storage_problems(
    index: Any, info: Any, state: dict[str, Any], path: str, seen: dict[str, str | None] | None = None
) -> list[str]:
    if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
        return [f"storage map key {index!r} is not a MetadataIndex"]
    what = f"storage entry for {index.fqn!r}"
    if index.fqn not in state:
        return [f"{what}: the state dict metadata has no such key"]
    rel = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    problems: list[str] = []
    relative = _relative_problem(rel, what, {} if seen is None else seen)
    if relative is not None:
        problems.append(relative)
    if not (_int(offset) and _int(length)):
        problems.append(f"{what}: offset {offset!r} and length {length!r} must be integers")
    elif offset < 0 or length < 0 or offset + length > MAX_BYTES:
        problems.append(f"{what}: byte range offset {offset}, length {length} is impossible")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms is not None and not (
        isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)
    ):
        problems.append(f"{what}: transform_descriptors {transforms!r} must be a list of strings")
    return problems


def _incomplete(obj: Any, fields: dict[type, frozenset[str]] | None = None) -> list[str]:
    """The dataclass fields ``obj`` lacks (a pickle can build an instance without ``__init__``).

    ``fields`` caches each class's field names: a ``.metadata`` holds millions of objects of six classes.
    An instance whose ``__dict__`` holds every field is complete without looking further.
    """
    cls = type(obj)
    names = fields.get(cls) if fields is not None else None
    if names is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            names = frozenset()
        else:
            names = frozenset(f.name for f in dataclasses.fields(obj))
        if fields is not None:
            fields[cls] = names
    if not names or names <= getattr(obj, "__dict__", {}).keys():
        return []
    return sorted(name for name in names if not hasattr(obj, name))


def _missing_fields(metadata: Metadata) -> list[str]:
    fields: dict[type, frozenset[str]] = {}
    out: list[str] = []

    def check(obj: Any) -> None:
        missing = _incomplete(obj, fields)
        if missing:
            out.append(f"a {type(obj).__name__} lacks {', '.join(missing)}")

    check(metadata.storage_meta)
    for item in metadata.state_dict_metadata.values():
        check(item)
        check(getattr(item, "properties", None))
        for chunk in getattr(item, "chunks", None) or ():
            check(chunk)
    for index, info in metadata.storage_data.items():
        check(index)
        check(info)
    return out


def metadata_problems(metadata: Metadata, path: str) -> list[str]:
    """Every structural problem of ``metadata`` (read from ``path``); empty when it is sound."""
    try:
        return _problems(metadata, path)
    except Exception as exc:  # noqa: BLE001 - objects a hostile pickle built half-way break any access
        return [f"malformed metadata objects ({type(exc).__name__}: {exc})"]


def _problems(metadata: Metadata, path: str) -> list[str]:
    missing = _incomplete(metadata)
    if missing:
        return [f"the Metadata object lacks {', '.join(missing)}"]
    state = metadata.state_dict_metadata
    if not isinstance(state, dict):
        return [f"state_dict_metadata is a {type(state).__name__}, not a dict"]
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return ["carries no storage map" if storage is None else f"the storage map is a {type(storage).__name__}"]
    meta = metadata.storage_meta
    if meta is not None and not isinstance(meta, StorageMeta):
        return [f"storage_meta is a {type(meta).__name__}, not a StorageMeta"]
    unserved = _more_chunks_than_records(state, storage)
    if unserved:
        return [unserved]
    missing = _missing_fields(metadata)
    if missing:
        return missing
    problems: list[str] = []
    described: dict[tuple[str, tuple[int, ...]], int] = {}  # (fqn, chunk offsets) -> bytes its elements take
    for fqn, item in state.items():
        if not isinstance(fqn, str):
            problems.append(f"state dict key {fqn!r} is not a string")
        elif isinstance(item, TensorStorageMetadata):
            problems += _tensor_problems(fqn, item, storage, described)
        elif isinstance(item, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                problems.append(f"value {fqn!r} has no storage entry")
        else:
            problems.append(f"{fqn!r} has metadata of type {type(item).__name__}")
    # One pass over the storage map: each entry's own checks, the byte ranges of each file (for _shared_bytes,
    # with the first overlap of neighbours while a file's entries ascend, as writers append them) and the bytes
    # records describe beyond what they store (wanted only when nothing else is wrong).
    seen: dict[str, str | None] = {}
    ranges: dict[str, list[tuple[int, int, str]]] = {}  # file -> (offset, end, key) of every sound entry
    unsorted: set[str] = set()  # files whose entries do not ascend: sorted before their sweep
    first: dict[str, tuple[tuple[int, int, str], tuple[int, int, str]]] = {}  # the first overlapping neighbours
    cap, total, counting = BROADCAST_BYTES.bytes, 0, not problems
    excess: str | Exception | None = None
    for index, info in storage.items():
        sound = False
        if type(index) is MetadataIndex and type(info) is StorageInfo:  # what torch writes: checked inline
            fqn, rel, offset, length = index.fqn, info.relative_path, info.offset, info.length
            sound = (  # exactly what _storage_problems accepts without a word, for a file name already judged
                type(fqn) is str
                and type(rel) is str
                and type(offset) is int
                and type(length) is int
                and fqn in state
                and seen.get(rel, rel) is None
                and 0 <= offset
                and 0 <= length
                and offset + length <= MAX_BYTES
                and info.transform_descriptors is None
            )
        if not sound:
            found = _storage_problems(index, info, state, path, seen)
            if found:
                problems += found
                counting = False
                continue
            fqn, rel, offset, length = index.fqn, info.relative_path, info.offset, info.length
        if length > 0:
            span = (offset, offset + length, fqn)
            spans = ranges.get(rel)
            if spans is None:
                ranges[rel] = [span]
            else:
                if offset < spans[-1][0]:
                    unsorted.add(rel)
                elif offset < spans[-1][1] and rel not in first:
                    first[rel] = (spans[-1], span)
                spans.append(span)
        if counting and not info.transform_descriptors:
            off = index.offset  # a torch.Size hashes and compares as the tuple of its dimensions
            try:
                nbytes = described.get((fqn, off if type(off) is torch.Size else tuple(off or ())))
            except Exception as exc:  # noqa: BLE001 - an offset a pickle made up: raised below if nothing else is wrong
                excess, counting = exc, False
                nbytes = None
            if nbytes is not None and nbytes > length:
                total += nbytes - length
                if total > cap:
                    excess, counting = _repeats(fqn, rel, total, cap), False
    if first or unsorted:
        shared = _shared_bytes(ranges, unsorted, first)
        if shared and not _safetensors_layout(state, storage):
            problems += shared
    if isinstance(excess, Exception) and not problems:
        raise excess
    if excess is not None and not problems:
        problems.append(str(excess))
    return problems


def _more_chunks_than_records(state: dict[str, Any], storage: dict[Any, Any]) -> str | None:
    """Counted before anything walks the chunks: every chunk and every value needs a storage entry of its own
    (distinct keys), but a pickle can list one tensor entry of k chunks under n keys at a few bytes a key (a
    memo reference), n * k chunks from a file of n + k objects. Walking those would take minutes and, with a
    message per chunk lacking an entry, gigabytes."""
    chunks = values = 0
    for item in state.values():
        if isinstance(item, BytesStorageMetadata):
            values += 1
        elif isinstance(getattr(item, "chunks", None), list):
            chunks += len(item.chunks)
    if chunks + values <= len(storage):
        return None
    return (
        f"the state dict lists {chunks} chunks and {values} values but the storage map has {len(storage)} "
        "entries; each chunk and each value needs one of its own"
    )


def _repeats(fqn: str, rel: str, total: int, cap: int) -> str:
    """Records together may describe at most :data:`~..limits.BROADCAST_BYTES` more than they store.

    A record holds its chunk's elements (plus a zip around them), so one shorter than its chunk describes a
    broadcast view, each checked alone when decoded. N of them, a few hundred bytes each, would make
    ``convert`` write and ``verify --deep`` read N times the limit. Items stored through an extension
    (compression) have their own bound, per item, and are not counted. :func:`_problems` adds up, in storage
    order, what each entry's chunk (``described``) holds beyond the entry's length; this is the complaint about
    the entry ``(fqn, rel)`` that took the ``total`` past ``cap``."""
    return (
        f"its records, up to {fqn!r} in {rel!r}, describe {total} bytes more than they store (broadcast views), "
        f"more than {cap} bytes; refusing to expand them. If it is genuine, set {BROADCAST_BYTES.env} to a larger "
        "number of bytes"
    )


def _safetensors_layout(state: dict[str, Any], storage: dict[Any, Any]) -> bool:
    """Whether this is torch's DCP-safetensors layout, whose storage entries of one file may overlap: a tensor
    entry exactly its elements' bytes long (a native record adds a zip around them; as
    :mod:`.sniff` tells the layouts apart)."""
    for fqn, item in state.items():
        if isinstance(item, TensorStorageMetadata):
            for chunk in item.chunks:
                info = storage.get(MetadataIndex(fqn, chunk.offsets))
                nbytes = math.prod(chunk.sizes) * item.properties.dtype.itemsize
                if info is not None and nbytes > 0 and info.length == nbytes and not info.transform_descriptors:
                    return True
    return False


def _shared_bytes(
    ranges: dict[str, list[tuple[int, int, str]]],
    unsorted: set[str],
    first: dict[str, tuple[tuple[int, int, str], tuple[int, int, str]]],
) -> list[str]:
    """Entries whose byte ranges overlap in one file: no writer stores two items in the same bytes, and two
    keys of one dtype and shape read from one record would load the same values silently. Writers append
    records in order, so only the files in ``unsorted`` are sorted and swept here; for the others the
    collecting loop found the first overlapping neighbours (``first``)."""
    problems: list[str] = []
    for rel, spans in ranges.items():
        pair = first.get(rel)
        if rel in unsorted:
            spans = sorted(spans)
            pair = next(((a, b) for a, b in zip(spans, spans[1:]) if b[0] < a[1]), None)
        if pair is not None:
            (_begin, end, key), (begin, next_end, other) = pair
            problems.append(
                f"storage entries for {key!r} and {other!r} overlap in {rel!r} (bytes [{begin}, "
                f"{min(end, next_end)}) are claimed twice); each item is stored in its own bytes"
            )
    return problems


def check_metadata(metadata: Metadata, path: str) -> Metadata:
    """``metadata`` if :func:`metadata_problems` finds nothing, else one error naming ``path`` and them all."""
    problems = metadata_problems(metadata, path)
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CorruptCheckpointError(f"{path}: corrupt or hostile checkpoint metadata: {shown}{more}")
    return metadata
