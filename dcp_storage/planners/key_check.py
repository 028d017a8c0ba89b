"""One key-mismatch report whatever the planner: torch's planners, checked from the reader's side.

:class:`~.planner.RemappingLoadPlanner` raises :class:`~.errors.IncompatibleKeysError` (every missing and
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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from dcp_storage._torch import flatten_v2_3
from dcp_storage.formats.dcp_native.native import rows_of
from dcp_storage.planners.matching import KeyRules, match_keys
from dcp_storage.planners.planner import DynamicMetaLoadPlanner, RemappingLoadPlanner

__all__ = ["check_planned_keys", "enforce_for", "rules_of"]


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
