"""Matching state-dict keys to stored entries, and decoding ``BYTE_IO`` items without running checkpoint code.

Decoding ``BYTE_IO`` items without running code from the checkpoint.

torch's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(value, weights_only=False)``: a checkpoint
can run code on every rank that loads it. Our planners decode with
:func:`~dcp_storage.formats.byte_items.decode_byte_item` instead (``weights_only=True``, torch.save zip
archives only) and turn refusals into :class:`~dcp_storage.errors.UnsafeCheckpointError` naming the key.
Callers that trust a class can allow it with ``safe_globals`` (passed to
``torch.serialization.safe_globals``).

The planners' core: match state-dict keys to checkpoint keys, check them, and build the read items.

Pure functions over a *flattened* state dict and a ``Metadata``; the planner classes only feed them.

Read items name both sides: ``dest_index.fqn`` is the state-dict key (the planner's ``resolve_tensor``,
``commit_tensor`` and ``load_bytes`` look it up in the state dict) and ``storage_index.fqn`` the checkpoint
key (readers look it up in the checkpoint's storage map). torch's resharding helper builds items with one
name for both; we build them with the checkpoint key and rename the destination side. Any reader that
follows the DCP contract (torch's ``FileSystemReader``, ours) then works with renamed keys unchanged.
"""

from __future__ import annotations

import fnmatch
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from dcp_storage._torch import create_chunk_list, create_read_items
from dcp_storage.errors import ShapeMismatchError
from dcp_storage.formats.byte_items import decode_byte_item
from dcp_storage.formats.columns import columns_of, rows_of
from dcp_storage.planners.column_plan import DtypePolicy, plan_on_columns
from dcp_storage.planners.key_map import (
    KEYS_SHOWN,
    DtypeMismatchError,
    IncompatibleKeysError,
    KeyCollisionError,
    KeyMap,
    LoadResult,
    UnsupportedValueError,
    ValueTypeMismatchError,
    suggest_key_map,
    warn_nothing_matched,
)

__all__ = [
    "KeyMatch",
    "KeyRules",
    "build_read_items",
    "check_and_build",
    "check_values",
    "match_keys",
    "metadata_from_state_dict",
    "safe_load_bytes",
]


def safe_load_bytes(value: io.BytesIO, where: str, safe_globals: Sequence[Any] = ()) -> Any:
    """The value in ``value``, decoded with ``torch.load(weights_only=True)``; refusals are our errors.

    ``where`` names the item in messages (e.g. ``"checkpoint key 'extra_state'"``).
    """
    return decode_byte_item(value.read(), where, safe_globals)


@dataclass(frozen=True)
class KeyMatch:
    """``pairs``: state-dict key -> checkpoint key, for keys the checkpoint has; the rest, as in LoadResult."""

    pairs: dict[str, str]
    missing: list[str]
    unexpected: list[str]


@dataclass(frozen=True)
class KeyRules:
    """Which key mismatches fail a load.

    ``strict()`` is ``nn.Module.load_state_dict(strict=True)``; ``partial()`` is ``strict=False``;
    ``missing_only()`` is DCP's ``DefaultLoadPlanner(allow_partial_load=False)`` (checkpoint keys the
    state dict does not ask for are never an error there). ``ignore_unexpected`` holds ``fnmatch``
    patterns of checkpoint keys that are fine to leave unread (e.g. ``"optim.*"`` when loading a model
    from a training checkpoint); they are not reported as unexpected.
    """

    fail_on_missing: bool
    fail_on_unexpected: bool
    ignore_unexpected: tuple[str, ...] = ()

    @staticmethod
    def strict(ignore_unexpected: Iterable[str] = ()) -> KeyRules:
        return KeyRules(True, True, tuple(ignore_unexpected))

    @staticmethod
    def partial(ignore_unexpected: Iterable[str] = ()) -> KeyRules:
        return KeyRules(False, False, tuple(ignore_unexpected))

    @staticmethod
    def missing_only() -> KeyRules:
        return KeyRules(True, False)

    def is_ignored(self, checkpoint_key: str) -> bool:
        return any(fnmatch.fnmatchcase(checkpoint_key, p) for p in self.ignore_unexpected)

    def enforce(
        self, missing: Sequence[str], unexpected: Sequence[str], matched: int, who: str, fix: str | None = None
    ) -> None:
        """Raise :class:`IncompatibleKeysError` for the mismatches these rules fail on; warn if nothing matched.

        ``matched`` is the number of state-dict keys found in the checkpoint: a partial load that matches
        none loads nothing at all, which is almost always a wrong key map (``who`` names the planner).
        """
        bad_missing = list(missing) if self.fail_on_missing else []
        bad_unexpected = list(unexpected) if self.fail_on_unexpected else []
        if bad_missing or bad_unexpected:
            raise IncompatibleKeysError(bad_missing, bad_unexpected, suggest_key_map(missing, unexpected), fix)
        if not matched and missing:
            warn_nothing_matched(who, len(missing), len(unexpected), suggest_key_map(missing, unexpected))


