"""Copying the state off the training loop's tensors: what an async save blocks the loop for.

torch's ``dcp.async_save`` stages every save into freshly allocated host memory (its ``DefaultStager``), so
each save pays for the allocation and the page faults of a state-sized buffer on top of the copy. The
manager has at most one save in flight, so once a save is durable its buffers are free again: the
:class:`ReusingStager` keeps them and copies the next state into them in place, which costs a ``memcpy``.

The first save (or one whose state changed shape, dtype, layout or sharding) is staged by torch's own
``DefaultStager``; later ones are copied into its result. Non-tensor values are deep-copied each time.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

__all__ = ["ReusingStager", "state_bytes"]


class _Mismatch(Exception):
    """The new state does not fit the kept buffers: stage afresh."""


class ReusingStager:
    """Stages a state dict into host memory, reusing the previous staging's buffers when they fit.

    Call :meth:`stage` only when the previous staged copy is no longer read (its save is durable).
    """

    def __init__(self) -> None:
        self._staged: Any = None
        self.reused = 0

    def stage(self, state: Mapping[str, Any]) -> Any:
        if self._staged is not None:
            try:
                with torch.no_grad():
                    staged = _refill(state, self._staged)
                self.reused += 1
                return staged
            except _Mismatch:
                self._staged = None
        stager = DefaultStager(StagingOptions(False, False, False, False))  # async_save's own default
        try:
            self._staged = stager.stage(dict(state))
        finally:
            stager.close()
        return self._staged

    def close(self) -> None:
        self._staged = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _refill(src: Any, dst: Any) -> Any:
    """``dst`` (a staged copy) updated to hold ``src``'s values, tensors copied in place."""
    if isinstance(src, torch.Tensor):
        if not isinstance(dst, torch.Tensor) or isinstance(src, DTensor) != isinstance(dst, DTensor):
            raise _Mismatch
        if isinstance(src, DTensor) and (src.placements != dst.placements or src.device_mesh != dst.device_mesh):
            raise _Mismatch
        s, d = _local(src), _local(dst)
        if s.shape != d.shape or s.dtype != d.dtype or s.stride() != d.stride() or d.device.type != "cpu":
            raise _Mismatch
        if isinstance(src, DTensor) and (src.shape != dst.shape or src.stride() != dst.stride()):
            raise _Mismatch
        d.copy_(s)
        return dst
    if isinstance(src, Mapping):
        if not isinstance(dst, dict) or set(src) != set(dst):
            raise _Mismatch
        for key, value in src.items():
            dst[key] = _refill(value, dst[key])
        return dst
    if isinstance(src, list):
        if not isinstance(dst, list) or len(src) != len(dst):
            raise _Mismatch
        for i, value in enumerate(src):
            dst[i] = _refill(value, dst[i])
        return dst
    if isinstance(src, tuple):
        if not isinstance(dst, tuple) or len(src) != len(dst) or type(src) is not type(dst):
            raise _Mismatch
        return (
            type(src)(*(_refill(s, d) for s, d in zip(src, dst)))
            if hasattr(src, "_fields")
            else tuple(_refill(s, d) for s, d in zip(src, dst))
        )
    return copy.deepcopy(src)


def state_bytes(state: Any) -> int:
    """Bytes of the (local) tensors in ``state``: what a ``memcpy`` of the rank's state moves."""
    if isinstance(state, torch.Tensor):
        t = _local(state)
        return t.numel() * t.element_size()
    if isinstance(state, Mapping):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0
