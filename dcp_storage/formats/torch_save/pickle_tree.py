"""Decoding a ``torch.save`` ``data.pkl`` into a tree of tensor descriptors, with an allow-list.

``torch.load`` unpickles ``data.pkl`` and, for each tensor, reads its storage. We unpickle it with
:class:`~dcp_storage.safe_unpickle.AllowListUnpickler`, resolving only what a state dict pickles to (plain
containers, ``OrderedDict``, ``set``, ``torch.Size``, dtypes, devices, storage classes, bytes via
``_codecs.encode``, tensors via ``torch._utils._rebuild_tensor_v2``/``_v3``, parameters via
``_rebuild_parameter``), and tensors become :class:`TensorDescriptor` objects: storage key, dtype, shape,
stride and storage offset, without reading a byte of storage. Globals the user registered with torch
(``torch.serialization.add_safe_globals`` / ``safe_globals``, :mod:`..safe_globals`) are accepted as
``torch.load(weights_only=True)`` accepts them. Any other global raises
:class:`~dcp_storage.errors.UnsafeCheckpointError` before it is resolved, so a malicious payload never runs
(the same guarantee as ``torch.load(weights_only=True)``, with a smaller allow-list); the message names the
global and both ways out.

``trust=True`` (an explicit opt-in, for files from a trusted source only) decodes as
``torch.load(weights_only=False)`` would: any other global is imported and called as pickle does, so the
file can run code. Tensors still become descriptors; nothing else changes.

:func:`scan_legacy` applies the same allow-list to the legacy (pre-1.6, ``_use_new_zipfile_serialization=
False``) format, so that such a file is refused as unsafe when it is, and as unsupported otherwise.
"""

from __future__ import annotations

import codecs
import collections
import io
import math
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dcp_storage.errors import CorruptCheckpointError, UnsafeCheckpointError
from dcp_storage.formats.paths import check_view
from dcp_storage.safe_unpickle import AllowListUnpickler, with_registered_globals

__all__ = ["LEGACY_MAGIC", "LegacyNeedsMoreBytes", "TensorDescriptor", "decode_data_pkl", "scan_legacy"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER


@dataclass(frozen=True)
class TensorDescriptor:
    """A tensor of the archive, not loaded: its elements are in record ``data/<storage_key>``.

    Element ``i`` of the storage is at byte ``i * itemsize`` of that record; the tensor is
    ``storage.as_strided(shape, stride, storage_offset)``.
    """

    storage_key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_nbytes: int

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class _StorageRef:
    key: str
    nbytes: int
    dtype: torch.dtype | None  # None: an UntypedStorage (the tensor's rebuild call names the dtype)


class _StorageType:
    """What a storage class name in a persistent id resolves to: only its element dtype matters."""

    def __init__(self, name: str, dtype: torch.dtype | None) -> None:
        self.name = name
        self.dtype = dtype

    def __repr__(self) -> str:  # errors quote persistent ids: the class name, never an object address
        return f"torch.{self.name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # a storage class called from the pickle
        raise UnsafeCheckpointError("", f"torch.{self.name}", "storage constructor called outside a persistent id")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _ints(value: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)) or not all(type(v) is int and v >= 0 for v in value):
        raise CorruptCheckpointError(f"{where}: tensor {what} {value!r} is not a tuple of non-negative ints")
    return tuple(value)


#: How to load a file the allow-list refuses, appended to the refusal ({} is the global's dotted name).
WAYS_OUT = (
    "if you trust this file and where it came from: allow that global with "
    "torch.serialization.add_safe_globals([{}]) (or inside torch.serialization.safe_globals([...])), or decode the "
    "whole file as torch.load(weights_only=False) would with trust=True (dcp-storage convert --trust)"
)


class _TrustingUnpickler(AllowListUnpickler):
    """``trust=True``: the allow-list's stand-ins first (tensors stay descriptors), then any global, as pickle does."""

    check_state = False  # any global may run anyway; only sizes and parsing are checked before unpickling

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        return pickle.Unpickler.find_class(self, module, name)


