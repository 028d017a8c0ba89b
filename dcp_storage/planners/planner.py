"""The load planners: :class:`RemappingLoadPlanner` and the drop-in :class:`DynamicMetaLoadPlanner`.

One implementation, four swappable parts (see :mod:`.matching` for the core):

* ``key_map`` (:class:`~.key_map.KeyMap`): state-dict key -> checkpoint key;
* ``strict`` (``True``/``False`` or a :class:`~.matching.KeyRules`): which missing/unexpected keys fail;
* ``dtype_policy`` (:class:`~.dtype_policy.DtypePolicy`): which dtype conversions are accepted;
* ``metadata_source`` (:class:`MetadataSource`): the checkpoint's own metadata, or metadata built from
  the state dict for formats that carry none (torch.save files).

Call order (``dcp.load`` drives it; every rank calls every step unless noted):

1. ``set_up_planner(state_dict, metadata, is_coordinator)``: flattens the state dict as torch's
   ``DefaultLoadPlanner`` does (nested dicts become ``"model.embed.weight"`` keys) and picks the metadata.
2. ``create_local_plan()``: maps keys, raises for collisions, strict key mismatches, non-tensor
   destinations, shape and refused dtype mismatches (all before any I/O), sets ``planner.result``
   (a :class:`~.report.LoadResult`) and returns the read items.
3. ``create_global_plan`` (coordinator only) / ``finish_plan``: unchanged, as torch's.
4. During the reader's ``read_data``: ``resolve_tensor``/``commit_tensor`` for tensors (destinations
   looked up by state-dict key; the reader's ``copy_`` casts dtypes), ``load_bytes`` for other values,
   decoded with ``torch.load(weights_only=True)`` (:mod:`.safe_bytes`).

One key-mismatch report whatever the planner (:func:`check_planned_keys`): torch's planners, checked from
the reader's side.

:class:`RemappingLoadPlanner` raises :class:`~.errors.IncompatibleKeysError` (every missing and
unexpected key, and a key map that would match, such as ``KeyMap.strip_prefix('model.')``) in
``create_local_plan``. torch's ``DefaultLoadPlanner``, which ``dcp.load`` uses when given no planner,
raises a bare ``RuntimeError("Missing key in checkpoint state_dict: x.")`` for the first missing key; and
planners that describe the checkpoint from the state dict (torch's and our ``DynamicMetaLoadPlanner``)
never compare keys with the checkpoint at all, so the reader meets a key it does not have mid-load.

Our readers call :func:`check_planned_keys` in ``set_up_storage_reader``, which ``dcp.load`` calls after
the planner's ``set_up_planner`` (the planner holds the flattened state dict) and before its
``create_local_plan``, with the reader's own metadata. For a ``DefaultLoadPlanner``-family planner that
does not compare keys with that metadata itself, it raises the error ``RemappingLoadPlanner`` would for
the mismatches the planner fails on, and warns when a partial load matches no key at all. Other planners
(``LoadPlanner`` implementations of their own) are left to their own rules.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from dcp_storage._torch import flatten_v2_3, set_element
from dcp_storage.errors import ShapeMismatchError
from dcp_storage.formats.columns import rows_of
from dcp_storage.planners.column_plan import PLAIN_TENSORS, DtypePolicy
from dcp_storage.planners.key_map import KeyMap, KeyMapLike, LoadResult
from dcp_storage.planners.matching import (
    KeyMatch,
    KeyRules,
    check_and_build,
    match_keys,
    metadata_from_state_dict,
    result_of,
    safe_load_bytes,
)
from dcp_storage.runtime import gc_paused

__all__ = [
    "DynamicMetaLoadPlanner",
    "MetadataSource",
    "RemappingLoadPlanner",
    "check_planned_keys",
    "enforce_for",
    "rules_of",
]


@dataclass(frozen=True)
class MetadataSource:
    """Where the planner's checkpoint description comes from; build with the named factories."""

    name: str
    choose: Callable[[Mapping[str, Any], Metadata | None, KeyMap, str], Metadata | None]

    def __repr__(self) -> str:
        return self.name

    @staticmethod
    def storage() -> MetadataSource:
        """The metadata the storage reader returned (DCP's default)."""
        return MetadataSource("MetadataSource.storage()", lambda sd, md, key_map, who: md)

    @staticmethod
    def state_dict() -> MetadataSource:
        """Always describe the checkpoint from the state dict, ignoring the reader's metadata.

        What torch's ``DynamicMetaLoadPlanner.set_up_planner`` does: one ``TensorStorageMetadata`` per
        tensor with its size, dtype and local chunks, and nothing else (no storage or planner data);
        non-tensor values raise. Keys are the checkpoint keys the key map gives.
        """
        return MetadataSource(
            "MetadataSource.state_dict()", lambda sd, md, key_map, who: metadata_from_state_dict(sd, key_map, who)
        )

    @staticmethod
    def state_dict_if_empty() -> MetadataSource:
        """The reader's metadata when it describes any key, else the state dict's (as ``state_dict()``)."""

        def choose(sd: Mapping[str, Any], md: Metadata | None, key_map: KeyMap, who: str) -> Metadata | None:
            if md is not None and md.state_dict_metadata:
                return md
            return metadata_from_state_dict(sd, key_map, who)

        return MetadataSource("MetadataSource.state_dict_if_empty()", choose)


class RemappingLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that renames keys, checks dtypes and shapes up front, and reports keys.

    Args:
        key_map: state-dict key -> checkpoint key: a :class:`KeyMap`, a ``{sd key: ckpt key}`` dict or a
            callable; ``None`` loads every key from the checkpoint key of the same name.
        strict: ``True`` (default) raises :class:`~.errors.IncompatibleKeysError` when a state-dict key
            is missing from the checkpoint or a checkpoint key is unexpected, like
            ``nn.Module.load_state_dict``; ``False`` loads what matches and reports the rest in
            ``planner.result`` (and warns when no key at all matches: such a load loads nothing). A
            :class:`KeyRules` chooses finer (e.g.
            ``KeyRules.strict(ignore_unexpected=["optim.*"])`` to load a model from a training checkpoint).
        dtype_policy: which stored -> destination dtype conversions to accept; default
            ``DtypePolicy.cast()`` (any conversion within float, int or complex).
        metadata_source: default ``MetadataSource.storage()``.
        safe_globals: classes/functions ``BYTE_IO`` values may contain beyond torch's ``weights_only``
            allow-list (only for checkpoints you trust). Our readers, which decode ``BYTE_IO`` themselves
            before calling ``load_bytes`` (:mod:`dcp_storage.formats.byte_items`), honour this list too;
            ``torch.serialization.safe_globals([...])`` around ``dcp.load`` works for every layer.
        flatten_state_dict, flatten_sharded_tensors: as in torch's ``DefaultLoadPlanner``.

    After ``create_local_plan`` (so after ``dcp.load``), ``planner.result`` is a :class:`LoadResult`.
    """

    def __init__(
        self,
        key_map: KeyMapLike | None = None,
        *,
        strict: bool | KeyRules = True,
        dtype_policy: DtypePolicy | None = None,
        metadata_source: MetadataSource | None = None,
        safe_globals: Sequence[Any] = (),
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
    ) -> None:
        if isinstance(strict, KeyRules):
            rules = strict
        elif isinstance(strict, bool):
            rules = KeyRules.strict() if strict else KeyRules.partial()
        else:
            raise TypeError(f"strict must be a bool or a KeyRules, got {type(strict).__name__}")
        if dtype_policy is not None and not isinstance(dtype_policy, DtypePolicy):
            raise TypeError(f"dtype_policy must be a DtypePolicy, got {type(dtype_policy).__name__}")
        if metadata_source is not None and not isinstance(metadata_source, MetadataSource):
            raise TypeError(f"metadata_source must be a MetadataSource, got {type(metadata_source).__name__}")
        super().__init__(
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
            allow_partial_load=not rules.fail_on_missing,
        )
        self.key_map = KeyMap.coerce(key_map)
        self.key_rules = rules
        self.dtype_policy = dtype_policy or DtypePolicy.cast()
        self.metadata_source = metadata_source or MetadataSource.storage()
        self.safe_globals = tuple(safe_globals)
        self.result: LoadResult | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key_map={self.key_map!r}, strict={self.key_rules!r}, "
            f"dtype_policy={self.dtype_policy!r}, metadata_source={self.metadata_source!r})"
        )

    # ------------------------------------------------------------------------------- LoadPlanner API
    def set_up_planner(
        self, state_dict: STATE_DICT_TYPE, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        with gc_paused():  # two small objects per key, beside a million-entry Metadata: no full collections
            flat = _flat_copy(state_dict) if self.flatten_state_dict and self.flatten_sharded_tensors else None
        if flat is None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        else:  # what torch's set_up_planner gives for such a state dict, without its per-value traversals
            self.original_state_dict = state_dict
            self.state_dict, self.mappings = flat
            self.metadata = metadata
            self.is_coordinator = is_coordinator
        self.result = None
        self.metadata = self.metadata_source.choose(self.state_dict, metadata, self.key_map, type(self).__name__)

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise RuntimeError(f"{type(self).__name__}.create_local_plan called before set_up_planner gave it metadata")
        with gc_paused():  # a few small acyclic objects per tensor: at 1M tensors, collections were 2/3 of it
            match = self._match(self.metadata)
            self.key_rules.enforce(match.missing, match.unexpected, len(match.pairs), type(self).__name__)
            casts, items = check_and_build(self.state_dict, self.metadata, match.pairs, self.dtype_policy)
            self.result = result_of(match, casts)
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key, ckpt_key = read_item.dest_index.fqn, read_item.storage_index.fqn
        where = f"checkpoint key {ckpt_key!r}" + ("" if key == ckpt_key else f" (state-dict key {key!r})")
        self.load_value(read_item, safe_load_bytes(value, where, self.safe_globals))

    def load_value(self, read_item: ReadItem, obj: Any) -> None:
        """Place an already decoded ``BYTE_IO`` value (our readers decode safely and call this instead of
        ``load_bytes``: :func:`dcp_storage.formats.byte_items.deliver_byte_item`)."""
        key = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj

    # ------------------------------------------------------------------------------------- helpers
    def _match(self, metadata: Metadata) -> KeyMatch:
        rows = rows_of(metadata)  # lazy metadata over columns: its {name: row}, a plain dict
        ckpt_keys: Mapping[str, Any] = metadata.state_dict_metadata if rows is None else rows
        match = match_keys(self.state_dict, ckpt_keys, self.key_map, self.key_rules)
        if not self.flatten_state_dict:
            return match
        # Checkpoints saved before torch 2.4 flattened nested containers differently. Like torch's
        # DefaultLoadPlanner: if some checkpoint keys are not asked for and the old flattening (through
        # the key map) asks for them, use the old flattening.
        if len(match.pairs) == len(ckpt_keys):  # every checkpoint key is asked for (targets are distinct)
            return match
        wanted = set(match.pairs.values())
        leftover = {c for c in ckpt_keys if c not in wanted}
        if not leftover:
            return match
        old_state_dict, old_mappings = flatten_v2_3(self.original_state_dict)
        if any(self.key_map(k) in leftover for k in old_state_dict):
            self.state_dict, self.mappings = old_state_dict, old_mappings
            return match_keys(self.state_dict, ckpt_keys, self.key_map, self.key_rules)
        return match


class FlatPaths(Mapping[str, tuple[str, ...]]):
    """The planner's ``mappings`` (flat key -> path in the nested state dict) of :func:`_flat_copy`: only the
    nested keys' paths are stored; a top-level key's path, ``(key,)``, is made when asked (a million top-level
    tensors: a million tuples and a dict of them fewer, ~140 MB)."""

    __slots__ = ("_flat", "_nested")

    def __init__(self, flat: Mapping[str, Any], nested: dict[str, tuple[str, ...]]) -> None:
        self._flat, self._nested = flat, nested

    def __getitem__(self, key: str) -> tuple[str, ...]:
        path = self._nested.get(key)
        if path is None:
            if key not in self._flat:
                raise KeyError(key)
            path = (key,)
        return path

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat)

    def __len__(self) -> int:
        return len(self._flat)


def _flat_copy(state_dict: Any) -> tuple[dict[str, Any], FlatPaths] | None:
    """torch's flattening of a state dict of nested plain dicts whose leaves are plain, non-meta tensors or
    scalars: ``({"a.b": value}, {"a.b": ("a", "b")})``; ``None`` for anything else (lists, tuples, other
    mappings, tensor subclasses, meta tensors, keys that flatten alike: torch's own ``set_up_planner``
    handles, or refuses, those).

    For these, torch's three passes (``_init_state_dict``, ``_flatten_sharded_tensors``,
    ``flatten_state_dict``) change nothing but the nesting; at a million tensors they cost seconds.
    """
    if type(state_dict) is not dict:
        return None
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[str, ...]] = {}  # nested keys only (FlatPaths)
    plain, scalars = PLAIN_TENSORS, _SCALARS

    def walk(prefix: tuple[str, ...], d: dict[Any, Any]) -> bool:
        for k, v in d.items():
            name = k if type(k) is str else str(k)
            t = type(v)
            if t is dict:
                if not walk((*prefix, name), v):
                    return False
                continue
            if not (t in scalars or (t in plain and not v.is_meta)):
                return False
            key = ".".join((*prefix, name)) if prefix else name
            if key in flat:
                return False  # torch raises "duplicated flatten key"
            flat[key] = v
            if prefix:
                paths[key] = (*prefix, name)
        return True

    return (flat, FlatPaths(flat, paths)) if walk((), state_dict) else None


_SCALARS = (int, float, bool, str, bytes, type(None))


class DynamicMetaLoadPlanner(RemappingLoadPlanner):
    """Drop-in for ``torch.distributed.checkpoint.format_utils.DynamicMetaLoadPlanner``.

    Same constructor arguments and behaviour: ``set_up_planner`` ignores the reader's metadata and
    describes the checkpoint from the state dict (each tensor's size, dtype and local chunks; non-tensor
    values raise :class:`~.errors.UnsupportedValueError`, a ``RuntimeError``), for formats that carry no
    metadata, such as torch.save files read with ``BroadcastingTorchSaveReader``. ``allow_partial_load``
    means what it means for ``DefaultLoadPlanner``.

    Unlike torch's: ``key_map`` (the described keys are the checkpoint keys it gives), ``dtype_policy``
    (no effect with ``MetadataSource.state_dict()``, which describes the destination dtypes; the reader's
    ``copy_`` casts), ``metadata_source`` (``MetadataSource.state_dict_if_empty()`` uses the reader's
    metadata when it has any), ``BYTE_IO`` decoded with ``weights_only=True``, ``planner.result``.

    Note: torch's ``BroadcastingTorchSaveReader`` looks up ``planner.state_dict[<checkpoint key>]`` on
    non-coordinator ranks, so with a renaming ``key_map`` it works only on a single rank.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        key_map: KeyMapLike | None = None,
        dtype_policy: DtypePolicy | None = None,
        metadata_source: MetadataSource | None = None,
        safe_globals: Sequence[Any] = (),
    ) -> None:
        super().__init__(
            key_map,
            strict=KeyRules.partial() if allow_partial_load else KeyRules.missing_only(),
            dtype_policy=dtype_policy,
            metadata_source=metadata_source or MetadataSource.state_dict(),
            safe_globals=safe_globals,
            flatten_state_dict=flatten_state_dict,
            flatten_sharded_tensors=flatten_sharded_tensors,
        )


