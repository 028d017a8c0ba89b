"""The globals a user registered with torch as safe to unpickle, for our allow-list decoders.

``torch.load(weights_only=True)`` accepts, beyond its own allow-list, whatever the user registered with
``torch.serialization.add_safe_globals([...])`` or inside ``with torch.serialization.safe_globals([...])``.
The allow-list decoders of ``torch.save`` files' ``data.pkl`` and of DCP's ``.metadata`` accept the same:
:func:`with_registered_globals` adds them to a decoder's allow-list (its own entries win), read from
torch's registry each time a decoder is built, so a ``safe_globals`` block counts exactly while it is open.

torch matches a pickled global by its full dotted path (``module.qualname``, or the path given with the
object as ``(obj, "path")``); a pickle names a global as ``(module, name)``, so every split of the path at a
dot is entered, which accepts exactly the globals torch accepts.

Allow-list unpickling: the only way this project turns pickle bytes into objects.

``pickle.load`` resolves any global the stream names and calls it, so a checkpoint could run code on the
machine that opens it. :class:`AllowListUnpickler` resolves only ``(module, name)`` pairs it was given and
raises :class:`~dcp_storage.errors.UnsafeCheckpointError` for anything else *before* resolving it: the
payload never runs. It also applies state only to objects the load itself created, and refuses sizes
beyond the stream before anything is allocated (:mod:`.pickle_guard`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable
from typing import Any

from torch.serialization import get_safe_globals

from dcp_storage.errors import CorruptCheckpointError, UnsafeCheckpointError
from dcp_storage.pickle_guard import MISSING, guard_pickle
from dcp_storage.runtime import gc_paused

__all__ = ["AllowListUnpickler", "StandInRefusal", "registered_globals", "safe_loads", "with_registered_globals"]


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


class StandInRefusal(Exception):
    """Raised by an allow-listed stand-in (a restricted ``getattr``, say) for arguments it refuses.

    :class:`AllowListUnpickler` turns it into :class:`~dcp_storage.errors.UnsafeCheckpointError` naming
    the file, which the stand-in does not know.
    """

    def __init__(self, forbidden: str, detail: str) -> None:
        super().__init__(forbidden, detail)
        self.forbidden = forbidden
        self.detail = detail


class AllowListUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allow-listed globals and modifies only objects it created.

    ``allowed`` maps ``(module, name)`` to the object to return for it (the real class, or a stand-in).
    ``persistent_load`` may be given for formats that use persistent ids (torch.save's storages);
    without it a persistent id is refused. ``file`` must be an ``io.BytesIO`` (the whole stream is
    checked before it is unpickled).

    Before the C unpickler runs, :func:`~dcp_storage.pickle_guard.guard_pickle` walks the stream from
    the current position to its ``STOP``: a ``BUILD``, ``SETITEM(S)``, ``APPEND(S)`` or ``ADDITEMS`` on
    anything this load did not create (an allow-listed class or function, an enum member, a shared
    constant), ``BUILD`` state that could set dunder attributes or slots, memo indices, lengths or frames
    beyond the stream and anything the walk cannot parse are refused before a single object is built.
    Subclasses that change which globals resolve override :meth:`resolve`, which both use; one that
    resolves any global (a user's explicit trust) sets ``check_state = False``: sizes are still checked.
    """

    check_state = True

    def __init__(
        self,
        file: io.BytesIO,
        path: str,
        allowed: dict[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(file, io.BytesIO):
            raise TypeError(f"AllowListUnpickler reads an io.BytesIO, not a {type(file).__name__}")
        super().__init__(file)
        self._stream = file
        self._path = path
        self._allowed = allowed
        self._persistent = persistent_load

    def load(self) -> Any:
        stream = self._stream
        guard_pickle(stream.getvalue(), stream.tell(), self._path, self._guard_resolve, check_state=self.check_state)
        try:
            with gc_paused():
                return super().load()
        except StandInRefusal as refusal:
            raise UnsafeCheckpointError(self._path, refusal.forbidden, refusal.detail) from None

    def resolve(self, module: str, name: str) -> Any:
        """The object ``(module, name)`` stands for, or :data:`~dcp_storage.pickle_guard.MISSING`."""
        return self._allowed.get((module, name), MISSING)

    def _guard_resolve(self, module: str, name: str) -> Any:
        """For the guard walk: a global the allow-list lacks is refused there, as ``find_class`` would
        refuse it when the unpickler reaches the same opcode (and with the same error)."""
        found = self.resolve(module, name)
        if found is MISSING and self.check_state:
            return self.find_class(module, name)
        return found

    def find_class(self, module: str, name: str) -> Any:
        found = self.resolve(module, name)
        if found is MISSING:
            raise UnsafeCheckpointError(self._path, f"{module}.{name}")
        return found

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
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: not a valid pickle ({type(exc).__name__}: {exc})") from exc
    if expected is not None and not isinstance(obj, expected):
        raise CorruptCheckpointError(f"{path}: expected {expected}, unpickled a {type(obj).__name__}")
    return obj


def globals_of(module: Any, names: Iterable[str]) -> dict[tuple[str, str], Any]:
    """Allow-list entries for ``names`` of ``module`` (resolved to the real objects)."""
    return {(module.__name__, name): getattr(module, name) for name in names}
