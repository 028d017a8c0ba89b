"""Hand-made safetensors bytes for tests: valid files of any dtype, and deliberately broken ones."""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from dcp_storage.formats.safetensors.header import TORCH_TO_SAFETENSORS


def blob(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    """``u64 length`` + ``header`` (a JSON-able object, or raw bytes as they are) + ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaN payloads and all); bools are 0/1."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def every_dtype_tensors(seed: int = 7) -> dict[str, torch.Tensor]:
    """One tensor per dtype the format defines (and torch has), plus 0-dim and zero-size ones."""
    out: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(sorted(TORCH_TO_SAFETENSORS, key=str)):
        name = TORCH_TO_SAFETENSORS[dtype].lower()
        out[f"t_{name}"] = random_tensor(dtype, (6, 5), seed + i)
    out["scalar_f32"] = random_tensor(torch.float32, (), seed + 100)
    out["scalar_i64"] = random_tensor(torch.int64, (), seed + 101)
    out["empty_rows"] = torch.empty(0, 4, dtype=torch.float16)
    out["empty_1d"] = torch.empty(0, dtype=torch.int32)
    return out


def torch_reference(seed: int = 11) -> dict[str, torch.Tensor]:
    """What the torch-writer checkpoints hold: every dtype at (6, 5), an uneven matrix, 0-dim, zero-size."""
    out = every_dtype_tensors(seed)
    out["w_uneven"] = random_tensor(torch.float32, (7, 9), seed + 200)
    return out