def check_planned_keys(planner: Any, metadata: Metadata) -> None:
    """Raise :class:`~.errors.IncompatibleKeysError` if ``planner`` would fail on a key ``metadata`` lacks.

    A no-op for planners that check keys themselves (``RemappingLoadPlanner`` over the reader's metadata),
    that are not ``DefaultLoadPlanner``-like, or that are not set up (``None``: no ``dcp.load`` running).
    """
    if not isinstance(planner, DefaultLoadPlanner):
        return
    if isinstance(planner, RemappingLoadPlanner) and planner.metadata is metadata:
        return  # create_local_plan reports it, with the planner's own rules
    state_dict = getattr(planner, "state_dict", None)
    if not isinstance(state_dict, Mapping) or not state_dict:
        return
    rows = rows_of(metadata)  # lazy metadata over columns: its {name: row}, a plain dict
    ckpt_keys: Mapping[str, Any] = metadata.state_dict_metadata if rows is None else rows
    key_map: Callable[[str], str] = getattr(planner, "key_map", None) or _same
    rules = rules_of(planner)
    match = match_keys(_planned_keys(planner, state_dict, ckpt_keys, key_map), ckpt_keys, key_map, rules)
    enforce_for(planner, match.missing, match.unexpected, len(match.pairs))
    if rows is None and type(planner).create_local_plan is DefaultLoadPlanner.create_local_plan:
        _check_shapes(state_dict, metadata.state_dict_metadata, match.pairs)


