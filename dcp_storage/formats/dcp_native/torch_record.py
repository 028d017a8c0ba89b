"""A ``torch.save`` record of a tensor, parsed without running it, and the globals a ``.metadata`` pickle may name.

The globals a DCP ``.metadata`` pickle may name, and the stand-ins that replace torch's risky ones.

Shared by the guarded unpickler (:mod:`.metadata_io`) and the native decoder (:mod:`.native_decode`), which
matches globals by module and name against this table and never imports or calls what a file names.

Locating a tensor's raw bytes inside a ``torch.save`` zip record, without loading it.

DCP's native layout stores every tensor item as a complete ``torch.save`` archive (a zip of
``data.pkl``, ``byteorder``, ``data/<key>``, ...) at ``(offset, length)`` inside a ``.distcp`` file. torch
reads the whole archive, builds the full tensor and narrows it. We read only the first few KiB (the local
zip headers and the tiny ``data.pkl``), learn dtype, shape, strides and where the raw storage bytes start,
and then fetch exactly the bytes a rank needs, straight into the destination tensor.

``data.pkl`` is decoded with an allow-list that admits only what a plain tensor pickles to; anything else
(a tensor subclass, hooks, an exotic layout) is reported as unsupported and the caller falls back to
``torch.load(weights_only=True)`` on the whole record.
"""

from __future__ import annotations

import collections
import copyreg
import enum
import functools
import io
import math
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_md

from dcp_storage._torch import StorageInfo
from dcp_storage.errors import CorruptCheckpointError, UnsafeCheckpointError
from dcp_storage.formats.dcp_native.records import (
    UnsupportedRecord,
    check_record_zip,
    decode_tensor_pickle,
    walk_records,
)
from dcp_storage.formats.paths import check_view
from dcp_storage.formats.reading import SliceRead
from dcp_storage.formats.slices import is_row_major
from dcp_storage.safe_unpickle import AllowListUnpickler, StandInRefusal, globals_of

__all__ = [
    "NeedMoreBytes",
    "TensorRecord",
    "UnsupportedRecord",
    "check_record_zip",
    "load_tensor_record",
    "metadata_allow_list",
    "parse_tensor_record",
    "predicted_record",
    "relayout_whole",
    "tensor_of_record",
    "tensor_over_record",
]


def _layout_by_name(name: str) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout`` that only looks names up."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise ValueError(f"unknown torch layout {name!r}")


def _enum_member(cls: Any, name: Any) -> Any:
    """Stand-in for ``builtins.getattr``: only ``getattr(EnumClass, member_name)``.

    Early Python 3.11 releases (Debian 12's 3.11.2 among them; 3.11.7 no longer) pickle an enum member as
    ``getattr(cls, name)`` instead of ``cls(value)``, so ``.metadata`` written there, by torch or by us,
    names ``builtins.getattr`` for DCP's ``_MEM_FORMAT_ENCODING``. ``cls`` comes from the allow-list like every global; anything but a member
    of an allow-listed enum is refused.
    """
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise StandInRefusal("builtins.getattr", f"allowed only for an enum member, not getattr({cls!r}, {name!r})")


def _torch_constants() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout_by_name,
    }
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


def metadata_allow_list() -> dict[tuple[str, str], Any]:
    """Every global a DCP ``.metadata`` pickle may name."""
    allowed = _torch_constants()
    allowed.update(
        globals_of(
            dcp_md,
            [
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            ],
        )
    )
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = StorageInfo
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    # torch's FileSystemWriter records the checkpoint path as a pathlib object in StorageMeta.
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    allowed[("builtins", "getattr")] = allowed[("__builtin__", "getattr")] = _enum_member
    allowed[("copyreg", "_reconstructor")] = copyreg._reconstructor
    allowed[("copy_reg", "_reconstructor")] = copyreg._reconstructor
    for name, obj in (
        ("object", object),
        ("set", set),
        ("frozenset", frozenset),
        ("tuple", tuple),
        ("list", list),
        ("dict", dict),
    ):
        allowed[("builtins", name)] = obj
        allowed[("__builtin__", name)] = obj
    return allowed