def match_keys(
    state_dict_keys: Iterable[str],
    checkpoint_keys: Iterable[str],
    key_map: Callable[[str], str],
    rules: KeyRules,
) -> KeyMatch:
    """Map every state-dict key through ``key_map``; raise ``KeyCollisionError`` if two share a target.

    ``checkpoint_keys``: a mapping keyed by checkpoint key (a plain dict is fastest: lazy metadata's
    ``{name: row}``, :func:`~dcp_storage.formats.columns.rows_of`), or any iterable.
    """
    keys = state_dict_keys if isinstance(state_dict_keys, (list, tuple)) else list(state_dict_keys)
    ckpt = checkpoint_keys if isinstance(checkpoint_keys, Mapping) else dict.fromkeys(checkpoint_keys)
    sources: Any
    if (
        isinstance(key_map, KeyMap)
        and key_map.is_identity
        and isinstance(state_dict_keys, Mapping)  # distinct keys: the identity has no collisions
        and all(type(k) is str for k in keys)
    ):
        pairs = {k: k for k in keys if k in ckpt}
        missing = [k for k in keys if k not in ckpt] if len(pairs) < len(keys) else []
        sources = state_dict_keys
    else:
        target_of: dict[str, str] = {}
        many: dict[str, list[str]] = {}
        for key in keys:
            target = key_map(key)
            target_of[key] = target
            many.setdefault(target, []).append(key)
        collisions = {c: srcs for c, srcs in many.items() if len(srcs) > 1}
        if collisions:
            raise KeyCollisionError(collisions, key_map)
        sources = many
        pairs = {k: t for k, t in target_of.items() if t in ckpt}
        missing = [k for k, t in target_of.items() if t not in ckpt] if len(pairs) < len(target_of) else []
    if len(pairs) == len(ckpt):  # targets are distinct: every checkpoint key is asked for
        unexpected: list[str] = []
    else:
        unexpected = [c for c in ckpt if c not in sources and not rules.is_ignored(c)]
    return KeyMatch(pairs, missing, unexpected)


def _size_of(value: Any) -> torch.Size | None:
    size = getattr(value, "size", None)
    return size() if callable(size) else None


def _dtype_of(value: Any) -> torch.dtype | None:
    if isinstance(value, torch.Tensor):
        return value.dtype
    metadata = getattr(value, "metadata", None)  # ShardedTensor
    props = getattr(metadata(), "tensor_properties", None) if callable(metadata) else None
    return getattr(props, "dtype", None)


def check_values(
    state_dict: Mapping[str, Any],
    metadata: Metadata,
    pairs: Mapping[str, str],
    dtype_policy: DtypePolicy,
) -> dict[str, tuple[torch.dtype, torch.dtype]]:
    """Check type, shape and dtype of every matched value; return the casts the load will do.

    Raises (after looking at every key, so one error lists them all) ``ValueTypeMismatchError``, then
    ``ShapeMismatchError``, then ``DtypeMismatchError``.
    """
    return check_and_build(state_dict, metadata, pairs, dtype_policy, build=False)[0]


def check_and_build(
    state_dict: Mapping[str, Any],
    metadata: Metadata,
    pairs: Mapping[str, str],
    dtype_policy: DtypePolicy,
    build: bool = True,
) -> tuple[dict[str, tuple[torch.dtype, torch.dtype]], list[ReadItem]]:
    """:func:`check_values` then (with ``build``) :func:`build_read_items`: ``(casts, items)``.

    On lazy metadata over columns, one pass does both (:mod:`.column_plan`); the errors are the same.
    """
    cols, rows = columns_of(metadata), rows_of(metadata)
    items: list[ReadItem] = []
    if cols is not None and rows is not None:
        kinds, shapes, dtypes, casts, items = plan_on_columns(
            state_dict, metadata, cols, rows, pairs, dtype_policy, _named, _size_of, _dtype_of, build
        )
    else:
        kinds, shapes, dtypes, casts = _value_problems(state_dict, metadata, pairs, dtype_policy)
    if kinds:
        raise ValueTypeMismatchError(
            _listing(kinds, "value(s) are not tensors where the checkpoint has tensors")
            + "; put a tensor of the saved shape and dtype in the state dict"
        )
    if shapes:
        raise ShapeMismatchError(_listing(shapes, "tensor(s) do not have the checkpoint's shape"))
    if dtypes:
        raise DtypeMismatchError(
            _listing(dtypes, f"dtype conversion(s) refused by {dtype_policy!r}") + f"; {dtype_policy.fix}"
        )
    if build and (cols is None or rows is None):
        items = build_read_items(state_dict, metadata, pairs)
    return casts, items