class _Decoder:
    """One ``data.pkl``: the allow-list and the storages seen so far."""

    def __init__(self, where: str, legacy: bool = False, trust: bool = False) -> None:
        self.where = where
        self.legacy = legacy
        self.trust = trust
        self.storages: dict[str, _StorageRef] = {}
        self.allowed = with_registered_globals(self._allowed())

    # ------------------------------------------------------------------------------------ globals
    def _allowed(self) -> dict[tuple[str, str], Any]:
        allowed: dict[tuple[str, str], Any] = {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_v3,
            ("torch._utils", "_rebuild_parameter"): self._rebuild_parameter,
            ("torch", "Size"): torch.Size,
            ("torch", "device"): self._device,
            ("_codecs", "encode"): self._encode,
        }
        for module in ("builtins", "__builtin__"):  # protocol 2 names the builtins module __builtin__
            for name, value in (("set", set), ("frozenset", frozenset), ("complex", complex), ("slice", slice)):
                allowed[(module, name)] = value
        for name in dir(torch):
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                allowed[("torch", name)] = value
        for name, dtype in _storage_classes().items():
            allowed[("torch", name)] = _StorageType(name, dtype)
        allowed[("torch.storage", "UntypedStorage")] = _StorageType("UntypedStorage", None)
        return allowed

    def _encode(self, text: Any, encoding: Any = "utf-8") -> bytes:
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
            raise CorruptCheckpointError(
                f"{self.where}: unexpected _codecs.encode({type(text).__name__}, {encoding!r})"
            )
        return codecs.encode(text, encoding)

    def _device(self, spec: Any, index: Any = None) -> torch.device:
        if not isinstance(spec, str) or not (index is None or type(index) is int):
            raise CorruptCheckpointError(f"{self.where}: unexpected torch.device arguments {spec!r}, {index!r}")
        return torch.device(spec) if index is None else torch.device(spec, index)

    # ------------------------------------------------------------------------------------ storages
    def persistent_load(self, pid: Any) -> _StorageRef:
        # zip format: ("storage", storage_type, key, location, numel)
        # legacy format: ("storage", storage_type, root_key, location, numel, view_metadata)
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
            raise CorruptCheckpointError(f"{self.where}: unexpected persistent id {pid!r:.200}")
        storage_type, key, numel = pid[1], pid[2], pid[4]
        if len(pid) == 6 and pid[5] is not None:
            raise CorruptCheckpointError(f"{self.where}: legacy storage views are not supported")
        if (
            not isinstance(storage_type, _StorageType)
            or not isinstance(key, str)
            or type(numel) is not int
            or numel < 0
        ):
            raise CorruptCheckpointError(f"{self.where}: malformed storage reference {pid!r:.200}")
        nbytes = numel if storage_type.dtype is None else numel * _itemsize(storage_type.dtype)
        ref = _StorageRef(key, nbytes, storage_type.dtype)
        seen = self.storages.setdefault(key, ref)
        if seen.nbytes != ref.nbytes:
            raise CorruptCheckpointError(
                f"{self.where}: storage {key!r} is referenced with sizes {seen.nbytes} and {ref.nbytes}"
            )
        if seen.dtype != ref.dtype and None not in (seen.dtype, ref.dtype):  # torch.load keeps the first
            raise CorruptCheckpointError(
                f"{self.where}: storage {key!r} is referenced as {seen.dtype} and as {ref.dtype}; torch.save "
                "writes one dtype per storage (the file was edited or is damaged)"
            )
        return ref

    # ------------------------------------------------------------------------------------ tensors
    def _tensor(
        self, storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: torch.dtype
    ) -> TensorDescriptor:
        if not isinstance(storage, _StorageRef):
            raise CorruptCheckpointError(
                f"{self.where}: a tensor's storage is a {type(storage).__name__}, not a storage"
            )
        shape = _ints(size, "shape", self.where)
        strides = _ints(stride, "stride", self.where)
        if len(shape) != len(strides) or type(storage_offset) is not int or storage_offset < 0:
            raise CorruptCheckpointError(
                f"{self.where}: tensor shape {shape}, stride {strides}, offset {storage_offset!r} disagree"
            )
        where = f"{self.where}: storage {storage.key!r}"
        check_view(shape, strides, storage_offset, _itemsize(dtype), storage.nbytes, where)
        return TensorDescriptor(storage.key, dtype, shape, strides, int(storage_offset), storage.nbytes)

    def _rebuild_v2(
        self,
        storage: Any,
        storage_offset: Any,
        size: Any,
        stride: Any,
        requires_grad: Any = False,
        backward_hooks: Any = None,
        metadata: Any = None,
    ) -> TensorDescriptor:
        if not isinstance(storage, _StorageRef) or storage.dtype is None:
            raise CorruptCheckpointError(f"{self.where}: _rebuild_tensor_v2 needs a typed storage")
        self._plain_view(metadata)
        return self._tensor(storage, storage_offset, size, stride, storage.dtype)

    def _rebuild_v3(
        self,
        storage: Any,
        storage_offset: Any,
        size: Any,
        stride: Any,
        requires_grad: Any,
        backward_hooks: Any,
        dtype: Any,
        metadata: Any = None,
    ) -> TensorDescriptor:
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{self.where}: _rebuild_tensor_v3 with dtype {dtype!r}")
        self._plain_view(metadata)
        return self._tensor(storage, storage_offset, size, stride, dtype)

    def _plain_view(self, metadata: Any) -> None:
        """Refuse a view whose values are not its stored elements (a lazy conjugate or negative, ``t.conj()``):
        its slices are read as raw elements, which would drop the bit and load the wrong values."""
        if metadata:
            raise CorruptCheckpointError(
                f"{self.where}: a tensor is stored as a view with {sorted(metadata) if isinstance(metadata, dict) else metadata} "
                "bits set (a lazy conj() or neg()), which this reader cannot apply to ranged reads; load the file with "
                "torch.load, or save t.resolve_conj().resolve_neg() instead"
            )

    def _rebuild_parameter(self, data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> TensorDescriptor:
        if not isinstance(data, TensorDescriptor):
            raise CorruptCheckpointError(f"{self.where}: a Parameter wraps a {type(data).__name__}, not a tensor")
        return data

    # ------------------------------------------------------------------------------------ loading
    def unpickler(self, stream: io.BytesIO) -> AllowListUnpickler:
        kind = _TrustingUnpickler if self.trust else AllowListUnpickler
        return kind(stream, self.where, self.allowed, self.persistent_load)


def _storage_classes() -> dict[str, torch.dtype | None]:
    """``torch.FloatStorage`` and friends, and ``torch.UntypedStorage``, by name (warnings silenced)."""
    out: dict[str, torch.dtype | None] = {"UntypedStorage": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(torch):
            if not name.endswith("Storage") or name in ("UntypedStorage", "TypedStorage"):
                continue
            value = getattr(torch, name, None)
            dtype = getattr(value, "dtype", None) if isinstance(value, type) else None
            if isinstance(dtype, torch.dtype):
                out[name] = dtype
    return out


def decode_data_pkl(data: bytes, where: str, trust: bool = False) -> tuple[Any, dict[str, int]]:
    """Decode ``data.pkl``: the object tree (tensors as :class:`TensorDescriptor`) and storage sizes by key.

    Raises :class:`UnsafeCheckpointError` for a global outside the allow-list (nothing is executed) and
    :class:`CorruptCheckpointError` for anything malformed. ``trust``: see the module docstring.
    """
    decoder = _Decoder(where, trust=trust)
    try:
        obj = decoder.unpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise _refusal(exc, where) from None
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any other decoder failure means the bytes are garbage
        raise CorruptCheckpointError(f"{where}: data.pkl is not a valid pickle ({type(exc).__name__}: {exc})") from None
    _check_depth(obj, where)
    return obj, {k: r.nbytes for k, r in decoder.storages.items()}


def _refusal(exc: UnsafeCheckpointError, where: str) -> UnsafeCheckpointError:
    """The refusal naming the file, the global, and (for a global refused by the allow-list) the ways out."""
    detail = exc.detail
    if not detail and "." in exc.forbidden:  # a global the allow-list lacks, not a refused use of an allowed one
        detail = WAYS_OUT.format(exc.forbidden)
    return UnsafeCheckpointError(exc.path or where, exc.forbidden, detail)


MAX_DEPTH = 100  # containers inside containers; real state dicts nest a handful of levels


def _check_depth(tree: Any, where: str) -> None:
    """Refuse containers nested deeper than :data:`MAX_DEPTH`, without recursion.

    A pickle builds ``[[[...]]]`` 200,000 levels deep from a few hundred kilobytes and without any
    recursion; everything that walks the tree afterwards (flattening it as DCP does, ``torch.save`` of a
    value) recurses and would raise ``RecursionError``. Each container is visited once (pickles can make
    cycles), so the cost is linear in the tree.
    """
    containers = (dict, list, tuple, set, frozenset)
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(tree, 1)] if isinstance(tree, containers) else []
    while todo:
        node, depth = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: values nested more than {MAX_DEPTH} levels deep")
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        todo.extend((child, depth + 1) for child in children if isinstance(child, containers))


class LegacyNeedsMoreBytes(Exception):
    """The legacy pickle stream runs past the bytes given; retry with more of the file."""


def scan_legacy(prefix: bytes, where: str, complete: bool) -> None:
    """Check a legacy-format ``torch.save`` file's pickles with the allow-list, without running anything.

    ``prefix`` is the start of the file (``complete`` if it is the whole file). Returns when the stream's
    magic number, protocol version, system info and object all decode with the allow-list; raises
    :class:`UnsafeCheckpointError` for a forbidden global, :class:`LegacyNeedsMoreBytes` when ``prefix``
    ends too early, :class:`CorruptCheckpointError` otherwise.
    """
    decoder = _Decoder(where, legacy=True)
    stream = io.BytesIO(prefix)
    try:
        for _ in range(4):  # magic number, protocol version, sys info, the object
            decoder.unpickler(stream).load()
    except UnsafeCheckpointError as exc:
        raise _refusal(exc, where) from None
    except CorruptCheckpointError:
        raise
    except (EOFError, pickle.UnpicklingError) as exc:
        if not complete:
            raise LegacyNeedsMoreBytes() from None
        raise CorruptCheckpointError(f"{where}: truncated legacy torch.save pickle ({exc})") from None
    except Exception as exc:  # noqa: BLE001
        raise CorruptCheckpointError(
            f"{where}: not a valid legacy torch.save pickle ({type(exc).__name__}: {exc})"
        ) from None


def is_legacy_head(head: bytes) -> bool:
    """Does the file start with a pickle of torch's legacy magic number? (Decoded with no globals allowed.)"""
    try:
        value = AllowListUnpickler(io.BytesIO(head), "", {}).load()
    except Exception:  # noqa: BLE001 - anything but a plain int pickle: not the legacy format
        return False
    return type(value) is int and value == LEGACY_MAGIC