def _check_shapes(state_dict: Mapping[str, Any], stored: Mapping[str, Any], pairs: Mapping[str, str]) -> None:
    """:class:`~.errors.ShapeMismatchError` naming every tensor whose (global) shape differs from the stored one,
    where DCP's default planner would raise a bare ``ValueError`` for the first one."""
    wrong = []
    for key, ckpt_key in pairs.items():
        value, entry = state_dict.get(key), stored.get(ckpt_key)
        if isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata):
            if tuple(value.size()) != tuple(entry.size):
                wrong.append(f"{key!r} is {list(value.size())} in the state dict, {list(entry.size)} in the checkpoint")
    if wrong:
        more = f" (and {len(wrong) - 10} more)" if len(wrong) > 10 else ""
        raise ShapeMismatchError(
            f"{len(wrong)} tensor(s) have another shape than the checkpoint's: {'; '.join(wrong[:10])}{more}; build "
            "the model with the checkpoint's configuration, or leave those keys out of the state dict"
        )


def rules_of(planner: Any) -> KeyRules:
    """The key rules ``planner`` loads by: its own, its ``allow_partial_load``, else DCP's default."""
    if isinstance(planner, RemappingLoadPlanner):
        return planner.key_rules
    if getattr(planner, "allow_partial_load", False) is True:
        return KeyRules.partial()
    return KeyRules.missing_only()


