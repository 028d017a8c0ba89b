"""Bit-exact tensor comparisons for tests: dtype, shape and every byte (NaN payloads and -0.0 included)."""

from __future__ import annotations

from typing import Any

import torch

from dcp_storage._torch import local_shape_and_offset

__all__ = ["local_slice", "raw_bytes", "same_bits"]


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements, in row-major order, as a flat CPU ``uint8`` tensor (any device, any strides)."""
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes; ``torch.equal`` alone would call NaN != NaN and -0.0 == 0.0."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(raw_bytes(a), raw_bytes(b))


def local_slice(full: torch.Tensor, dt: Any) -> torch.Tensor:
    """The part of ``full`` that DTensor ``dt``'s local shard holds on this rank."""
    shape, offset = local_shape_and_offset(full.shape, dt.device_mesh, dt.placements)
    out = full
    for dim, (off, length) in enumerate(zip(offset, shape)):
        out = out.narrow(dim, off, length)
    return out
