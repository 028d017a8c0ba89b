"""Planning loads over metadata columns, and ``DtypePolicy`` (the stored -> destination dtype conversions a load
accepts).

``DtypePolicy``: which stored-dtype -> destination-dtype conversions a load accepts.

Loading *is* casting already: every DCP reader ends in ``dest.copy_(src)``, which converts to the
destination's dtype (ours read straight into the destination when the dtypes agree, else into a staging
buffer of the stored dtype that is then ``copy_``'d). So a bf16 checkpoint loads into fp32 parameters,
and back, bit-exactly as ``tensor.to(dtype)`` would convert it. The policy decides only which of those
conversions are intended; the planner checks every tensor in ``create_local_plan``, before any I/O, and
raises :class:`~dcp_storage.planners.key_map.DtypeMismatchError` listing the refused ones.

* ``DtypePolicy.cast()`` (the default): cast within a kind (float <-> float, int <-> int,
  complex <-> complex); refuse across kinds (a float checkpoint into an int tensor is usually a bug).
* ``DtypePolicy.exact()``: every dtype must match.
* ``DtypePolicy.explicit({torch.bfloat16: torch.float32})``: only the listed stored -> destination
  conversions (plus exact matches).
* ``DtypePolicy.unchecked()``: whatever ``copy_`` does (torch's ``DefaultLoadPlanner`` behaviour).

The metadata-from-state-dict planners (``DynamicMetaLoadPlanner``) describe tensors with the destination's
dtype, so there the check cannot see a stored dtype; the reader's ``copy_`` still casts.

The planners' core on a ``.metadata``'s columns: the same checks and read items, without torch's objects.

:func:`~.matching.check_values` and :func:`~.matching.build_read_items` come here when the metadata is
lazy metadata over columns (:func:`~dcp_storage.formats.columns.columns_of`). The result
is exactly what they give on torch's ``Metadata`` (same errors and messages, same ``ReadItem``\\ s, equal and
in the same order); what changes is the cost at a million tensors:

* an entry is found by its row (one ``{name: row}`` dict), its shape and dtype read from arrays; no
  ``TensorStorageMetadata`` is built for a tensor stored whole in one chunk;
* such a tensor loaded into a plain tensor (the usual case) gets its ``ReadItem`` built directly: the
  zero offsets are one ``torch.Size`` per number of dimensions, the lengths one per distinct shape, the
  destination and storage ``MetadataIndex`` one object when the keys are equal (they are then equal in
  every field), and the frozen dataclasses filled as torch's unpickling fills them (``object.__new__``
  and ``object.__setattr__`` in field order), not through their ``__init__``;
* everything else (chunked tensors, values, DTensor and other destinations, empty tensors) goes through
  torch's own ``_create_read_items`` on the entry built for that key alone.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from dcp_storage._torch import create_read_items
from dcp_storage.formats.columns import MetadataColumns

__all__ = ["DtypePolicy", "PLAIN_TENSORS", "plan_on_columns", "whole_single_chunk"]


_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


def dtype_kind(dtype: torch.dtype) -> str:
    """``"bool"``, ``"complex"``, ``"float"``, ``"quantized"`` or ``"int"``."""
    if dtype == torch.bool:
        return "bool"
    if dtype in _QUANTIZED:
        return "quantized"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "int"


@dataclass(frozen=True)
class DtypePolicy:
    """Which dtype conversions a load accepts; build with the named factories."""

    name: str
    accepts: Callable[[torch.dtype, torch.dtype], bool]
    fix: str = ""

    def __repr__(self) -> str:
        return self.name

    def allows(self, stored: torch.dtype, dest: torch.dtype) -> bool:
        """Whether a tensor stored as ``stored`` may load into a destination of dtype ``dest``."""
        return stored == dest or self.accepts(stored, dest)

    @staticmethod
    def cast() -> DtypePolicy:
        """Cast to the destination's dtype within a kind (float<->float, int<->int, complex<->complex)."""
        return DtypePolicy(
            "DtypePolicy.cast()",
            lambda stored, dest: dtype_kind(stored) == dtype_kind(dest) and dtype_kind(stored) != "quantized",
            "DtypePolicy.cast() only casts within a kind (float<->float, int<->int); allow these with "
            "DtypePolicy.explicit({stored: destination}) or DtypePolicy.unchecked()",
        )

    @staticmethod
    def exact() -> DtypePolicy:
        """Every destination must have the stored dtype."""
        return DtypePolicy(
            "DtypePolicy.exact()",
            lambda stored, dest: False,
            "DtypePolicy.exact() refuses every conversion; use DtypePolicy.cast() to cast to the destination",
        )

    @staticmethod
    def explicit(dtype_map: Mapping[torch.dtype, torch.dtype]) -> DtypePolicy:
        """Only these ``{stored dtype: destination dtype}`` conversions (and exact matches)."""
        table = dict(dtype_map)
        for k, v in table.items():
            if not isinstance(k, torch.dtype) or not isinstance(v, torch.dtype):
                raise TypeError(f"DtypePolicy.explicit needs torch.dtype -> torch.dtype, got {k!r} -> {v!r}")
        shown = ", ".join(f"{k}: {v}" for k, v in table.items())
        return DtypePolicy(
            f"DtypePolicy.explicit({{{shown}}})",
            lambda stored, dest: table.get(stored) == dest,
            "add the conversion to the dtype_map",
        )

    @staticmethod
    def unchecked() -> DtypePolicy:
        """Accept whatever ``Tensor.copy_`` accepts (torch's ``DefaultLoadPlanner`` behaviour)."""
        return DtypePolicy("DtypePolicy.unchecked()", lambda stored, dest: True)


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
"""Destination types read as one whole chunk (torch's ``_create_chunk_list`` for a plain tensor)."""

