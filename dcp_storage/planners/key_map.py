"""``KeyMap``: how a state-dict key names the checkpoint key it loads from.

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
checkpoint key raises :class:`~dcp_storage.planners.errors.KeyCollisionError` before anything is read.
A key map renames keys only, never values: an optimizer's ``param_groups[i]["params"]`` lists keep the
names they were saved with.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

__all__ = ["KeyMap", "KeyMapLike"]


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