def _value_problems(
    state_dict: Mapping[str, Any], metadata: Metadata, pairs: Mapping[str, str], dtype_policy: DtypePolicy
) -> tuple[list[str], list[str], list[str], dict[str, tuple[torch.dtype, torch.dtype]]]:
    kinds: list[str] = []
    shapes: list[str] = []
    dtypes: list[str] = []
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for key, ckpt_key in pairs.items():
        md = metadata.state_dict_metadata[ckpt_key]
        if not isinstance(md, TensorStorageMetadata):
            continue
        value = state_dict[key]
        named = _named(key, ckpt_key)
        size = _size_of(value)
        if size is None:
            kinds.append(
                f"{named}: checkpoint holds a tensor of shape {tuple(md.size)}, state dict a {type(value).__name__}"
            )
            continue
        if tuple(md.size) != tuple(size):
            shapes.append(f"{named}: checkpoint has shape {tuple(md.size)}, state dict has {tuple(size)}")
            continue
        dest = _dtype_of(value)
        stored = md.properties.dtype
        if dest is None or stored is None or dest == stored:
            continue
        if dtype_policy.allows(stored, dest):
            casts[key] = (stored, dest)
        else:
            dtypes.append(f"{named}: checkpoint stores {stored}, destination is {dest}")
    return kinds, shapes, dtypes, casts


def build_read_items(state_dict: Mapping[str, Any], metadata: Metadata, pairs: Mapping[str, str]) -> list[ReadItem]:
    """The read items of the matched keys, resharding as torch does, with destinations renamed."""
    cols, rows = columns_of(metadata), rows_of(metadata)
    if cols is not None and rows is not None:
        policy = DtypePolicy.unchecked()
        kinds, shapes, _, _, items = plan_on_columns(
            state_dict, metadata, cols, rows, pairs, policy, _named, _size_of, _dtype_of
        )
        if not kinds and not shapes:
            return items
        # unchecked values that check_values would refuse: torch's resharding decides, entry by entry
    items = []
    for key, ckpt_key in pairs.items():
        value = state_dict[key]
        stored = metadata.state_dict_metadata[ckpt_key]
        whole = _whole_item(key, ckpt_key, stored, value)
        if whole is not None:  # the common case without torch's resharding sweep (a million tensors: seconds)
            items.append(whole)
            continue
        # A DTensor on a submesh this rank is not part of has nothing to load here (as in torch).
        if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
            continue
        for item in create_read_items(ckpt_key, stored, value):
            if key != ckpt_key:
                dest = item.dest_index
                item = replace(item, dest_index=MetadataIndex(key, dest.offset, dest.index))
            items.append(item)
    return items


def _whole_item(key: str, ckpt_key: str, stored: Any, value: Any) -> ReadItem | None:
    """The one read item torch's resharding gives a plain tensor stored whole, in one chunk, at the
    tensor's own non-empty shape; ``None`` for anything else (torch's ``create_read_items`` decides)."""
    if type(value) is not torch.Tensor or type(stored) is not TensorStorageMetadata or len(stored.chunks) != 1:
        return None
    chunk, size = stored.chunks[0], value.size()
    if not (list(chunk.sizes) == list(size) == list(stored.size)) or any(chunk.offsets) or 0 in size:
        return None
    zeros = torch.Size([0] * len(size))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(key, zeros, 0),
        dest_offsets=zeros,
        storage_index=MetadataIndex(ckpt_key, zeros, 0),
        storage_offsets=zeros,
        lengths=torch.Size(size),
    )


def metadata_from_state_dict(
    state_dict: Mapping[str, Any], key_map: Callable[[str], str], planner_name: str
) -> Metadata:
    """torch's ``DynamicMetaLoadPlanner`` metadata, under the checkpoint keys ``key_map`` gives.

    Each tensor is described by its own size, dtype and *local* chunks (as torch does). Non-tensor values
    raise ``UnsupportedValueError`` (a ``RuntimeError``, as torch's does). Colliding keys are left to
    :func:`match_keys` to report.
    """
    described: dict[str, STORAGE_TYPES] = {}
    for key, value in state_dict.items():
        if not torch.is_tensor(value):
            raise UnsupportedValueError(
                f"Non-tensor value identified at {key}. At this time {planner_name} only supports loading "
                f"Tensors (found a {type(value).__name__}); leave it out of the state dict or load it separately"
            )
        described[key_map(key)] = TensorStorageMetadata(
            TensorProperties(dtype=value.dtype), value.size(), create_chunk_list(value)
        )
    return Metadata(state_dict_metadata=described)


def _named(key: str, ckpt_key: str) -> str:
    return repr(key) if key == ckpt_key else f"{key!r} (checkpoint key {ckpt_key!r})"


def _listing(problems: list[str], what: str) -> str:
    shown = "; ".join(problems[:KEYS_SHOWN])
    more = len(problems) - KEYS_SHOWN
    return f"{len(problems)} {what}: {shown}" + (f"; ... and {more} more" if more > 0 else "")


def result_of(match: KeyMatch, casts: dict[str, tuple[torch.dtype, torch.dtype]]) -> LoadResult:
    return LoadResult(
        missing_keys=list(match.missing),
        unexpected_keys=list(match.unexpected),
        renamed={k: c for k, c in match.pairs.items() if k != c},
        casts=casts,
    )
