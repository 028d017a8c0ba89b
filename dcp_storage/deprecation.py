"""Renamed keywords keep working for a while: the old name is accepted with a ``DeprecationWarning``.

A storage class's first parameter is ``path``, as in torch's ``FileSystemReader``/``FileSystemWriter``;
classes that called it ``url`` accept ``url=`` still, warn, and hand it on as ``path``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renamed_attributes", "renamed_keyword"]

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keyword(old: str, new: str) -> Callable[[F], F]:
    """Decorate a function whose parameter ``old`` is now ``new``: ``old=`` still works, with a warning."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{fn.__qualname__}: pass {new}= only ({old}= is its deprecated name)")
                warnings.warn(
                    f"{fn.__qualname__}: the keyword {old}= is deprecated; pass {new}= (or the value positionally)",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def renamed_attributes(module: str, renamed: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) serving each old name in ``renamed`` as its new one, with a warning."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated; use {new}", DeprecationWarning, stacklevel=2)
        return namespace[new]

    return __getattr__
