"""safetensors dtype names <-> torch dtypes (every dtype the format defines that torch has)."""

from __future__ import annotations

import torch

__all__ = ["SAFETENSORS_TO_TORCH", "TORCH_TO_SAFETENSORS", "safetensors_dtype", "torch_dtype"]


def _table() -> dict[str, torch.dtype]:
    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "I32": "int32",
        "U32": "uint32",
        "I64": "int64",
        "U64": "uint64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }
    return {st: getattr(torch, tn) for st, tn in names.items() if isinstance(getattr(torch, tn, None), torch.dtype)}


SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = _table()
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype for a safetensors dtype string, or ``None`` if unknown."""
    return SAFETENSORS_TO_TORCH.get(name)


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors dtype string for a torch dtype, or ``None`` if the format has none."""
    return TORCH_TO_SAFETENSORS.get(dtype)
