"""FSDP model introspection and the local shards a rank holds, with the errors of :mod:`dcp_storage.fsdp`.

Errors of :mod:`dcp_storage.fsdp`; all derive from :class:`~dcp_storage.errors.DcpStorageError`.

Shape mismatches raise :class:`~dcp_storage.errors.ShapeMismatchError`, refused dtype casts
:class:`~dcp_storage.planners.DtypeMismatchError` and non-tensor values
:class:`~dcp_storage.planners.ValueTypeMismatchError`, as elsewhere in the package.

Questions about wrapped models: is it FSDP, which FSDP unit owns a submodule, what is the user's module.

Wrappers this module sees through:

* FSDP1 (``FullyShardedDataParallel``): a wrapper module whose user module is its ``_fsdp_wrapped_module``
  child (``.module``), so wrapped names gain ``_fsdp_wrapped_module.`` segments;
* FSDP2 (``fully_shard``): no wrapper; the user's module *becomes* an ``FSDPModule`` (its class is swapped);
* DDP / DataParallel (``.module``), ``torch.compile`` (``OptimizedModule._orig_mod``), and activation
  checkpointing's ``CheckpointWrapper`` (``_checkpoint_wrapped_module``, only when resolving names).

The model side of a full-state-dict load: describe what each rank holds (meta tensors: :mod:`.materialize`).

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DataParallel, DistributedDataParallel

from dcp_storage._torch import child_modules, compiled_original, sharded_tensor_class
from dcp_storage.errors import DcpStorageError
from dcp_storage.planners.key_map import ValueTypeMismatchError, format_keys

__all__ = [
    "Chunk",
    "Entry",
    "FullStateDictKeysError",
    "LocalShards",
    "UnknownModuleError",
    "clean_key",
    "get_fsdp_parent",
    "is_fsdp_model",
    "is_fsdp_unit",
    "maybe_get_wrapped",
    "model_state_dict",
    "set_wrapped_model",
    "uses_fsdp1",
]


class FullStateDictKeysError(DcpStorageError, RuntimeError):
    """The full state dict and the model's state dict do not hold the same keys.

    ``missing_keys``: model keys the full state dict lacks; ``unexpected_keys``: full-state-dict keys the
    model does not have (the meanings of ``nn.Module.load_state_dict``).
    """

    def __init__(self, missing_keys: Sequence[str], unexpected_keys: Sequence[str]) -> None:
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)
        parts = []
        if self.missing_keys:
            parts.append(
                f"{len(self.missing_keys)} missing key(s) (in the model, not in the full state dict): "
                f"{format_keys(self.missing_keys)}"
            )
        if self.unexpected_keys:
            parts.append(
                f"{len(self.unexpected_keys)} unexpected key(s) (in the full state dict, not in the model): "
                f"{format_keys(self.unexpected_keys)}"
            )
        msg = "load_full_state_dict: the full state dict does not match the model: " + "; ".join(parts)
        msg += (
            ". Keys are compared after dropping wrapper segments (_fsdp_wrapped_module, _checkpoint_wrapped_module, "
            "_orig_mod)"
        )
        if self.unexpected_keys and all(k.startswith("module.") for k in self.unexpected_keys):
            msg += "; the unexpected keys all start with 'module.' (a DDP state dict?): strip that prefix first"
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:  # crosses processes
        return (type(self), (self.missing_keys, self.unexpected_keys))


class UnknownModuleError(DcpStorageError, LookupError):
    """A module name that does not resolve to a submodule of the model (names the part that failed)."""


#: Child names that wrappers insert into module names; resolving a name looks through them.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def is_fsdp_unit(module: nn.Module) -> bool:
    """True for an FSDP1 wrapper or an FSDP2 module (the module itself, not its children)."""
    return isinstance(module, (FSDP1, FSDPModule))


def is_fsdp_model(model: nn.Module) -> bool:
    """True if ``model`` or any submodule is FSDP1-wrapped or an FSDP2 ``FSDPModule``.

    Looks through DDP and ``torch.compile`` wrappers too, since they hold the model as a submodule.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"is_fsdp_model expects an nn.Module, got {type(model).__name__}")
    return any(is_fsdp_unit(m) for m in model.modules())


