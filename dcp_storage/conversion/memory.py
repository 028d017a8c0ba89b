"""Giving freed tensor memory back to the OS between tensors.

Streaming allocates and frees one tensor-sized block per tensor. glibc raises its mmap threshold after the
first large block is freed (up to 32 MiB), so later tensors come from the heap, and freed heap blocks are not
always reused or returned: resident memory can then grow by a tensor per tensor written. ``malloc_trim(0)``
returns free heap pages to the OS; :class:`MemoryReleaser` calls it after every large tensor (or every
``every_bytes`` of small ones). A no-op where there is no glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

__all__ = ["MemoryReleaser", "malloc_trim"]

MiB = 1024 * 1024


def _load_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _load_trim()


def malloc_trim() -> bool:
    """Return free heap memory to the OS (glibc); ``False`` where unavailable."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class MemoryReleaser:
    """Call :meth:`freed` with each tensor's size once it is dropped; trims after large frees."""

    def __init__(self, large_bytes: int = 4 * MiB, every_bytes: int = 64 * MiB) -> None:
        self.large_bytes = large_bytes
        self.every_bytes = every_bytes
        self._pending = 0

    def freed(self, nbytes: int) -> None:
        self._pending += nbytes
        if nbytes >= self.large_bytes or self._pending >= self.every_bytes:
            self._pending = 0
            malloc_trim()
