"""Raw byte views of tensor memory, so transports can fill tensors in place.

A memoryview over a CPU tensor's bytes lets ``os.preadv`` or a socket read land directly in the
destination, with no intermediate buffer. (``Tensor.numpy()`` would do this too, but numpy is optional
and does not know bfloat16 or float8.)
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["host_buffer", "writable_bytes"]


def writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory.

    The caller must keep ``tensor`` alive while the view is used.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("writable_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def host_buffer(
    shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype, for_device: torch.device
) -> torch.Tensor:
    """A contiguous host tensor to stage bytes for ``for_device`` (pinned when that is a GPU)."""
    pin = for_device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)
