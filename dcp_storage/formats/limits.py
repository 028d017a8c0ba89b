"""Bounds on sizes a checkpoint declares, checked before anything is allocated or read.

Headers and pickles state shapes, offsets and lengths as integers of any size. torch indexes tensors and
files with signed 64-bit integers, so a declared size past ``2**63 - 1`` bytes cannot be real: left
unchecked it surfaces later as ``OverflowError`` or ``RuntimeError: numel: integer multiplication
overflow`` deep inside torch, with no file named. Python ints do the arithmetic here, so nothing wraps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import CorruptCheckpointError

__all__ = ["MAX_BYTES", "check_byte_range", "checked_nbytes"]

MAX_BYTES = 2**63 - 1


def checked_nbytes(shape: Sequence[int], itemsize: int, where: str) -> int:
    """``prod(shape) * itemsize``, or :class:`CorruptCheckpointError` if a dimension is negative or the
    byte count cannot exist (more than ``2**63 - 1``)."""
    if any(n < 0 for n in shape):
        raise CorruptCheckpointError(f"{where}: shape {list(shape)} has a negative dimension")
    nbytes = math.prod(shape) * itemsize
    if nbytes > MAX_BYTES:
        raise CorruptCheckpointError(
            f"{where}: shape {list(shape)} needs {nbytes} bytes, more than any file can hold (2**63 - 1); "
            "the checkpoint is corrupt or hostile"
        )
    return nbytes


def check_byte_range(offset: int, length: int, where: str) -> None:
    """A stored record's ``[offset, offset + length)`` must be non-negative and end before ``2**63``."""
    if offset < 0 or length < 0 or offset + length > MAX_BYTES:
        raise CorruptCheckpointError(
            f"{where}: byte range offset {offset}, length {length} is impossible (negative, or past 2**63 - 1)"
        )