_new = object.__new__
_set = object.__setattr__
_TENSOR = LoadItemType.TENSOR


def whole_single_chunk(cols: MetadataColumns) -> np.ndarray:
    """Per entry: a tensor of at least one element stored as one chunk covering it (offsets 0, sizes = shape)."""
    n, c = len(cols.names), cols.chunk_count
    per_entry = np.diff(cols.chunk_at)
    if c == n and (per_entry == 1).all() and np.array_equal(cols.box_at, cols.shape_at):
        # a chunk per entry, laid out like the shapes (safetensors; DCP unsharded): compared element by element,
        # with no index arrays unless some element differs (a million entries: ~60 MB fewer temporaries)
        odd = (cols.chunk_offsets != 0) | (cols.chunk_sizes != cols.dims) | (cols.dims == 0)
        out = ~cols.is_bytes
        if odd.any():
            out &= np.bincount(np.repeat(np.arange(n), np.diff(cols.shape_at))[odd], minlength=n) == 0
        return out
    entry_of_chunk = np.repeat(np.arange(n), per_entry)
    dims_per_chunk = np.diff(cols.box_at)
    chunk_of_elem = np.repeat(np.arange(c), dims_per_chunk)
    # element e of chunk k's box is dimension e - box_at[k] of its tensor's shape
    aligned = np.arange(len(cols.chunk_offsets)) + (cols.shape_at[entry_of_chunk] - cols.box_at[:-1])[chunk_of_elem]
    bad = (cols.chunk_offsets != 0) | (cols.chunk_sizes != cols.dims[aligned])
    whole = np.bincount(chunk_of_elem[bad], minlength=c) == 0
    empty = np.zeros(n, dtype=bool)
    empty[np.repeat(np.arange(n), np.diff(cols.shape_at))[cols.dims == 0]] = True
    first = np.minimum(cols.chunk_at[:-1], max(c - 1, 0))
    return (per_entry == 1) & ~cols.is_bytes & ~empty & (whole[first] if c else False)