def get_fsdp_parent(layer_name: str, model: nn.Module) -> nn.Module | None:
    """The FSDP unit that manages the submodule ``layer_name`` of ``model``, or None if none does.

    That is the closest FSDP-wrapped module on the path from ``model`` down to the named submodule,
    the submodule itself included: an FSDP2 ``FSDPModule``, or for FSDP1 the ``FullyShardedDataParallel``
    wrapper (not the user module inside it). ``layer_name`` may be written with or without FSDP1's
    ``_fsdp_wrapped_module.`` segments (and ``_orig_mod.`` / ``_checkpoint_wrapped_module.``); ``""`` is
    ``model`` itself. Raises :class:`~dcp_storage.fsdp.UnknownModuleError` (a ``LookupError``) for a name
    that is not a submodule.
    """
    for module in reversed(_module_path(model, layer_name)):
        if is_fsdp_unit(module):
            return module
    return None


def maybe_get_wrapped(model: nn.Module) -> nn.Module:
    """The innermost user module: unwraps FSDP1 (``.module``), DDP / DataParallel (``.module``) and
    ``torch.compile`` (``._orig_mod``), in any nesting. FSDP2 modules are the user's module and are returned
    as they are; a model without wrappers is returned unchanged."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, (FSDP1, DistributedDataParallel, DataParallel)):
            model = model.module
        elif (original := compiled_original(model)) is not None:
            model = original
        else:
            break
    return model


def set_wrapped_model(state: Any, wrapped_model: nn.Module) -> None:
    """Set ``state.model = wrapped_model`` (e.g. a trainer state after wrapping its model in FSDP).

    Raises ``TypeError`` if ``state`` has no ``model`` attribute (nothing is added to objects that do not
    already hold a model) or if ``wrapped_model`` is not an ``nn.Module``.
    """
    if not isinstance(wrapped_model, nn.Module):
        raise TypeError(f"set_wrapped_model: wrapped_model must be an nn.Module, got {type(wrapped_model).__name__}")
    if not hasattr(state, "model"):
        raise TypeError(
            f"set_wrapped_model: {type(state).__name__} object has no 'model' attribute to set; pass the object "
            "that holds the model (an object with a .model attribute)"
        )
    state.model = wrapped_model


def _module_path(model: nn.Module, name: str) -> list[nn.Module]:
    """Modules from ``model`` down to the one named ``name``, wrappers passed through included."""
    path = [model]
    current = model
    walked: list[str] = []
    for segment in (s for s in name.split(".") if s):
        if segment in WRAPPER_SEGMENTS and segment not in child_modules(current):
            continue  # a wrapper segment of a differently wrapped model: not part of the user's name
        while segment not in (kids := child_modules(current)):
            inner = next((kids[w] for w in WRAPPER_SEGMENTS if kids.get(w) is not None), None)
            if inner is None:
                where = ".".join(walked) or "the model"
                children = ", ".join(repr(c) for c in _user_children(current)) or "none"
                raise UnknownModuleError(
                    f"{name!r} is not a submodule of {type(model).__name__}: {where} "
                    f"({type(current).__name__}) has no child {segment!r} (its children: {children})"
                )
            current = inner
            path.append(current)
        child = child_modules(current)[segment]
        if child is None:
            raise UnknownModuleError(f"{name!r}: submodule {segment!r} of {'.'.join(walked) or 'the model'} is None")
        current = child
        path.append(current)
        walked.append(segment)
    return path


def _user_children(module: nn.Module) -> list[str]:
    """Child names, looking through wrapper children (what a user would type)."""
    names: list[str] = []
    for child_name, child in child_modules(module).items():
        if child_name in WRAPPER_SEGMENTS and child is not None:
            names.extend(_user_children(child))
        else:
            names.append(child_name)
    return names


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
    if isinstance(value, sharded_tensor_class()):
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
