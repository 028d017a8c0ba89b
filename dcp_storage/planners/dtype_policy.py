"""``DtypePolicy``: which stored-dtype -> destination-dtype conversions a load accepts.

Loading *is* casting already: every DCP reader ends in ``dest.copy_(src)``, which converts to the
destination's dtype (ours read straight into the destination when the dtypes agree, else into a staging
buffer of the stored dtype that is then ``copy_``'d). So a bf16 checkpoint loads into fp32 parameters,
and back, bit-exactly as ``tensor.to(dtype)`` would convert it. The policy decides only which of those
conversions are intended; the planner checks every tensor in ``create_local_plan``, before any I/O, and
raises :class:`~dcp_storage.planners.errors.DtypeMismatchError` listing the refused ones.

* ``DtypePolicy.cast()`` (the default): cast within a kind (float <-> float, int <-> int,
  complex <-> complex); refuse across kinds (a float checkpoint into an int tensor is usually a bug).
* ``DtypePolicy.exact()``: every dtype must match.
* ``DtypePolicy.explicit({torch.bfloat16: torch.float32})``: only the listed stored -> destination
  conversions (plus exact matches).
* ``DtypePolicy.unchecked()``: whatever ``copy_`` does (torch's ``DefaultLoadPlanner`` behaviour).

The metadata-from-state-dict planners (``DynamicMetaLoadPlanner``) describe tensors with the destination's
dtype, so there the check cannot see a stored dtype; the reader's ``copy_`` still casts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["DtypePolicy"]

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
