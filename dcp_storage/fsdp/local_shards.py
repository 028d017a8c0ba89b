"""The model side of a full-state-dict load: describe what each rank holds (meta tensors: :mod:`.materialize`).

Every value of the model's state dict becomes an :class:`Entry`: its global shape and dtype, and the
blocks (:class:`Chunk`) of the global tensor this rank stores, each backed by a local tensor:

* FSDP2 / DTensor (``Shard``/``Replicate`` placements): the local shard, one block (none when empty);
* FSDP1 under ``SHARDED_STATE_DICT``: a ``ShardedTensor``'s local shards;
* a plain tensor (an unsharded buffer, a non-FSDP module): the whole tensor.

Entries are plain data (no tensors) so ranks can send them to the coordinator; the local tensors stay in
:class:`LocalShards`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp import StateDictType
from torch.distributed.tensor import DTensor, Replicate, Shard

from dcp_storage.errors import DcpStorageError
from dcp_storage.fsdp.introspection import WRAPPER_SEGMENTS
from dcp_storage.planners.errors import ValueTypeMismatchError, format_keys

__all__ = ["Chunk", "Entry", "LocalShards", "clean_key", "model_state_dict", "uses_fsdp1"]


@dataclass(frozen=True)
class Chunk:
    """A block of a global tensor: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def region(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))


@dataclass(frozen=True)
class Entry:
    """One state-dict value as this rank holds it (plain data: crosses ranks)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


@dataclass
class LocalShards:
    """This rank's entries, in state-dict order, and the local tensor behind each chunk."""

    entries: dict[str, Entry] = field(default_factory=dict)
    tensors: dict[tuple[str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)

    @classmethod
    @torch.no_grad()
    def of(cls, state_dict: dict[str, Any]) -> LocalShards:
        out = cls()
        bad: list[str] = []
        for key, value in state_dict.items():
            pieces = _local_pieces(key, value)
            if pieces is None:
                bad.append(key)
                continue
            shape, chunks = pieces
            meta = [key for _c, t in chunks if t.is_meta]
            if meta:
                raise DcpStorageError(
                    f"load_full_state_dict: {key!r} is still on the meta device after materialisation"
                )
            out.entries[key] = Entry(key, shape, value.dtype, tuple(c for c, _t in chunks))
            for chunk, tensor in chunks:
                out.tensors[(key, chunk.offsets)] = tensor
        if bad:
            raise ValueTypeMismatchError(
                f"load_full_state_dict loads tensors only, but the model's state dict holds other values at "
                f"{format_keys(bad)} (extra state?)"
            )
        return out

    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _local_pieces(key: str, value: Any) -> tuple[tuple[int, ...], list[tuple[Chunk, torch.Tensor]]] | None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, DTensor):
        odd = [p for p in value.placements if type(p) not in (Shard, Replicate)]
        if odd:
            raise DcpStorageError(
                f"load_full_state_dict: {key!r} has placements {list(value.placements)}; only Shard and Replicate "
                "(FSDP2, HSDP) are supported. Load through dcp.load with a DCP checkpoint instead"
            )
        local = value.to_local()
        (md,) = value.__create_chunk_list__()
        chunk = Chunk(tuple(int(o) for o in md.offsets), tuple(int(n) for n in md.sizes))
        if tuple(local.shape) != chunk.sizes:
            raise DcpStorageError(f"internal error: {key!r} local shard {list(local.shape)} is not {list(chunk.sizes)}")
        return tuple(value.shape), ([(chunk, local)] if chunk.numel else [])
    if isinstance(value, ShardedTensor):
        pieces = []
        for shard in value.local_shards():
            chunk = Chunk(
                tuple(int(o) for o in shard.metadata.shard_offsets), tuple(int(n) for n in shard.metadata.shard_sizes)
            )
            if chunk.numel:
                pieces.append((chunk, shard.tensor))
        return tuple(value.size()), pieces
    if isinstance(value, torch.Tensor):
        chunk = Chunk((0,) * value.dim(), tuple(value.shape))
        return tuple(value.shape), ([(chunk, value)] if chunk.numel else [])
    return None


def clean_key(key: str) -> str:
    """``key`` without wrapper segments (``_fsdp_wrapped_module.``, ``_orig_mod.``, ...)."""
    return ".".join(s for s in key.split(".") if s not in WRAPPER_SEGMENTS)


def uses_fsdp1(model: nn.Module) -> bool:
    return any(isinstance(m, FSDP1) for m in model.modules())


@contextlib.contextmanager
def model_state_dict(model: nn.Module) -> Iterator[tuple[dict[str, Any], bool]]:
    """``(state_dict, needs_load)``: the state dict to fill in place, and whether it must then be loaded.

    FSDP2 and plain modules: ``model.state_dict()``, whose tensors share storage with the parameters and
    buffers (``needs_load`` False). FSDP1: the state dict under ``StateDictType.SHARDED_STATE_DICT``
    (``ShardedTensor`` values, copies), which the caller loads back with ``model.load_state_dict`` inside
    this context (``needs_load`` True). FSDP1's state-dict calls are collectives: every rank enters.
    """
    if uses_fsdp1(model):
        with FSDP1.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            yield model.state_dict(), True
    else:
        yield model.state_dict(), False