def plan_on_columns(
    state_dict: Mapping[str, Any],
    metadata: Metadata,
    cols: MetadataColumns,
    rows: Mapping[str, int],
    pairs: Mapping[str, str],
    dtype_policy: DtypePolicy,
    named: Any,
    size_of: Any,
    dtype_of: Any,
    build: bool = True,
) -> tuple[list[str], list[str], list[str], dict[str, tuple[torch.dtype, torch.dtype]], list[ReadItem]]:
    """:func:`~.matching.check_values`'s findings (kinds, shapes, dtypes, casts) and, with ``build`` and when
    there are none, :func:`~.matching.build_read_items`'s items: one pass over the pairs, from the columns."""
    kinds: list[str] = []
    shapes: list[str] = []
    dtypes: list[str] = []
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    items: list[ReadItem] = []
    # per-entry columns as compact sequences (bytes, array), not lists: 1-8 bytes an entry instead of 8 plus an int
    # object, which at a million entries is the planning's peak
    is_bytes = cols.is_bytes.astype(np.uint8).tobytes()
    shape_at = array("q", cols.shape_at.astype(np.int64).tobytes())
    dims = array("q", cols.dims.astype(np.int64).tobytes())
    prop = array("i", cols.prop.astype(np.int32).tobytes())
    simple = whole_single_chunk(cols).astype(np.uint8).tobytes() if build else b""
    stored_dtypes = [p.dtype for p in cols.properties]
    entry = metadata.state_dict_metadata.entry  # type: ignore[attr-defined]
    allowed: dict[tuple[Any, Any], bool] = {}
    zeros: dict[int, torch.Size] = {}
    lengths: dict[torch.Size, torch.Size] = {}
    plain = PLAIN_TENSORS
    append = items.append
    new, put, kind = _new, _set, _TENSOR
    for key, ckpt_key in pairs.items():
        r = rows[ckpt_key]
        value = state_dict[key]
        if not is_bytes[r]:
            shape = tuple(dims[shape_at[r] : shape_at[r + 1]])
            is_plain = type(value) in plain
            size = value.shape if is_plain else size_of(value)
            if size is None:
                kinds.append(
                    f"{named(key, ckpt_key)}: checkpoint holds a tensor of shape {shape}, "
                    f"state dict a {type(value).__name__}"
                )
                continue
            if shape != tuple(size):
                shapes.append(f"{named(key, ckpt_key)}: checkpoint has shape {shape}, state dict has {tuple(size)}")
                continue
            dest = value.dtype if is_plain else dtype_of(value)
            stored = stored_dtypes[prop[r]]
            if not (dest is stored or dest is None or stored is None or dest == stored):
                ok = allowed.get((stored, dest))
                if ok is None:
                    ok = allowed[(stored, dest)] = dtype_policy.allows(stored, dest)
                if ok:
                    casts[key] = (stored, dest)
                else:
                    dtypes.append(f"{named(key, ckpt_key)}: checkpoint stores {stored}, destination is {dest}")
            if not build or kinds or shapes or dtypes:
                continue  # planning fails: no items
            if is_plain and simple[r]:  # a whole tensor in one whole chunk: its one ReadItem, built directly
                length = lengths.get(size)
                if length is None:
                    length = lengths[size] = size
                zero = zeros.get(len(size))
                if zero is None:
                    zero = zeros[len(size)] = torch.Size([0] * len(size))
                index = new(MetadataIndex)  # as MetadataIndex(key, zero, 0) (its __init__'s order)
                put(index, "fqn", key)
                put(index, "index", 0)
                put(index, "offset", zero)
                if key != ckpt_key:
                    stored_index = new(MetadataIndex)
                    put(stored_index, "fqn", ckpt_key)
                    put(stored_index, "index", 0)
                    put(stored_index, "offset", zero)
                else:
                    stored_index = index
                item = new(ReadItem)  # as ReadItem(...), fields in order; through its __dict__: at a million
                fields = item.__dict__  # items half the time of six object.__setattr__ calls, +60 bytes each
                fields["type"] = kind
                fields["dest_index"] = index
                fields["dest_offsets"] = zero
                fields["storage_index"] = stored_index
                fields["storage_offsets"] = zero
                fields["lengths"] = length
                append(item)
                continue
        if not build or kinds or shapes or dtypes:
            continue
        # A DTensor on a submesh this rank is not part of has nothing to load here (as in torch).
        if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
            continue
        for item in create_read_items(ckpt_key, entry(r), value):
            if key != ckpt_key:
                d = item.dest_index
                item = dataclasses.replace(item, dest_index=MetadataIndex(key, d.offset, d.index))
            append(item)
    return kinds, shapes, dtypes, casts, items
