"""``KeyMap`` (renaming keys), the load report, and the errors the planners raise before any byte is read.

Errors the load planners raise, all before any checkpoint byte is read (except unsafe ``BYTE_IO``).

They derive from :class:`~dcp_storage.errors.DcpStorageError` and from the builtin torch's planners raise
for the same condition (``RuntimeError`` for missing keys and non-tensor values, ``ValueError`` for bad
mappings, ``TypeError`` for dtype/type mismatches), so code written against ``DefaultLoadPlanner`` keeps
working. Shape mismatches raise :class:`~dcp_storage.errors.ShapeMismatchError`.

Under ``dcp.load`` an error raised by a planner step reaches the caller wrapped in torch's
``CheckpointException`` (its ``failures`` maps each rank to ``(exception, traceback)``), and the
exception's text carries ours.

What a load matched: :class:`LoadResult` (``planner.result``) and the key-map hint for strict errors.

``KeyMap``: how a state-dict key names the checkpoint key it loads from.

Direction: **state-dict key -> checkpoint key**, always. Keys are the flattened ones DCP uses: a nested
state dict ``{"model": {"embed.weight": ...}}`` has the key ``"model.embed.weight"``.

Which helper for which situation (``sd`` = your state dict, ``ckpt`` = the checkpoint):

===========================================================  =======================================
situation                                                    key map
===========================================================  =======================================
ckpt saved from a DDP / ``torch.compile`` / wrapper model,    ``KeyMap.add_prefix("module.")``
sd from the plain model (ckpt has the extra prefix)           (``"_orig_mod."``, ``"model."``, ...)
sd from the wrapped model, ckpt from the plain one            ``KeyMap.strip_prefix("module.")``
the prefix sits under a top-level entry of a nested sd        ``KeyMap.within("model.", KeyMap.add_prefix("module."))``
FSDP1 ``_fsdp_wrapped_module.`` in the middle of ckpt keys    ``KeyMap.regex(r"^(blocks\\.\\d+)\\.", r"\\1._fsdp_wrapped_module.")``
a few renames                                                 ``KeyMap.rename({"head.weight": "lm_head.weight"})``
anything else                                                 ``KeyMap.callable(fn)``, ``KeyMap.chain(...)``
===========================================================  =======================================

When a strict load fails because every key is off by a prefix, the error says which helper would fix it.

A key map must be one-to-one on the state dict's keys: sending two state-dict keys to the same
checkpoint key raises :class:`~dcp_storage.planners.key_map.KeyCollisionError` before anything is read.
A key map renames keys only, never values: an optimizer's ``param_groups[i]["params"]`` lists keep the
names they were saved with.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from dcp_storage.errors import DcpStorageError

__all__ = [
    "DtypeMismatchError",
    "IncompatibleKeysError",
    "KeyCollisionError",
    "KeyMap",
    "KeyMapLike",
    "LoadResult",
    "UnsupportedValueError",
    "ValueTypeMismatchError",
    "format_keys",
    "suggest_key_map",
    "warn_nothing_matched",
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
    Raised the same way whatever the planner (:func:`~.planner.check_planned_keys` covers torch's) and whatever the reader.
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


# Bounds on the hint's search: it runs only when a strict load is about to fail.
_HINT_MAX_KEYS = 20_000
_HINT_MAX_DROP = 3  # longest run of key components a prefix may have


@dataclass(frozen=True)
class LoadResult:
    """The outcome of matching a state dict with a checkpoint, set on the planner by ``create_local_plan``.

    ``missing_keys`` and ``unexpected_keys`` mean what they mean for ``nn.Module.load_state_dict``:
    state-dict keys the checkpoint lacks (left untouched), and checkpoint keys that no state-dict key
    loads from (state-dict order and checkpoint-metadata order respectively). ``renamed`` maps each
    state-dict key that loads from a differently named checkpoint key to that key; ``casts`` maps each
    state-dict key whose stored dtype differs from its destination's to ``(stored, destination)``.
    """

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = field(default_factory=dict)


def suggest_key_map(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """A hint such as ``KeyMap.add_prefix('module.') would match 12 of the missing keys``, or ``""``.

    Looks for one run of up to three dot-separated components that, dropped from (added to) the
    checkpoint's unexpected keys, gives the state dict's missing keys.
    """
    if not missing or not unexpected or len(missing) > _HINT_MAX_KEYS or len(unexpected) > _HINT_MAX_KEYS:
        return ""
    votes: Counter[tuple[str, str, str]] = Counter()  # (factory, scope, prefix)
    for longer, shorter, factory in (
        (unexpected, set(missing), "add_prefix"),
        (missing, set(unexpected), "strip_prefix"),
    ):
        for key in longer:
            parts = key.split(".")
            for i in range(len(parts) - 1):
                for j in range(i + 1, min(i + _HINT_MAX_DROP, len(parts) - 1) + 1):
                    if ".".join(parts[:i] + parts[j:]) in shorter:
                        scope = "".join(p + "." for p in parts[:i])
                        prefix = "".join(p + "." for p in parts[i:j])
                        votes[(factory, scope, prefix)] += 1
    if not votes:
        return ""
    (factory, scope, prefix), count = votes.most_common(1)[0]
    text = f"KeyMap.{factory}({prefix!r})"
    if scope:
        text = f"KeyMap.within({scope!r}, {text})"
    return f"key_map={text} would match {count} of the missing keys"


def warn_nothing_matched(who: str, state_dict_keys: int, checkpoint_keys: int, hint: str) -> None:
    """Warn that a partial load matched no key at all: it will load nothing (``who`` names the planner)."""
    warnings.warn(
        f"{who}: none of the {state_dict_keys} state-dict keys is among the checkpoint's {checkpoint_keys} keys, "
        "so this partial load loads nothing"
        + (f"; {hint}" if hint else "; check the key map and the checkpoint's keys (dcp-storage inspect)"),
        stacklevel=4,
    )


class KeyMap:
    """A named, composable function from a state-dict key to the checkpoint key it loads from.

    Build one with the named factories; call it like a function (``key_map("embed.weight")``). ``repr``
    shows how it was built, so errors can say which map produced a key.
    """

    __slots__ = ("_desc", "_fn")

    def __init__(self, fn: Callable[[str], str], description: str) -> None:
        self._fn = fn
        self._desc = description

    def __call__(self, key: str) -> str:
        out = self._fn(key)
        if not isinstance(out, str):
            raise TypeError(f"{self!r} mapped state-dict key {key!r} to {out!r}; a key map must return a str")
        return out

    def __repr__(self) -> str:
        return self._desc

    @property
    def is_identity(self) -> bool:
        """Whether this is :meth:`identity` (every key its own checkpoint key)."""
        return self._fn is _identity

    def then(self, other: KeyMapLike) -> KeyMap:
        """``self`` first, then ``other`` (same as ``KeyMap.chain(self, other)``)."""
        return KeyMap.chain(self, other)

    # ------------------------------------------------------------------------------------- factories
    @staticmethod
    def identity() -> KeyMap:
        """Every key loads from the checkpoint key of the same name (what DCP does by default)."""
        return KeyMap(_identity, "KeyMap.identity()")

    @staticmethod
    def add_prefix(prefix: str) -> KeyMap:
        """``"x"`` loads from ``prefix + "x"``: the checkpoint's keys carry a prefix the state dict lacks.

        E.g. a checkpoint saved from a DDP model (``module.``) or a ``torch.compile``'d one
        (``_orig_mod.``) loaded into the plain model.
        """
        _check_prefix(prefix)
        return KeyMap(lambda key: prefix + key, f"KeyMap.add_prefix({prefix!r})")

    @staticmethod
    def strip_prefix(prefix: str) -> KeyMap:
        """``prefix + "x"`` loads from ``"x"``: the state dict's keys carry a prefix the checkpoint lacks.

        Keys that do not start with ``prefix`` are left as they are (like
        ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present``).
        """
        _check_prefix(prefix)
        return KeyMap(lambda key: key.removeprefix(prefix), f"KeyMap.strip_prefix({prefix!r})")

    @staticmethod
    def regex(pattern: str | re.Pattern[str], repl: str | Callable[[re.Match[str]], str], count: int = 0) -> KeyMap:
        """``re.sub(pattern, repl, key, count)``; keys the pattern does not match are left as they are."""
        compiled = re.compile(pattern)
        return KeyMap(lambda key: compiled.sub(repl, key, count), f"KeyMap.regex({compiled.pattern!r}, {repl!r})")

    @staticmethod
    def rename(mapping: Mapping[str, str]) -> KeyMap:
        """Explicit renames ``{state-dict key: checkpoint key}``; other keys are left as they are."""
        table = dict(mapping)
        for k, v in table.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"KeyMap.rename needs str -> str, got {k!r} -> {v!r}")
        return KeyMap(lambda key: table.get(key, key), f"KeyMap.rename(<{len(table)} keys>)")

    @staticmethod
    def within(scope: str, inner: KeyMapLike) -> KeyMap:
        """Apply ``inner`` to what follows ``scope`` in keys that start with it; leave other keys alone.

        ``KeyMap.within("model.", KeyMap.add_prefix("module."))`` maps ``"model.embed.weight"`` to
        ``"model.module.embed.weight"`` and leaves ``"optim.step"`` as it is.
        """
        _check_prefix(scope)
        fn = KeyMap.coerce(inner)
        return KeyMap(
            lambda key: scope + fn(key[len(scope) :]) if key.startswith(scope) else key,
            f"KeyMap.within({scope!r}, {fn!r})",
        )

    @staticmethod
    def chain(*maps: KeyMapLike) -> KeyMap:
        """Apply ``maps`` left to right."""
        parts = [KeyMap.coerce(m) for m in maps]

        def run(key: str) -> str:
            for part in parts:
                key = part(key)
            return key

        return KeyMap(run, "KeyMap.chain(" + ", ".join(map(repr, parts)) + ")")

    @staticmethod
    def callable(fn: Callable[[str], str], name: str | None = None) -> KeyMap:
        """Any function from a state-dict key to a checkpoint key (it must return a ``str``)."""
        if not callable(fn):
            raise TypeError(f"KeyMap.callable needs a callable, got {type(fn).__name__}")
        label = name or getattr(fn, "__qualname__", None) or repr(fn)
        return KeyMap(fn, f"KeyMap.callable({label})")

    @staticmethod
    def coerce(value: KeyMapLike | None) -> KeyMap:
        """A ``KeyMap`` from ``None`` (identity), a ``KeyMap``, a ``{sd key: ckpt key}`` dict, or a callable."""
        if value is None:
            return KeyMap.identity()
        if isinstance(value, KeyMap):
            return value
        if isinstance(value, Mapping):
            return KeyMap.rename(value)
        if callable(value):
            return KeyMap.callable(value)
        raise TypeError(f"expected a KeyMap, a dict or a callable, got {type(value).__name__}")


KeyMapLike = KeyMap | Mapping[str, str] | Callable[[str], str]


def _identity(key: str) -> str:
    return key


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"a prefix must be a non-empty str, got {prefix!r}")
