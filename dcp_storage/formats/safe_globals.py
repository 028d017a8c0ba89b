"""The globals a user registered with torch as safe to unpickle, for our allow-list decoders.

``torch.load(weights_only=True)`` accepts, beyond its own allow-list, whatever the user registered with
``torch.serialization.add_safe_globals([...])`` or inside ``with torch.serialization.safe_globals([...])``.
The allow-list decoders of ``torch.save`` files' ``data.pkl`` and of DCP's ``.metadata`` accept the same:
:func:`with_registered_globals` adds them to a decoder's allow-list (its own entries win), read from
torch's registry each time a decoder is built, so a ``safe_globals`` block counts exactly while it is open.

torch matches a pickled global by its full dotted path (``module.qualname``, or the path given with the
object as ``(obj, "path")``); a pickle names a global as ``(module, name)``, so every split of the path at a
dot is entered, which accepts exactly the globals torch accepts.
"""

from __future__ import annotations

from typing import Any

from torch.serialization import get_safe_globals

__all__ = ["registered_globals", "with_registered_globals"]


def registered_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` for every global in torch's ``get_safe_globals()``."""
    out: dict[tuple[str, str], Any] = {}
    for entry in get_safe_globals():
        if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], str):
            obj, path = entry
        else:
            obj, path = entry, f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}"
        parts = path.split(".")
        for i in range(1, len(parts)):
            out[(".".join(parts[:i]), ".".join(parts[i:]))] = obj
    return out


def with_registered_globals(allowed: dict[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
    """``allowed`` plus :func:`registered_globals` (``allowed`` wins where both name a global)."""
    extra = registered_globals()
    return {**extra, **allowed} if extra else allowed