class NeedMoreBytes(Exception):
    """The prefix given is too short to reach the tensor's data; retry with at least ``needed`` bytes."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


@dataclass(frozen=True)
class TensorRecord:
    """Where and how one saved tensor's elements lie, relative to the start of its record."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    data_start: int  # byte offset of the storage bytes, relative to the record start
    storage_nbytes: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def is_row_major(self) -> bool:
        return is_row_major(self.shape, self.stride)


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None  # None for UntypedStorage (bytes)
    numel: int

    @property
    def nbytes(self) -> int:
        if self.dtype is None:
            return self.numel
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class _Spec:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class _StorageType:
    """Stand-in for ``torch.FloatStorage`` & co. in the allow-list; one shared instance per name.

    Immutable on purpose: pickle's ``BUILD`` opcode can target any object on the stack, so a malicious
    ``data.pkl`` could otherwise rewrite a shared instance's ``dtype`` and make every later record
    (of any checkpoint, in this process) decode with the wrong dtype.
    """

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype | None) -> None:
        object.__setattr__(self, "dtype", dtype)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")


def _rebuild_v2(
    storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None
) -> _Spec:
    if not isinstance(storage, _StorageRef) or storage.dtype is None or hooks or metadata:
        raise UnsupportedRecord("tensor with hooks, conj/neg bits or untyped storage")
    return _Spec(storage, int(storage_offset), tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> _Spec:
    if not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype) or hooks or metadata:
        raise UnsupportedRecord("tensor with hooks, conj/neg bits (torch.load applies them) or unknown dtype")
    return _Spec(storage, int(storage_offset), tuple(size), tuple(stride), dtype)


def _legacy_storage_dtypes() -> dict[str, torch.dtype]:
    """``torch.FloatStorage`` and friends by name, read without touching the deprecated classes."""
    import warnings

    out: dict[str, torch.dtype] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(torch):
            value = getattr(torch, name, None)
            if name.endswith("Storage") and isinstance(value, type):
                dtype = getattr(value, "dtype", None)
                if isinstance(dtype, torch.dtype):
                    out[name] = dtype
    return out


def _allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch", "UntypedStorage"): _StorageType(None),
        ("torch.storage", "UntypedStorage"): _StorageType(None),
    }
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    for name, dtype in _legacy_storage_dtypes().items():
        allowed[("torch", name)] = _StorageType(dtype)
    return allowed


_ALLOWED = _allowed()


