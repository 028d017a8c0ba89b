"""Allow-list unpickling: the only way this project turns pickle bytes into objects.

``pickle.load`` resolves any global the stream names and calls it, so a checkpoint could run code on the
machine that opens it. :class:`AllowListUnpickler` resolves only ``(module, name)`` pairs it was given and
raises :class:`~dcp_storage.errors.UnsafeCheckpointError` for anything else *before* resolving it: the
payload never runs.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Callable, Iterable
from typing import Any

from .errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["AllowListUnpickler", "safe_loads"]


class AllowListUnpickler(pickle._Unpickler):  # type: ignore[misc,name-defined]
    """An unpickler that resolves only allow-listed globals.

    ``allowed`` maps ``(module, name)`` to the object to return for it (the real class, or a stand-in).
    ``persistent_load`` may be given for formats that use persistent ids (torch.save's storages);
    without it a persistent id is refused.

    It is built on the pure-Python unpickler so that ``BUILD`` can be checked too: a stream may only
    set state on instances it created, never on an allow-listed class, function or module (which would
    let it rewire, say, ``PosixPath.__new__`` for the whole process).
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(
        self,
        file: io.BufferedIOBase | io.BytesIO,
        path: str,
        allowed: dict[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self._path = path
        self._allowed = allowed
        self._persistent = persistent_load

    def _load_build_checked(self) -> None:
        target = self.stack[-2] if len(self.stack) >= 2 else None  # [-1] is the state
        if isinstance(target, (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)) or callable(
            target
        ) and any(target is obj for obj in self._allowed.values()):
            raise UnsafeCheckpointError(
                self._path, getattr(target, "__qualname__", type(target).__name__), "the stream tried to modify it"
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build_checked

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(self._path, f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafeCheckpointError(self._path, "persistent id", f"unexpected persistent id {pid!r}")
        return self._persistent(pid)


def safe_loads(
    data: bytes | bytearray | memoryview,
    path: str,
    allowed: dict[tuple[str, str], Any],
    persistent_load: Callable[[Any], Any] | None = None,
    expected: type | tuple[type, ...] | None = None,
) -> Any:
    """Unpickle ``data`` (read from ``path``) with the allow-list; check the result's type.

    Garbage or truncated bytes raise :class:`CorruptCheckpointError` naming ``path``.
    """
    try:
        obj = AllowListUnpickler(io.BytesIO(data), path, allowed, persistent_load).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure means the bytes are not what we expect
        raise CorruptCheckpointError(f"{path}: not a valid pickle ({type(exc).__name__}: {exc})") from exc
    if expected is not None and not isinstance(obj, expected):
        raise CorruptCheckpointError(f"{path}: expected {expected}, unpickled a {type(obj).__name__}")
    return obj


def globals_of(module: Any, names: Iterable[str]) -> dict[tuple[str, str], Any]:
    """Allow-list entries for ``names`` of ``module`` (resolved to the real objects)."""
    return {(module.__name__, name): getattr(module, name) for name in names}
