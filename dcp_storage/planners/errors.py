"""Errors the load planners raise, all before any checkpoint byte is read (except unsafe ``BYTE_IO``).

They derive from :class:`~dcp_storage.errors.DcpStorageError` and from the builtin torch's planners raise
for the same condition (``RuntimeError`` for missing keys and non-tensor values, ``ValueError`` for bad
mappings, ``TypeError`` for dtype/type mismatches), so code written against ``DefaultLoadPlanner`` keeps
working. Shape mismatches raise :class:`~dcp_storage.errors.ShapeMismatchError`.

Under ``dcp.load`` an error raised by a planner step reaches the caller wrapped in torch's
``CheckpointException`` (its ``failures`` maps each rank to ``(exception, traceback)``), and the
exception's text carries ours.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from dcp_storage.errors import DcpStorageError

__all__ = [
    "DtypeMismatchError",
    "IncompatibleKeysError",
    "KeyCollisionError",
    "UnsupportedValueError",
    "ValueTypeMismatchError",
    "format_keys",
]

#: How many keys an error message names before it says "... and N more".
KEYS_SHOWN = 10


def format_keys(keys: Iterable[str], limit: int = KEYS_SHOWN) -> str:
    """``'a', 'b', 'c'`` or ``'a', 'b', ... and 998 more`` (for messages about huge key lists)."""
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    if len(keys) > limit:
        shown += f", ... and {len(keys) - limit} more"
    return shown


#: What :class:`IncompatibleKeysError` tells a ``RemappingLoadPlanner`` user to do (``fix`` replaces it).
STRICT_FIX = "Pass strict=False to load the keys that match (planner.result lists the rest)"


class IncompatibleKeysError(DcpStorageError, RuntimeError):
    """``strict=True`` and the state dict and the checkpoint do not hold the same keys.

    ``missing_keys`` are state-dict keys the checkpoint lacks; ``unexpected_keys`` are checkpoint keys no
    state-dict key maps to (the meanings of ``nn.Module.load_state_dict``). ``hint`` is a key map that would
    match (:func:`~.report.suggest_key_map`); ``fix`` replaces the closing advice (for other planners).
    Raised the same way whatever the planner (:mod:`.key_check` covers torch's) and whatever the reader.
    """

    def __init__(
        self, missing_keys: Sequence[str], unexpected_keys: Sequence[str], hint: str = "", fix: str | None = None
    ) -> None:
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)
        parts = []
        if self.missing_keys:
            parts.append(
                f"{len(self.missing_keys)} missing key(s) (in the state dict, not in the checkpoint): "
                f"{format_keys(self.missing_keys)}"
            )
        if self.unexpected_keys:
            parts.append(
                f"{len(self.unexpected_keys)} unexpected key(s) (in the checkpoint, not in the state dict): "
                f"{format_keys(self.unexpected_keys)}"
            )
        msg = "checkpoint and state dict keys differ: " + "; ".join(parts)
        if hint:
            msg += f". {hint}"
        msg += ". " + (fix if fix is not None else STRICT_FIX)
        self.hint = hint
        self.fix = fix
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:  # DCP gathers rank errors by pickle
        return (type(self), (self.missing_keys, self.unexpected_keys, self.hint, self.fix))


class KeyCollisionError(DcpStorageError, ValueError):
    """A key map sends two or more state-dict keys to the same checkpoint key.

    ``collisions`` maps each such checkpoint key to the state-dict keys that map to it.
    """

    def __init__(self, collisions: Mapping[str, Sequence[str]], key_map: object) -> None:
        self.collisions = {k: list(v) for k, v in collisions.items()}
        self.key_map = key_map if isinstance(key_map, str) else repr(key_map)  # a str: the map may not pickle
        shown = [f"{format_keys(srcs, 4)} -> {ckpt!r}" for ckpt, srcs in list(self.collisions.items())[:KEYS_SHOWN]]
        more = len(self.collisions) - len(shown)
        msg = (
            f"{self.key_map} maps several state-dict keys to the same checkpoint key: "
            + "; ".join(shown)
            + (f"; ... and {more} more" if more > 0 else "")
            + ". Each state-dict key must load from its own checkpoint key; make the map one-to-one"
        )
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.collisions, self.key_map))


class DtypeMismatchError(DcpStorageError, TypeError):
    """The dtype policy refuses to cast a stored dtype into a destination's dtype."""


class ValueTypeMismatchError(DcpStorageError, TypeError):
    """The checkpoint holds a tensor where the state dict holds something that is not one."""


class UnsupportedValueError(DcpStorageError, RuntimeError):
    """A state-dict value the planner cannot build metadata for (``DynamicMetaLoadPlanner``: non-tensors)."""