class _DataPklUnpickler(AllowListUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsupportedRecord(f"global {module}.{name}") from None


def _persistent_load(pid: Any) -> _StorageRef:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise UnsupportedRecord(f"persistent id {pid!r}")
    _, storage_type, key, _location, numel = pid
    if not isinstance(storage_type, _StorageType):
        raise UnsupportedRecord("unknown storage type")
    return _StorageRef(str(key), storage_type.dtype, int(numel))


# Records of tensors that share shape, dtype and storage key start with identical bytes up to their data:
# parsed once, found again by those bytes (a few hundred records per checkpoint, a handful of shapes).
_RECORD_CACHE_LIMIT = 4096
_record_cache: dict[bytes, TensorRecord] = {}
_prefix_lengths: dict[int, None] = {}  # distinct data_start values seen, in first-seen order


def parse_tensor_record(prefix: memoryview | bytes, record_len: int, path: str) -> TensorRecord:
    """Parse the start of a ``torch.save`` tensor record.

    ``prefix`` holds the first bytes of the record (the whole record works too); ``record_len`` is the
    record's full length from the metadata. Raises :class:`NeedMoreBytes`, :class:`UnsupportedRecord` or
    :class:`CorruptCheckpointError` (naming ``path``).
    """
    buf = memoryview(prefix).cast("B") if not isinstance(prefix, memoryview) else prefix
    for length in tuple(_prefix_lengths):  # a copy: another thread's load may add a length meanwhile
        if length <= len(buf):
            hit = _record_cache.get(bytes(buf[:length]))
            if hit is not None:
                _check_fits(hit.data_start, hit.storage_nbytes, record_len, path)
                return hit
    record = _parse_record(buf, record_len, path)
    if len(_record_cache) >= _RECORD_CACHE_LIMIT:
        _record_cache.clear()
        _prefix_lengths.clear()
    _record_cache[bytes(buf[: record.data_start])] = record
    _prefix_lengths.setdefault(record.data_start)
    return record


def _check_fits(data_start: int, data_size: int, record_len: int, path: str) -> None:
    if data_start + data_size > record_len:
        raise CorruptCheckpointError(
            f"{path}: tensor data ends at byte {data_start + data_size} of a {record_len}-byte record (truncated?)"
        )


def _parse_record(buf: memoryview, record_len: int, path: str) -> TensorRecord:
    """:func:`parse_tensor_record` without the cache: everything it returns depends only on
    ``buf[:data_start]``, plus the check that the data fits in ``record_len``."""
    entries = walk_records(buf, record_len, path)
    pkl = next((n for n in entries if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl is None:
        if len(buf) < record_len:
            raise NeedMoreBytes(min(record_len, 2 * len(buf) + 4096))
        raise CorruptCheckpointError(f"{path}: torch.save record has no data.pkl entry")
    root = pkl[: -len("data.pkl")]
    start, size = entries[pkl]
    if size is None:
        raise NeedMoreBytes(min(record_len, 2 * len(buf) + 4096))
    pkl_bytes = bytes(buf[start : start + size])
    result = decode_tensor_pickle(pkl_bytes, _ALLOWED, _persistent_load)
    if result is None:  # not the canonical form: the full allow-list unpickler decodes and classifies it
        try:
            result = _DataPklUnpickler(io.BytesIO(pkl_bytes), path, _ALLOWED, _persistent_load).load()
        except (UnsupportedRecord, UnsafeCheckpointError):
            raise UnsupportedRecord("data.pkl is not a plain tensor") from None
        except Exception as exc:
            raise CorruptCheckpointError(f"{path}: cannot decode the tensor's data.pkl ({exc})") from exc
    if not isinstance(result, _Spec):
        raise UnsupportedRecord("data.pkl is not a single tensor")
    spec: _Spec = result
    order = entries.get(f"{root}byteorder")
    if order is not None and order[1] is not None and bytes(buf[order[0] : order[0] + order[1]]) != b"little":
        raise UnsupportedRecord("big-endian record")
    data = entries.get(f"{root}data/{spec.storage.key}")
    if data is None:
        if len(buf) < record_len:
            raise NeedMoreBytes(min(record_len, 2 * len(buf) + 4096))
        raise CorruptCheckpointError(f"{path}: torch.save record has no data/{spec.storage.key} entry")
    data_start, data_size = data
    if data_size is None:
        data_size = spec.storage.nbytes
    _check_fits(data_start, data_size, record_len, path)
    if data_size != spec.storage.nbytes:
        raise CorruptCheckpointError(
            f"{path}: storage data/{spec.storage.key} holds {data_size} bytes, data.pkl says {spec.storage.nbytes}"
        )
    check_view(spec.size, spec.stride, spec.storage_offset, spec.dtype.itemsize, data_size, path)
    return TensorRecord(spec.dtype, spec.size, spec.stride, spec.storage_offset, data_start, data_size)


def tensor_over_record(data: memoryview, rec: TensorRecord) -> torch.Tensor:
    """A tensor over ``data`` (a whole record) as ``rec`` describes it; shares memory with ``data``."""
    if rec.storage_nbytes == 0:
        return torch.empty(rec.shape, dtype=rec.dtype)
    raw = data[rec.data_start : rec.data_start + rec.storage_nbytes]
    if raw.readonly:
        raw = memoryview(bytearray(raw))
    flat = torch.frombuffer(raw, dtype=torch.uint8).view(rec.dtype)
    return flat.as_strided(rec.shape, rec.stride, rec.storage_offset)


# A record's zip uses 64-bit fields from 4 GiB on, which changes the bytes around its data: no layout guessed there.
_ZIP32_BELOW = (1 << 32) - (1 << 20)


def predicted_record(dtype: torch.dtype, shape: tuple[int, ...], record_len: int) -> TensorRecord | None:
    """The layout of a ``record_len``-byte record holding a row-major tensor of ``dtype`` and ``shape``, if it is
    laid out as this process's ``torch.save`` lays out such a tensor; ``None`` if its length says otherwise.

    Why: on an object store, learning each record's header first costs a round of requests before any data;
    a record whose length is exactly header + data + trailer of torch's own layout can have its header and
    data fetched together. A guess only: the caller parses the header bytes that came with the data and
    reads the record again the usual way unless :func:`parse_tensor_record` gives exactly this.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 < nbytes < _ZIP32_BELOW:
        return None
    head, tail = _header_bytes(dtype, len(shape)), _trailer_bytes(nbytes % 64)
    if head is None or tail is None or head + nbytes + tail != record_len:
        return None
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return TensorRecord(dtype, tuple(shape), stride, 0, head, nbytes)


def relayout_whole(work: SliceRead, guess: TensorRecord, real: TensorRecord) -> bool:
    """For a read planned on the layout ``guess`` whose header says ``real``: if only the strides differ and
    ``work`` read the whole tensor (so its bytes are the whole storage), check those bytes and lay them out in
    the destination as ``real`` says. ``True`` if done; ``False``: the slice must be read again.

    Why: torch's writer saves transposed and channels_last tensors as they are, with the length of a row-major
    record, so their layout is guessed wrong; reading them again would fetch every such tensor twice.
    """
    placed = (real.dtype, real.shape, real.data_start, real.storage_nbytes, real.storage_offset)
    plain = work.window is None and work.strided is None and work.mapped is None
    if placed != (guess.dtype, guess.shape, guess.data_start, guess.storage_nbytes, 0) or not plain:
        return False
    if tuple(work.lengths) != tuple(real.shape):  # a slice of the tensor: not the storage it read
        return False
    landed = work.staging if work.staging is not None else work.dest
    if work.check is not None:
        work.check(landed)  # the bytes as stored, before they move
    flat = landed.reshape(-1) if work.staging is not None else landed.reshape(-1).clone()
    work.dest.copy_(flat.as_strided(real.shape, real.stride))
    work.staging, work.requests = None, []
    return True


@functools.lru_cache(maxsize=256)
def _header_bytes(dtype: torch.dtype, ndim: int) -> int | None:
    """Bytes before the data in this torch's record of a ``dtype`` tensor of ``ndim`` dimensions (the pickle of
    a larger shape is a few bytes longer, which the 64-byte alignment of the data almost always absorbs)."""
    return _layout_of((1,) * ndim, dtype)[0]


@functools.lru_cache(maxsize=64)
def _trailer_bytes(rest: int) -> int | None:
    """Bytes after the data in this torch's record of a tensor of ``64 * k + rest`` bytes (the entries after the
    data are padded to 64-byte alignment, so only the remainder matters)."""
    return _layout_of((64 + rest,), torch.uint8)[1]


def _layout_of(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int | None, int | None]:
    buffer = io.BytesIO()
    try:
        torch.save(torch.zeros(shape, dtype=dtype), buffer)
        raw = buffer.getvalue()
        rec = parse_tensor_record(raw, len(raw), "<torch.save layout>")
    except Exception:  # a dtype this torch cannot make, save or we cannot parse (quantized ones): no guess
        return None, None
    return rec.data_start, len(raw) - rec.data_start - rec.storage_nbytes


_FORBIDDEN = re.compile(r"(?:GLOBAL|global)\s+([\w.]+(?:\s*\.\s*\w+)?)")


def load_tensor_record(data: bytes | memoryview, path: str) -> Any:
    """Load a whole record with ``torch.load(weights_only=True)``, after :func:`check_record_zip` (torch's
    reader would pick its own entries and inflate whatever sizes they declare); map refusals to our errors. A
    tensor must be a view that expands its storage by at most the broadcast limit (:func:`~..limits.check_view`)."""
    check_record_zip(data, path)
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        if "Weights only load failed" in text or "weights_only" in text:
            match = _FORBIDDEN.search(text)
            raise UnsafeCheckpointError(
                path, match.group(1) if match else "unknown global", "weights_only=True refused it"
            ) from None
        raise CorruptCheckpointError(
            f"{path}: cannot decode a torch.save record ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(loaded, torch.Tensor) and loaded.layout == torch.strided:
        stored = loaded.untyped_storage().nbytes()
        check_view(tuple(loaded.shape), loaded.stride(), loaded.storage_offset(), loaded.element_size(), stored, path)
    return loaded


def tensor_of_record(data: bytes | memoryview, where: str, check_zip: bool) -> torch.Tensor:
    """The tensor a whole record holds: a view of ``data`` where our parser reads the record, else
    :func:`load_tensor_record`'s; its zip (layout, CRC-32s) checked first when ``check_zip``."""
    if check_zip:
        check_record_zip(data, where)
    try:
        return tensor_over_record(memoryview(data), parse_tensor_record(memoryview(data), len(data), where))
    except (UnsupportedRecord, NeedMoreBytes):
        value = load_tensor_record(data, where)
    if not isinstance(value, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: record holds a {type(value).__name__}, not a tensor")
    return value