def enforce_for(planner: Any, missing: Sequence[str], unexpected: Sequence[str], matched: int) -> None:
    """:meth:`KeyRules.enforce` with ``planner``'s rules, naming it and the fix that fits it."""
    fix = None
    if not isinstance(planner, RemappingLoadPlanner) or isinstance(planner, DynamicMetaLoadPlanner):
        fix = (
            f"Pass {type(planner).__name__}(allow_partial_load=True) to load the keys that match, or "
            "planner=RemappingLoadPlanner(key_map=...) to load them under other names"
        )
    rules_of(planner).enforce(missing, unexpected, matched, type(planner).__name__, fix)


def _same(key: str) -> str:
    return key


def _planned_keys(
    planner: DefaultLoadPlanner,
    state_dict: Mapping[str, Any],
    ckpt_keys: Mapping[str, Any],
    key_map: Callable[[str], str],
) -> list[str]:
    """The state-dict keys the planner will look up: torch < 2.4's flattening for checkpoints saved so.

    As ``DefaultLoadPlanner.create_local_plan`` decides: when checkpoint keys are left over and the old
    flattening of the state dict names some of them, the old one.
    """
    keys = list(state_dict)
    original = getattr(planner, "original_state_dict", None)
    if not getattr(planner, "flatten_state_dict", False) or not isinstance(original, Mapping):
        return keys
    wanted = {key_map(k) for k in keys}
    leftover = {c for c in ckpt_keys if c not in wanted}
    if not leftover:
        return keys
    old_keys = list(flatten_v2_3(dict(original))[0])
    return old_keys if any(key_map(k) in leftover for k in old_keys) else keys
